"""A rank's record: what the rank writes before it exits, and what the launcher knows of the rank.

`WrittenRecord` is ``rank<N>.json``, the one statement of its keys: the rank fills it
(`megatron_testkit.rank_worker`) and writes it with `write` through the kit's contained, atomic
writer; the launcher reads it with `read` through the bounded reader, each field checked by its
declared type (the rank ran arbitrary code: the file may be forged). `RankRecord` is the launcher's
view of one rank after a launch: its exit, its sampled peaks, its log and stacks, and the written
record taken in (`RankRecord.take`); `megatron_testkit.diagnosis` turns the records into a verdict.
"""

from __future__ import annotations

import json
import typing
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from accounting.json_input import JsonInputError, load_json
from megatron_testkit.safe_write import Folder
from megatron_testkit.schema import RankPeak

__all__ = ["RankRecord", "Unreadable", "WrittenRecord", "read", "record_name", "write"]

# A rank's record is its own JSON, a few kB; a traceback or a huge exception message is clipped
# here rather than read whole (the record is untrusted: the rank ran arbitrary code).
MAX_RECORD_BYTES = 16 * 2**20
MAX_TEXT = 1 << 20
# The CPU layer's substitutions a record may name, and the length of each name.
_MAX_SUBSTITUTIONS = 64
_MAX_CALL_NAME = 256


@dataclass(frozen=True)
class WrittenRecord:
    """``rank<N>.json``: what a rank leaves just before it exits (any exit it sees coming).

    ``status`` is ``ok`` (the function returned and its result was written) or ``failed``; the
    exception fields say why. Times are wall-clock seconds (`time.time()`).
    """

    rank: int | None = None
    pid: int | None = None
    status: str | None = None
    started: float | None = None
    time: float | None = None  # when the record was written
    peak_host_bytes: int | None = None  # VmHWM, or the sampled sum with the rank's descendants
    peak_process: str | None = None  # the descendant that held most of the rank's peak, if any
    peak_device_bytes: int | None = None
    device: str | None = None  # the rank's own device
    platform: str | None = None  # the golden platform that device names
    last_collective: str | None = None
    collective_seq: int | None = None
    # False while the rank was still starting (Python, torch, the test's module, the process
    # group): a host budget crossed then is the budget's fault, no rank's.
    in_function: bool = True
    idle_host_bytes: int | None = None  # an idle rank's footprint (Python + torch)
    ready_at: float | None = None  # when the rank's process group was up
    cpu_substitutions: dict[str, int] = field(default_factory=dict)  # `megatron_cpu` calls substituted
    exc_type: str | None = None
    exc_message: str | None = None
    traceback: str | None = None
    kind_hint: str | None = None  # ``oom`` when the rank knew (a budget, torch's OutOfMemoryError)
    budget_exceeded: str | None = None  # ``host`` when the rank's budget watchdog stopped it


@dataclass(frozen=True)
class Unreadable:
    """A ``rank<N>.json`` that is not a record the kit wrote (forged, truncated, wrong types); why."""

    why: str


def record_name(rank: int) -> str:
    """The record's file name in the launch's folder."""
    return f"rank{rank}.json"


def write(run_dir: str | Path, record: WrittenRecord) -> Path:
    """Write ``record`` into the launch's folder atomically (the launcher never reads half a record)."""
    if record.rank is None:
        raise ValueError("a rank's written record must name its rank")
    folder = Folder(run_dir, create=False, what="the launch's folder")
    return folder.write_text(record_name(record.rank), json.dumps(asdict(record), default=str))


def _text(value: Any) -> str | None:
    return value[:MAX_TEXT].replace("\0", " ") if isinstance(value, str) else None


def _count(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def _seconds(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def _flag(value: Any) -> bool:
    return value if isinstance(value, bool) else True


def _substitutions(value: Any) -> dict[str, int]:
    if not isinstance(value, dict):
        return {}
    return {
        str(call)[:_MAX_CALL_NAME]: n
        for call, n in list(value.items())[:_MAX_SUBSTITUTIONS]
        if isinstance(n, int) and not isinstance(n, bool) and 0 <= n < 2**53
    }


# How a field of each declared type is read: a value of the wrong type reads as the default.
_READERS: dict[Any, Callable[[Any], Any]] = {
    str | None: _text,
    int | None: _count,
    float | None: _seconds,
    bool: _flag,
    dict[str, int]: _substitutions,
}
# Each written field with its reader, found once from its declared type (a field of a type without
# a reader fails at import, not on a rank's record).
_FIELD_READERS = tuple(
    (f.name, _READERS[typing.get_type_hints(WrittenRecord)[f.name]]) for f in fields(WrittenRecord)
)


def read(path: Path) -> WrittenRecord | Unreadable | None:
    """A rank's record through the bounded reader, each field typed by its declaration; None when
    it is missing, and `Unreadable` when it is not a record the kit wrote (deep nesting, NaN, not
    an object), so the rank is diagnosed from its exit, never with a traceback."""
    try:
        data = load_json(path, limit=MAX_RECORD_BYTES, what="rank record", max_depth=8)
    except JsonInputError as exc:
        if exc.strerror and not path.exists():
            return None
        return Unreadable(str(exc))
    if not isinstance(data, dict):
        return Unreadable(f"rank record {path} is not an object")
    return WrittenRecord(**{name: check(data.get(name)) for name, check in _FIELD_READERS})


@dataclass
class RankRecord:
    """Everything known about one rank after a launch.

    `status` is ``ok`` (returned), ``failed`` (exception, signal or non-zero exit), ``torn_down``
    (still running when another rank's failure ended the launch) or ``hung`` (still running at
    the timeout). Times are wall-clock seconds (`time.time()`), comparable across the ranks of a
    host. `kind`, `knock_on` and `oom_line` are the diagnosis' (`megatron_testkit.diagnosis`).
    """

    rank: int
    status: str
    pid: int | None = None
    exit_code: int | None = None
    signal: str | None = None
    time: float | None = None
    exc_type: str | None = None
    exc_message: str | None = None
    traceback: str | None = None
    kind_hint: str | None = None
    peak_host_bytes: int | None = None
    peak_device_bytes: int | None = None
    peak_process: str | None = None  # the descendant that held most of the rank's peak, if any
    last_collective: str | None = None
    collective_seq: int = 0
    stack: str | None = None
    log_path: str | None = None
    log_tail: str | None = None
    kind: str | None = None
    knock_on: bool = False
    oom_line: str | None = None  # the output line that said "out of memory", for a rank without an exception
    device: str | None = None
    platform: str | None = None
    in_function: bool = True
    idle_host_bytes: int | None = None
    ready_at: float | None = None
    cpu_substitutions: dict[str, int] = field(default_factory=dict)
    unreadable: str | None = None  # why the rank's record was refused, when it was

    def take(self, written: WrittenRecord) -> None:
        """Take in the rank's written record: its own fields as written, merged with the
        launcher's evidence where both saw the same thing (the peak, the time, the status)."""
        for name in _TAKEN_AS_WRITTEN:
            setattr(self, name, getattr(written, name))
        self.collective_seq = written.collective_seq or 0
        self.time = written.time if written.time is not None else self.time
        self.peak_host_bytes = max(written.peak_host_bytes or 0, self.peak_host_bytes or 0) or None
        self.peak_process = written.peak_process or self.peak_process
        if written.status == "failed" and self.status in ("ok", "torn_down", "hung"):
            self.status = "failed"

    def summary(self) -> str:
        """One line: what this rank died of, e.g. ``RuntimeError: Connection closed by peer``."""
        if self.exc_type:
            text = (self.exc_message or "").strip().splitlines()
            return f"{self.exc_type}: {text[0] if text else ''}".rstrip(": ")
        printed = f" after printing: {self.oom_line}" if self.oom_line else ""
        if self.signal:
            hint = " (possibly the kernel OOM killer)" if self.signal == "SIGKILL" and not printed else ""
            return f"killed by {self.signal}{hint}{printed}"
        if self.exit_code not in (None, 0):
            return f"exited with code {self.exit_code} without a Python exception{printed}"
        if self.exit_code == 0 and self.status == "failed":
            return "exited with code 0 before returning (no result, no record)"
        return self.status

    def peak(self) -> RankPeak:
        """This rank's row in the report."""
        return RankPeak(
            self.rank,
            self.peak_host_bytes,
            self.peak_device_bytes,
            self.exit_code,
            self.signal,
            self.peak_process,
        )


# The written fields the launcher merges with its own evidence (`RankRecord.take`; the rank and
# pid are the ones it spawned), and those it does not keep (the exception's message says which
# budget was exceeded; the report counts from the launcher's own start). It takes the rest as written.
_MERGED = frozenset({"rank", "pid", "status", "time", "collective_seq", "peak_host_bytes", "peak_process"})
_NOT_KEPT = frozenset({"started", "budget_exceeded"})
_TAKEN_AS_WRITTEN = tuple(f.name for f in fields(WrittenRecord) if f.name not in _MERGED | _NOT_KEPT)
