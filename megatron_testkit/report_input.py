"""The one way the kit's commands read a kit report: bounded, parsed, checked against the schema, fail closed.

A report comes from a CI artifact, which a fork's pull request controls, so it is untrusted input.
`read_report` (`megatron_testkit.schema`) reads it through the bounded reader `accounting.json_input`
(at most `MAX_REPORT_BYTES` of a regular file, strict JSON with no NaN or Infinity, bounded depth)
and checks every field it keeps against the schema's declared types and bounds, into a typed
`Report`: the readers (verdicts, the job summary) read its rows as they are. `load_report` gives
the same checked report as JSON, for the readers that index it or put keys of their own on its rows
(repro's plan, the node merge); it holds only the schema's fields. `printable` escapes text from a
report before it reaches a terminal or a job summary. Stdlib only.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from accounting.json_input import printable
from megatron_testkit.schema import MAX_REPORT_BYTES, Report, ReportError, read_report

__all__ = [
    "MAX_REPORT_BYTES",
    "Report",
    "ReportError",
    "code_span",
    "load_report",
    "printable",
    "read_report",
]


def load_report(path: Path | str) -> dict[str, Any]:
    """The report at `path`, checked field by field, as JSON holding only the schema's fields."""
    return read_report(path).to_json()


def code_span(text: str, width: int = 200) -> str:
    """`text` as a Markdown code span (job summaries) that no backtick or newline in it can end."""
    return "`" + printable(text, width).replace("`", "'") + "`"
