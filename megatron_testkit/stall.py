"""Deadlocks named within a stall window, whatever the launch's timeout.

A launch is deadlocked when every live rank is blocked and none can progress. Blocked means one
of (nothing looser: a rank that might still progress is never called blocked):

- inside a torch.distributed collective or barrier (the launcher's `CollectiveCounter` notes entry
  and exit, and ``Work.wait`` of an async one) with no CPU progress over the window: neither a
  new collective entered nor CPU time used beyond `MIN_CPU_S` by the rank's own threads (the
  kit's watchdog thread excluded);
- waiting in a collective while another rank has exited, or is stalled in a different one.

A rank that computes, or sleeps in user code outside any collective, is never blocked: a
deadlock verdict needs every live rank inside a collective. On NCCL a collective returns at once
and the host thread waits in a stream synchronisation the host cannot see, so there the
position and the progress come from each rank's flight recorder (`nccl_positions`): the op it
has not completed, whether its count of completed ops moved, and its waits for the wait-for
graph (`megatron_testkit.fr_waits`), which win over the wrappers' (`with_flight_recorder`).

The rank side writes its position into ``rank<N>.state`` (`megatron_testkit.rank_worker`); the
launcher reads it each poll (`read_position`) and feeds a `StallDetector`, whose `verdict` names
the rank the others wait for: the one that entered the fewest of the group's collectives
(point-to-point ops do not advance a group's sequence, as in NCCL's flight recorder), the lowest
rank on ties.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megatron_testkit import fr_waits, procfs, wait_graph
from megatron_testkit.wait_graph import RankWaits

__all__ = [
    "DEFAULT_WINDOW_S",
    "WINDOW_ENV",
    "Position",
    "Stall",
    "StallDetector",
    "check_window",
    "default_window",
    "nccl_positions",
    "read_position",
    "track_work_waits",
    "with_flight_recorder",
]

WINDOW_ENV = "KIT_STALL_WINDOW"  # seconds, or "off"
# At most 30 s, so a deadlock is named within half a minute whatever the launch's timeout: long
# enough that a loaded 2-core runner's slowest collective (a gloo all-gather of a few MiB) returns
# well within it, short against any launch timeout.
DEFAULT_WINDOW_S = 30.0
# CPU a blocked rank may still use over the window (its gloo threads polling sockets, the
# interpreter's periodic work): at most MIN_CPU_S plus CPU_SHARE of the window. A rank that moves
# data or computes inside a collective uses far more, even with a tenth of a loaded core.
MIN_CPU_S = 0.25
CPU_SHARE = 0.02
# Point-to-point ops: they have their own sequence, not the group's (NCCL numbers them apart too).
P2P_OPS = frozenset({"send", "recv", "isend", "irecv", "batch_isend_irecv"})
# A rank's state line: padded to a multiple of this (it grows, never cut), read up to the maximum.
STATE_LINE_BYTES = 512
MAX_STATE_BYTES = 1 << 20


def check_window(value: Any, what: str = "stall_window") -> float | None:
    """A stall window in seconds (finite, above 0), or None for off; ValueError/TypeError else."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{what} must be a number of seconds or None (off), got {value!r}")
    if not 0 < value < float("inf"):
        raise ValueError(f"{what} must be a finite number of seconds above 0, got {value!r}")
    return float(value)


def default_window(environ: Mapping[str, str] | None = None) -> float | None:
    """``KIT_STALL_WINDOW`` (seconds, or ``off``), else `DEFAULT_WINDOW_S`; ValueError naming it."""
    raw = (os.environ if environ is None else environ).get(WINDOW_ENV, "").strip()
    if not raw:
        return DEFAULT_WINDOW_S
    if raw.lower() == "off":
        return None
    try:
        return check_window(float(raw))
    except (TypeError, ValueError):
        raise ValueError(
            f"{WINDOW_ENV}={raw!r}: expected a finite number of seconds above 0 (e.g. 30) or 'off'"
        ) from None


# ---- inside a rank -------------------------------------------------------------------------------
def track_work_waits(on_enter: Callable[[Any], Any], on_exit: Callable[[Any], None]) -> bool:
    """Count ``Work.wait()`` of an async collective as time inside it (rank side; True if patched).

    ``dist.all_reduce(t, async_op=True)`` returns at once; the rank then blocks in ``work.wait()``,
    which the collective wrappers never see. ``on_enter(work)`` runs before the wait and its
    result is passed to ``on_exit`` after it.
    """
    try:
        from torch._C._distributed_c10d import Work
    except ImportError:
        return False
    original = Work.wait

    def wait(self: Any, *args: Any, **kwargs: Any) -> Any:
        token = on_enter(self)
        try:
            return original(self, *args, **kwargs)
        finally:
            on_exit(token)

    try:
        Work.wait = wait
    except (AttributeError, TypeError):
        return False
    return True


# ---- the launcher's view -----------------------------------------------------------------------------
@dataclass(frozen=True)
class Position:
    """Where one rank is: the collective it is inside (None: outside any), how many it entered
    (all, and the group's alone), whether its process group is up, and its work so far (CPU
    seconds on the host; completed ops on NCCL's flight recorder)."""

    inside: str | None
    seq: int
    group_seq: int
    ready: bool
    work: float | None
    # What each thread waits on (group, #k, peer) and the rank's counts: the wait-for graph's
    # input (`megatron_testkit.wait_graph`); None where the view has none (NCCL's flight recorder).
    waits: RankWaits | None = None


def read_position(run_dir: Path, rank: int, pid: int) -> Position | None:
    """Rank ``rank``'s position from its state line and /proc; None before it wrote one (or
    while it rewrites it: the caller keeps the last one)."""
    try:
        with open(run_dir / f"rank{rank}.state", "rb") as f:
            raw = f.read(MAX_STATE_BYTES + 1)
        state = json.loads(raw.decode().strip() or "null") if len(raw) <= MAX_STATE_BYTES else None
    except (OSError, ValueError):
        return None
    if not isinstance(state, dict):
        return None
    return Position(
        inside=state.get("inside") if isinstance(state.get("inside"), str) else None,
        seq=_int(state.get("seq")),
        group_seq=_int(state.get("group_seq")),
        ready=state.get("ready") is True,
        work=_own_cpu(pid, state.get("kit_tids")),
        waits=wait_graph.parse_waits(state),
    )


def _int(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def _own_cpu(pid: int, kit_tids: Any) -> float | None:
    """The rank's CPU seconds without the kit's own threads (its RSS watchdog samples every 20 ms)."""
    total = procfs.cpu_seconds(pid)
    if total is None:
        return None
    for tid in kit_tids if isinstance(kit_tids, list) else []:
        if isinstance(tid, int):
            total -= procfs.cpu_seconds(pid, tid) or 0.0
    return total


def nccl_positions(
    stem: str | os.PathLike[str],
    ranks: Iterable[int],
    groups: Mapping[str, Sequence[int]] | None = None,
    cache: dict[int, tuple[Any, Position]] | None = None,
) -> dict[int, Position]:
    """Each NCCL rank's position from its latest flight-recorder dump (request dumps first).

    Inside = its oldest op not done (the call, numbered among all its ops); work = how many
    ops it completed, so any completion is progress; waits = the wait-for graph's input
    (`megatron_testkit.fr_waits`, with ``groups`` for group ranks the dump lacks). Ranks without
    a readable dump are left out (they are judged by the host view). ``cache`` (the launch's own
    dict) keeps each rank's last reading: a dump file not rewritten since is not read again (the
    launcher polls several times between two dump requests, and a full ring takes a while to read).
    """
    from megatron_testkit import flight_recorder

    out = {}
    for rank in ranks:
        path = flight_recorder.dump_path(stem, rank)
        try:
            st = path.stat()
        except OSError:
            continue
        key = (st.st_mtime_ns, st.st_size, st.st_ino, len(groups or ()))
        if cache is not None and rank in cache and cache[rank][0] == key:
            out[rank] = cache[rank][1]
            continue
        try:
            trace = flight_recorder.parse_dump(flight_recorder.load_dump(path), rank)
        except (OSError, ValueError):
            continue
        out[rank] = _fr_position(trace, groups)
        if cache is not None:
            cache[rank] = (key, out[rank])
    return out


def _fr_position(trace: Any, groups: Mapping[str, Sequence[int]] | None) -> Position:
    oldest = min((e for e in trace.entries if not e.done), key=lambda e: e.record_id, default=None)
    return Position(
        # Numbered as the wrappers number ``inside``: among all the rank's ops (record ids count them).
        inside=f"{fr_waits.op_name(oldest.op)} #{oldest.record_id + 1}" if oldest is not None else None,
        seq=trace.first_record + len(trace.entries),
        group_seq=max(trace.enqueued.values(), default=0),
        ready=True,
        work=float(trace.first_record + sum(e.done for e in trace.entries)),
        waits=fr_waits.rank_waits(trace, groups),
    )


def with_flight_recorder(
    host: Mapping[int, Position], recorded: Mapping[int, Position]
) -> dict[int, Position]:
    """An NCCL launch's positions: the flight recorder's where a rank has a dump, else the host's.

    The flight recorder's view wins over the wrappers' (`megatron_testkit.fr_waits` says why); the
    host's readiness stays. With no dump at all (no rank's NCCL group is up yet, or a torch that
    cannot dump on request) the host's view stands, as on gloo. Once some rank has one, a rank
    without keeps its host position without waits: the two views number collectives differently,
    so one graph never mixes them, and until every rank has a dump the per-rank rule judges.
    """
    if not recorded:
        return dict(host)
    out = {}
    for rank, position in host.items():
        fr = recorded.get(rank)
        if fr is None:
            out[rank] = dataclasses.replace(position, waits=None)
        else:
            out[rank] = dataclasses.replace(fr, ready=position.ready)
    return out


@dataclass(frozen=True)
class Stall:
    """A deadlock verdict: the rank to name, why (one line), where every live rank was, and (on
    the wait-for graph) one line per rank of the deadlock saying whom it waits for and where."""

    rank: int
    why: str
    lines: tuple[str, ...]
    waits: tuple[str, ...] = ()
    cycle: tuple[int, ...] = ()


@dataclass
class _Watch:
    position: Position
    since: float  # when this rank last entered a collective or made progress
    work_at_since: float | None


class StallDetector:
    """Per launch: watches each live rank's `Position` and says when ranks deadlock.

    Positions with waits (the host view) are judged on the wait-for graph
    (`megatron_testkit.wait_graph`); without (NCCL's flight recorder) by the per-rank rule: every
    live rank inside a collective, one stalled, each stalled or waiting on a stalled rank elsewhere.
    ``min_work`` is the progress that resets a rank's stall clock: on the host view (the default)
    `MIN_CPU_S` plus `CPU_SHARE` of the window, in CPU seconds; one completed op on the flight
    recorder's (pass 0.5).
    """

    def __init__(self, window: float, *, min_work: float | None = None) -> None:
        self.window = window
        self.min_work = MIN_CPU_S + CPU_SHARE * window if min_work is None else min_work
        self.watches: dict[int, _Watch] = {}
        self.exited: set[int] = set()
        self.last_waits: dict[int, RankWaits | None] = {}  # an exited rank's last known waits

    def observe(self, now: float, rank: int, position: Position | None) -> None:
        """Take rank ``rank``'s position at time ``now`` (None: none known now; a rank seen before
        keeps its last one, as a state line being rewritten reads as none)."""
        if position is None:
            return
        watch = self.watches.get(rank)
        if position.waits is not None:
            moved = (
                watch is None
                or watch.position.waits is None
                or position.waits.key() != watch.position.waits.key()
                or position.seq != watch.position.seq
                or position.waits.main is None
            )
        else:
            moved = (
                watch is None
                or position.inside != watch.position.inside
                or position.seq != watch.position.seq
                or position.inside is None
            )
        progressed = (
            watch is not None
            and position.work is not None
            and watch.work_at_since is not None
            and position.work - watch.work_at_since > self.min_work
        )
        if moved or progressed:
            self.watches[rank] = _Watch(position, now, position.work)
        else:
            watch.position = position

    def rank_exited(self, rank: int) -> None:
        """Rank ``rank`` is no longer running (its peers in a collective can never complete it)."""
        self.exited.add(rank)
        watch = self.watches.pop(rank, None)
        if watch is not None:
            self.last_waits[rank] = watch.position.waits

    def stalled(self, now: float, rank: int) -> bool:
        """Inside a collective with no new collective and no progress for the whole window (on the
        wait-for graph: the main thread inside it)."""
        watch = self.watches.get(rank)
        if not watch or now - watch.since < self.window:
            return False
        waits = watch.position.waits
        return waits.main is not None if waits is not None else watch.position.inside is not None

    def verdict(self, now: float, live: Iterable[int]) -> Stall | None:
        """A `Stall` when ranks are deadlocked (the rule of the class docstring); else None."""
        live = sorted(live)
        if not live or any(r not in self.watches for r in live):
            return None
        if all(self.watches[r].position.waits is not None for r in live):
            return self._graph_verdict(now, live)
        stalled = {r for r in live if self.stalled(now, r)}
        if not stalled:
            return None
        for r in live:
            inside = self.watches[r].position.inside
            if inside is None:
                return None  # computing or sleeping in user code: never judged hung
            elsewhere = any(self.watches[o].position.inside != inside for o in stalled if o != r)
            if r not in stalled and not self.exited and not elsewhere:
                return None
        root = min(live, key=lambda r: (self.watches[r].position.group_seq, r))
        lines = tuple(self._line(now, r) for r in live) + tuple(
            f"rank {r}: exited" for r in sorted(self.exited)
        )
        where = self.watches[root].position.inside
        why = (
            f"deadlock: every live rank blocked in a collective with no progress for {self.window:g} s "
            f"(the stall window); rank {root} is in {where}; it entered the fewest of the group's collectives"
        )
        return Stall(root, why, lines)

    def _graph_verdict(self, now: float, live: list[int]) -> Stall | None:
        blocked = [r for r in live if self.stalled(now, r)]
        if not blocked:
            return None
        views = {**self.last_waits, **{r: self.watches[r].position.waits for r in live}}
        inside = {r: self.watches[r].position.inside for r in live}
        judged = wait_graph.judge(self.window, live, blocked, views, self.exited, inside)
        if judged is None:
            return None
        lines = tuple(self._graph_line(now, r) for r in live) + tuple(
            f"rank {r}: exited" for r in sorted(self.exited)
        )
        return Stall(judged.rank, judged.why, lines, judged.waits, judged.cycle)

    def _graph_line(self, now: float, rank: int) -> str:
        """Where the rank is: its main thread's collective, or user code (with any other thread's)."""
        watch = self.watches[rank]
        waits = watch.position.waits
        assert waits is not None
        if waits.main is not None:
            line = self._line(now, rank)
        else:
            p = watch.position
            work = (
                f", CPU +{p.work - watch.work_at_since:.2f} s"
                if p.work is not None and watch.work_at_since is not None
                else ""
            )
            line = f"rank {rank}: in user code (its main thread outside any collective){work}"
        others = [w for w in waits.threads if not w.main]
        for w in others:
            line += f"; thread {w.thread!r} in {wait_graph.describe(w, waits.groups)}"
        return line

    def _line(self, now: float, rank: int) -> str:
        watch = self.watches[rank]
        p = watch.position
        work = (
            f", CPU +{p.work - watch.work_at_since:.2f} s"
            if p.work is not None and watch.work_at_since is not None
            else ""
        )
        where = ""
        if p.waits is not None and p.waits.main is not None:
            where = f"; its main thread in {wait_graph.describe(p.waits.main, p.waits.groups)}"
            if p.waits.main.thread == fr_waits.FR_THREAD:  # an op on the device, not a thread
                where = f"; its oldest op not done (flight recorder): {wait_graph.describe(p.waits.main, p.waits.groups)}"
                if p.work is not None and watch.work_at_since is not None:
                    work = f", ops completed +{p.work - watch.work_at_since:.0f}"
        return (
            f"rank {rank}: in {p.inside} for {now - watch.since:.1f} s{work}; "
            f"{p.seq} collectives entered, {p.group_seq} of them the group's{where}"
        )


def write_state(
    fd: int, fields: Mapping[str, Any], size: int = STATE_LINE_BYTES, groups: str | None = None
) -> int:
    """Overwrite a rank's state line in place (rank side; never raises for the disk); its new size.

    The line is padded to ``size`` bytes and grows (in whole `STATE_LINE_BYTES` blocks) when the
    state is longer, never cut: a cut line would leave the rank without a position. A state over
    `MAX_STATE_BYTES` is replaced by a short line that says so (``overflow``), which the launcher
    reads as a rank whose waits are unknown. ``groups``, if given, is the ``groups`` field already
    serialised (it only grows: the rank keeps it as JSON rather than dump it at every collective).
    """
    line = json.dumps(dict(fields), separators=(",", ":"))
    if groups is not None:
        line = f'{line[:-1]},"groups":{groups}}}' if len(line) > 2 else f'{{"groups":{groups}}}'
    if len(line) + 1 > MAX_STATE_BYTES:
        short = {
            k: fields[k]
            for k in ("last_collective", "seq", "group_seq", "inside", "ready", "ready_at", "kit_tids")
            if k in fields
        }
        line = json.dumps({**short, "overflow": len(line)}, separators=(",", ":"))
    data = line.encode()
    if len(data) + 1 > size:
        size = -(-(len(data) + 1) // STATE_LINE_BYTES) * STATE_LINE_BYTES
    with contextlib.suppress(OSError):
        os.pwrite(fd, data.ljust(size - 1) + b"\n", 0)
    return size
