"""The session report: one row per test, with its ranks' figures, as a table, JSON and Markdown.

`ReportCollector` folds pytest's per-phase reports (local, or sent over by xdist workers) into
rows; `build_report` adds the session header; the `format_*`/`write_report` functions render it.
Nothing here imports pytest or torch, so it is cheap and unit-testable with plain objects.

The JSON field names are a contract (``python -m megatron_testkit repro --from-report`` reads them), defined
once, typed and versioned, in `megatron_testkit.schema`; the renderers read that JSON.
"""

from __future__ import annotations

import datetime
import json
import os
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from accounting.json_input import printable
from megatron_testkit.budgets import MemoryBudget, format_size
from megatron_testkit.memory_series import bound_total
from megatron_testkit.metrics import TestMetrics
from megatron_testkit.schema import (
    OUTCOMES,
    REPORT_VERSION,
    CpuSubstitution,
    Failure,
    Launch,
    RankPeak,
    Report,
    Run,
    TestEntry,
)


@dataclass
class TestRow:
    """One test's row while its phases arrive; `runs` holds every `run_ranks` launch it made."""

    nodeid: str
    outcome: str = "passed"
    duration_s: float = 0.0
    budget_host_bytes: int | None = None
    budget_device_bytes: int | None = None
    failure: Failure | None = None
    pytest_rss_before_bytes: int | None = None
    pytest_rss_after_bytes: int | None = None
    leaked_processes: int = 0
    worker: str | None = None
    skip_capability: str | None = None
    runs: list[Run] = field(default_factory=list)
    finished: bool = False  # its teardown report arrived
    reported: bool = False  # a phase report arrived (a row made at the test's start has none yet)
    metrics: dict[str, Any] | None = None  # the recorded series (`megatron_testkit.metrics`)
    line: int | None = None  # the test function's line in its file (pytest's location), 1-based

    def entry(self) -> TestEntry:
        """The row in the report's schema (runs folded into per-test and per-rank maxima)."""
        ranks: dict[int, RankPeak] = {}
        for run in self.runs:
            for r in run.ranks:
                row = ranks.setdefault(r.rank, RankPeak(r.rank))
                if r.peak_host_bytes is not None and r.peak_host_bytes >= (row.peak_host_bytes or 0):
                    row.peak_process = r.peak_process  # who held the peak that is kept
                row.peak_host_bytes = _max(row.peak_host_bytes, r.peak_host_bytes)
                row.peak_device_bytes = _max(row.peak_device_bytes, r.peak_device_bytes)
                row.exit_code, row.signal = r.exit_code, r.signal
        last = self.runs[-1] if self.runs else None
        kept = [run for run in self.runs if run.log_dir]
        return TestEntry(
            nodeid=self.nodeid,
            outcome=self.outcome,
            duration_s=round(self.duration_s, 4),
            world_size=max((run.world_size for run in self.runs), default=0),
            backend=last.backend if last else None,
            seed=last.seed if last else None,
            budget_host_bytes=self.budget_host_bytes,
            budget_device_bytes=self.budget_device_bytes,
            peak_host_bytes=_max_of(r.peak_host_bytes for r in ranks.values()),
            peak_device_bytes=_max_of(r.peak_device_bytes for r in ranks.values()),
            ranks=[ranks[k] for k in sorted(ranks)],
            failure=self.failure,
            pytest_rss_before_bytes=self.pytest_rss_before_bytes,
            pytest_rss_after_bytes=self.pytest_rss_after_bytes,
            leaked_processes=self.leaked_processes + sum(run.leaked_processes for run in self.runs),
            log_dir=kept[0].log_dir if kept else None,
            launches=launch_records(self.runs, self.failure),
            worker=self.worker,
            skip_capability=self.skip_capability,
            metrics=TestMetrics.from_json(self.metrics) if self.metrics else None,
            queued_s=_sum_of(run.queued_s for run in self.runs),
            admitted_bytes=_max_of(run.admitted_bytes for run in self.runs),
            setup_s=_sum_of(run.setup_s for run in self.runs),
            rank_logs=kept[0].rank_logs if kept else None,
            line=self.line,
        )

    def to_json(self) -> dict[str, Any]:
        """The row as the report's JSON."""
        return self.entry().to_json()


def launch_records(runs: list[Run], failure: Failure | None) -> list[Launch]:
    """Each launch with its verdict; a failed one is ``caught`` unless it is the test's own failure.

    The test's failure is the last launch whose root cause it names (a test that retried a launch
    and failed on the last try caught the earlier tries).
    """
    launches = [Launch.from_run(run) for run in runs]
    own = None
    if failure is not None and failure.kind is not None:
        own = next(
            (
                i
                for i in reversed(range(len(launches)))
                if (launches[i].rank, launches[i].kind, launches[i].first_line)
                == (failure.rank, failure.kind, failure.first_line)
            ),
            None,
        )
    for i, launch in enumerate(launches):
        launch.caught = launch.failed and i != own
    return launches


def caught_note(row: dict[str, Any]) -> str:
    """``"1 launch failed: rank 1 oom, caught"`` for the launches a test caught ("" when none)."""
    caught = [
        launch for launch in row.get("launches") or [] if isinstance(launch, dict) and launch.get("caught")
    ]
    if not caught:
        return ""
    causes = ", ".join(Launch.from_json(launch).cause() for launch in caught)
    return f"{len(caught)} launch{'es' if len(caught) > 1 else ''} failed: {causes}, caught"


def _max(a: int | None, b: int | None) -> int | None:
    return b if a is None else a if b is None else max(a, b)


def _sum_of(values: Any) -> float | None:
    known = [v for v in values if v is not None]
    return round(sum(known), 3) if known else None


def _max_of(values: Any) -> int | None:
    out = None
    for v in values:
        out = _max(out, v)
    return out


class ReportCollector:
    """Folds pytest's setup/call/teardown reports into `TestRow`s, in the order tests ran.

    Reads only plain attributes (``nodeid``, ``when``, ``outcome``, ``duration``, ``longrepr``)
    and the ``kit`` dict the plugin attaches, which xdist carries from workers unchanged.
    """

    def __init__(self) -> None:
        self.rows: dict[str, TestRow] = {}
        self.substituted: dict[str, int] = {}  # the CPU layer's substitutions: call -> how often

    def cpu_substitutions(self, more: dict[str, int] | None = None) -> list[CpuSubstitution] | None:
        """The session's CPU-layer substitutions, each call once with its count (most first);
        None when the layer substituted nothing."""
        for call, n in (more or {}).items():
            self.substituted[call] = self.substituted.get(call, 0) + n
        if not self.substituted:
            return None
        ordered = sorted(self.substituted.items(), key=lambda item: (-item[1], item[0]))
        return [CpuSubstitution(call, count) for call, count in ordered]

    def start(self, nodeid: str) -> None:
        """A test is starting: its row exists from now on, so an interrupt before any of its phases
        reported (a signal while a fixture launches ranks) still records it as ``interrupted``."""
        self.rows.setdefault(nodeid, TestRow(nodeid))

    def add(self, report: Any) -> None:
        """Take one phase's report."""
        row = self.rows.setdefault(report.nodeid, TestRow(report.nodeid))
        row.reported = True
        row.duration_s += float(getattr(report, "duration", 0.0) or 0.0)
        row.line = row.line or _test_line(report)
        kit = getattr(report, "kit", None) or {}
        row.runs.extend(Run.from_json(run) for run in kit.get("runs", []))
        for key in ("budget_host_bytes", "budget_device_bytes"):
            if kit.get(key) is not None:
                setattr(row, key, kit[key])
        if "pytest_rss_before_bytes" in kit:
            row.pytest_rss_before_bytes = kit["pytest_rss_before_bytes"]
        if "pytest_rss_after_bytes" in kit:
            row.pytest_rss_after_bytes = kit["pytest_rss_after_bytes"]
        row.leaked_processes += int(kit.get("leaked_processes", 0))
        row.worker = kit.get("worker") or row.worker
        row.skip_capability = kit.get("skip_capability") or row.skip_capability
        row.metrics = kit.get("metrics") or row.metrics
        for call, n in (kit.get("cpu_substitutions") or {}).items():
            self.substituted[str(call)] = self.substituted.get(str(call), 0) + int(n)
        outcome = _phase_outcome(report)
        if outcome in ("failed", "error") and row.outcome not in ("failed", "error"):
            failure = kit.get("failure")
            row.failure = Failure.from_json(failure) if failure else _failure_from_longrepr(report)
        row.outcome = _combine(row.outcome, outcome)
        row.finished = row.finished or getattr(report, "when", None) == "teardown"

    def interrupt(self, why: str) -> None:
        """The session was interrupted (Ctrl-C, SIGTERM): a test it stopped is ``interrupted``.

        A test whose teardown never arrived was cut short; unless it had already failed, its
        passing setup (or call) says nothing of it, and reading it as ``passed`` would tell
        ``ci repro`` there is nothing to rerun.
        """
        for row in self.rows.values():
            if not row.finished and row.outcome not in ("failed", "error"):
                row.outcome = "interrupted"
                row.failure = Failure(rank=None, kind=None, first_line=why, message=why)
                row.reported = True

    def fail_running(self, failure: Failure) -> None:
        """The running test (started, its teardown not arrived) failed with ``failure``, reported
        from outside its phases (a torchrun rank's deadlock verdict, `megatron_testkit.last_words`)."""
        for row in self.rows.values():
            if not row.finished:
                row.outcome = "failed"
                row.failure = failure
                row.reported = True

    def rows_json(self) -> list[dict[str, Any]]:
        """Every row in the report's schema (a test that started and reported nothing, in a session
        that was not interrupted, has no outcome to give and is left out)."""
        return [row.to_json() for row in self.rows.values() if row.reported]


def _test_line(report: Any) -> int | None:
    """The test function's line (1-based) from pytest's ``location``, when that names the file of
    the node id (a test inherited from another file's class has its line in that other file)."""
    location = getattr(report, "location", None)
    if not isinstance(location, tuple) or len(location) < 2 or not isinstance(location[1], int):
        return None
    path = str(location[0]).replace(os.sep, "/")
    return location[1] + 1 if report.nodeid.split("::", 1)[0] == path else None


def _phase_outcome(report: Any) -> str:
    when, outcome = getattr(report, "when", "call"), report.outcome
    if outcome == "failed":
        return "failed" if when == "call" else "error"
    if outcome == "skipped":
        # An xfail shows as skipped in pytest's own counts; keep that.
        return "skipped"
    return "passed"


def _combine(current: str, new: str) -> str:
    rank = {"passed": 0, "skipped": 1, "failed": 2, "error": 3, "interrupted": 4}
    if current == "failed" and new == "error":
        return "failed"  # a test that failed and then errored in teardown reads as failed
    return new if rank[new] > rank[current] else current


def _failure_from_longrepr(report: Any) -> Failure:
    message = str(getattr(report, "longreprtext", "") or getattr(report, "longrepr", "") or "")
    crash = getattr(getattr(report, "longrepr", None), "reprcrash", None)
    first = getattr(crash, "message", None) or (message.strip().splitlines() or [""])[-1]
    return Failure(
        rank=None, kind=None, first_line=first.splitlines()[0] if first else "", message=message[-20000:]
    )


def build_report(session: dict[str, Any], rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The whole report as JSON: header (with outcome counts filled in from the rows) and rows.

    The rows go through the schema (`Report.from_json`), so a row that does not fit it fails here,
    where it is written, not in the CI job that reads it.
    """
    # The four outcomes every report has counted always; `interrupted` only in a session it ended.
    counts = dict.fromkeys(OUTCOMES[:4], 0)
    for row in rows:
        counts[row["outcome"]] = counts.get(row["outcome"], 0) + 1
    report = Report.from_json(
        {"version": REPORT_VERSION, "session": {**session, "outcome_counts": counts}, "tests": rows}
    )
    # Memory over time stays a small part of the report, however many launches the session made.
    bound_total(launch.memory for test in report.tests for launch in test.launches if launch.memory)
    return report.to_json()


def plural(count: int, noun: str, nouns: str | None = None) -> str:
    """``1 test``, ``2 tests``; `nouns` where an added s is wrong (``1 process``, ``2 processes``)."""
    return f"{count} {noun if count == 1 else nouns or noun + 's'}"


def rss_growth_line(report: dict[str, Any]) -> str:
    """``pytest RSS grew X MiB across N rank test(s)`` (summed over the tests that ran ranks)."""
    grown, n = 0, 0
    for row in report["tests"]:
        if row["world_size"] and row["pytest_rss_before_bytes"] is not None and row["pytest_rss_after_bytes"]:
            grown += row["pytest_rss_after_bytes"] - row["pytest_rss_before_bytes"]
            n += 1
    return f"pytest RSS grew {grown / 2**20:.1f} MiB across {plural(n, 'rank test')}"


_COLUMNS = ("test", "world", "backend", "time", "peak host", "peak device", "budget", "outcome")
# Shown after ``time`` when any listed test waited for memory admission: the wait is counted
# there, not in ``time`` (a 14 s test that queued 31 s reads 14.0s and 31.2s, not 45.2s).
_QUEUED = "queued"
_QUEUED_SHOWN_S = 0.05  # a wait that rounds to 0.0s in the table is no wait


def _listed(report: dict[str, Any]) -> list[dict[str, Any]]:
    """The rows the table lists: tests that launched ranks or declared a budget."""
    return [
        row
        for row in report["tests"]
        if row["world_size"] or row["budget_host_bytes"] is not None or row["budget_device_bytes"] is not None
    ]


def _queued_s(row: dict[str, Any]) -> float:
    queued = row.get("queued_s")
    return float(queued) if isinstance(queued, (int, float)) and queued > 0 else 0.0


def shows_queued(report: dict[str, Any]) -> bool:
    """Whether the table has a ``queued`` column: a listed test waited for admission."""
    return any(_queued_s(row) >= _QUEUED_SHOWN_S for row in _listed(report))


def table_columns(report: dict[str, Any]) -> tuple[str, ...]:
    """The table's columns: `_COLUMNS`, with ``queued`` after ``time`` when `shows_queued`."""
    if not shows_queued(report):
        return _COLUMNS
    at = _COLUMNS.index("time") + 1
    return (*_COLUMNS[:at], _QUEUED, *_COLUMNS[at:])


def table_rows(report: dict[str, Any]) -> list[tuple[str, ...]]:
    """The printed rows: tests that launched ranks or declared a budget (others are counted).

    With a ``queued`` column (`shows_queued`), ``time`` is the test's time less its wait."""
    queued_column = shows_queued(report)
    out = []
    for row in _listed(report):
        budget = MemoryBudget(row["budget_host_bytes"], row["budget_device_bytes"]).describe()
        outcome = row["outcome"]
        failure = row["failure"] or {}
        notes = []
        if failure.get("kind"):
            # A rank's verdict names the rank; a golden mismatch is the test's, not a rank's.
            rank = failure.get("rank")
            notes.append(f"{'' if rank is None else f'rank {rank} '}{failure['kind']}")
        if caught_note(row):  # a launch the test caught keeps its verdict in the table
            notes.append(caught_note(row))
        if notes:
            outcome += f" ({'; '.join(notes)})"
        queued = _queued_s(row) if queued_column else 0.0
        timing = [f"{max(0.0, row['duration_s'] - queued):.1f}s"]
        if queued_column:
            timing.append(f"{queued:.1f}s" if queued else "-")
        out.append(
            (
                row["nodeid"],
                str(row["world_size"] or "-"),
                row["backend"] or "-",
                *timing,
                format_size(row["peak_host_bytes"]),
                format_size(row["peak_device_bytes"]),
                budget,
                outcome,
            )
        )
    return out


def admission_line(report: dict[str, Any]) -> str:
    """``admission: peak 3.00 GiB of 6.52 GiB admitted (KIT_HOST_MEMORY=7GB); 4 launches queued
    12.3 s in all; 1.00 GiB a rank for 9 launches without a memory_budget`` ('' without admission)."""
    session = report["session"]
    limit = session.get("admission_limit_bytes")
    if limit is None:
        return ""
    queued = [row["queued_s"] for row in report["tests"] if row.get("queued_s")]
    default = session.get("admission_default_rank_bytes")
    undeclared = sum(
        1
        for row in report["tests"]
        if row["world_size"] and row.get("admitted_bytes") and row["budget_host_bytes"] is None
    )
    return (
        f"admission: peak {format_size(session.get('admission_peak_bytes'))} of {format_size(limit)} admitted "
        f"({session.get('admission_source') or '?'}); {plural(len(queued), 'test')} queued {sum(queued):.1f} s in all; "
        f"{format_size(default)} a rank for the {plural(undeclared, 'rank test')} without a memory_budget"
    )


def skip_counts(report: dict[str, Any]) -> dict[str, int]:
    """Skipped tests per declared capability (``undeclared`` for a free-text skip), most first.

    An xfail reads as skipped in the counts but carries no capability, so it is not listed here.
    """
    counts: dict[str, int] = {}
    for row in report["tests"]:
        name = row.get("skip_capability")
        if row["outcome"] == "skipped" and name:
            counts[name] = counts.get(name, 0) + 1
    return dict(sorted(counts.items(), key=lambda item: (-item[1], item[0])))


def skip_summary_asked(session: dict[str, Any]) -> bool:
    """Whether the session asked for the skip policy's summary (KIT_ALLOWED_SKIPS, ``kit_skip_summary``).

    A project that did not opt in sees nothing of it; a report older than the field (version 1/2)
    told it always, and still does.
    """
    if "skip_summary" not in session:
        return True
    return bool(session.get("skip_summary")) or session.get("allowed_skips") is not None


def _footer(report: dict[str, Any], written: bool = True) -> list[str]:
    counts = report["session"]["outcome_counts"]
    shown = len(table_rows(report))
    rest = len(report["tests"]) - shown
    where = "listed in kit-report.json" if written else "--kit-report DIR lists them"
    lines = [
        ", ".join(f"{n} {k}" for k, n in counts.items() if n) or "no tests",
        f"{plural(rest, 'test')} ran no ranks ({where})" if rest else "",
        rss_growth_line(report),
    ]
    skipped = skip_counts(report) if skip_summary_asked(report["session"]) else {}
    if skipped:
        lines.append("skips by capability: " + ", ".join(f"{name} {n}" for name, n in skipped.items()))
    admitted = admission_line(report)
    if admitted:
        lines.append(admitted)
    # Said once per session (the launch that found it says so in its start_reason too).
    lines += [f"warm start: {line}" for line in report["session"].get("warm_preload_dropped") or []]
    leaked = sum(row["leaked_processes"] for row in report["tests"])
    if leaked:
        killed = "was" if leaked == 1 else "were"
        lines.append(
            f"{plural(leaked, 'leaked process', 'leaked processes')} {killed} killed (see leaked_processes per test)"
        )
    return [line for line in lines if line]


def format_table(report: dict[str, Any], written: bool = True) -> str:
    """Plain-text table for the terminal summary; ``written``: a ``kit-report.json`` exists."""
    rows = table_rows(report)
    columns = table_columns(report)
    widths = [max(len(c), *(len(r[i]) for r in rows)) if rows else len(c) for i, c in enumerate(columns)]
    widths[0] = min(widths[0], 80)

    def line(cells: tuple[str, ...]) -> str:
        cells = (_clip(cells[0], widths[0]), *cells[1:])
        return "  ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True)).rstrip()

    out = [line(columns), line(tuple("-" * w for w in widths))]
    out += [line(r) for r in rows]
    return "\n".join([*out, "", *_footer(report, written)])


def _clip(text: str, width: int) -> str:
    return text if len(text) <= width else "..." + text[-(width - 3) :]


def format_markdown(report: dict[str, Any]) -> str:
    """GitHub-flavoured Markdown: the same table, then failures with their first lines."""
    session = report["session"]
    lines = [
        "## Kit report",
        "",
        f"{_md(session.get('host', '?'))}, {_md(session.get('cpu_count', '?'))} CPUs, "
        f"{_md(session.get('gpus', 0))} GPUs, torch {_md(session.get('torch') or '-')}, "
        f"megatron-core {_md(session.get('megatron_core') or '-')}, "
        f"{session.get('duration_s', 0):.1f} s, {_code('-m ' + str(session.get('markexpr') or '(all)'))}"
        + (f", CI job {_code(session['ci_job'])}" if session.get("ci_job") else "")
        + (
            f"; {plural(len(session['sessions']), 'session')} that shared this report folder, every row kept"
            if session.get("sessions")
            else ""
        ),
        *(
            ["", f"CUDA context in pytest: {_md(session['cuda_context'])}"]
            if session.get("cuda_context")
            else []
        ),
        "",
        "| " + " | ".join(table_columns(report)) + " |",
        "|" + "|".join("---" for _ in table_columns(report)) + "|",
    ]
    for row in table_rows(report):
        lines.append("| " + " | ".join(_md(c) for c in row) + " |")
    lines += ["", *(f"- {line}" for line in _footer(report))]
    failures = [row for row in report["tests"] if row["failure"]]
    if failures:
        lines += ["", "### Failures", ""]
        for row in failures:
            lines.append(f"- {_code(row['nodeid'])}: {_md(row['failure'].get('first_line') or '')}")
            logs = row.get("rank_logs") or row["log_dir"]  # relative to this folder since version 4
            if logs:
                lines.append(f"  rank logs: {_code(logs)}")
    return "\n".join(lines) + "\n"


def _md(text: object) -> str:
    """A table cell or a line of the Markdown: control characters escaped (a report is untrusted:
    an escape sequence in a node id would reach the job summary and the CI log), pipes too."""
    return printable(str(text)).replace("|", "\\|")


def _code(text: object) -> str:
    """``text`` as a code span that no backtick or control character in it can end or drive."""
    return "`" + printable(str(text)).replace("`", "'") + "`"


REPORT_JSON, REPORT_MARKDOWN = "kit-report.json", "kit-report.md"
# Held while a session reads, merges and writes the folder's report (two sessions may share it).
REPORT_LOCK = ".kit-report.lock"


@dataclass(frozen=True)
class ReportFiles:
    """The files `write_report` wrote (unpacks as ``json, markdown``), how many sessions the
    folder's report now holds, and what the writer had to say (an earlier report set aside)."""

    json: Path
    markdown: Path
    sessions: int = 1
    notes: tuple[str, ...] = ()

    def __iter__(self) -> Any:
        return iter((self.json, self.markdown))


def write_report(report: dict[str, Any], directory: str | os.PathLike) -> ReportFiles:
    """Write ``kit-report.json`` and ``kit-report.md`` into the report folder (the CI job, not the
    kit, puts the Markdown in ``$GITHUB_STEP_SUMMARY``, once).

    Under the folder's lock, the report already there (another session's: a job that runs pytest
    twice into one folder, two jobs on one runner) is read through the bounded reader and merged
    (`megatron_testkit.session_merge`): every row of each session is kept. One that cannot be read
    is set aside as ``kit-report.unreadable-<time>.json``, never overwritten unseen. Both files are
    written by the kit's writer (`megatron_testkit.safe_write`): atomic, never through a link;
    `WriteRefused` in one line otherwise (a full disk leaves the previous report whole).
    """
    from megatron_testkit.safe_write import Folder
    from megatron_testkit.schema import ReportError, read_report
    from megatron_testkit.session_merge import merge_sessions

    folder = Folder(directory, what="--kit-report folder")
    notes: list[str] = []
    with folder.lock(REPORT_LOCK):
        merged = report
        found = folder.lstat(REPORT_JSON)
        if found is not None and stat.S_ISREG(found.st_mode):
            try:
                earlier = read_report(folder.path / REPORT_JSON).to_json()
            except ReportError as exc:
                stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%S.%fZ")
                aside = folder.rename(REPORT_JSON, f"kit-report.unreadable-{stamp}.json")
                notes.append(f"the folder's earlier report could not be merged ({exc}); kept as {aside}")
            else:
                header, rows = merge_sessions(earlier, report)
                merged = build_report(header, rows)
        text = json.dumps(merged, indent=2, default=str, allow_nan=False) + "\n"
        json_path = folder.write_text(REPORT_JSON, text)
        md_path = folder.write_text(REPORT_MARKDOWN, format_markdown(merged))
    sessions = len(merged["session"].get("sessions") or [None])
    return ReportFiles(json_path, md_path, sessions, tuple(notes))
