"""PyTorch's flight recorder for the rank launcher: ask for a dump before a kill, collect and read it.

Facts this module is built on (PyTorch's ProcessGroupNCCL and flight recorder):

- Each rank records its last collectives in a ring buffer whose size is ``TORCH_FR_BUFFER_SIZE``
  (older releases read only ``TORCH_NCCL_TRACE_BUFFER_SIZE``, and their dump pipe is created only
  when that older name is > 0), and writes a dump to ``<TORCH_FR_DUMP_TEMP_FILE><rank>``
  (older name ``TORCH_NCCL_DEBUG_INFO_TEMP_FILE``).
- NCCL writes that dump by itself only on a watchdog timeout or error. megatron-core's groups are
  created with ``distributed_timeout_minutes=30``, and the launcher kills ranks long before that,
  so a hang inside a megatron group used to leave no dump.
- ``TORCH_NCCL_DEBUG_INFO_PIPE_FILE=<stem>`` makes the global process group create a FIFO
  ``<stem><rank>.pipe``; anything written to it makes the heartbeat-monitor thread dump. That
  thread polls every ``TORCH_NCCL_COORD_CHECK_MILSEC`` (1000 ms) only while
  ``TORCH_NCCL_DUMP_ON_TIMEOUT`` is on, otherwise every heartbeat timeout (8-10 minutes). So the
  launcher must request the dump and then wait at least one poll plus the write before it kills.

The CPU build's gloo process groups record into the same flight recorder and dump the same
format through ``torch._C._distributed_c10d._dump_fr_trace()``, which is how the parsing is
tested without a GPU.
"""

from __future__ import annotations

import contextlib
import errno
import io
import json
import os
import pickle
import stat
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from accounting.json_input import JsonInputError, read_regular_file

__all__ = [
    "DUMP_STEM",
    "Collective",
    "RankTrace",
    "diagnose",
    "dump_before_kill",
    "dump_path",
    "load_dump",
    "megatron_timeout_minutes",
    "nccl_env",
    "parse_dump",
    "pipe_path",
    "read_dumps",
    "request_dumps",
    "wait_for_dumps",
]

# File stem of the dumps and request pipes inside a launch's directory: rank r dumps to
# `<stem>r` and listens on `<stem>r.pipe` (the same stem for both, as PyTorch's own tests do).
DUMP_STEM = "nccl_flight_recorder_rank"
# A dump holds at most the recorder's ring of entries (2000 by default) with their stacks: megabytes.
MAX_DUMP_BYTES = 256 * 2**20
# The monitor thread's poll interval the launcher asks for (PyTorch's default is 1000 ms): the
# wait between a dump request and the kill is at least one poll.
COORD_CHECK_MS = 250
# How long the launcher waits for the requested dumps before it kills: a few polls plus the write.
DUMP_WAIT_S = 3.0
# Environment variable the launcher gives each rank: its process-group timeout in seconds.
PG_TIMEOUT_ENV = "KIT_PG_TIMEOUT_S"


def nccl_env(run_dir: str | os.PathLike[str], *, environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """Environment for an NCCL launch: flight recorder on, dumps and request pipes in ``run_dir``.

    Both names of each setting, for old and new PyTorch. A value the user already set in
    ``environ`` (the launcher's own environment) is left to them for the poll interval only.
    """
    environ = os.environ if environ is None else environ
    stem = str(Path(run_dir) / DUMP_STEM)
    env = {
        "TORCH_FR_BUFFER_SIZE": "2000",
        "TORCH_NCCL_TRACE_BUFFER_SIZE": "2000",
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
        "TORCH_FR_DUMP_TEMP_FILE": stem,
        "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": stem,
        "TORCH_NCCL_DEBUG_INFO_PIPE_FILE": stem,
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "3",
    }
    if "TORCH_NCCL_COORD_CHECK_MILSEC" not in environ:
        env["TORCH_NCCL_COORD_CHECK_MILSEC"] = str(COORD_CHECK_MS)
    return env


def dump_path(stem: str | os.PathLike[str], rank: int) -> Path:
    """Where rank ``rank`` writes its dump (``<stem><rank>``, PyTorch's DebugInfoWriter naming)."""
    return Path(f"{stem}{rank}")


def pipe_path(stem: str | os.PathLike[str], rank: int) -> Path:
    """The FIFO rank ``rank`` reads dump requests from (``<stem><rank>.pipe``)."""
    return Path(f"{stem}{rank}.pipe")


def request_dumps(stem: str | os.PathLike[str], ranks: Iterable[int]) -> dict[int, str]:
    """Write a dump request into each rank's pipe without ever blocking; returns each rank's outcome.

    ``requested``; ``no-pipe`` (the rank has no NCCL process group yet, or an old torch);
    ``not-a-fifo``; ``no-reader`` (the pipe exists but its process is gone).
    """
    outcome = {}
    for rank in ranks:
        path = pipe_path(stem, rank)
        try:
            mode = os.stat(path).st_mode
        except FileNotFoundError:
            outcome[rank] = "no-pipe"
            continue
        if not stat.S_ISFIFO(mode):
            outcome[rank] = "not-a-fifo"
            continue
        try:
            fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
        except OSError as exc:
            # ENXIO: a FIFO with no reader; opening it for writing without O_NONBLOCK would wait.
            outcome[rank] = "no-reader" if exc.errno == errno.ENXIO else f"error: {exc.strerror}"
            continue
        try:
            os.write(fd, b"dump\n")
            outcome[rank] = "requested"
        except OSError as exc:
            outcome[rank] = f"error: {exc.strerror}"
        finally:
            os.close(fd)
    return outcome


def dump_before_kill(
    stem: str | os.PathLike[str], ranks: Iterable[int], *, wait_s: float = DUMP_WAIT_S
) -> dict[int, str]:
    """Request a dump from every given rank, wait for those that can answer; returns each outcome.

    ``dumped`` (its file reads whole), ``requested, no dump within <wait_s> s``, or why no request
    was possible (see `request_dumps`). Ranks without a pipe cost no waiting, so a gloo launch or a
    rank that died before creating its process group does not slow the teardown.
    """
    ranks = list(ranks)
    asked = request_dumps(stem, ranks)
    waiting = [r for r in ranks if asked[r] == "requested"]
    found = wait_for_dumps(stem, waiting, wait_s) if waiting else {}
    outcome = {}
    for rank in ranks:
        if rank in found:
            outcome[rank] = "dumped"
        elif asked[rank] == "requested":
            outcome[rank] = f"requested, no dump within {wait_s:g} s"
        else:
            outcome[rank] = asked[rank]
    return outcome


class _NoGlobals(pickle.Unpickler):
    """A dump is plain dicts, lists, tuples, strings and numbers: refuse anything that imports."""

    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"flight-recorder dump refers to {module}.{name}; refusing to import it")


def load_dump(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read one dump file: PyTorch's pickle (the default) or its JSON form.

    Raises ValueError naming the file when it is neither (e.g. still being written).
    """
    try:  # bounded: a regular file (never a FIFO) of at most MAX_DUMP_BYTES
        data = read_regular_file(path, MAX_DUMP_BYTES, "flight-recorder dump")
    except JsonInputError as exc:
        raise ValueError(str(exc)) from None
    try:
        loaded = _NoGlobals(io.BytesIO(data)).load()
    except Exception as pickle_error:
        try:
            loaded = json.loads(data)
        except ValueError:
            raise ValueError(
                f"{path}: not a flight-recorder dump (neither pickle nor JSON: {pickle_error})"
            ) from None
    if not isinstance(loaded, dict) or "entries" not in loaded:
        raise ValueError(f"{path}: not a flight-recorder dump (no 'entries'; keys {sorted(loaded)[:8]})")
    return loaded


def wait_for_dumps(
    stem: str | os.PathLike[str], ranks: Iterable[int], timeout_s: float, *, poll_s: float = 0.05
) -> dict[int, Path]:
    """Wait until each rank's dump exists and reads whole, or ``timeout_s``; returns those found."""
    pending = set(ranks)
    found: dict[int, Path] = {}
    deadline = time.monotonic() + timeout_s
    while True:
        for rank in sorted(pending):
            path = dump_path(stem, rank)
            with contextlib.suppress(OSError, ValueError):
                if path.stat().st_size > 0:
                    load_dump(path)
                    found[rank] = path
        pending -= set(found)
        if not pending or time.monotonic() >= deadline:
            return found
        time.sleep(poll_s)


@dataclass(frozen=True)
class Collective:
    """One flight-recorder entry: which group, which collective number, which op, how far it got.

    ``group`` is for people (the group's name, with its description when it has one); ``pg_name``
    is the group's name as torch keys it (``group.group_name``, what the wrappers key groups by).
    ``done``: the op completed (its state says so, torch retired it, or the group's status counts
    it completed: the CPU build's gloo groups leave the state at ``scheduled`` and retire instead).
    ``peer``: a point-to-point op's peer as the group numbers it (``send 0->1``: 1), or None.
    """

    group: str
    seq: int
    op: str
    state: str
    is_p2p: bool = False
    input_sizes: tuple = ()
    pg_name: str = ""
    input_dtypes: tuple[str, ...] = ()
    output_sizes: tuple = ()
    output_dtypes: tuple[str, ...] = ()
    done: bool = False
    record_id: int = 0
    peer: int | None = None


@dataclass
class RankTrace:
    """One rank's dump, read: its entries and, per group, the last enqueued and completed numbers.

    ``groups``: each group's global ranks from the dump's ``pg_config`` (NCCL fills it; the CPU
    build's gloo groups leave it empty); ``first_record``: the oldest entry's record id (above 0:
    the ring buffer dropped older entries, so counts taken from the entries are not whole).
    """

    rank: int
    version: str
    entries: list[Collective] = field(default_factory=list)
    enqueued: dict[str, int] = field(default_factory=dict)
    completed: dict[str, int] = field(default_factory=dict)
    groups: dict[str, tuple[int, ...]] = field(default_factory=dict)
    first_record: int = 0


# Bounds on what one dump may list (it is read as untrusted input).
_MAX_ENTRIES = 1 << 16
_MAX_RANKS = 1 << 16


def _group_name(entry: Mapping[str, Any]) -> str:
    pg = entry.get("process_group")
    if isinstance(pg, (list, tuple)) and pg:
        name, desc = str(pg[0]), str(pg[1]) if len(pg) > 1 else ""
        return f"{name} ({desc})" if desc and desc != "undefined" else name
    return str(entry.get("pg_id", "?"))


def _pg_name(entry: Mapping[str, Any]) -> str:
    pg = entry.get("process_group")
    return str(pg[0])[:200] if isinstance(pg, (list, tuple)) and pg else str(entry.get("pg_id", "?"))[:200]


def _number(value: Any, default: int = 0) -> int:
    """An int field of a dump (the JSON form writes some as strings), ``default`` when it is none."""
    if isinstance(value, bool):
        return default
    if isinstance(value, int):
        return value
    if isinstance(value, str) and value.lstrip("-").isdigit() and len(value) < 20:
        return int(value)
    return default


def _shapes(raw: Any) -> tuple:
    if not isinstance(raw, (list, tuple)):
        return ()
    return tuple(
        tuple(d for d in shape if isinstance(d, int) and not isinstance(d, bool))
        for shape in raw[:64]
        if isinstance(shape, (list, tuple))
    )


def _names(raw: Any) -> tuple[str, ...]:
    return tuple(str(d)[:40] for d in raw[:64]) if isinstance(raw, (list, tuple)) else ()


def _ranks_text(raw: Any) -> tuple[int, ...] | None:
    """``pg_config``'s ranks, written as the text ``"[0, 1]"``: the ints, or None if it is not that."""
    if (
        not isinstance(raw, str)
        or len(raw) > 16 * _MAX_RANKS
        or not raw.startswith("[")
        or not raw.endswith("]")
    ):
        return None
    body = raw[1:-1].strip()
    parts = [p.strip() for p in body.split(",")] if body else []
    if not all(p.isdigit() and len(p) < 10 for p in parts):
        return None
    return tuple(int(p) for p in parts)


def _p2p_peer(name: str) -> int | None:
    """The group rank of a point-to-point op's peer: ``send 0->1`` -> 1, ``recv 1<-0`` -> 0."""
    _, _, meta = name.partition(" ")
    for arrow in ("->", "<-"):
        if arrow in meta:
            peer = meta.split(arrow, 1)[1].strip()
            return int(peer) if peer.isdigit() and len(peer) < 10 else None
    return None


def parse_dump(dump: Mapping[str, Any], rank: int) -> RankTrace:
    """The parts of a dump that say where a rank is: per group, its collectives and sequence numbers.

    The dump is untrusted: fields of the wrong type read as absent, lists are bounded.
    """
    trace = RankTrace(rank=rank, version=str(dump.get("version", "?"))[:40])
    names: dict[str, str] = {}
    status = dump.get("pg_status")
    status = status if isinstance(status, dict) else {}
    raw_entries = dump.get("entries")
    for raw in raw_entries[:_MAX_ENTRIES] if isinstance(raw_entries, list) else []:
        if not isinstance(raw, dict):
            continue
        entry = _collective(raw, status.get(str(raw.get("pg_id"))), len(trace.entries))
        names[str(raw.get("pg_id"))] = entry.group
        trace.entries.append(entry)
        if not entry.is_p2p:
            trace.enqueued[entry.group] = max(trace.enqueued.get(entry.group, 0), entry.seq)
    trace.first_record = min((e.record_id for e in trace.entries), default=0)
    _read_status(trace, status, names)
    _read_config(trace, dump.get("pg_config"))
    return trace


def _collective(raw: Mapping[str, Any], pg_status: Any, position: int) -> Collective:
    """One entry of a dump; `pg_status` is its group's status (its last completed collective)."""
    is_p2p = raw.get("is_p2p") is True
    seq = _number(raw.get("p2p_seq_id" if is_p2p else "collective_seq_id"))
    state = str(raw.get("state"))[:40]
    completed = _number(pg_status.get("last_completed_collective"), -1) if isinstance(pg_status, dict) else -1
    profiling = str(raw.get("profiling_name"))[:200]
    return Collective(
        _group_name(raw),
        seq,
        profiling,
        state,
        is_p2p,
        _shapes(raw.get("input_sizes")),
        _pg_name(raw),
        _names(raw.get("input_dtypes")),
        _shapes(raw.get("output_sizes")),
        _names(raw.get("output_dtypes")),
        state == "completed" or raw.get("retired") is True or (not is_p2p and 0 < seq <= completed),
        _number(raw.get("record_id"), position),  # absent: entries are in record order
        _p2p_peer(profiling) if is_p2p else None,
    )


def _read_status(trace: RankTrace, status: dict[Any, Any], names: dict[str, str]) -> None:
    """Each group's last enqueued and completed collective (`pg_status`), under its entries' group name."""
    for pg_id, pg_status in list(status.items())[:_MAX_ENTRIES]:
        if not isinstance(pg_status, dict):
            continue
        group = names.get(str(pg_id), str(pg_id))
        enq = _number(pg_status.get("last_enqueued_collective"), -1)
        done = _number(pg_status.get("last_completed_collective"), -1)
        if enq > 0:
            trace.enqueued[group] = max(trace.enqueued.get(group, 0), enq)
        trace.completed[group] = done


def _read_config(trace: RankTrace, config: Any) -> None:
    """Each group's member ranks (`pg_config`), by its name."""
    for key, pg in list(config.items())[:_MAX_ENTRIES] if isinstance(config, dict) else []:
        if not isinstance(pg, dict):
            continue
        name = pg.get("name") if isinstance(pg.get("name"), str) and pg.get("name") else str(key)
        ranks = _ranks_text(pg.get("ranks"))
        if name and ranks:
            trace.groups[name[:200]] = ranks


def read_dumps(stem: str | os.PathLike[str], ranks: Iterable[int]) -> list[RankTrace]:
    """Load and parse the dumps that exist for ``ranks`` (missing or unreadable ones are left out)."""
    traces = []
    for rank in ranks:
        with contextlib.suppress(OSError, ValueError):
            traces.append(parse_dump(load_dump(dump_path(stem, rank)), rank))
    return traces


def _op_of(traces: list[RankTrace], group: str, seq: int) -> str:
    for trace in traces:
        for entry in trace.entries:
            if entry.group == group and entry.seq == seq and not entry.is_p2p:
                sizes = f" {list(map(list, entry.input_sizes))}" if entry.input_sizes else ""
                return f"{entry.op}{sizes}"
    return "a collective"


def diagnose(traces: list[RankTrace], world_size: int | None = None) -> list[str]:
    """One line per finding, per group: which rank is behind, and in which collective the others wait.

    For each group, the ranks whose last enqueued collective is below the group's highest never
    entered that collective (the usual cause of a hang); when every rank entered it but some did
    not complete it, the collective itself is stuck (a dead peer, a blocked stream). Ranks without
    a dump are named as such when ``world_size`` is given.
    """
    lines = []
    if world_size is not None:
        missing = sorted(set(range(world_size)) - {t.rank for t in traces})
        if missing:
            lines.append(f"no flight-recorder dump from rank(s) {missing}")
    groups = sorted({g for t in traces for g in t.enqueued})
    for group in groups:
        seqs = {t.rank: t.enqueued[group] for t in traces if group in t.enqueued}
        top = max(seqs.values())
        ahead = sorted(r for r, s in seqs.items() if s == top)
        behind = sorted(r for r, s in seqs.items() if s < top)
        op = _op_of(traces, group, top)
        if behind:
            detail = ", ".join(f"rank {r} at #{seqs[r]}" for r in behind)
            lines.append(
                f"group {group}: rank(s) {ahead} entered collective #{top} {op}; {detail} never entered it"
            )
            continue
        stuck = sorted(
            t.rank for t in traces if group in t.enqueued and 0 <= t.completed.get(group, top) < top
        )
        if stuck:
            lines.append(
                f"group {group}: every rank entered collective #{top} {op}; not completed on rank(s) {stuck}"
            )
    return lines


def megatron_timeout_minutes(environ: Mapping[str, str] | None = None, default: float = 30.0) -> float:
    """The launcher's process-group timeout in minutes, for megatron's ``distributed_timeout_minutes``.

    megatron-core creates every model-parallel group with ``timedelta(minutes=...)``, 30 by
    default; inside a launch its groups must time out with the default group (``KIT_PG_TIMEOUT_S``,
    set by the launcher), so NCCL's watchdog, not the launcher's kill, ends a hang in them and
    writes the dump. Outside a launch the megatron default stands.
    """
    environ = os.environ if environ is None else environ
    raw = environ.get(PG_TIMEOUT_ENV)
    if not raw:
        return default
    try:
        seconds = float(raw)
    except ValueError:
        raise ValueError(f"{PG_TIMEOUT_ENV}={raw!r}: expected seconds, e.g. 240") from None
    if not seconds > 0:
        raise ValueError(f"{PG_TIMEOUT_ENV}={raw!r}: must be > 0 seconds")
    return seconds / 60.0
