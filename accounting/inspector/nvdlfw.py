"""The nvdlfw-inspect / Transformer Engine backend: a debug session object and its bridge to records.

TE's `LogTensorStats` debug feature computes statistics inside TE's GEMMs and logs them, through
nvdlfw-inspect's logger, on `debug_api.step()`. `NvdlfwSession` starts nvdlfw-inspect's
(process-global, upstream's choice) debug session and hands each logged scalar, parsed back into
(layer, tensor, stat), to the listeners subscribed to *that session object*; this package keeps
no module-level mutable state. Facts from upstream that shape it (TE 2.6, nvdlfw-inspect 0.2):

- TE modules fix debug mode when they are constructed (`TEDebugState.debug_enabled`, set by the
  first TE module's `__init__`, read by every forward), so the session must start before the
  model is built; `te_debug_mode_problem` turns TE's flag into the error.
- TE reduces activation/gradient statistics over `debug_api.get_tensor_reduction_group()`,
  which defaults to the whole world, and weights over the TP group. The inspector's records are
  per rank, so `per_rank=True` (the default) sets a one-rank reduction group (no communication)
  and turns TE's weight TP reduction off for the session.
- TE computes each statistic with torch reductions in the tensor's own dtype (bf16 under
  megatron's `Float16Module`), so its values carry bf16 rounding (relative 2^-8 per rounding).
- For LayerNorm+Linear modules TE's "activation" is the normalised GEMM input, not the module
  input the hooks see; under this backend the hooks record no "activation" for such modules, so
  a record never mixes two different tensors.

Everything here imports nvdlfw-inspect/TE lazily: on CPU the hooks backend needs neither.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from accounting.inspector.config import InspectConfig

# What TE's LogTensorStats debug feature computes itself (the rest falls back to the hooks).
TE_STATS = frozenset({"min", "max", "mean", "std", "l1_norm", "l2_norm"})
TE_TENSORS = frozenset({"activation", "weight", "output", "gradient", "dgrad"})

# (layer, tensor, stat, value, step)
Listener = Callable[[str, str, str, float, int], None]


class NvdlfwSession:
    """A running nvdlfw-inspect debug session with `LogTensorStats` configured from an `InspectConfig`.

    Create it with `start_nvdlfw_session(config)` *before* building a model with TE modules, pass
    it to `TensorInspector(..., session=session)`, and `end()` it (or use it as a context manager)
    when training is done. Only one can run at a time in a process (nvdlfw-inspect's rule).
    """

    def __init__(
        self,
        config: InspectConfig,
        *,
        namespace: str = "transformer_engine",
        feature_dirs: list[str] | None = None,
        log_dir: str | Path = ".",
        per_rank: bool = True,
    ) -> None:
        import nvdlfw_inspect.api as debug_api
        from nvdlfw_inspect.logging import BaseLogger

        if debug_api.DEBUG_MANAGER is not None:
            raise RuntimeError(
                "an nvdlfw-inspect debug session is already running in this process; end it "
                "(end_nvdlfw_session()) before starting another"
            )
        if namespace == "transformer_engine" and feature_dirs is None:
            import transformer_engine

            feature_dirs = [str(Path(transformer_engine.__file__).parent / "debug" / "features")]
        self.config = config
        self.namespace = namespace
        self.stats = tuple(s for s in config.stats if s in TE_STATS)
        self.tensors = tuple(t for t in config.tensors if t in TE_TENSORS)
        self._listeners: list[Listener] = []
        self._group: Any = None
        self._saved_weight_reduce: bool | None = None
        session = self

        class _SessionLogger(BaseLogger):
            def log_scalar(self, name: str, value: float | int, iteration: int, **kwargs: Any) -> None:
                session._dispatch(name, value, iteration)

        debug_api.initialize(
            config_file=self._session_config(),
            feature_dirs=feature_dirs,
            statistics_logger=_SessionLogger(),
            log_dir=str(log_dir),
        )
        self.running = True
        if per_rank:
            try:
                self._reduce_per_rank(debug_api)
            except BaseException:
                self.end()
                raise

    def _session_config(self) -> dict[str, Any]:
        return {
            "tensor_inspector": {
                "enabled": True,
                "layers": {"layer_name_regex_pattern": self.config.layers},
                self.namespace: {
                    "LogTensorStats": {
                        "enabled": True,
                        "tensors": list(self.tensors),
                        "stats": list(self.stats),
                        "freq": self.config.every,
                    }
                },
            }
        }

    def _reduce_per_rank(self, debug_api: Any) -> None:
        dist = torch.distributed
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            # Collective over the world: every rank creates every one-rank group.
            self._group, _ = dist.new_subgroups(group_size=1)
            debug_api.set_tensor_reduction_group(self._group)
        if self.namespace == "transformer_engine":
            from transformer_engine.debug.pytorch.debug_state import TEDebugState

            self._saved_weight_reduce = TEDebugState.weight_tensor_tp_group_reduce
            TEDebugState.set_weight_tensor_tp_group_reduce(False)

    def subscribe(self, listener: Listener) -> Callable[[], None]:
        """Call `listener(layer, tensor, stat, value, step)` for each scalar; returns the unsubscribe."""
        self._listeners.append(listener)

        def unsubscribe() -> None:
            if listener in self._listeners:
                self._listeners.remove(listener)

        return unsubscribe

    def _dispatch(self, name: str, value: float | int, iteration: int) -> None:
        parsed = parse_scalar_name(name, self.tensors, self.stats)
        if parsed is not None:
            for listener in list(self._listeners):
                listener(*parsed, float(value), int(iteration))

    def end(self) -> None:
        """End the debug session and undo what `per_rank` changed (idempotent)."""
        if not self.running:
            return
        self.running = False
        self._listeners.clear()
        if self._saved_weight_reduce is not None:
            from transformer_engine.debug.pytorch.debug_state import TEDebugState

            TEDebugState.set_weight_tensor_tp_group_reduce(self._saved_weight_reduce)
        end_nvdlfw_session()
        if self._group is not None:
            torch.distributed.destroy_process_group(self._group)
            self._group = None

    def __enter__(self) -> NvdlfwSession:
        return self

    def __exit__(self, *exc: object) -> None:
        self.end()


def start_nvdlfw_session(
    config: InspectConfig,
    *,
    namespace: str = "transformer_engine",
    feature_dirs: list[str] | None = None,
    log_dir: str | Path = ".",
    per_rank: bool = True,
) -> NvdlfwSession:
    """Start nvdlfw-inspect's debug session with its `LogTensorStats` for `config`; see `NvdlfwSession`.

    `namespace="transformer_engine"` uses TE's features (found from the installed TE when
    `feature_dirs` is None); call this before building the model. `namespace="base"` uses
    nvdlfw-inspect's own generic feature (called explicitly with `debug_api.log_tensor_stats`);
    it serves as an independent implementation of the same statistics in the unit tests. Only
    the statistics the feature knows are configured (`TE_STATS`).
    """
    return NvdlfwSession(
        config, namespace=namespace, feature_dirs=feature_dirs, log_dir=log_dir, per_rank=per_rank
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


def te_debug_mode_problem(debug_enabled: bool | None) -> str | None:
    """Why TE will log nothing, from `TEDebugState.debug_enabled`, or None when it will.

    TE sets the flag when its first module is constructed, to whether an nvdlfw-inspect session
    exists then, and every forward reads it: `False` means the model was built before the
    session started and its TE modules run without debug hooks for good.
    """
    if debug_enabled is False:
        return (
            "the model's Transformer Engine modules were built before the nvdlfw-inspect session "
            "started, so TE runs them without debug hooks and logs no statistics: call "
            "start_nvdlfw_session(config) before building the model"
        )
    return None


def te_module_class() -> type | None:
    """TE's module base class, or None where TE does not import (never installed on CPU)."""
    try:
        from transformer_engine.pytorch.module.base import TransformerEngineBaseModule
    except Exception:  # ImportError, or RuntimeError when TE's CUDA libraries are missing
        return None
    return TransformerEngineBaseModule


def normalises_its_input(module: torch.nn.Module) -> bool:
    """True for TE's LayerNorm+Linear/MLP modules, whose GEMM input (TE's "activation") is normalised."""
    return hasattr(module, "layer_norm_weight")


class TEBackend:
    """nvdlfw-inspect driving TE's `LogTensorStats` for one inspector, through a running session."""

    def __init__(self, session: NvdlfwSession, model: Any, listener: Listener) -> None:
        import nvdlfw_inspect.api as debug_api
        from transformer_engine.debug.pytorch.debug_state import TEDebugState

        problem = te_debug_mode_problem(TEDebugState.debug_enabled)
        if problem is not None:
            raise RuntimeError(problem)
        self.api = debug_api
        debug_api.infer_and_assign_layer_names(model)
        self._unsubscribe = session.subscribe(listener)

    def begin(self, step: int) -> None:
        self.api.initialize_training_step(step)

    def end(self) -> None:
        self.api.step()  # TE logs its buffered statistics now, to the session's listeners

    def close(self) -> None:
        self._unsubscribe()


def merge_scalars(
    records: list[dict[str, Any]], scalars: list[tuple[str, str, str, float, int]], rank: int
) -> list[dict[str, Any]]:
    """Fold nvdlfw-inspect's one-scalar-per-call output into the per-(step, layer, tensor) records."""
    by_key = {(r["step"], r["layer"], r["tensor"]): r for r in records}
    for layer, tensor, stat, value, step in scalars:
        blank = {"step": step, "rank": rank, "layer": layer, "tensor": tensor}
        by_key.setdefault((step, layer, tensor), blank)[stat] = value
    return list(by_key.values())


def parse_scalar_name(
    name: str, tensors: tuple[str, ...], stats: tuple[str, ...]
) -> tuple[str, str, str] | None:
    """Split nvdlfw-inspect's `<layer>_<tensor>_<stat>` scalar name back into its parts."""
    for stat in stats:
        for tensor in tensors:
            suffix = f"_{tensor}_{stat}"
            if name.endswith(suffix):
                return name[: -len(suffix)], tensor, stat
    return None
