"""A CI job's summary of its kit report: the Markdown for the job summary, the annotations, the repro line.

`job_summary` is what the composite action (``action.yml``) appends to ``$GITHUB_STEP_SUMMARY``:
the report's table (``kit-report.md``), the memory chart (`megatron_testkit.charts`), the golden
files the run's platform lacks and the command that makes them (`golden_candidates`), the NCCL
flight-recorder dumps found, and the exact command that reruns the job's failures locally from its
artifact. `annotations` gives one ``::error`` workflow command per failed test, naming the test,
the rank and the kind (the first 50, then a line that counts the rest). Everything read is
untrusted (a fork's pull request runs the job): the report through the bounded reader, its text
escaped before it reaches a summary or a command.
"""

from __future__ import annotations

import shlex
from collections.abc import Sequence
from pathlib import Path

from accounting.json_input import JsonInputError, printable, read_regular_file
from megatron_testkit.charts import memory_charts_markdown
from megatron_testkit.golden_candidates import missing_golden_markdown
from megatron_testkit.report_input import ReportError, read_report
from megatron_testkit.verdicts import failed_tests, verdict

REPORT_JSON, REPORT_MARKDOWN = "kit-report.json", "kit-report.md"
REPRO_COMMAND = "python -m megatron_testkit repro"
# The report's Markdown is at most the report's own size; a file of another job's is refused past it.
MAX_MARKDOWN_BYTES = 32 * 2**20
_FLIGHT_RECORDER = "nccl_flight_recorder_rank*"
# GitHub shows 10 error annotations a step and 50 a job; 100,000 failures printed 12 MB of them.
MAX_ANNOTATIONS = 50


def outside_folder(reports: Path, paths: Sequence[Path]) -> Path | None:
    """The first of `paths` that is not inside the folder `reports` once links and ``..`` are
    resolved (None when all are): only the report folder's own files reach a public summary."""
    folder = reports.resolve()
    for path in paths:
        if folder not in path.resolve().parents:
            return path
    return None


def _read_markdown(path: Path) -> str | None:
    """A Markdown file the job wrote, bounded, its control characters escaped line by line (an
    artifact's file is untrusted: an escape sequence would drive the CI log's terminal); None when
    it is missing or not a regular file."""
    try:
        text = read_regular_file(path, MAX_MARKDOWN_BYTES, "summary file").decode("utf-8", "replace")
    except JsonInputError:
        return None
    return "\n".join(printable(line) for line in text.split("\n"))


def repro_command(
    artifact: str | None,
    command: str = REPRO_COMMAND,
    run_id: str | None = None,
    repository: str | None = None,
    reports: str | None = None,
) -> str:
    """The line that reruns a job's failures locally, in the project's root: when the run is known,
    the GitHub CLI downloads its artifact into a folder of that name first; else the report is the
    artifact's, downloaded into a folder of its name, or without an artifact the report folder's
    (`reports`, as given: a local run's line runs where it was printed)."""
    if not (artifact and run_id):
        folder = artifact or reports
        path = f"{folder.rstrip('/')}/{REPORT_JSON}" if folder else REPORT_JSON
        return f"{command} --from-report {shlex.quote(path)}"
    where = f" --repo {shlex.quote(repository)}" if repository else ""
    fetch = f"gh run download {shlex.quote(run_id)}{where} --name {shlex.quote(artifact)} --dir {shlex.quote(artifact)}"
    return f"{fetch} && {command} --from-report {shlex.quote(f'{artifact}/{REPORT_JSON}')}"


def job_summary(
    reports: Path,
    root: Path | None = None,
    *,
    artifact: str | None = None,
    repro: str | None = None,
    also: Sequence[Path] = (),
) -> str:
    """The job summary's Markdown for the report folder `reports` (the tests' ids are relative to
    `root`, default the working directory). `also`: more Markdown files the job writes, appended
    (one line for each that is missing); without a kit report one line says so, unless the job
    writes such files instead (a benchmark row)."""
    extra = [
        _read_markdown(path) or f"No {printable(path.name, 200)}: the job stopped before it wrote it.\n"
        for path in also
    ]
    table = _read_markdown(reports / REPORT_MARKDOWN)
    parts = []
    if table is not None:
        parts.append(table)
    elif not extra:
        parts.append(
            f"## Kit report\n\nNo kit report: the job stopped before the kit wrote {REPORT_MARKDOWN}.\n"
        )
    charts = memory_charts_markdown(reports / REPORT_JSON)
    if charts:
        parts.append(charts)
    missing = missing_golden_markdown(reports, root, artifact=artifact)
    if missing:
        parts.append(missing)
    dumps = sum(1 for _ in reports.rglob(_FLIGHT_RECORDER)) if reports.is_dir() else 0
    if dumps:
        parts.append(f"NCCL flight-recorder dumps: {dumps}\n")
    parts += extra
    if extra and table is None and artifact:
        parts.append(f"The job's files: the `{printable(artifact, 200)}` artifact.\n")
    if repro and table is not None:
        downloads = repro.startswith("gh run download")  # the line fetches the artifact itself
        fetch = (
            f"download the `{printable(artifact, 200)}` artifact, then " if artifact and not downloads else ""
        )
        parts.append(f"Reproduce locally: {fetch}`{printable(repro, 600)}`\n")
    return "\n".join(parts)


def _data(text: str) -> str:
    """A workflow command's message, escaped as GitHub's toolkit does (no new line can start)."""
    return text.replace("%", "%25").replace("\r", "%0D").replace("\n", "%0A")


def _property(text: str) -> str:
    """A workflow command's property value (``file=``, ``title=``), escaped."""
    return _data(text).replace(":", "%3A").replace(",", "%2C")


def annotations(reports: Path, limit: int = MAX_ANNOTATIONS) -> list[str]:
    """One ``::error`` line per failed, errored or interrupted test of the folder's report:
    ``::error file=tests/test_x.py,line=12,title=tests/test_x.py::test_y: rank 1 oom::<first line>``
    (``line=``: the test function's, where the report has it), the first `limit` of them, then one
    line that counts the rest. Empty when the report is missing or unusable (the summary says why)."""
    try:
        report = read_report(reports / REPORT_JSON)
    except ReportError:
        return []
    failed = failed_tests(report)
    lines = []
    for test in failed[:limit]:
        v = verdict(test)
        name = printable(v.nodeid, 300)
        title = f"{name}: {printable(v.cause, 80)}"
        message = printable(v.first_line, 600) or f"{v.outcome} (see the job's kit report)"
        path = v.nodeid.split("::", 1)[0]
        where = f"file={_property(printable(path, 300))}," if path.endswith(".py") else ""
        if where and test.line is not None:  # the test function's line (1 or more; version 4 on)
            where += f"line={test.line},"
        lines.append(f"::error {where}title={_property(title)}::{_data(message)}")
    if len(failed) > limit:
        lines.append(
            f"and {len(failed) - limit} more failed test(s), not annotated: see the job's kit report"
        )
    return lines
