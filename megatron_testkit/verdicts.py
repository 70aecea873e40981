"""Reads a kit report (`reports/kit-report.json`) and states, per failed test, what went wrong.

The report is written by the kit's plugin; its schema (field names, `REPORT_VERSION`) is defined
once, typed, in `megatron_testkit.schema`, and read through `megatron_testkit.schema.read_report`
(bounded, checked, fail closed) into a typed `Report`, whose `TestEntry` rows the verdicts read as
they are; text from a report is escaped before it is printed. A verdict is the line a developer needs first: which test, which rank, `oom | error |
crash | hang`, the first error line, and the peak memory against the budget. Reading is strict
about what it needs (a report that cannot be used is a `ReportError` with one line saying why) and
lenient about the rest (missing optional fields print as "-").
"""

from __future__ import annotations

import os
import stat
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO
from xml.parsers import expat

from megatron_testkit.budgets import format_size

# The one loader, re-exported for the readers that import it from here.
from megatron_testkit.report_input import ReportError as ReportError
from megatron_testkit.report_input import load_report as load_report
from megatron_testkit.report_input import printable
from megatron_testkit.schema import Report, TestEntry

# What repro reruns: a failure, and a test the session was stopped in (CI cancel, Ctrl-C), which
# never got to pass.
FAILED = ("failed", "error", "interrupted")
# A JUnit file holds one message per failing test, the kit clips them: far under this. Read past
# it, nothing more is parsed (the first lines found before are kept).
MAX_JUNIT_BYTES = 64 * 2**20
_JUNIT_CHUNK = 2**20
MAX_FIRST_LINE_CHARS = 2000  # a first line longer than this is clipped
MAX_MESSAGE_CHARS = 2**16  # of an element's text, what is searched for its first line


def _rows(report: Report | Mapping[str, Any]) -> list[Any]:
    return report.tests if isinstance(report, Report) else report["tests"]


def _id_and_outcome(test: TestEntry | Mapping[str, Any]) -> tuple[str, str]:
    if isinstance(test, TestEntry):
        return test.nodeid, test.outcome
    return test["nodeid"], test["outcome"]


def failed_tests(report: Report | Mapping[str, Any]) -> list[Any]:
    """The report's failed, errored and interrupted tests, in report order, each node id once (its
    rows as they are: `TestEntry` of a `Report`, objects of a report as JSON)."""
    seen: dict[str, Any] = {}
    for test in _rows(report):
        nodeid, outcome = _id_and_outcome(test)
        if outcome in FAILED and nodeid not in seen:
            seen[nodeid] = test
    return list(seen.values())


def tests_by_id(report: Report | Mapping[str, Any]) -> dict[str, Any]:
    """Node id -> test entry; a failed phase (setup/teardown error) wins over a passed one."""
    out: dict[str, Any] = {}
    for test in _rows(report):
        nodeid, outcome = _id_and_outcome(test)
        if nodeid not in out or outcome in FAILED:
            out[nodeid] = test
    return out


@dataclass(frozen=True)
class Verdict:
    """What a report says about one test, reduced to what a person reads first."""

    nodeid: str
    outcome: str
    rank: int | None
    kind: str | None
    first_line: str
    peak_host: int | None
    budget_host: int | None
    peak_device: int | None
    budget_device: int | None
    world_size: int | None
    seed: int | None
    at_s: float | None = None  # when it failed: the failing launch's time from spawn to verdict

    @property
    def cause(self) -> str:
        """``"rank 1 oom"``, ``"error"`` (a failure in the pytest process), ``"passed"``..."""
        if self.outcome not in ("failed", "error"):  # passed, skipped, interrupted: the outcome says it
            return self.outcome
        kind = self.kind or "error"
        return f"rank {self.rank} {kind}" if self.rank is not None else kind

    def memory(self) -> str:
        """``"host 1.62 GiB / 1.50 GiB"`` (peak / budget), device too when either is known."""
        parts = [f"host {format_size(self.peak_host)} / {format_size(self.budget_host)}"]
        if self.peak_device is not None or self.budget_device is not None:
            parts.append(f"device {format_size(self.peak_device)} / {format_size(self.budget_device)}")
        return ", ".join(parts)


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def junit_key(nodeid: str) -> tuple[str, str]:
    """The (classname, name) pytest's JUnit XML gives the test `nodeid`."""
    path, *parts = nodeid.split("::")
    module = path[:-3] if path.endswith(".py") else path
    return ".".join([module.replace("/", "."), *parts[:-1]]), parts[-1] if parts else ""


def _open_regular(path: Path | str) -> BinaryIO | None:
    """`path` opened for reading when it is a regular file (a FIFO would block the reader); None
    for anything else, or a file that cannot be opened."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        return None
    return os.fdopen(fd, "rb")


def _first_line(text: str) -> str:
    return next((ln.strip() for ln in text.splitlines() if ln.strip()), "")[:MAX_FIRST_LINE_CHARS]


class _DoctypeRefused(Exception):
    """A JUnit file with a DOCTYPE: pytest writes none, and entity definitions live there."""


class _JunitLines:
    """expat's handlers for `junit_first_lines`: per test case, the first line of its failure,
    else of its error, as pytest's JUnit XML writes them (a message, else the element's text)."""

    def __init__(self, wanted: Collection[tuple[str, str]] | None) -> None:
        self.wanted = wanted
        self.found: dict[tuple[str, str], str] = {}
        self.case: tuple[str, str] | None = None  # the wanted test case being read
        self.lines: dict[str, str] = {}  # its "failure" and "error" first lines
        self.text: list[str] | None = None  # the text of its failure or error being read
        self.text_chars = 0

    def start(self, tag: str, attrs: dict[str, str]) -> None:
        if tag == "testcase":
            key = (attrs.get("classname", ""), attrs.get("name", ""))
            wanted = self.wanted is None or key in self.wanted
            self.case, self.lines = (key if wanted and key not in self.found else None), {}
        elif tag in ("failure", "error") and self.case is not None and tag not in self.lines:
            message = attrs.get("message", "")
            if message:
                self.lines[tag] = _first_line(message)
            else:
                self.text, self.text_chars = [], 0

    def data(self, text: str) -> None:
        if self.text is not None and self.text_chars < MAX_MESSAGE_CHARS:
            self.text.append(text[: MAX_MESSAGE_CHARS - self.text_chars])
            self.text_chars += len(self.text[-1])

    def end(self, tag: str) -> None:
        if tag in ("failure", "error") and self.text is not None:
            self.lines.setdefault(tag, _first_line("".join(self.text)))
            self.text = None
        elif tag == "testcase" and self.case is not None:
            line = self.lines.get("failure", self.lines.get("error"))
            if line is not None:
                self.found[self.case] = line
            self.case = None

    def doctype(self, *args: object) -> None:
        raise _DoctypeRefused


def junit_first_lines(
    path: Path | str, wanted: Collection[tuple[str, str]] | None = None
) -> dict[tuple[str, str], str]:
    """(classname, name) -> the first line of each failure or error message in a JUnit XML file
    (of the test cases in `wanted` only, when given).

    Failures in the pytest process (no rank involved) have no `failure` entry in the kit report;
    JUnit has their assertion message. The file is untrusted (it comes with a CI artifact) and
    streamed through expat, keeping only the lines asked for: memory stays flat whatever the
    file holds (a 64 MiB file parsed into a tree took 0.7 to 2.7 GB). Reading stops after
    `MAX_JUNIT_BYTES`, at the first malformed byte and at a DOCTYPE, keeping the lines found
    before. A missing or unreadable file gives an empty mapping.
    """
    handle = _open_regular(path)
    if handle is None:
        return {}
    lines = _JunitLines(wanted)
    parser = expat.ParserCreate()
    parser.buffer_text = True
    parser.StartElementHandler = lines.start
    parser.EndElementHandler = lines.end
    parser.CharacterDataHandler = lines.data
    parser.StartDoctypeDeclHandler = lines.doctype
    left = MAX_JUNIT_BYTES
    with handle:
        try:
            while left > 0:
                chunk = handle.read(min(_JUNIT_CHUNK, left))
                if not chunk:
                    break
                left -= len(chunk)
                parser.Parse(chunk, False)
        except (OSError, expat.ExpatError, _DoctypeRefused):
            pass
    return lines.found


def verdict(test: TestEntry | Mapping[str, Any], junit: dict[tuple[str, str], str] | None = None) -> Verdict:
    """The verdict of one report entry (a typed row, or one as JSON, read leniently); the failing
    rank's peaks when the failure names a rank.

    Without a rank failure, the first line comes from `junit` (see `junit_first_lines`).
    """
    if isinstance(test, TestEntry):
        entry, world_size = test, _int(test.world_size)
    else:  # a row as JSON: a world size it lacks stays unknown (the typed row reads it as 0)
        entry, world_size = TestEntry.from_json(test, "test"), _int(test.get("world_size"))
    failure = entry.failure
    rank = failure.rank if failure else None
    peak_host, peak_device = entry.peak_host_bytes, entry.peak_device_bytes
    for row in entry.ranks:
        if rank is not None and row.rank == rank:
            peak_host = _int(row.peak_host_bytes) or peak_host
            peak_device = _int(row.peak_device_bytes) or peak_device
    first_line = ""
    if failure:
        first_line = failure.first_line.strip()
        if not first_line:
            first_line = next((ln.strip() for ln in failure.message.splitlines() if ln.strip()), "")
    if not first_line and junit and entry.outcome in FAILED:
        first_line = junit.get(junit_key(entry.nodeid), "")
    kind = failure.kind if failure else None
    # The launcher's first line repeats the cause ("rank 1 oom: ..."), which the verdict states already.
    prefix = f"rank {rank} {kind}: "
    if first_line.startswith(prefix):
        first_line = first_line[len(prefix) :]
    own = [launch for launch in entry.launches if launch.failed and not launch.caught]
    at_s = own[-1].duration_s if own else None  # a failure in the pytest process has no launch time
    return Verdict(
        nodeid=entry.nodeid,
        outcome=entry.outcome,
        rank=rank,
        kind=kind,
        first_line=first_line,
        peak_host=peak_host,
        budget_host=entry.budget_host_bytes,
        peak_device=peak_device,
        budget_device=entry.budget_device_bytes,
        world_size=world_size,
        seed=entry.seed,
        at_s=at_s if entry.outcome in FAILED else None,
    )


def _clip(text: str, width: int) -> str:
    return printable(text, width)


def format_verdicts(verdicts: list[Verdict], width: int = 160) -> str:
    """One block per failed test: the cause on the first line, the error and the memory below."""
    lines = []
    for v in verdicts:
        lines.append(f"FAILED {printable(v.nodeid)}: {printable(v.cause, 80)}")
        if v.first_line:
            lines.append(f"    {_clip(v.first_line, width)}")
        if v.world_size is None and v.peak_host is None and v.peak_device is None:
            lines.append("    in the pytest process (the test launched no ranks)")
        else:
            lines.append(f"    peak/budget: {v.memory()}; world size {v.world_size or '-'}, seed {v.seed}")
    return "\n".join(lines)


def brief(v: Verdict) -> str:
    """``"rank 1 oom at 3.2 s"`` (when it failed), ``"passed"``..."""
    cause = printable(v.cause, 80)
    return f"{cause} at {v.at_s:.1f} s" if v.at_s is not None and v.outcome in FAILED else cause


def format_pairs(
    ci: list[Verdict],
    local: dict[str, Verdict],
    skipped: Collection[str] = (),
) -> tuple[str, int]:
    """One line per test CI failed, its verdict there beside the one here:
    ``"test_x: CI: rank 1 oom at 3.2 s / here: rank 1 oom at 3.0 s"``; and how many still fail.

    A test not run here (`skipped`: stale or refused, or absent from `local`) does not count as
    still failing: the lines above say why it did not run.
    """
    lines, failing = [], 0
    for v in ci:
        here = local.get(v.nodeid)
        if here is None or v.nodeid in skipped:
            lines.append(f"{printable(v.nodeid)}: CI: {brief(v)} / here: not run")
            continue
        failing += here.outcome in FAILED
        lines.append(f"{printable(v.nodeid)}: CI: {brief(v)} / here: {brief(here)}")
    return "\n".join(lines), failing


def _launched_ranks(v: Verdict) -> bool:
    return bool(v.world_size) or v.peak_host is not None or v.peak_device is not None


def format_comparison(
    ci: list[Verdict],
    local: dict[str, Verdict],
    stale: Collection[str] = (),
    width: int = 160,
    refused: Mapping[str, str] | None = None,
) -> str:
    """For each test that failed in CI: the CI verdict next to the local one, then what differs.

    A stale id (no such test here any more) says so instead of "not run", and so does an id
    refused as not a test of this project (`refused`: id -> reason); a test that launched no
    ranks has no seed, world size or rank peaks to compare, and says that instead.
    """
    lines = []
    for v in ci:
        here = local.get(v.nodeid)
        lines.append(printable(v.nodeid))
        lines.append(
            f"    CI:    {v.outcome:<7} {printable(v.cause, 80):<16} {_clip(v.first_line, width)}".rstrip()
        )
        if refused and v.nodeid in refused:
            lines.append(f"    local: refused, not run: {refused[v.nodeid]}")
            continue
        if v.nodeid in stale:
            lines.append("    local: skipped: no such test here (renamed or removed since the CI run)")
            continue
        if here is None:
            lines.append("    local: not run (deselected, or skipped at collection?)")
            continue
        lines.append(
            f"    local: {here.outcome:<7} {printable(here.cause, 80):<16} {_clip(here.first_line, width)}".rstrip()
        )
        if not (_launched_ranks(v) or _launched_ranks(here)):
            lines.append(
                "    in the pytest process (the test launched no ranks): no seed, world size or rank memory"
            )
            continue
        lines.append(f"    memory CI: {v.memory()}; local: {here.memory()}")
        notes = []
        if here.seed != v.seed:
            notes.append(f"seed differs: CI {v.seed}, local {here.seed}")
        if here.world_size != v.world_size:
            notes.append(f"world size differs: CI {v.world_size}, local {here.world_size}")
        lines.append(
            "    " + ("; ".join(notes) if notes else f"same seed ({v.seed}) and world size ({v.world_size})")
        )
    return "\n".join(lines)
