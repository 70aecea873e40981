"""Deadlocks named within a stall window, whatever the launch's timeout.

A launch is deadlocked when every live rank is blocked and none can progress. Blocked means one
of (issue #34's rule, nothing looser):

- inside a torch.distributed collective or barrier (the launcher's `CollectiveCounter` notes entry
  and exit, and ``Work.wait`` of an async one) with no CPU progress over the window: neither a
  new collective entered nor CPU time used beyond `MIN_CPU_S` by the rank's own threads (the
  kit's watchdog thread excluded);
- waiting in a collective while another rank has exited, or is stalled in a different one.

A rank that computes, or sleeps in user code outside any collective, is never blocked: a
deadlock verdict needs every live rank inside a collective. On NCCL a collective returns at once
and the host thread waits in a stream synchronisation the host cannot see, so there the
position and the progress come from each rank's flight recorder (`nccl_positions`): the op it
has not completed, and whether its count of completed ops moved.

The rank side writes its position into ``rank<N>.state`` (`megatron_testkit.rank_worker`); the
launcher reads it each poll (`read_position`) and feeds a `StallDetector`, whose `verdict` names
the rank the others wait for: the one that entered the fewest of the group's collectives
(point-to-point ops do not advance a group's sequence, as in NCCL's flight recorder), the lowest
rank on ties.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megatron_testkit import procfs

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
]

WINDOW_ENV = "KIT_STALL_WINDOW"  # seconds, or "off"
# At most 30 s (the bound): long enough that a loaded 2-core runner's slowest collective
# (a gloo all-gather of a few MiB) returns well within it, short against any launch timeout.
DEFAULT_WINDOW_S = 30.0
# CPU a blocked rank may still use over the window (its gloo threads polling sockets, the
# interpreter's periodic work): at most MIN_CPU_S plus CPU_SHARE of the window. A rank that moves
# data or computes inside a collective uses far more, even with a tenth of a loaded core.
MIN_CPU_S = 0.25
CPU_SHARE = 0.02
# Point-to-point ops: they have their own sequence, not the group's (NCCL numbers them apart too).
P2P_OPS = frozenset({"send", "recv", "isend", "irecv", "batch_isend_irecv"})


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
def track_work_waits(on_enter: Callable[[str], None], on_exit: Callable[[str], None]) -> bool:
    """Count ``Work.wait()`` of an async collective as time inside it (rank side; True if patched).

    ``dist.all_reduce(t, async_op=True)`` returns at once; the rank then blocks in ``work.wait()``,
    which the collective wrappers never see.
    """
    try:
        from torch._C._distributed_c10d import Work
    except ImportError:
        return False
    original = Work.wait

    def wait(self: Any, *args: Any, **kwargs: Any) -> Any:
        on_enter("wait")
        try:
            return original(self, *args, **kwargs)
        finally:
            on_exit("wait")

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


def read_position(run_dir: Path, rank: int, pid: int) -> Position | None:
    """Rank ``rank``'s position from its state line and /proc; None before it wrote one."""
    try:
        state = json.loads((run_dir / f"rank{rank}.state").read_text().strip() or "null")
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


def nccl_positions(stem: str | os.PathLike[str], ranks: Iterable[int]) -> dict[int, Position]:
    """Each NCCL rank's position from its latest flight-recorder dump (request dumps first).

    Inside = its newest entry that is not ``completed`` (op and sequence number); work = how many
    of its entries completed, so any completion is progress. Ranks without a readable dump are
    left out (they are judged by the host view).
    """
    from megatron_testkit import flight_recorder

    out = {}
    for trace in flight_recorder.read_dumps(stem, ranks):
        pending = [e for e in trace.entries if e.state != "completed"]
        last = pending[-1] if pending else None
        out[trace.rank] = Position(
            inside=f"{last.op} #{last.seq}" if last is not None else None,
            seq=len(trace.entries),
            group_seq=max(trace.enqueued.values(), default=0),
            ready=True,
            work=float(sum(e.state == "completed" for e in trace.entries)),
        )
    return out


@dataclass(frozen=True)
class Stall:
    """A deadlock verdict: the rank to name, why (one line) and where every live rank was."""

    rank: int
    why: str
    lines: tuple[str, ...]


@dataclass
class _Watch:
    position: Position
    since: float  # when this rank last entered a collective or made progress
    work_at_since: float | None


class StallDetector:
    """Per launch: watches each live rank's `Position` and says when they all are blocked.

    ``min_work`` is the progress that resets a rank's stall clock: on the host view (the default)
    `MIN_CPU_S` plus `CPU_SHARE` of the window, in CPU seconds; one completed op on the flight
    recorder's (pass 0.5).
    """

    def __init__(self, window: float, *, min_work: float | None = None) -> None:
        self.window = window
        self.min_work = MIN_CPU_S + CPU_SHARE * window if min_work is None else min_work
        self.watches: dict[int, _Watch] = {}
        self.exited: set[int] = set()

    def observe(self, now: float, rank: int, position: Position | None) -> None:
        """Take rank ``rank``'s position at time ``now`` (None: none known yet)."""
        if position is None:
            self.watches.pop(rank, None)
            return
        watch = self.watches.get(rank)
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
        self.watches.pop(rank, None)

    def stalled(self, now: float, rank: int) -> bool:
        """Inside a collective with no new collective and no progress for the whole window."""
        watch = self.watches.get(rank)
        return bool(watch and watch.position.inside is not None and now - watch.since >= self.window)

    def verdict(self, now: float, live: Iterable[int]) -> Stall | None:
        """A `Stall` when every live rank is blocked and at least one stalled; else None."""
        live = sorted(live)
        if not live or any(r not in self.watches for r in live):
            return None
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
            f"(the stall window); rank {root} is in {where}"
        )
        return Stall(root, why, lines)

    def _line(self, now: float, rank: int) -> str:
        watch = self.watches[rank]
        p = watch.position
        work = (
            f", CPU +{p.work - watch.work_at_since:.2f} s"
            if p.work is not None and watch.work_at_since is not None
            else ""
        )
        return (
            f"rank {rank}: in {p.inside} for {now - watch.since:.1f} s{work}; "
            f"{p.seq} collectives entered, {p.group_seq} of them the group's"
        )


def write_state(fd: int, fields: Mapping[str, Any], size: int = 511) -> None:
    """Overwrite a rank's fixed-size state line in place (rank side; never raises for the disk)."""
    line = json.dumps(dict(fields), separators=(",", ":"))
    with contextlib.suppress(OSError):
        os.pwrite(fd, line.ljust(size).encode()[:size] + b"\n", 0)
