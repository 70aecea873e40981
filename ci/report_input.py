"""The one way the CI tools read a kit report: bounded, parsed, checked against the schema, fail closed.

A report comes from a CI artifact, which a fork's pull request controls, so it is untrusted input.
`load_report` reads at most `MAX_REPORT_BYTES`, refuses what is not strict JSON (NaN, Infinity,
numbers past Python's digit limit, nesting past the recursion limit), and checks every field it
keeps through `megatron_testkit.schema.check_report`; what it returns holds only the schema's
fields. `printable` escapes text from a report before it reaches a terminal or a job summary.
Stdlib only: `python -m ci job` runs `ci/charts.py` before the kit's dependencies are installed.
"""

from __future__ import annotations

import json
import os
import stat
import unicodedata
from pathlib import Path
from typing import Any

from megatron_testkit.schema import SchemaError, check_report

# The largest report read: about 1 kB per test plus failure text the writer clips to 20 000
# characters, so 32 MiB holds a whole suite that failed; parsed, it is roughly ten times that.
MAX_REPORT_BYTES = 32 * 2**20


class ReportError(ValueError):
    """A report that is missing, too large, not JSON, or not a well-formed kit report (version 1 or 2)."""


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def read_regular_file(path: Path | str, limit: int) -> bytes | None:
    """Up to `limit` + 1 bytes of `path`; None when it is not a regular file (a FIFO, /dev/zero...).

    Opened non-blocking, so a FIFO is refused instead of waiting for a writer.
    """
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    with os.fdopen(fd, "rb") as handle:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        return handle.read(limit + 1)


def read_json(path: Path | str, limit: int = MAX_REPORT_BYTES) -> Any:
    """The JSON value in the regular file `path`, read up to `limit` bytes; `ReportError` otherwise."""
    path = Path(path)
    try:
        data = read_regular_file(path, limit)
    except OSError as exc:
        raise ReportError(f"cannot read report {path}: {exc.strerror or exc}") from None
    if data is None:
        raise ReportError(f"{path} is not a regular file")
    if len(data) > limit:
        raise ReportError(f"{path} is larger than {limit} bytes, the most a kit report may be")
    try:
        return json.loads(data.decode("utf-8"), parse_constant=_refuse_constant)
    except UnicodeDecodeError:
        raise ReportError(f"{path} is not UTF-8 text") from None
    except json.JSONDecodeError as exc:
        raise ReportError(f"{path} is not JSON: {exc.msg} at line {exc.lineno}") from None
    except (ValueError, RecursionError) as exc:
        raise ReportError(f"{path} is not JSON the kit writes: {printable(str(exc), 120)}") from None


def load_report(path: Path | str) -> dict[str, Any]:
    """The report at `path`, checked field by field and holding only the schema's fields."""
    data = read_json(path)
    try:
        report = check_report(data)
    except SchemaError as exc:
        if str(exc).startswith("not a version"):
            raise ReportError(f"{path} is {exc}") from None
        raise ReportError(f"{path}: {exc}") from None
    return report.to_json()


def printable(text: str, width: int | None = None) -> str:
    """`text` with control and format characters (escape sequences, bidi overrides, newlines)
    written as escapes, clipped to `width` characters; safe to print to a terminal."""
    out = "".join(
        ch.encode("unicode_escape").decode("ascii")
        if unicodedata.category(ch)[0] in "CZ" and ch != " "
        else ch
        for ch in text
    )
    if width is not None and len(out) > width:
        out = out[: width - 1] + "…"
    return out


def code_span(text: str, width: int = 200) -> str:
    """`text` as a Markdown code span (job summaries) that no backtick or newline in it can end."""
    return "`" + printable(text, width).replace("`", "'") + "`"
