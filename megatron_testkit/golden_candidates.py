"""The golden files a run did not find, and the one command that makes them from its report.

A CI run (``CI=true``) fails each test that records metrics and has no golden file for its
platform, so the first run on a new platform (the first GPU job) fails every such test by
design. Its kit report holds what each of them recorded: the files can be made from that report.
`missing_golden_markdown` lists them for a job summary with the command to run, which ships with
the kit (it exists in any project that installed it). Part of the job summary
(`megatron_testkit.summary`, which the composite action writes).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from megatron_testkit import golden

UPDATE_COMMAND = golden.UPDATE_COMMAND  # `python -m megatron_testkit golden update`
REPORT_NAME = "kit-report.json"


@dataclass(frozen=True)
class Candidate:
    """A test that recorded metrics on `platform` and has no golden file there: where it goes."""

    nodeid: str
    platform: str
    path: Path  # relative to the project root


def missing_golden_files(reports: Path, root: Path | None = None) -> list[Candidate]:
    """The tests of ``reports``/kit-report.json whose golden file for their platform is missing.

    Only the tests ``golden update`` would write (passed, or failed only on golden values); the
    files are looked for under ``root`` (default: the working directory), where the test ids
    start. No readable report: none.
    """
    from megatron_testkit.golden_tool import UsageError, load_report

    root = Path.cwd() if root is None else root
    path = reports / REPORT_NAME
    if not path.is_file():
        return []
    try:
        report = load_report(str(path))
    except UsageError:
        return []
    out = []
    for entry in report.tests:
        metrics = entry.metrics
        if metrics is None or not metrics.series:
            continue
        kind = entry.failure.kind if entry.failure else None
        if not (entry.outcome == "passed" or (entry.outcome == "failed" and kind == "golden")):
            continue  # golden update leaves these out: they failed for another reason
        try:
            module, name = golden.golden_stem(entry.nodeid)
        except ValueError:
            continue
        paths = golden.golden_paths(Path(module), name, metrics.platform, metrics.megatron_core)
        if golden.find_golden([root / p for p in paths]) is None:
            out.append(Candidate(entry.nodeid, metrics.platform, paths[-1]))
    return out


def _plain(text: str) -> str:
    """``text`` for a fenced block: control characters escaped, no backtick fence can form."""
    escaped = "".join(ch if ch.isprintable() else ch.encode("unicode_escape").decode("ascii") for ch in text)
    return escaped.replace("`", "'")


def missing_golden_markdown(reports: Path, root: Path | None = None, *, artifact: str | None = None) -> str:
    """A job summary's section: the missing golden files and the command that makes them ("" when none).

    ``artifact`` names the CI artifact that holds the report (the reader downloads it first).
    """
    found = missing_golden_files(reports, root)
    if not found:
        return ""
    platforms = ", ".join(sorted({c.platform for c in found}))
    fetch = f"download the `{_plain(artifact)}` artifact, then " if artifact else ""
    lines = [
        "## Golden files to make",
        "",
        f"{len(found)} test(s) recorded metrics on platform {_plain(platforms)} and have no golden file "
        f"there (a CI run fails them). Their candidate values are in this run's {REPORT_NAME}:",
        "",
        "```text",
        *(f"{_plain(c.nodeid)}\n  -> {_plain(str(c.path))}" for c in found),
        "```",
        "",
        f"To make the files: {fetch}in the project root run `{UPDATE_COMMAND} {REPORT_NAME}` (the path "
        "of that report), review what it wrote (`git status`, `git diff`) and commit it.",
        "",
    ]
    return "\n".join(lines)
