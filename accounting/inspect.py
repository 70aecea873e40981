"""Tensor statistics for training runs: per-layer min/max/mean/std/norms/nan/inf every N steps.

`TensorInspector` watches the modules whose names match a regex and, on inspection steps only,
records statistics of their input activation, weight, output, incoming gradient and input
gradient, then writes them to a TensorBoard-like writer (`add_scalar`) and a JSON lines file.

Why it is built this way:

- **Free off-step.** Hooks are registered in `begin_step` of an inspection step and removed in
  `end_step`; on every other step the inspector does one integer modulo and nothing else: no hook
  runs, no tensor is touched, no host-device sync happens.
- **One sync per inspection step.** Hooks reduce each tensor to a small row of device-side
  partial sums (count, min, max, sum, centred sum of squares, ...) immediately, so no activation
  is kept alive; `end_step` stacks all rows and copies them to the host once.
- **Microbatches merge exactly.** Partials from several forward/backward calls in one step
  (pipeline schedules, gradient accumulation) are combined with Chan's parallel formula, so the
  statistics are those of all microbatches concatenated; the weight is taken once per step.
- **Names like nvdlfw-inspect's.** Layer names follow `nvdlfw_inspect.api.infer_and_assign_layer_names`
  (root `model`, ModuleList children named by their `layer_number` when they have one, as in
  megatron-core), so one regex selects the same layers with either backend and pipeline stages
  get distinct names.
- **Backends.** Where Transformer Engine imports and matched layers are TE modules, the
  statistics TE's `LogTensorStats` debug feature offers (`TE_STATS`) come from nvdlfw-inspect
  with TE's features: TE computes them inside its GEMMs and logs them on `debug_api.step()`; the
  rest (`nan_count`, `inf_count`) come from the hooks, and both merge into one record per
  (step, layer, tensor). TE modules pick debug mode at construction, so on that path call
  `start_nvdlfw_session(config)` before building the model. TE is never installed on CPU: there
  the hooks do everything. The TE path is guarded (TE raises RuntimeError, not ImportError,
  without CUDA libraries, and both are caught) and runs only on GPU runners with TE; on CPU the
  unit tests drive the same session/logger/merge code with nvdlfw-inspect's generic feature.

Caveats: a forward recomputed for activation checkpointing counts as another microbatch, and
`dgrad` is the gradient of the input tensor, so layers sharing one input see the summed
gradient. Statistics are per rank (no reduction across data-parallel ranks); each rank writes its own JSON
lines file, and usually only one rank holds a TensorBoard writer. `std` is the unbiased standard
deviation (`torch.std`'s default, as nvdlfw-inspect and TE use). A tensor containing NaN yields NaN
for every statistic except the counts, as torch's own reductions do.

This module imports only torch (and, lazily, nvdlfw-inspect/TE on the TE path).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

SUPPORTED_STATS = ("min", "max", "mean", "std", "l1_norm", "l2_norm", "nan_count", "inf_count")
# activation: the module's input; output: its output; gradient: the gradient arriving at the
# output (TE's naming); dgrad: the gradient with respect to the input; weight: `module.weight`.
SUPPORTED_TENSORS = ("activation", "weight", "output", "gradient", "dgrad")
# What TE's LogTensorStats debug feature computes itself (the rest falls back to the hooks).
TE_STATS = frozenset({"min", "max", "mean", "std", "l1_norm", "l2_norm"})
TE_TENSORS = frozenset({"activation", "weight", "output", "gradient", "dgrad"})

# Column layout of one partial-statistics row.
_N, _MIN, _MAX, _SUM, _M2, _L1, _SQ, _NAN, _INF = range(9)
_ROW = 9


class ScalarWriter(Protocol):
    """What the inspector needs from a TensorBoard `SummaryWriter` (or anything like it)."""

    def add_scalar(self, tag: str, scalar_value: float, global_step: int | None = None) -> Any: ...


@dataclass(frozen=True)
class InspectConfig:
    """Which layers, tensors and statistics to record, and how often (every `every`-th step)."""

    layers: str = r".*(fc1|fc2)"
    tensors: tuple[str, ...] = ("activation", "weight", "gradient")
    stats: tuple[str, ...] = SUPPORTED_STATS
    every: int = 5

    def __post_init__(self) -> None:
        if not isinstance(self.every, int) or isinstance(self.every, bool) or self.every < 1:
            raise ValueError(f"every = {self.every!r}: must be a positive int (inspect every N-th step)")
        for field, values, allowed in (
            ("tensors", self.tensors, SUPPORTED_TENSORS),
            ("stats", self.stats, SUPPORTED_STATS),
        ):
            if not values:
                raise ValueError(f"{field} is empty: name at least one of {allowed}")
            unknown = [v for v in values if v not in allowed]
            if unknown:
                raise ValueError(f"{field} = {values!r}: {unknown} not supported; choose from {allowed}")
        try:
            re.compile(self.layers)
        except re.error as err:
            raise ValueError(f"layers = {self.layers!r} is not a valid regex: {err}") from err

    def is_inspection_step(self, step: int) -> bool:
        """True on steps 0, every, 2*every, ... (nvdlfw-inspect's `freq` rule with start 0)."""
        return step % self.every == 0


def layer_names(model: torch.nn.Module | list[torch.nn.Module]) -> dict[str, torch.nn.Module]:
    """Every module under `model`, named the way nvdlfw-inspect names them.

    The root is `model`; children are `<parent>.<attribute>`, except that the children of a
    `ModuleList` are named by their `layer_number` attribute when they have one (megatron-core's
    1-based global layer index, which differs between pipeline stages). A list of model chunks
    (virtual pipeline) is walked chunk by chunk under the same root name, as nvdlfw-inspect does.
    """
    names: dict[str, torch.nn.Module] = {}

    def walk(module: torch.nn.Module, name: str) -> None:
        if isinstance(module, torch.nn.ModuleList):
            for attr, child in module.named_children():
                walk(child, f"{name}.{getattr(child, 'layer_number', attr)}")
            return
        names.setdefault(name, module)
        for attr, child in module.named_children():
            walk(child, f"{name}.{attr}")

    for chunk in model if isinstance(model, list) else [model]:
        walk(chunk, "model")
    return names


def partial_stats(tensor: torch.Tensor) -> torch.Tensor:
    """One float64 row of mergeable partial statistics of `tensor`, computed on its device.

    Columns: count, min, max, sum, centred sum of squares (M2), sum |x|, sum x^2, NaN count,
    inf count. No host sync: the row stays on the tensor's device.
    """
    x = tensor.detach().reshape(-1)
    if x.is_floating_point() and x.dtype != torch.float64:
        x = x.float()
    elif not x.is_floating_point():
        x = x.double()
    n = x.numel()
    if n == 0:
        nan = torch.full((), math.nan, dtype=torch.float64, device=x.device)
        zero = torch.zeros((), dtype=torch.float64, device=x.device)
        return torch.stack([zero, nan, nan, zero, zero, zero, zero, zero, zero])
    f64 = torch.float64
    # Sums accumulate in float64 (no float64 copy of the tensor is made); the mean is then
    # accurate to the tensor's own precision, so a constant tensor gets M2 = 0 exactly.
    total = x.sum(dtype=f64)
    mean = (total / n).to(x.dtype)
    parts = [
        torch.full((), float(n), dtype=f64, device=x.device),
        x.min(),
        x.max(),
        total,
        (x - mean).square().sum(dtype=f64),
        x.abs().sum(dtype=f64),
        x.square().sum(dtype=f64),
        x.isnan().sum(),
        x.isinf().sum(),
    ]
    return torch.stack([p.to(torch.float64) for p in parts])


def combine_partials(rows: list[list[float]], stats: tuple[str, ...]) -> dict[str, float | int]:
    """The requested statistics of the concatenation of the tensors behind `rows` (host floats).

    Means and centred sums of squares merge by Chan et al.'s parallel formula, which stays
    accurate where `sum x^2 - n mean^2` would cancel.
    """
    n = sum(r[_N] for r in rows)
    total = sum(r[_SUM] for r in rows)
    mean = total / n if n else math.nan
    m2 = sum(r[_M2] for r in rows) + sum(r[_N] * (r[_SUM] / r[_N] - mean) ** 2 for r in rows if r[_N])
    values: dict[str, float | int] = {
        # Empty tensors (count 0) have no extremes; they only add zeros to the sums.
        "min": min((r[_MIN] for r in rows if r[_N]), key=_nan_first, default=math.nan),
        "max": max((r[_MAX] for r in rows if r[_N]), key=_nan_last, default=math.nan),
        "mean": mean,
        "std": math.sqrt(m2 / (n - 1)) if n > 1 and m2 == m2 else math.nan,
        "l1_norm": sum(r[_L1] for r in rows),
        "l2_norm": math.sqrt(sum(r[_SQ] for r in rows)),
        "nan_count": int(sum(r[_NAN] for r in rows)),
        "inf_count": int(sum(r[_INF] for r in rows)),
    }
    return {s: values[s] for s in stats}


def _nan_first(v: float) -> tuple[int, float]:
    # A NaN anywhere makes min/max NaN, as torch.min/max do on the whole tensor.
    return (0, 0.0) if v != v else (1, v)


def _nan_last(v: float) -> tuple[int, float]:
    return (1, 0.0) if v != v else (0, v)


class StatsSink:
    """Writes one step's records to a scalar writer and/or a JSON lines file.

    TensorBoard tags are `inspect/<layer>/<tensor>/<stat>`; each JSON line is one
    `{"step", "rank", "layer", "tensor", <stat>: value, ...}` record (NaN/inf written as the
    JSON extensions `NaN`/`Infinity`, which Python's json reads back).
    """

    def __init__(self, writer: ScalarWriter | None = None, jsonl_path: str | Path | None = None) -> None:
        self.writer = writer
        self.jsonl_path = Path(jsonl_path) if jsonl_path is not None else None
        if self.jsonl_path is not None:
            self.jsonl_path.parent.mkdir(parents=True, exist_ok=True)

    def write(self, records: list[dict[str, Any]]) -> None:
        if self.writer is not None:
            for rec in records:
                for key, value in rec.items():
                    if key in SUPPORTED_STATS:
                        tag = f"inspect/{rec['layer']}/{rec['tensor']}/{key}"
                        self.writer.add_scalar(tag, value, rec["step"])
        if self.jsonl_path is not None and records:
            with self.jsonl_path.open("a") as fh:
                for rec in records:
                    fh.write(json.dumps(rec) + "\n")


class _HookBackend:
    """Forward hooks plus tensor gradient hooks, alive only between begin_step and end_step."""

    def __init__(self, modules: dict[str, torch.nn.Module], tensors: tuple[str, ...]) -> None:
        self.modules = modules
        self.tensors = tensors
        self._handles: list[Any] = []
        self._rows: dict[tuple[str, str], list[torch.Tensor]] = {}
        self._weights_seen: set[str] = set()

    @property
    def active(self) -> bool:
        return bool(self._handles)

    def attach(self) -> None:
        self._rows = {}
        self._weights_seen = set()
        for name, module in self.modules.items():
            self._handles.append(module.register_forward_hook(self._forward_hook(name), with_kwargs=True))

    def detach(self) -> dict[tuple[str, str], list[torch.Tensor]]:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        rows, self._rows = self._rows, {}
        return rows

    def _add(self, layer: str, tensor_name: str, tensor: Any) -> None:
        if isinstance(tensor, torch.Tensor):
            self._rows.setdefault((layer, tensor_name), []).append(partial_stats(tensor))

    def _forward_hook(self, layer: str):
        wanted = self.tensors

        def hook(module: torch.nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
            inp = args[0] if args else next((v for v in kwargs.values() if isinstance(v, torch.Tensor)), None)
            # megatron's parallel linears return (output, bias): the tensor is the first item.
            out = output[0] if isinstance(output, (tuple, list)) else output
            if "activation" in wanted:
                self._add(layer, "activation", inp)
            if "output" in wanted:
                self._add(layer, "output", out)
            if "weight" in wanted and layer not in self._weights_seen:
                self._weights_seen.add(layer)
                self._add(layer, "weight", getattr(module, "weight", None))
            if "gradient" in wanted and isinstance(out, torch.Tensor) and out.requires_grad:
                out.register_hook(lambda g: self._add(layer, "gradient", g))
            if "dgrad" in wanted and isinstance(inp, torch.Tensor) and inp.requires_grad:
                inp.register_hook(lambda g: self._add(layer, "dgrad", g))

        return hook


# Listeners of the nvdlfw-inspect session's scalars: callables (layer, tensor, stat, value, step).
# Module-level because nvdlfw-inspect's session is process-global and, with TE, must exist
# before the model is built, i.e. before any inspector does.
NVDLFW_LISTENERS: list[Callable[[str, str, str, float, int], None]] = []


def start_nvdlfw_session(
    config: InspectConfig,
    *,
    namespace: str = "transformer_engine",
    feature_dirs: list[str] | None = None,
    log_dir: str | Path = ".",
) -> None:
    """Start nvdlfw-inspect's (process-global) debug session with its `LogTensorStats` for `config`.

    `namespace="transformer_engine"` uses TE's features (found from the installed TE when
    `feature_dirs` is None); TE modules choose debug mode when they are constructed, so call this
    before building the model, then create the `TensorInspector`. `namespace="base"` uses
    nvdlfw-inspect's own generic feature (called explicitly with `debug_api.log_tensor_stats`);
    it serves as an independent implementation of the same statistics in the unit tests. Only the
    statistics the feature knows are configured (`TE_STATS`); every scalar it logs is parsed back
    into (layer, tensor, stat) and handed to the `NVDLFW_LISTENERS`.
    """
    import nvdlfw_inspect.api as debug_api
    from nvdlfw_inspect.logging import BaseLogger

    if namespace == "transformer_engine" and feature_dirs is None:
        import transformer_engine

        feature_dirs = [str(Path(transformer_engine.__file__).parent / "debug" / "features")]
    stats = tuple(s for s in config.stats if s in TE_STATS)
    tensors = tuple(t for t in config.tensors if t in TE_TENSORS)
    session_config = {
        "tensor_inspector": {
            "enabled": True,
            "layers": {"layer_name_regex_pattern": config.layers},
            namespace: {
                "LogTensorStats": {
                    "enabled": True,
                    "tensors": list(tensors),
                    "stats": list(stats),
                    "freq": config.every,
                }
            },
        }
    }

    class _ListenerLogger(BaseLogger):
        def log_scalar(self, name: str, value: float | int, iteration: int, **kwargs: Any) -> None:
            parsed = _parse_nvdlfw_name(name, tensors, stats)
            if parsed is not None:
                for listener in list(NVDLFW_LISTENERS):
                    listener(*parsed, float(value), int(iteration))

    debug_api.initialize(
        config_file=session_config,
        feature_dirs=feature_dirs,
        statistics_logger=_ListenerLogger(),
        log_dir=str(log_dir),
    )


def end_nvdlfw_session() -> None:
    """End nvdlfw-inspect's debug session (a no-op when none is running)."""
    import nvdlfw_inspect.api as debug_api
    import nvdlfw_inspect.logging as nvdlfw_logging

    debug_api.end_debug()
    # nvdlfw-inspect adds a file handler to its logger on every initialize and never closes it;
    # close them so that a long session (many tests) does not accumulate open log files.
    if nvdlfw_logging.LOGGER is not None:
        for handler in list(nvdlfw_logging.LOGGER.logger.handlers):
            nvdlfw_logging.LOGGER.logger.removeHandler(handler)
            handler.close()


class _TEBackend:
    """nvdlfw-inspect driving Transformer Engine's `LogTensorStats` debug feature (GPU runners).

    TE computes the statistics inside its GEMMs, buffers them, and logs them on
    `debug_api.step()`; they reach the inspector through `NVDLFW_LISTENERS`. When no session is
    running the inspector starts one (and ends it on close); TE modules built before that run
    without debug hooks, so prefer `start_nvdlfw_session(config)` before building the model.
    """

    def __init__(self, config: InspectConfig, model: Any, listener: Callable[..., None]) -> None:
        import nvdlfw_inspect.api as debug_api

        self.api = debug_api
        self.owns_session = debug_api.DEBUG_MANAGER is None
        if self.owns_session:
            start_nvdlfw_session(config)
        debug_api.infer_and_assign_layer_names(model)
        self.listener = listener
        NVDLFW_LISTENERS.append(listener)

    def begin(self, step: int) -> None:
        self.api.initialize_training_step(step)

    def end(self) -> None:
        self.api.step()

    def close(self) -> None:
        if self.listener in NVDLFW_LISTENERS:
            NVDLFW_LISTENERS.remove(self.listener)
        if self.owns_session:
            end_nvdlfw_session()


def _te_module_class() -> type | None:
    try:
        from transformer_engine.pytorch.module.base import TransformerEngineBaseModule
    except Exception:  # ImportError, or RuntimeError when TE's CUDA libraries are missing
        return None
    return TransformerEngineBaseModule


class TensorInspector:
    """Records statistics of selected layers' tensors every `every`-th training step.

    Usage::

        inspector = TensorInspector(model, layers=r".*(fc1|fc2)", every=5,
                                    writer=tb_writer, jsonl_path="stats_rank0.jsonl")
        for step in range(1, steps + 1):
            with inspector.step(step):
                loss = train_step()        # forward and backward of every microbatch
        inspector.close()

    `begin_step(step)` / `end_step()` are the same without the context manager. On a
    non-inspection step both are a modulo check. `end_step` returns the records it wrote
    (a list of dicts, empty off-step); `history` keeps every record written.
    """

    def __init__(
        self,
        model: torch.nn.Module | list[torch.nn.Module],
        layers: str = r".*(fc1|fc2)",
        tensors: tuple[str, ...] = ("activation", "weight", "gradient"),
        stats: tuple[str, ...] = SUPPORTED_STATS,
        every: int = 5,
        writer: ScalarWriter | None = None,
        jsonl_path: str | Path | None = None,
        *,
        backend: str = "auto",
        rank: int | None = None,
    ) -> None:
        self.config = InspectConfig(layers=layers, tensors=tuple(tensors), stats=tuple(stats), every=every)
        self.sink = StatsSink(writer, jsonl_path)
        self.rank = rank if rank is not None else _default_rank()
        pattern = re.compile(self.config.layers)
        self.modules = {n: m for n, m in layer_names(model).items() if pattern.search(n)}
        if not self.modules:
            raise ValueError(f"layers = {layers!r} matches no module of the model")
        te_class = _te_module_class()
        uses_te = te_class is not None and any(isinstance(m, te_class) for m in self.modules.values())
        if backend not in ("auto", "hooks", "te"):
            raise ValueError(f"backend = {backend!r}: choose 'auto', 'hooks' or 'te'")
        if backend == "te" and not uses_te:
            raise ValueError(
                "backend = 'te' needs Transformer Engine and TE modules among the matched layers"
            )
        self.backend = "te" if (backend == "te" or (backend == "auto" and uses_te)) else "hooks"
        if self.backend == "te":
            self._hook_stats = tuple(s for s in self.config.stats if s not in TE_STATS)
            self._te: _TEBackend | None = _TEBackend(self.config, model, self._on_nvdlfw_scalar)
        else:
            self._hook_stats = self.config.stats
            self._te = None
        self._hooks = _HookBackend(self.modules, self.config.tensors) if self._hook_stats else None
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
            records = _merge_scalars(records, self._nvdlfw_scalars, self.rank)
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
        """Remove any hooks; stop listening to (and end, if it started it) the nvdlfw-inspect session."""
        if self._hooks is not None:
            self._hooks.detach()
        if self._te is not None:
            self._te.close()
            self._te = None

    def _hook_records(
        self, step: int, rows: dict[tuple[str, str], list[torch.Tensor]]
    ) -> list[dict[str, Any]]:
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


def _merge_scalars(
    records: list[dict[str, Any]], scalars: list[tuple[str, str, str, float, int]], rank: int
) -> list[dict[str, Any]]:
    """Fold nvdlfw-inspect's one-scalar-per-call output into the per-(step, layer, tensor) records."""
    by_key = {(r["step"], r["layer"], r["tensor"]): r for r in records}
    for layer, tensor, stat, value, step in scalars:
        blank = {"step": step, "rank": rank, "layer": layer, "tensor": tensor}
        by_key.setdefault((step, layer, tensor), blank)[stat] = value
    return list(by_key.values())


def _parse_nvdlfw_name(
    name: str, tensors: tuple[str, ...], stats: tuple[str, ...]
) -> tuple[str, str, str] | None:
    """Split nvdlfw-inspect's `<layer>_<tensor>_<stat>` scalar name back into its parts."""
    for stat in stats:
        for tensor in tensors:
            suffix = f"_{tensor}_{stat}"
            if name.endswith(suffix):
                return name[: -len(suffix)], tensor, stat
    return None


def _default_rank() -> int:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank()
    return 0
