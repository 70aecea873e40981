"""The deadlock rule on the wait-for graph: which blocked ranks wait for each other forever.

Each rank's state line carries what its threads wait on (`megatron_testkit.waits`); `parse_waits`
reads it (untrusted: bounded, typed) and `judge` applies the rule to the ranks the launcher found
blocked (the main thread inside a collective, with no new collective and no CPU progress for the
stall window):

- a rank blocked in collective #k of group G waits for the members of G that have not entered
  #k of G; a rank blocked in a receive waits for its sender (that has not entered the matching
  send), in a send for its receiver;
- a deadlock is the largest set of blocked ranks each of which waits only for ranks of the set
  or ranks that exited: a cycle of waits, a wait on an exited rank, or a wait on such a rank.
  A rank waiting for a rank that is not blocked (it computes, sleeps in user code, entered a
  new collective within the window) is never in it, nor is a rank whose wait is in a group whose
  sequence is not known on every member (collectives the wrappers cannot see): those are judged
  without it, and no cycle is named through them;
- members of one group blocked at the same sequence number in different collectives, or in the
  same one with tensors of different sizes or dtypes (where both sides' are known: the wrappers
  note them for tensor arguments, the flight recorder for every op), are a collective mismatch,
  named with both sides.

The verdict names the rank the others wait for: the one most ranks of the set wait for in a
group collective it has not entered, or the exited rank. When every rank of the cycle is waited
for alike, the cycle is symmetric and the verdict says so rather than picking one by counts.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "SAME_TENSORS",
    "Judgement",
    "RankWaits",
    "Wait",
    "describe",
    "judge",
    "parse_waits",
    "tensors_text",
]

# Bounds on what a rank's state line may list (it is read as untrusted input).
_MAX_THREADS = 256
_MAX_GROUPS = 4096
_MAX_RANKS = 1 << 16
_KINDS = frozenset({"collective", "send", "recv", "unknown"})
_MAX_TENSORS = 64
_MAX_DIMS = 16
# Collectives whose tensors every member passes with the same sizes and dtypes (the wrappers note
# the argument named here; the flight recorder, the op's inputs). Others may differ by design:
# all_to_all's splits, gather's and scatter's lists on their root only, the object collectives.
SAME_TENSORS = {
    "all_reduce": "tensor",
    "broadcast": "tensor",
    "reduce": "tensor",
    "all_gather": "tensor",
    "all_gather_into_tensor": "input_tensor",
    "reduce_scatter": "output",
    "reduce_scatter_tensor": "output",
}


@dataclass(frozen=True)
class Wait:
    """One thread's wait: the collective (``op``, as called; ``leaf``, the innermost call), its group
    and sequence number (#k), the peer of a point-to-point op, and where known the sizes and dtypes
    of the tensors every member must pass alike (`SAME_TENSORS`)."""

    op: str
    kind: str
    group: str | None
    seq: int
    peer: int | None
    leaf: str
    main: bool
    thread: str
    sizes: tuple[tuple[int, ...], ...] | None = None
    dtypes: tuple[str, ...] | None = None


@dataclass(frozen=True)
class RankWaits:
    """What one rank's threads wait on, and its counts: per group, per peer."""

    threads: tuple[Wait, ...] = ()
    groups: Mapping[str, tuple[int, ...]] = field(default_factory=dict)
    entered: Mapping[str, int] = field(default_factory=dict)
    inexact: frozenset[str] = frozenset()
    sent: Mapping[int, int] = field(default_factory=dict)
    received: Mapping[int, int] = field(default_factory=dict)
    overflow: bool = False

    @property
    def main(self) -> Wait | None:
        """The main thread's wait (None: it runs or sleeps outside any collective)."""
        return next((w for w in self.threads if w.main), None)

    def key(self) -> tuple[Any, ...] | None:
        """What identifies the main thread's wait (a change is a new collective)."""
        w = self.main
        return None if w is None else (w.op, w.kind, w.group, w.seq, w.peer, w.leaf)


def _int(value: Any, low: int = 0) -> int | None:
    if isinstance(value, int) and not isinstance(value, bool) and low <= value < 1 << 62:
        return value
    return None


def _str(value: Any) -> str | None:
    return value[:200] if isinstance(value, str) else None


def parse_waits(state: Mapping[str, Any]) -> RankWaits | None:
    """The waits in a rank's state (None: the state carries none, an older rank or another view)."""
    if state.get("overflow") is not None:
        return RankWaits(overflow=True)
    raw = state.get("waits")
    if not isinstance(raw, list):
        return None
    threads = []
    for item in raw[:_MAX_THREADS]:
        if not isinstance(item, dict):
            continue
        op, kind = _str(item.get("op")), item.get("kind")
        seq = _int(item.get("seq"))
        if op is None or kind not in _KINDS or seq is None:
            continue
        peer = _int(item.get("peer"))
        threads.append(
            Wait(
                op,
                kind,
                _str(item.get("group")),
                seq,
                peer,
                _str(item.get("leaf")) or op,
                item.get("main") is True,
                _str(item.get("thread")) or "?",
                _sizes(item.get("sizes")),
                _dtypes(item.get("dtypes")),
            )
        )
    groups: dict[str, tuple[int, ...]] = {}
    raw_groups = state.get("groups")
    for name, ranks in list(raw_groups.items())[:_MAX_GROUPS] if isinstance(raw_groups, dict) else []:
        if isinstance(ranks, list) and len(ranks) <= _MAX_RANKS:
            members = tuple(r for r in ranks if _int(r) is not None)
            if len(members) == len(ranks):
                groups[str(name)] = members
    return RankWaits(
        threads=tuple(threads),
        groups=groups,
        entered=_counts(state.get("entered"), str),
        inexact=frozenset(g for g in state.get("inexact") or [] if isinstance(g, str))
        if isinstance(state.get("inexact"), list)
        else frozenset(),
        sent=_counts(state.get("sent"), _rank_key),
        received=_counts(state.get("received"), _rank_key),
    )


def _sizes(raw: Any) -> tuple[tuple[int, ...], ...] | None:
    if not isinstance(raw, list) or len(raw) > _MAX_TENSORS:
        return None
    shapes = []
    for shape in raw:
        if not isinstance(shape, list) or len(shape) > _MAX_DIMS or any(_int(d) is None for d in shape):
            return None
        shapes.append(tuple(shape))
    return tuple(shapes)


def _dtypes(raw: Any) -> tuple[str, ...] | None:
    if not isinstance(raw, list) or len(raw) > _MAX_TENSORS or not all(isinstance(d, str) for d in raw):
        return None
    return tuple(d[:40] for d in raw)


def tensors_text(wait: Wait) -> str:
    """``float32 [4]``, ``float32 [4], float32 [2, 2]``: the tensors a wait passes, as far as known."""
    sizes, dtypes = wait.sizes or (), wait.dtypes or ()
    parts = [
        f"{dtypes[i] if i < len(dtypes) else '?'} {list(sizes[i]) if i < len(sizes) else '?'}"
        for i in range(max(len(sizes), len(dtypes)))
    ]
    return ", ".join(parts[:4]) + (f", ... ({len(parts)} tensors)" if len(parts) > 4 else "") or "no tensors"


def _rank_key(key: str) -> int | None:
    return int(key) if key.isdigit() and len(key) < 10 else None


def _counts(raw: Any, key_of: Any) -> dict[Any, int]:
    out = {}
    for key, value in list(raw.items())[:_MAX_GROUPS] if isinstance(raw, dict) else []:
        k, v = key_of(str(key)), _int(value)
        if k is not None and v is not None:
            out[k] = v
    return out


def describe(wait: Wait, groups: Mapping[str, tuple[int, ...]]) -> str:
    """``all_reduce #1 of group [0, 1]``, ``recv #1 from rank 0``, ``send #2 to rank 3``."""
    if wait.kind == "collective":
        ranks = groups.get(wait.group or "")
        where = f"group {list(ranks)}" if ranks is not None else f"group {wait.group!r}"
        if ranks is not None and sum(1 for other in groups.values() if other == ranks) > 1:
            # Several groups over the same ranks (two new_group([0, 1]), megatron-core's TP and
            # DP over one pair): the name tells them apart, the usual cause of such a deadlock.
            where += f" (group name {wait.group!r})"
        inner = f" ({wait.leaf})" if wait.leaf != wait.op else ""
        return f"{wait.op}{inner} #{wait.seq} of {where}"
    if wait.kind == "recv":
        return f"{wait.op} #{wait.seq} from rank {wait.peer}"
    if wait.kind == "send":
        return f"{wait.op} #{wait.seq} to rank {wait.peer}"
    return f"{wait.op} (its group or peer unknown)"


@dataclass(frozen=True)
class Judgement:
    """A verdict: the rank to name, why (one line), one line per rank of the deadlock, the cycle."""

    rank: int
    why: str
    waits: tuple[str, ...]
    cycle: tuple[int, ...] = ()
    mismatch: bool = False


@dataclass(frozen=True)
class _Targets:
    ranks: frozenset[int]
    known: bool  # the group's sequence (or the peer's count) is known on every member


def _count_of(view: RankWaits | None, wait: Wait, rank: int) -> int | None:
    """How far ``view``'s rank got in what ``rank``'s ``wait`` needs from it (None: unknown)."""
    if view is None or view.overflow:
        return None
    if wait.kind == "collective":
        if wait.group not in view.groups or wait.group in view.inexact:
            return None
        return view.entered.get(wait.group or "", 0)
    if wait.group is not None and wait.group in view.inexact:
        return None
    return (view.sent if wait.kind == "recv" else view.received).get(rank, 0)


def _targets(rank: int, view: RankWaits, views: Mapping[int, RankWaits | None]) -> _Targets | None:
    """Whom ``rank``'s main thread waits for (None: no wait the graph can judge)."""
    wait = view.main
    if wait is None or view.overflow or wait.kind == "unknown":
        return None
    if wait.group is not None and wait.group in view.inexact:
        return _Targets(frozenset(), known=False)
    if wait.kind == "collective":
        members = view.groups.get(wait.group or "")
        if members is None or rank not in members:
            return None
        others = [m for m in members if m != rank]
    else:
        others = [wait.peer] if wait.peer is not None else []
    missing, known = set(), True
    for m in others:
        count = _count_of(views.get(m), wait, rank)
        if count is None:
            known = False
        elif count < wait.seq:
            missing.add(m)
    return _Targets(frozenset(missing), known)


def judge(
    window: float,
    live: Iterable[int],
    blocked: Iterable[int],
    views: Mapping[int, RankWaits | None],
    exited: Iterable[int],
    inside: Mapping[int, str | None],
) -> Judgement | None:
    """The verdict on the blocked ranks (see the module docstring); None while none is due.

    ``views`` holds every rank's waits (an exited rank's last known ones); ``inside`` each live
    rank's collective as the rank counts them all (``recv #2``), for the verdict's first line.
    """
    live, blocked, exited = sorted(live), set(blocked), set(exited)
    mismatch = _mismatch(blocked, views)
    if mismatch is not None:
        return mismatch
    targets = {
        r: t for r in blocked if (view := views.get(r)) is not None and (t := _targets(r, view, views))
    }
    members = {r for r, t in targets.items() if t.known and t.ranks and t.ranks <= blocked | exited}
    while True:  # the largest set whose every rank waits only for the set or for exited ranks
        keep = {r for r in members if targets[r].ranks <= members | exited}
        if keep == members:
            break
        members = keep
    if not members:
        return None
    return _deadlock(window, live, members, targets, views, exited, inside)


def _mismatch(blocked: set[int], views: Mapping[int, RankWaits | None]) -> Judgement | None:
    """Two blocked members of a group at the same #k in different collectives, or in the same one
    with tensors of different sizes or dtypes where both are known (`SAME_TENSORS`)."""
    seen: dict[tuple[str, int], tuple[int, Wait]] = {}
    for r in sorted(blocked):
        view = views.get(r)
        wait = view.main if view is not None else None
        if wait is None or wait.kind != "collective" or wait.group is None or wait.group in view.inexact:
            continue
        other = seen.setdefault((wait.group, wait.seq), (r, wait))
        if other[0] == r:
            continue
        o, ow = other
        groups = view.groups
        # ``wait on all_reduce`` (an async op's Work) is the same collective as ``all_reduce``.
        if _called(ow) != _called(wait):
            why = (
                f"collective mismatch: rank {o} is in {describe(ow, groups)} while rank {r} is in "
                f"{describe(wait, groups)}: members of one group at the same collective of it "
                f"called different ones; both blocked with no progress for the stall window"
            )
            lines = (f"rank {o} is in {describe(ow, groups)}", f"rank {r} is in {describe(wait, groups)}")
            return Judgement(o, why, lines, mismatch=True)
        differ = _tensors_differ(ow, wait)
        if differ:
            left = f"{describe(ow, groups)} with {tensors_text(ow)}"
            right = f"{describe(wait, groups)} with {tensors_text(wait)}"
            why = (
                f"collective mismatch: rank {o} is in {left} while rank {r} is in {right}: members of "
                f"one group at the same collective of it passed tensors of different {differ}; both "
                f"blocked with no progress for the stall window"
            )
            return Judgement(o, why, (f"rank {o} is in {left}", f"rank {r} is in {right}"), mismatch=True)
    return None


def _tensors_differ(a: Wait, b: Wait) -> str:
    """``sizes``, ``dtypes``, ``sizes and dtypes``, or "" (alike, or not known on both sides)."""
    if _called(a) not in SAME_TENSORS:
        return ""
    what = []
    if a.sizes is not None and b.sizes is not None and a.sizes != b.sizes:
        what.append("sizes")
    if a.dtypes is not None and b.dtypes is not None and a.dtypes != b.dtypes:
        what.append("dtypes")
    return " and ".join(what)


def _called(wait: Wait) -> str:
    return wait.leaf.removeprefix("wait on ")


def _ranks_text(ranks: Iterable[int]) -> str:
    ranks = sorted(ranks)
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))


def _deadlock(
    window: float,
    live: list[int],
    members: set[int],
    targets: Mapping[int, _Targets],
    views: Mapping[int, RankWaits | None],
    exited: set[int],
    inside: Mapping[int, str | None],
) -> Judgement:
    # Who is waited for, and by how many of the set in a group collective it has not entered.
    held: dict[int, int] = {}
    for r in members:
        wait = views[r].main  # type: ignore[union-attr]
        for t in targets[r].ranks:
            held[t] = held.get(t, 0) + (wait is not None and wait.kind == "collective")
    waited_exited = sorted(t for r in members for t in targets[r].ranks if t in exited)
    cycle = _cycle(min(members), members, targets)
    symmetric = False
    if waited_exited:
        root = waited_exited[0]
    else:
        top = max(held.get(r, 0) for r in members)
        leaders = sorted(r for r in members if held.get(r, 0) == top)
        loop = set(cycle[:-1])
        symmetric = len(leaders) > 1 and loop <= set(leaders)
        root = leaders[0] if not symmetric else min(loop)
        cycle = _cycle(root, members, targets)
    lines = []
    on_cycle = set(cycle)
    for r in sorted(members):
        view = views[r]
        assert view is not None and view.main is not None
        whom = ", ".join(f"rank {t}" + (" (exited)" if t in exited else "") for t in sorted(targets[r].ranks))
        knock = "" if r in on_cycle else " (knock-on)"
        lines.append(f"rank {r} waits in {describe(view.main, view.groups)} for {whom}{knock}")
    every = members == set(live)
    head = (
        f"deadlock: every live rank blocked in a collective with no progress for {window:g} s (the stall window)"
        if every
        else f"deadlock: {_ranks_text(members)} blocked in collectives with no progress for {window:g} s "
        f"(the stall window), waiting for each other"
    )
    chain = " -> ".join(f"rank {r}" for r in cycle)
    if waited_exited:
        waiting = sorted(r for r in members if root in targets[r].ranks)
        verb = "waits" if len(waiting) == 1 else "wait"
        tail = f"; rank {root} exited while {_ranks_text(waiting)} {verb} for it: {chain}"
    else:
        view = views[root]
        assert view is not None and view.main is not None
        where = f"; rank {root} is in {inside.get(root) or view.main.op} (of all its collectives; {describe(view.main, view.groups)})"
        if symmetric:
            tail = f"{where}; the cycle is symmetric, each rank waits for the next and none is behind the others: {chain}"
        else:
            count = held.get(root, 0)
            tail = (
                f"{where}; the one the others wait for ({count} of them in a group collective it has not entered): "
                f"{chain}"
            )
    return Judgement(root, head + tail, tuple(lines), tuple(cycle))


def _cycle(start: int, members: set[int], targets: Mapping[int, _Targets]) -> list[int]:
    """Follow the waits from ``start`` (lowest target first) until a rank repeats or one exited."""
    path, seen = [start], {start}
    while True:
        nxt = sorted(targets[path[-1]].ranks) if path[-1] in targets else []
        inside = [t for t in nxt if t in members]
        if not inside:
            if nxt:
                path.append(nxt[0])
            return path
        step = inside[0]
        path.append(step)
        if step in seen:
            loop_start = path.index(step)
            return path[loop_start:]
        seen.add(step)
