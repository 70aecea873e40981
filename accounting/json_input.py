"""The one bounded reader of untrusted JSON: regular files only, a size cap, strict JSON, bounded depth.

Everything the library and the kit read may be crafted: kit reports and golden files from a CI
artifact or a pull request, metric lines and records a rank wrote, a `--hf-config` path that may
name a FIFO or `/dev/zero`. `load_json` reads at most `limit` bytes of a regular file (opened
non-blocking, so a FIFO is refused instead of waited on), and `parse_json` accepts strict JSON
only: no NaN or Infinity (nor a number that overflows to one), no integer past Python's digit
limit, no duplicate key, nesting at most `MAX_DEPTH` deep. The typed-field helpers (`get_str`,
`get_int`, `get_number`, ...) check one field each and fail in one line naming it. Every error is
a `JsonInputError` (a ValueError) whose message is one line, with the file and the field.

Stdlib only, and importing it imports nothing else of `accounting` (no torch): the kit's plugin
and the CI tools (`python -m ci job` runs before the kit's dependencies are installed) read
through it too.
"""

from __future__ import annotations

import json
import math
import os
import stat
import unicodedata
from collections.abc import Mapping
from typing import Any

# Nesting deeper than this is no file the kit or a config writer makes (a kit report is ~8 deep).
MAX_DEPTH = 64
# The default size cap: a kit report of a whole failed suite is well under it (see ci/report_input).
DEFAULT_LIMIT = 32 * 2**20

_MISSING: Any = object()
_CONTAINERS = (dict, list)


class JsonInputError(ValueError):
    """Untrusted JSON input that is unreadable, too large, not strict JSON, or of the wrong shape.

    ``strerror`` is the system's reason when the file could not be opened or read (else None), for
    callers whose own message says "cannot read <path>"."""

    def __init__(self, message: str, strerror: str | None = None) -> None:
        super().__init__(message)
        self.strerror = strerror


def printable(text: str, width: int | None = None) -> str:
    """`text` with control and format characters (escape sequences, bidi overrides, newlines)
    written as escapes, clipped to `width` characters: text from a file, quoted in an error or
    printed to a terminal or a job summary, stays on one line and cannot drive the terminal."""
    out = "".join(
        ch.encode("unicode_escape").decode("ascii")
        if unicodedata.category(ch)[0] in "CZ" and ch != " "
        else ch
        for ch in text
    )
    if width is not None and len(out) > width:
        out = out[: width - 1] + "…"
    return out


def read_regular_file(path: str | os.PathLike[str], limit: int, what: str = "file") -> bytes:
    """Up to `limit` bytes of the regular file `path`; `JsonInputError` for anything else.

    Opened with ``O_NONBLOCK`` and checked with ``fstat`` on the open descriptor, so a FIFO, a
    socket or a device (``/dev/zero``) is refused before a byte is read; a file larger than
    `limit` is refused after reading `limit` + 1 bytes, never more. Messages start with
    ``<what> <path>``.
    """
    where = f"{what} {printable(os.fspath(path), 300)}"
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        reason = exc.strerror or str(exc)
        raise JsonInputError(f"{where}: cannot read it ({reason})", reason) from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise JsonInputError(f"{where} is not a regular file")
    with os.fdopen(fd, "rb") as handle:
        try:
            data = handle.read(limit + 1)
        except OSError as exc:
            reason = exc.strerror or str(exc)
            raise JsonInputError(f"{where}: cannot read it ({reason})", reason) from None
    if len(data) > limit:
        raise JsonInputError(f"{where} is larger than {limit} bytes, the most it may be")
    return data


def load_json(
    path: str | os.PathLike[str],
    *,
    limit: int = DEFAULT_LIMIT,
    what: str = "file",
    max_depth: int = MAX_DEPTH,
) -> Any:
    """The strict JSON value in the regular file `path` (at most `limit` bytes); one-line
    `JsonInputError` naming the file otherwise. `what` names the file's kind in messages."""
    data = read_regular_file(path, limit, what)
    return parse_json(data, where=f"{what} {printable(os.fspath(path), 300)}", max_depth=max_depth)


def parse_json(data: str | bytes, *, where: str, max_depth: int = MAX_DEPTH) -> Any:
    """`data` (UTF-8 bytes or text) as strict JSON; `JsonInputError` starting with `where` otherwise."""
    if isinstance(data, bytes):
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError:
            raise JsonInputError(f"{where} is not UTF-8 text") from None
    else:
        text = data
    try:
        value = json.loads(
            text,
            parse_constant=_refuse_constant,
            parse_float=_finite_float,
            object_pairs_hook=_unique_keys,
        )
    except json.JSONDecodeError as exc:
        raise JsonInputError(f"{where} is not JSON: {exc.msg} at line {exc.lineno}") from None
    except RecursionError:
        raise JsonInputError(
            f"{where} is not JSON the kit reads: nested deeper than {max_depth} levels"
        ) from None
    except ValueError as exc:  # a refused constant, an overflowing number, a duplicate key, digits
        raise JsonInputError(f"{where} is not JSON the kit reads: {printable(str(exc), 120)}") from None
    if _depth(value, max_depth) > max_depth:
        raise JsonInputError(f"{where} is not JSON the kit reads: nested deeper than {max_depth} levels")
    return value


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text[:40]} overflows a float")
    return value


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out = dict(pairs)
    if len(out) != len(pairs):  # rare: only then find the key that repeats
        seen: set[str] = set()
        key = next(k for k, _ in pairs if k in seen or seen.add(k))  # type: ignore[func-returns-value]
        raise ValueError(f"key {printable(key, 60)!r} appears twice in one object")
    return out


def _depth(value: Any, limit: int = MAX_DEPTH) -> int:
    """The nesting depth of a parsed value (a scalar is 0), level by level without recursion;
    stops counting past `limit`. (json only makes plain dicts and lists.)"""
    level = [value] if type(value) in _CONTAINERS else []
    depth = 0
    while level and depth <= limit:
        depth += 1
        below: list[Any] = []
        for item in level:
            below += [c for c in (item.values() if type(item) is dict else item) if type(c) in _CONTAINERS]
        level = below
    return depth


# ---- typed fields: one check a field, one line naming it ------------------------------------------


def require_object(value: Any, where: str) -> dict[str, Any]:
    """`value` when it is a JSON object; `JsonInputError` naming `where` otherwise."""
    if not isinstance(value, dict):
        raise JsonInputError(f"{where} is not an object (got {_kind(value)})")
    return value


def require_list(value: Any, where: str, max_items: int | None = None) -> list[Any]:
    """`value` when it is a JSON array of at most `max_items` entries."""
    if not isinstance(value, list):
        raise JsonInputError(f"{where} is not a list (got {_kind(value)})")
    if max_items is not None and len(value) > max_items:
        raise JsonInputError(f"{where} has more than {max_items} entries")
    return value


def get_str(
    obj: Mapping[str, Any],
    key: str,
    where: str,
    *,
    default: Any = _MISSING,
    max_chars: int = 1 << 20,
    nullable: bool = False,
) -> Any:
    """``obj[key]`` as text of at most `max_chars` characters (None too when `nullable`)."""
    value = _get(obj, key, where, default)
    if _absent(value, default, nullable):
        return value
    if not isinstance(value, str):
        raise JsonInputError(f"{where}.{key} is not text (got {_kind(value)})")
    if len(value) > max_chars:
        raise JsonInputError(f"{where}.{key} is longer than {max_chars} characters")
    return value


def get_int(
    obj: Mapping[str, Any],
    key: str,
    where: str,
    *,
    default: Any = _MISSING,
    low: int | None = None,
    high: int | None = None,
    nullable: bool = False,
) -> Any:
    """``obj[key]`` as an integer in [`low`, `high`] (a bool is not an integer here)."""
    value = _get(obj, key, where, default)
    if _absent(value, default, nullable):
        return value
    if isinstance(value, bool) or not isinstance(value, int):
        raise JsonInputError(f"{where}.{key} is not an integer (got {_kind(value)})")
    if (low is not None and value < low) or (high is not None and value > high):
        raise JsonInputError(f"{where}.{key} = {value} is outside [{low}, {high}]")
    return value


def get_number(
    obj: Mapping[str, Any],
    key: str,
    where: str,
    *,
    default: Any = _MISSING,
    low: float | None = None,
    high: float | None = None,
    nullable: bool = False,
) -> Any:
    """``obj[key]`` as a finite int or float in [`low`, `high`] (a bool is not a number here)."""
    value = _get(obj, key, where, default)
    if _absent(value, default, nullable):
        return value
    check_number(value, f"{where}.{key}")
    if (low is not None and value < low) or (high is not None and value > high):
        raise JsonInputError(f"{where}.{key} = {value!r} is outside [{low}, {high}]")
    return value


def get_bool(obj: Mapping[str, Any], key: str, where: str, *, default: Any = _MISSING) -> Any:
    """``obj[key]`` as true or false."""
    value = _get(obj, key, where, default)
    if _absent(value, default, False):
        return value
    if not isinstance(value, bool):
        raise JsonInputError(f"{where}.{key} is not true or false (got {_kind(value)})")
    return value


def check_number(value: Any, where: str) -> int | float:
    """`value` when it is a finite int or float (not a bool); `JsonInputError` naming `where`."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise JsonInputError(f"{where} is not a number (got {_kind(value)})")
    if isinstance(value, float) and not math.isfinite(value):
        raise JsonInputError(f"{where} = {value!r} is not a finite number")
    return value


def _get(obj: Mapping[str, Any], key: str, where: str, default: Any) -> Any:
    if key in obj:
        return obj[key]
    if default is _MISSING:
        raise JsonInputError(f"{where} has no {key!r}")
    return default


def _absent(value: Any, default: Any, nullable: bool) -> bool:
    """Whether `value` is the caller's default (the key was missing) or an allowed null."""
    return (default is not _MISSING and value is default) or (nullable and value is None)


def _kind(value: Any) -> str:
    if value is None:
        return "null"
    names = {bool: "a boolean", int: "an integer", float: "a number", str: "text", list: "a list"}
    return names.get(type(value), "an object" if isinstance(value, dict) else type(value).__name__)
