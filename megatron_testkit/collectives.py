"""Count the torch.distributed calls a rank makes, so "one all-reduce" is measured, not assumed.

`CollectiveCounter` wraps each communication function of `torch.distributed` in this process
(install/uninstall, or use it as a context manager) and records every call under the current
`phase`, a label the caller sets ("train", "log", ...):

    counter = CollectiveCounter().install()
    counter.phase = "log"
    reduce_max_memory(report, pp_group)
    counter.calls["log"]          # ["all_reduce[0, 1]"]: name, plus the group's global ranks
    counter.counts("log")         # {"all_reduce": 1, "all_gather": 0, ...}: every wrapped name
    counter.uninstall()

One wrapper per function is set in both `torch.distributed` and `distributed_c10d`, the same
object in both: `P2POp` checks `op in (isend, irecv)` by identity against the c10d globals, so two
different wrappers would make megatron's pipeline p2p fail. Because c10d is patched too, a call
that one collective makes to another through the module's globals is counted as well (e.g. the
`isend` a `P2POp` runs inside `batch_isend_irecv`); counters that are compared with each other
see the same convention.

The rank launcher (`megatron_testkit.rank_worker`) uses the same class without recording, only calling
back on entry and exit, to note the last collective each rank entered and whether it is still
inside it, for hang diagnosis and stall detection (`megatron_testkit.stall`); a test's
counter installed later wraps the launcher's wrapper, and uninstalling it restores that one.

torch is imported inside the methods, so importing `megatron_testkit` stays cheap.
"""

from __future__ import annotations

import functools
from collections import Counter
from collections.abc import Callable, Iterable
from typing import Any

__all__ = ["COLLECTIVES", "CollectiveCounter"]

# Every torch.distributed function through which a rank communicates (absent ones are skipped).
COLLECTIVES: tuple[str, ...] = (
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_object",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "broadcast",
    "broadcast_object_list",
    "barrier",
    "monitored_barrier",
    "all_to_all",
    "all_to_all_single",
    "reduce",
    "gather",
    "gather_object",
    "scatter",
    "scatter_object_list",
    "send",
    "recv",
    "isend",
    "irecv",
    "batch_isend_irecv",
)


class CollectiveCounter:
    """Counts torch.distributed calls per phase inside one rank (see the module docstring).

    `calls[phase]` lists the calls in order, each as its name followed by the global ranks of
    the group when one was passed by keyword (`"all_reduce[0, 2]"`), the bare name otherwise.
    `on_enter(name)`, if given, runs before each call and `on_exit(name)` after it returns or
    raises (the launcher's stall detection: a rank is "inside" a collective between the two);
    `on_call(name, original, args, kwargs)`, if given, runs before each call with the call's own
    arguments and returns a function called with its result after it (None when it raised): the
    rank's wait tracking (`megatron_testkit.waits`). `record=False` keeps no call list (and
    does not look up group ranks), for a counter that lives as long as the process.
    """

    def __init__(
        self,
        names: Iterable[str] = COLLECTIVES,
        *,
        on_enter: Callable[[str], None] | None = None,
        on_exit: Callable[[str], None] | None = None,
        on_call: Callable[[str, Any, tuple[Any, ...], dict[str, Any]], Callable[[Any], None]] | None = None,
        record: bool = True,
    ) -> None:
        self.names = tuple(names)
        self.phase = "setup"
        self.calls: dict[str, list[str]] = {}
        self._by_name: dict[str, Counter[str]] = {}
        self._on_enter = on_enter
        self._on_exit = on_exit
        self._on_call = on_call
        self._record = record
        self._saved: list[tuple[Any, str, Any]] = []

    def install(self) -> CollectiveCounter:
        """Wrap the functions in both namespaces (those present in this torch); returns self."""
        import torch.distributed as dist
        from torch.distributed import distributed_c10d

        if self._saved:
            raise RuntimeError("CollectiveCounter is already installed")
        for name in self.names:
            original = getattr(distributed_c10d, name, None)
            if original is None:
                continue
            wrapped = self._wrap(name, original)  # one object for both namespaces (P2POp identity)
            for module in (dist, distributed_c10d):
                if getattr(module, name, None) is original:
                    self._saved.append((module, name, original))
                    setattr(module, name, wrapped)
        return self

    def uninstall(self) -> None:
        """Put back the functions `install` replaced (whatever they were then)."""
        for module, name, original in reversed(self._saved):
            setattr(module, name, original)
        self._saved = []

    def __enter__(self) -> CollectiveCounter:
        return self.install()

    def __exit__(self, *exc: object) -> None:
        self.uninstall()

    def counts(self, phase: str | None = None) -> dict[str, int]:
        """Calls by function name (every wrapped name, zeros included) in `phase`, or in all phases."""
        phases = self._by_name.values() if phase is None else [self._by_name.get(phase, Counter())]
        total: Counter[str] = Counter()
        for by_name in phases:
            total.update(by_name)
        return {name: total[name] for name in self.names}

    def _wrap(self, name: str, original: Any) -> Any:
        @functools.wraps(original)
        def counted(*args: Any, **kwargs: Any) -> Any:
            if self._on_enter is not None:
                self._on_enter(name)
            if self._record:
                group = kwargs.get("group")
                ranks = _group_ranks(group) if group is not None else None
                self.calls.setdefault(self.phase, []).append(f"{name}{ranks}" if ranks else name)
                self._by_name.setdefault(self.phase, Counter())[name] += 1
            done = self._on_call(name, original, args, kwargs) if self._on_call is not None else None
            if self._on_exit is None and done is None:
                return original(*args, **kwargs)
            result = None
            try:
                result = original(*args, **kwargs)
                return result
            finally:
                if done is not None:
                    done(result)
                if self._on_exit is not None:
                    self._on_exit(name)

        return counted


def _group_ranks(group: Any) -> list[int] | None:
    import torch.distributed as dist

    try:
        return dist.get_process_group_ranks(group)
    except Exception:  # not a ProcessGroup (e.g. a megatron wrapper): leave it unnamed
        return None
