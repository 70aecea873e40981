"""`TensorInspector`: per-layer statistics every N steps, free on every other step.

It matches layers by nvdlfw-inspect's names (`names.py`), reduces their tensors with hooks
that exist only during an inspection step (`hooks.py`, `tensor_stats.py`), optionally takes TE's
own statistics through an nvdlfw-inspect session (`nvdlfw.py`), and writes one record per
(step, layer, tensor) to TensorBoard and JSON lines (`sinks.py`).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from accounting.inspector.config import InspectConfig
from accounting.inspector.hooks import HookRecorder, Rows
from accounting.inspector.names import layer_names
from accounting.inspector.nvdlfw import (
    TE_STATS,
    NvdlfwSession,
    TEBackend,
    merge_scalars,
    normalises_its_input,
    te_module_class,
)
from accounting.inspector.sinks import ScalarWriter, StatsSink
from accounting.inspector.tensor_stats import combine_partials


class TensorInspector:
    """Records statistics of selected layers' tensors every `every`-th training step.

    Usage::

        inspector = TensorInspector(model, layers=r".*(fc1|fc2)", every=5,
                                    writer=tb_writer, jsonl_path="stats_rank0.jsonl")
        for step in range(1, steps + 1):
            with inspector.step(step):
                loss = train_step()        # forward and backward of every microbatch
        inspector.close()

    `layers`, `tensors`, `stats` and `every` default to `InspectConfig`'s values (declared there
    only); pass `config=` instead to give them all at once. `begin_step(step)` / `end_step()`
    are the same as `step` without the context manager. On a non-inspection step both are a
    modulo check. `end_step` returns the records it wrote (empty off-step); `history` keeps them.

    Backends: the hooks, always available. With TE modules among the matched layers and an
    `NvdlfwSession` started before the model was built (`session=`), the statistics in
    `TE_STATS` come from TE's `LogTensorStats` and the rest from the hooks, merged into one
    record. `backend="hooks"` forces the hooks; `backend="te"` requires TE and the session.

    Caveats: a forward recomputed for activation checkpointing counts as another microbatch;
    `dgrad` is the gradient of the input tensor, so layers sharing one input see the summed
    gradient. Statistics are per rank; each rank writes its own JSON lines file, and usually
    only one rank holds a TensorBoard writer.
    """

    def __init__(
        self,
        model: torch.nn.Module | list[torch.nn.Module],
        layers: str | None = None,
        tensors: tuple[str, ...] | None = None,
        stats: tuple[str, ...] | None = None,
        every: int | None = None,
        writer: ScalarWriter | None = None,
        jsonl_path: str | Path | None = None,
        *,
        config: InspectConfig | None = None,
        session: NvdlfwSession | None = None,
        backend: str = "auto",
        rank: int | None = None,
    ) -> None:
        self.config = _resolve_config(config, layers=layers, tensors=tensors, stats=stats, every=every)
        if session is not None:
            _check_session(session, self.config)
        self.sink = StatsSink(writer, jsonl_path)
        self.rank = rank if rank is not None else _default_rank()
        pattern = re.compile(self.config.layers)
        self.modules = {n: m for n, m in layer_names(model).items() if pattern.search(n)}
        if not self.modules:
            raise ValueError(f"layers = {self.config.layers!r} matches no module of the model")
        self.backend = _choose_backend(backend, self.modules, session)
        skip: frozenset[tuple[str, str]] = frozenset()
        self._te: TEBackend | None = None
        if self.backend == "te":
            assert session is not None  # _choose_backend refuses "te" without one
            self._hook_stats = tuple(s for s in self.config.stats if s not in TE_STATS)
            self._te = TEBackend(session, model, self._on_nvdlfw_scalar)
            skip = frozenset((n, "activation") for n, m in self.modules.items() if normalises_its_input(m))
        else:
            self._hook_stats = self.config.stats
        self._hooks = HookRecorder(self.modules, self.config.tensors, skip) if self._hook_stats else None
        self._step: int | None = None
        self._nvdlfw_scalars: list[tuple[str, str, str, float, int]] = []
        self.history: list[dict[str, Any]] = []

    @property
    def layer_names(self) -> list[str]:
        """The names of the matched layers, in module-tree order."""
        return list(self.modules)

    @property
    def hooks_attached(self) -> bool:
        return self._hooks is not None and self._hooks.active

    def begin_step(self, step: int) -> None:
        """Start step `step`; attaches the hooks only when it is an inspection step."""
        if not self.config.is_inspection_step(step):
            self._step = None
            return
        self._step = step
        if self._te is not None:
            self._te.begin(step)
        if self._hooks is not None:
            self._hooks.attach()

    def end_step(self) -> list[dict[str, Any]]:
        """Finish the step: on an inspection step detach the hooks, write and return the records."""
        step, self._step = self._step, None
        if step is None:
            return []
        records: list[dict[str, Any]] = []
        if self._hooks is not None:
            records = self._hook_records(step, self._hooks.detach())
        if self._te is not None:
            self._nvdlfw_scalars = []
            self._te.end()  # TE logs its buffered statistics now, through _on_nvdlfw_scalar
            records = merge_scalars(records, self._nvdlfw_scalars, self.rank)
        self.sink.write(records)
        self.history.extend(records)
        return records

    def _on_nvdlfw_scalar(self, layer: str, tensor: str, stat: str, value: float, step: int) -> None:
        if stat in self.config.stats and tensor in self.config.tensors and layer in self.modules:
            self._nvdlfw_scalars.append((layer, tensor, stat, value, step))

    @contextmanager
    def step(self, step: int) -> Iterator[None]:
        """`begin_step(step)`, the body, `end_step()` (the hooks are removed even on error)."""
        self.begin_step(step)
        try:
            yield
        finally:
            self.end_step()

    def close(self) -> None:
        """Remove any hooks and stop listening to the nvdlfw-inspect session (its owner ends it)."""
        if self._hooks is not None:
            self._hooks.detach()
        if self._te is not None:
            self._te.close()
            self._te = None

    def _hook_records(self, step: int, rows: Rows) -> list[dict[str, Any]]:
        if not rows:
            return []
        keys = list(rows)
        # The one host copy of the step: every partial row of every (layer, tensor) at once.
        flat = torch.stack([r for k in keys for r in rows[k]])
        host = flat.cpu().tolist()
        records, i = [], 0
        for layer, tensor in keys:
            count = len(rows[(layer, tensor)])
            values = combine_partials(host[i : i + count], self._hook_stats)
            i += count
            records.append({"step": step, "rank": self.rank, "layer": layer, "tensor": tensor, **values})
        return records


def _resolve_config(config: InspectConfig | None, **fields: Any) -> InspectConfig:
    given = {k: (tuple(v) if isinstance(v, (list, tuple)) else v) for k, v in fields.items() if v is not None}
    if config is not None and given:
        raise ValueError(f"give either config= or {sorted(given)}, not both")
    return config if config is not None else InspectConfig(**given)


def _check_session(session: NvdlfwSession, config: InspectConfig) -> None:
    # TE logs on the session's schedule and layers; a different one would leave records half-filled.
    theirs, ours = (session.config.every, session.config.layers), (config.every, config.layers)
    if theirs != ours:
        raise ValueError(
            f"the nvdlfw-inspect session inspects (every, layers) = {theirs!r}, this inspector {ours!r}: "
            "start the session with the inspector's InspectConfig"
        )
    if not session.running:
        raise ValueError("the nvdlfw-inspect session passed to the inspector has ended")


def _choose_backend(backend: str, modules: dict[str, torch.nn.Module], session: NvdlfwSession | None) -> str:
    if backend not in ("auto", "hooks", "te"):
        raise ValueError(f"backend = {backend!r}: choose 'auto', 'hooks' or 'te'")
    if backend == "hooks":
        return "hooks"
    te_class = te_module_class()
    uses_te = te_class is not None and any(isinstance(m, te_class) for m in modules.values())
    if backend == "te":
        if not uses_te:
            raise ValueError(
                "backend = 'te' needs Transformer Engine and TE modules among the matched layers"
            )
        if session is None:
            raise ValueError(
                "backend = 'te' needs session=start_nvdlfw_session(config), started before the "
                "model was built (TE modules fix debug mode at construction)"
            )
    return "te" if uses_te and session is not None else "hooks"


def _default_rank() -> int:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank()
    return 0
