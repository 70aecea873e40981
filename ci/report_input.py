"""The one way the CI tools read a kit report: bounded, parsed, checked against the schema, fail closed.

A report comes from a CI artifact, which a fork's pull request controls, so it is untrusted input.
`load_report` reads it through the kit's one report reader (`megatron_testkit.schema.read_report`,
which reads through the bounded reader `accounting.json_input`: at most `MAX_REPORT_BYTES` of a
regular file, strict JSON with no NaN or Infinity, bounded depth) and checks every field it keeps
through `megatron_testkit.schema.check_report`; what it returns holds only the schema's fields.
`printable` escapes text from a report before it reaches a terminal or a job summary.
Stdlib only: `python -m ci job` runs `ci/charts.py` before the kit's dependencies are installed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from accounting.json_input import printable
from megatron_testkit.schema import MAX_REPORT_BYTES, ReportError, read_report

__all__ = ["MAX_REPORT_BYTES", "ReportError", "code_span", "load_report", "printable"]


def load_report(path: Path | str) -> dict[str, Any]:
    """The report at `path`, checked field by field and holding only the schema's fields."""
    return read_report(path).to_json()


def code_span(text: str, width: int = 200) -> str:
    """`text` as a Markdown code span (job summaries) that no backtick or newline in it can end."""
    return "`" + printable(text, width).replace("`", "'") + "`"
