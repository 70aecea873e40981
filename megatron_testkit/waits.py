"""What each thread of a rank waits on: the group and sequence number of the collective it is in.

Rank side of the wait-for graph (`megatron_testkit.wait_graph` judges it in the launcher). The
launcher's collective wrappers (`megatron_testkit.collectives`) call `WaitTracker.enter` with the
call's own arguments, bound by the function's signature, so ``all_reduce(t, op, group)`` and
``all_reduce(t, group=group)`` read the same. For every collective a thread enters it records:

- the group, keyed by ``group.group_name`` (megatron-core makes several groups over the same
  ranks), ``group=None`` read as the default group, and the group's global ranks once;
- the collective's sequence number within that group (its ``#k``): a call made inside another
  on the same group (``all_gather_object`` runs two ``all_gather``) takes its parent's number
  for the first one, so the count is the group's own, as torch's per-group sequence number;
- point-to-point ``send``/``recv``/``isend``/``irecv`` as a wait on the peer, numbered per
  direction and peer (the k-th receive from rank 1 meets rank 1's k-th send to this rank);
- an async op's ``Work``, mapped to its collective when it is created (weak references), so
  ``Work.wait()`` is a wait in that collective;
- for the collectives whose members pass alike tensors (`wait_graph.SAME_TENSORS`), that
  argument's sizes and dtype (read from the tensor, no copy), so members at one number with
  different ones are named a collective mismatch.

A group whose count here differs from torch's own sequence number for it (collectives the wrappers
cannot see: DDP's C++ reducer, functional collectives, ``ProcessGroup`` methods called directly)
is listed as ``inexact``: the launcher judges it without its sequence.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import threading
import weakref
from dataclasses import dataclass
from typing import Any

from megatron_testkit.wait_graph import SAME_TENSORS

__all__ = ["P2P_OPS", "WaitTracker"]

# Point-to-point ops: numbered per peer, not in the group's sequence.
P2P_OPS = frozenset({"send", "recv", "isend", "irecv"})
_SENDS = frozenset({"send", "isend"})
# A container of point-to-point ops: its inner isend/irecv are what it waits on.
_CONTAINERS = frozenset({"batch_isend_irecv"})


class _Arguments:
    """A call's arguments by parameter name, positional ones bound by the function's signature
    (the names its positional parameters have, in order); absent ones read as None."""

    __slots__ = ("args", "kwargs", "names")

    def __init__(self, names: tuple[str, ...], args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        self.names, self.args, self.kwargs = names, args, kwargs

    def get(self, name: str) -> Any:
        if name in self.kwargs:
            return self.kwargs[name]
        try:
            index = self.names.index(name)
        except ValueError:
            return None
        return self.args[index] if index < len(self.args) else None


@dataclass
class _Frame:
    """One call a thread is inside (outermost first in the thread's stack)."""

    op: str
    kind: str  # "collective", "send", "recv" or "unknown" (no group or peer known)
    group: str | None = None
    seq: int = 0
    peer: int | None = None
    reusable: bool = False  # a collective whose first inner call on the same group takes its number
    tensor: tuple[list[int], str] | None = None  # sizes and dtype of the argument all members pass alike

    def as_wait(self) -> dict[str, Any]:
        wait = {"op": self.op, "kind": self.kind, "group": self.group, "seq": self.seq, "peer": self.peer}
        if self.tensor is not None:
            wait["sizes"], wait["dtypes"] = [self.tensor[0]], [self.tensor[1]]
        return wait


class WaitTracker:
    """Per-thread waits of one rank, and per-group and per-peer counts (see the module docstring).

    Not thread-safe by itself: the rank's lock is held around `enter`, `leave` and `state`.
    """

    def __init__(self) -> None:
        self.groups: dict[str, list[int]] = {}  # name -> global ranks, recorded once
        self.entered: dict[str, int] = {}  # name -> collectives entered (the group's sequence)
        self.ops: dict[str, int] = {}  # name -> every op on it, p2p included (torch counts those too)
        self.inexact: set[str] = set()
        self.sent: dict[int, int] = {}  # peer -> sends entered to it
        self.received: dict[int, int] = {}  # peer -> receives entered from it
        self.frames: dict[int, list[_Frame]] = {}
        self.thread_names: dict[int, str] = {}
        self.works: weakref.WeakKeyDictionary[Any, _Frame] = weakref.WeakKeyDictionary()
        self._signatures: dict[Any, tuple[str, ...]] = {}  # positional parameter names
        self._live: tuple[int, list[tuple[str, Any]]] = (-1, [])  # torch's groups, listed once
        self._groups_json: tuple[int, str] = (-1, "{}")

    # -- calls -----------------------------------------------------------------------------------
    def enter(self, name: str, original: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> _Frame:
        """Note that this thread entered ``name(*args, **kwargs)``; the frame to pass to `leave`."""
        ident = threading.get_ident()
        stack = self.frames.setdefault(ident, [])
        if not stack:
            self.thread_names[ident] = threading.current_thread().name
            self._check_exact()
        frame = self._frame(name, original, args, kwargs, stack)
        stack.append(frame)
        return frame

    def leave(self, frame: _Frame, result: Any = None) -> None:
        """The call of ``frame`` returned ``result`` (None when it raised); async ops keep their frame."""
        ident = threading.get_ident()
        stack = self.frames.get(ident, [])
        if frame in stack:
            del stack[stack.index(frame) :]
        if not stack:
            self.frames.pop(ident, None)
        for work in result if isinstance(result, list) else [result]:
            if work is not None and frame.kind != "unknown":
                with contextlib.suppress(TypeError):  # not weakly referenceable: its wait is unknown
                    self.works[work] = frame

    def depth(self) -> int:
        """How many calls this thread is inside."""
        return len(self.frames.get(threading.get_ident(), ()))

    def enter_wait(self, work: Any) -> _Frame:
        """This thread waits on ``work``: a wait in the collective that made it (unknown if none did)."""
        ident = threading.get_ident()
        stack = self.frames.setdefault(ident, [])
        made = self.works.get(work) if _weakable(work) else None
        if made is None and stack:  # inside a collective that waits on its own work (``barrier``)
            inner = stack[-1]
            frame = _Frame(inner.op, inner.kind, inner.group, inner.seq, inner.peer)
        elif made is None:
            frame = _Frame("wait", "unknown")
        else:
            frame = _Frame(
                f"wait on {made.op}", made.kind, made.group, made.seq, made.peer, tensor=made.tensor
            )
        self.thread_names.setdefault(ident, threading.current_thread().name)
        stack.append(frame)
        return frame

    # -- the state line --------------------------------------------------------------------------
    def groups_json(self) -> str:
        """``self.groups`` as JSON, serialised again only when a group was added (they never change)."""
        if self._groups_json[0] != len(self.groups):
            self._groups_json = (len(self.groups), json.dumps(self.groups, separators=(",", ":")))
        return self._groups_json[1]

    def state(self) -> dict[str, Any]:
        """The fields of ``rank<N>.state`` that carry the waits (JSON-ready; the groups apart, in
        `groups_json`)."""
        main = threading.main_thread().ident
        threads = []
        for ident, stack in self.frames.items():
            if not stack:
                continue
            inner = stack[-1]
            wait = inner.as_wait()
            wait["op"] = stack[0].op if stack[0].kind == inner.kind else inner.op
            wait["leaf"] = inner.op
            wait["main"] = ident == main
            wait["thread"] = self.thread_names.get(ident, str(ident))
            threads.append(wait)
        return {
            "waits": threads,
            "entered": self.entered,
            "inexact": sorted(self.inexact),
            "sent": {str(k): v for k, v in self.sent.items()},
            "received": {str(k): v for k, v in self.received.items()},
        }

    # -- inside ----------------------------------------------------------------------------------
    def _frame(
        self, name: str, original: Any, args: tuple[Any, ...], kwargs: dict[str, Any], stack: list[_Frame]
    ) -> _Frame:
        if name in _CONTAINERS:
            return _Frame(name, "unknown")
        bound = self._bind(original, args, kwargs)
        group = _group_name_and_ranks(bound.get("group"), self.groups)
        if group is None:
            return _Frame(name, "unknown")
        parent = stack[-1] if stack else None
        if name in P2P_OPS:
            peer = _peer(name, bound)
            kind = "send" if name in _SENDS else "recv"
            if parent is not None and parent.reusable and (parent.kind, parent.peer) == (kind, peer):
                parent.reusable = False  # ``recv`` runs ``irecv``: one receive, not two
                return _Frame(name, kind, group, parent.seq, peer)
            self.ops[group] = self.ops.get(group, 0) + 1
            if peer is None:  # receive from any source: no one peer to wait for
                return _Frame(name, "unknown", group)
            counts = self.sent if kind == "send" else self.received
            counts[peer] = counts.get(peer, 0) + 1
            return _Frame(name, kind, group, counts[peer], peer, reusable=True)
        tensor = _tensor(bound.get(SAME_TENSORS[name])) if name in SAME_TENSORS else None
        if parent is not None and parent.reusable and parent.group == group and parent.kind == "collective":
            parent.reusable = False  # the first inner call is the parent's collective
            return _Frame(name, "collective", group, parent.seq, tensor=tensor)
        self.entered[group] = self.entered.get(group, 0) + 1
        self.ops[group] = self.ops.get(group, 0) + 1
        return _Frame(name, "collective", group, self.entered[group], reusable=True, tensor=tensor)

    def _bind(self, original: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> _Arguments:
        if original not in self._signatures:
            try:
                names = tuple(
                    p.name
                    for p in inspect.signature(original).parameters.values()
                    if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
                )
            except (TypeError, ValueError):
                names = ()
            self._signatures[original] = names
        return _Arguments(self._signatures[original], args, kwargs)

    def refresh(self) -> None:
        """Note every process group of this rank (ranks, once) and check its count against torch's."""
        self._check_exact()

    def _check_exact(self) -> None:
        """Compare each group's count with torch's own sequence number for it (outermost calls only);
        every group of this rank is recorded, so a member that never called one still counts 0 in it."""
        for name, group in self._live_groups():
            torch_seq = _torch_seq(group)
            if torch_seq is None or torch_seq == self.ops.get(name, 0):
                self.inexact.discard(name)
            else:
                self.inexact.add(name)

    def _live_groups(self) -> list[tuple[str, Any]]:
        """This rank's process groups (name, group), listed again only when torch's registry grows."""
        registry = _registry()
        if len(registry) != self._live[0]:
            live = []
            for group, name in list(registry.items()):
                if _group_name_and_ranks(group, self.groups) is not None:
                    live.append((name, group))
            self._live = (len(registry), live)
        return self._live[1]


def _tensor(value: Any) -> tuple[list[int], str] | None:
    """A tensor argument's sizes and dtype (``float32``), read without a copy; None for anything else."""
    shape, dtype = getattr(value, "shape", None), getattr(value, "dtype", None)
    if shape is None or dtype is None:
        return None
    try:
        return [int(d) for d in shape], str(dtype).removeprefix("torch.")
    except (TypeError, ValueError):  # a symbolic or odd shape: not known
        return None


def _weakable(obj: Any) -> bool:
    try:
        weakref.ref(obj)
    except TypeError:
        return False
    return True


def _registry() -> dict[Any, str]:
    """torch's registry of this rank's process groups (group -> name; empty before init)."""
    try:
        from torch.distributed import distributed_c10d

        return distributed_c10d._world.pg_names
    except Exception:  # a torch without the registry: nothing to compare
        return {}


def _torch_seq(group: Any) -> int | None:
    try:
        return int(group._get_sequence_number_for_group())
    except Exception:  # a backend without it
        return None


def _group_name_and_ranks(group: Any, known: dict[str, list[int]]) -> str | None:
    """The group's name (``group`` None: the default group's), its global ranks noted in ``known`` once;
    None for what is not a process group."""
    try:
        from torch.distributed import distributed_c10d

        if group is None:
            group = distributed_c10d._get_default_group()
        name = group.group_name
        if not isinstance(name, str):
            return None
        if name not in known:
            known[name] = [int(r) for r in distributed_c10d.get_process_group_ranks(group)]
        return name
    except Exception:  # not a ProcessGroup (e.g. a wrapper object), or no default group yet
        return None


def _peer(name: str, bound: _Arguments) -> int | None:
    """The global rank a point-to-point op talks to (``group_dst``/``group_src`` mapped), or None."""
    key = "dst" if name in _SENDS else "src"
    peer = bound.get(key)
    if isinstance(peer, int) and not isinstance(peer, bool):
        return peer
    local = bound.get(f"group_{key}")
    if isinstance(local, int) and not isinstance(local, bool):
        try:
            from torch.distributed import distributed_c10d

            group = bound.get("group") or distributed_c10d._get_default_group()
            return int(distributed_c10d.get_global_rank(group, local))
        except Exception:
            return None
    return None
