"""The report's field declarations and the one reader that walks them (attrs' lesson, stdlib only).

Each report dataclass states a field once: its type in the annotation, its bounds in
``dataclasses.field(metadata=bounds(...))``. `read_object` walks ``dataclasses.fields()`` and
the type hints (``X | None``, ``list[X]``, ``dict[str, X]``, ``Literal[...]``, nested dataclasses,
``bool``/``int``/``float``/``str``, ``Any``), building each field's reader once, in one of two
modes: strict, for a report read back (a field of another type or past its bound is a
`SchemaError` naming its path, ``tests[3].ranks[1].rank``), and lenient, for the kit's own JSON
and older versions (a mistyped value reads as the field's default, a list's mistyped entry is left
out, bounds are not applied; a missing required field is still refused). `megatron_testkit.schema` declares the
fields; `megatron_testkit.memory_series` declares `RankMemory`'s.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import math
import types
import typing
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

# Bounds on what a report read back may hold. A report comes from a CI artifact, which a fork's
# pull request controls, so every size and count in it is bounded before anything is built from it.
# The largest multi-node job the kit merges; sets and lists of ranks are built from world sizes.
MAX_WORLD_SIZE = 1 << 16
# GPUs of one session (merged reports sum nodes); repro writes CUDA_VISIBLE_DEVICES from it.
MAX_GPUS = 1 << 12
# Rows of one report: the whole suite is a few thousand tests, parametrized ones included.
MAX_TESTS = 100_000
# Counts (launches, leaked processes) and other list lengths, e.g. the session's pytest arguments.
MAX_COUNT = 1 << 20
# A node id: pytest's ids are a path plus names and parameters, well under this.
MAX_NODEID_CHARS = 4096
# Any other text (a failure's message: the writer keeps its last 20 000 characters; a hang's
# stacks of every rank can be longer).
MAX_TEXT_CHARS = 1 << 20
# Integers are C int64 where the kit writes them; floats (durations, epoch seconds) are finite.
MAX_INT = 2**63 - 1
MAX_FLOAT = 1e15
# A setting's name and value: environment variables, short.
MAX_SETTING_CHARS = 4096
# Launches of one test: a test that launches in a loop is still far under this.
MAX_LAUNCHES = 10_000

# Ranges shared by fields of several classes: a rank, a world size, a size in bytes, a count.
RANK = (0, MAX_WORLD_SIZE - 1)
WORLD_SIZE = (0, MAX_WORLD_SIZE)
BYTES = (0, MAX_INT)
COUNT = (0, MAX_COUNT)


class SchemaError(ValueError):
    """A report, or part of one, that does not follow this schema; the message says where."""


def bounds(
    *,
    range: tuple[int, int] | None = None,
    chars: int | None = None,
    items: int | None = None,
    choices: tuple[str, ...] | None = None,
    keys: tuple[str, ...] | None = None,
    required: bool = False,
    read: Callable[[Any, str], Any] | None = None,
    keep: Callable[[Any], bool] | None = None,
    empty_is_none: bool = False,
) -> dict[str, Any]:
    """A field's bounds, for ``dataclasses.field(metadata=bounds(...))``: `range` (an int's, both
    ends included; default +-`MAX_INT`), `chars` (text; default `MAX_TEXT_CHARS`), `items` (a list's
    or an object's entries; default `MAX_COUNT`), `choices` (the text allowed), `keys` (an object's
    keys allowed); a list's item bounds apply to each of its items. `required`: a row cannot do
    without it (null is not absent); `read`: the field's type reads itself (``read(value, where)``,
    raising `SchemaError`); `keep`: which items of a list are kept (read leniently, one that cannot be read is dropped too); `empty_is_none`: empty text
    reads as None."""
    given = {
        "range": range,
        "chars": chars,
        "items": items,
        "choices": choices,
        "keys": keys,
        "required": required or None,
        "read": read,
        "keep": keep,
        "empty_is_none": empty_is_none or None,
    }
    return {key: value for key, value in given.items() if value is not None}


# A size in bytes: 0 to MAX_INT (None: unknown).
SIZE = bounds(range=BYTES)


# Reads one value: (value, where, strict) -> the value read, or `_WRONG` (lenient only).
Reader = Callable[[Any, str, bool], Any]


class _Field(NamedTuple):
    name: str
    kind: Any  # the type without its None
    meta: Mapping[str, Any]
    default: Callable[[], Any]
    read: Reader
    required: bool


_WRONG = object()  # what a lenient read gives for a value of another type: the default stands in


def _strip_none(hint: Any) -> Any:
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        kinds = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(kinds) != 1:
            raise TypeError(f"a report field is one type or None, not {hint}")
        return kinds[0]
    return hint


def _zero(kind: Any, nullable: bool) -> Callable[[], Any]:
    """What a field without a default reads as when absent: None when it may be, else empty."""
    if nullable or dataclasses.is_dataclass(kind):
        return _none
    origin = typing.get_origin(kind) or kind
    return {list: list, dict: dict, str: str, int: int, float: float, bool: bool}.get(origin, _none)


def _none() -> None:
    return None


@functools.cache
def declared_fields(cls: type) -> tuple[_Field, ...]:
    """The fields of `cls` with their types, bounds and readers, once per class:
    `typing.get_type_hints` compiles every annotation on each call (3 ms a row of 100,000 in a
    report that `merge-reports` reads, 5 minutes a report)."""
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        kind = _strip_none(hints[f.name])
        if f.default is not dataclasses.MISSING:
            default = functools.partial(_same, f.default)
        elif f.default_factory is not dataclasses.MISSING:
            default = f.default_factory
        else:
            default = _zero(kind, kind is not hints[f.name])
        read = reader(kind, f.metadata)
        out.append(_Field(f.name, kind, f.metadata, default, read, bool(f.metadata.get("required"))))
    return tuple(out)


def _same(value: Any) -> Any:
    return value


def required_fields(cls: type) -> tuple[str, ...]:
    """The fields of `cls` a row cannot do without."""
    return tuple(f.name for f in declared_fields(cls) if f.required)


def _refuse(strict: bool, message: str) -> Any:
    if strict:
        raise SchemaError(message)
    return _WRONG


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def read_value(value: Any, kind: Any, where: str, meta: Mapping[str, Any], strict: bool) -> Any:
    """`value` read as type `kind` (None already stripped) within the bounds in `meta`; strict: a
    `SchemaError` naming `where` when it does not fit, lenient: `_WRONG` (the caller's default)."""
    return reader(kind, meta)(value, where, strict)


def reader(kind: Any, meta: Mapping[str, Any]) -> Reader:
    """The reader of type `kind` within the bounds in `meta`, built once per field."""
    hook = meta.get("read")
    if hook is not None:
        return lambda value, where, strict: hook(value, where)
    origin, args = typing.get_origin(kind), typing.get_args(kind)
    if origin is list:
        return functools.partial(
            _read_list, reader(args[0], meta), meta.get("items", MAX_COUNT), meta.get("keep")
        )
    if origin is dict:
        keys = reader(str, {"choices": meta["keys"]} if "keys" in meta else {})
        return functools.partial(_read_dict, keys, reader(args[1], meta), meta.get("items", MAX_COUNT))
    if origin is typing.Literal:
        return reader(str, {**meta, "choices": args})
    if dataclasses.is_dataclass(kind):
        return functools.partial(_read_object_at, kind)
    if kind is bool:
        return _read_bool
    if kind is int:
        return functools.partial(_read_int, *meta.get("range", (-MAX_INT, MAX_INT)))
    if kind is float:
        return _read_float
    if kind is str:
        return functools.partial(
            _read_text,
            meta.get("chars", MAX_TEXT_CHARS),
            meta.get("choices"),
            bool(meta.get("empty_is_none")),
        )
    return _read_any


def _read_any(value: Any, where: str, strict: bool) -> Any:
    return value


def _read_bool(value: Any, where: str, strict: bool) -> Any:
    return value if isinstance(value, bool) else _refuse(strict, f"{where} is not true or false")


def _read_int(low: int, high: int, value: Any, where: str, strict: bool) -> Any:
    if _is_int(value) and (not strict or low <= value <= high):
        return value
    return _refuse(strict, f"{where} is not an integer in [{low}, {high}]")


def _read_float(value: Any, where: str, strict: bool) -> Any:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if ok and (not strict or abs(value) <= MAX_FLOAT):
        return value
    return _refuse(strict, f"{where} is not a finite number")


def _read_text(
    limit: int, choices: tuple[str, ...] | None, empty_is_none: bool, value: Any, where: str, strict: bool
) -> Any:
    if not isinstance(value, str) or (strict and len(value) > limit):
        return _refuse(strict, f"{where} is not text of at most {limit} characters")
    if strict and choices is not None and value not in choices:
        raise SchemaError(f"{where} is not one of {', '.join(choices)}")
    return None if empty_is_none and value == "" else value


def _read_list(
    item: Reader, limit: int, keep: Callable[[Any], bool] | None, value: Any, where: str, strict: bool
) -> Any:
    if type(value) is not list or (strict and len(value) > limit):
        return _refuse(strict, f"{where} is not a list of at most {limit} entries")
    out = []
    for i, entry in enumerate(value):
        try:
            got = item(entry, f"{where}[{i}]", strict)
        except SchemaError:
            if strict or keep is None:
                raise
            continue  # lenient, a list that filters its entries: one it cannot read is left out too
        if got is not _WRONG and (keep is None or keep(got)):
            out.append(got)  # lenient: an entry of another type is left out
    return out


def _read_dict(keys: Reader, item: Reader, limit: int, value: Any, where: str, strict: bool) -> Any:
    if not isinstance(value, dict) or (strict and len(value) > limit):
        return _refuse(strict, f"{where} is not an object of at most {limit} entries")
    out = {}
    for key, entry in value.items():
        name = keys(key, where, strict)
        got = item(entry, f"{where}.{key}", strict)
        if name is not _WRONG and got is not _WRONG:
            out[name] = got
    return out


def _read_object_at(cls: type, value: Any, where: str, strict: bool) -> Any:
    return read_object(value, cls, where, strict)


def read_object(value: Any, cls: type, where: str, strict: bool) -> Any:
    """An instance of dataclass `cls` from the JSON object `value`, field by field.

    A field absent or null reads as its default, unless it is required: strict, it is then checked
    (and refused) as its type; lenient, the row is refused (`SchemaError` "has no 'nodeid' and
    'outcome'"). Keys the class does not define are ignored (never read).
    """
    if isinstance(value, cls):
        return value
    if not isinstance(value, dict):
        return _refuse(strict, f"{where} is not an object")
    values = {}
    for f in declared_fields(cls):
        entry = value.get(f.name)
        if entry is None and not (strict and f.required):
            got = _WRONG
        else:
            got = f.read(entry, f"{where}.{f.name}", strict)
        if got is _WRONG:
            if f.required:
                raise SchemaError(_missing(cls, where))
            got = f.default()
        values[f.name] = got
    return cls(**values)


def _missing(cls: type, where: str) -> str:
    """``"tests[0] has no 'nodeid' and 'outcome'"``, ``"tests[0].ranks[0] has no integer 'rank'"``."""
    names = [("integer " if f.kind is int else "") + repr(f.name) for f in declared_fields(cls) if f.required]
    return f"{where} has no {' and '.join(names)}"


def from_json(cls: type, data: Any, where: str) -> Any:
    """`cls` read leniently from `data`; a `SchemaError` when `data` is no object or lacks a
    required field."""
    got = read_object(data, cls, where, strict=False)
    if got is _WRONG:
        raise SchemaError(_missing(cls, where) if required_fields(cls) else f"{where} is not an object")
    return got


_R = typing.TypeVar("_R", bound="JsonRecord")


class JsonRecord:
    """What every report dataclass shares: its JSON (`to_json`) and its lenient reader (`from_json`)."""

    def to_json(self) -> dict[str, Any]:
        """The record as plain JSON types, in the report's field names."""
        return typing.cast(dict[str, Any], as_json(self))

    @classmethod
    def from_json(cls: type[_R], data: Any, where: str | None = None) -> _R:
        """The inverse of `to_json`, lenient (the kit's own JSON, older report versions): a value of
        another type reads as the field's default."""
        return typing.cast(_R, from_json(cls, data, where or cls.__name__))


_SCALARS = (str, int, float, bool, type(None))


@functools.cache
def _field_names(cls: type) -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(cls))


def as_json(value: Any) -> Any:
    """What `dataclasses.asdict` gives, without its deep copy of every immutable scalar (half the
    time of reading or merging a report of 100,000 rows); other values it copies alike."""
    if type(value) in _SCALARS:
        return value
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {name: as_json(getattr(value, name)) for name in _field_names(type(value))}
    if type(value) is list:
        return [as_json(item) for item in value]
    if type(value) is dict:
        return {as_json(key): as_json(item) for key, item in value.items()}
    if type(value) is tuple:
        return tuple(as_json(item) for item in value)
    return copy.deepcopy(value)
