"""The parallel layout a FlopsAccumulator needs, read from megatron-core, and the checks that hold it.

The count is right only with the pure data-parallel group (not DP x CP: every CP rank of a DP
rank sees the same full `cu_seqlens`), the un-sliced sequence length (not a CP rank's slice of
`tokens`), and each micro batch reported once under a virtual pipeline. Each of these mistakes
used to give a silently wrong count. `FlopsAccumulator.from_parallel_state()` and
`FlopsAccumulator.from_process_groups()` take the groups and sizes from megatron-core (or from
the process groups and the model config) and give the accumulator its `ParallelLayout`, whose
checks then refuse them with a message naming the fix. Any accumulator refuses a group whose size
is not megatron-core's data-parallel size when megatron's parallel state is initialised.

Nothing here imports megatron (`parallel_state` is passed in, or looked up lazily), nor the
accumulator (its class is passed in), so the accumulator imports this module and not back.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

import torch

__all__ = [
    "ParallelLayout",
    "accumulator_for_layout",
    "accumulator_from_parallel_state",
    "accumulator_from_process_groups",
    "check_dp_group",
    "check_no_token_dropping",
    "megatron_data_parallel_size",
]

_FIX_GROUP = (
    "pass the pure data-parallel group, parallel_state.get_data_parallel_group(with_context_parallel=False), "
    "or build the accumulator with FlopsAccumulator.from_parallel_state()"
)


@dataclass(frozen=True)
class ParallelLayout:
    """What counting needs of the layout: the pure DP group and size, CP and VPP sizes, the length.

    `seq_length` is the configured, un-sliced sequence (pack) length, when known.
    """

    dp_size: int
    cp_size: int = 1
    vpp_size: int | None = None
    dp_group: Any = None
    seq_length: int | None = None

    def __post_init__(self) -> None:
        for name in ("dp_size", "cp_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"ParallelLayout.{name} = {value!r} must be a positive int")
        if self.seq_length is not None and (not isinstance(self.seq_length, int) or self.seq_length < 1):
            raise ValueError(
                f"seq_length = {self.seq_length!r} must be a positive int (the un-sliced length)"
            )

    def length_to_count(
        self, tokens: torch.Tensor | None, seq_len: int | None, vp_stage: int | None
    ) -> int | None:
        """The `seq_len` an accumulator should count for this micro batch; ValueError for a mistake.

        Refuses, from shapes only (no sync): under a virtual pipeline a micro batch without its
        `vp_stage` (it would count once per chunk); under CP a length taken from a CP rank's slice.
        """
        if self.vpp_size is not None and self.vpp_size > 1 and vp_stage is None:
            raise ValueError(
                f"add_microbatch: under a virtual pipeline (VPP = {self.vpp_size}) every model chunk's "
                "forward step reports the micro batch; pass vp_stage= (the chunk's index) so it counts "
                "once, or vp_stage=0 where each micro batch is reported once outside the model chunks"
            )
        return _unsliced_length(self, tokens, seq_len)


def megatron_data_parallel_size() -> int | None:
    """megatron-core's pure data-parallel size when its parallel state is initialised here, else None.

    Looked up in `sys.modules` only: a process that never imported megatron pays nothing.
    """
    ps = sys.modules.get("megatron.core.parallel_state")
    if ps is None or not ps.model_parallel_is_initialized():
        return None
    return int(ps.get_data_parallel_world_size(with_context_parallel=False))


def check_dp_group(group: Any, expected: int | None = None) -> None:
    """ValueError when `group`'s size is not the data-parallel size (`expected`, else megatron's).

    A DP x CP group counts every CP rank's copy of the batch (CP times too many); the world group
    under TP or PP counts each model-parallel rank's copy. No collective: the size is local.
    """
    if group is None or not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return
    if expected is None:
        expected = megatron_data_parallel_size()
    size = torch.distributed.get_world_size(group)
    if expected is not None and size != expected:
        raise ValueError(
            f"FlopsAccumulator: dp_group has {size} ranks but the data-parallel size is {expected}: "
            f"the global batch would be counted {size / expected:g} times; {_FIX_GROUP}"
        )


def check_no_token_dropping(config: Any) -> None:
    """ValueError for an MoE that drops tokens: counting every token's top-k experts over-counts it."""
    factor = getattr(config, "moe_expert_capacity_factor", None)
    if factor is not None and getattr(config, "num_moe_experts", None):
        raise ValueError(
            f"moe_expert_capacity_factor = {factor!r}: experts drop the tokens routed beyond their "
            "capacity, and the FLOPs count every token's top-k experts, so they would be over-counted; "
            "train dropless (moe_expert_capacity_factor=None) or count the MoE FLOPs from the router's "
            "real per-expert token counts"
        )


def _check_config(config: Any, cp_size: int, vpp_size: int | None) -> None:
    """The model config agrees with the process groups on CP and VPP, and drops no tokens."""
    if config is None:
        return
    check_no_token_dropping(config)
    config_cp = getattr(config, "context_parallel_size", 1) or 1
    config_vpp = getattr(config, "virtual_pipeline_model_parallel_size", None)
    if config_cp != cp_size or (config_vpp or 1) != (vpp_size or 1):
        raise ValueError(
            f"the model config says CP = {config_cp}, VPP = {config_vpp} but the process groups give "
            f"CP = {cp_size}, VPP = {vpp_size}: pass the config these groups were built for"
        )


def accumulator_for_layout(cls: Any, packed: bool, layout: ParallelLayout, **kwargs: Any) -> Any:
    """`cls(packed, ...)` (a FlopsAccumulator class) over `layout`'s DP group and size, holding `layout`.

    The accumulator then runs `layout.length_to_count` on every micro batch and checks its group
    against `layout.dp_size` at every resolve.
    """
    kwargs.setdefault("dp_group", layout.dp_group)
    if not packed:
        kwargs.setdefault("dp_size", layout.dp_size)
    accumulator = cls(packed, **kwargs)
    accumulator.layout = layout
    return accumulator


def _unsliced_length(layout: ParallelLayout, tokens: torch.Tensor | None, seq_len: int | None) -> int | None:
    """The sequence length to count: refuses a CP rank's slice where the layout shows it is one."""
    cp, full = layout.cp_size, layout.seq_length
    fix = f"pass seq_len={full or 'the un-sliced pack length'} (the length before the CP split)"
    if seq_len is not None:
        if cp > 1 and full is not None and seq_len != full and seq_len * cp == full:
            raise ValueError(
                f"add_microbatch: seq_len = {seq_len} is a CP rank's slice of the configured "
                f"{full} (CP = {cp}); {fix}"
            )
        return seq_len
    if tokens is None:
        return full
    if cp == 1:
        return None  # `tokens` holds the whole sequence
    local = int(tokens.shape[-1])
    if local == full:
        return full
    configured = f" ({full} configured)" if full else ""
    raise ValueError(
        f"add_microbatch: under context parallelism (CP = {cp}) the length of `tokens` ({local}) is "
        f"this CP rank's slice, not the sequence's{configured}, and would under-count the linear "
        f"layers' FLOPs; {fix}"
    )


def accumulator_from_parallel_state(
    cls: Any,
    packed: bool,
    *,
    parallel_state: Any = None,
    config: Any = None,
    seq_length: int | None = None,
    **kwargs: Any,
) -> Any:
    """A `cls` accumulator over megatron-core's pure data-parallel group, with its CP and VPP sizes.

    `parallel_state` defaults to `megatron.core.parallel_state` (initialised); `config` (the
    model's `TransformerConfig`) is checked against it and for token dropping; `seq_length` is the
    un-sliced sequence length. Other keyword arguments go to `FlopsAccumulator`.
    """
    ps = parallel_state
    if ps is None:
        try:
            from megatron.core import parallel_state as ps
        except ImportError as err:
            raise ValueError(
                "FlopsAccumulator.from_parallel_state needs megatron-core; without it use "
                "FlopsAccumulator.from_process_groups(dp_group=..., cp_group=...)"
            ) from err
    if not ps.model_parallel_is_initialized():
        raise ValueError(
            "FlopsAccumulator.from_parallel_state: megatron's parallel state is not initialised; "
            "call parallel_state.initialize_model_parallel(...) first"
        )
    vpp = ps.get_virtual_pipeline_model_parallel_world_size()
    cp = ps.get_context_parallel_world_size()
    _check_config(config, cp, vpp)
    layout = ParallelLayout(
        dp_size=int(ps.get_data_parallel_world_size(with_context_parallel=False)),
        cp_size=int(cp),
        vpp_size=vpp,
        dp_group=ps.get_data_parallel_group(with_context_parallel=False),
        seq_length=seq_length,
    )
    return accumulator_for_layout(cls, packed, layout, **kwargs)


def accumulator_from_process_groups(
    cls: Any,
    packed: bool,
    *,
    dp_group: Any = None,
    cp_group: Any = None,
    pg_collection: Any = None,
    config: Any = None,
    seq_length: int | None = None,
    **kwargs: Any,
) -> Any:
    """A `cls` accumulator from explicit process groups (megatron-core's `ProcessGroupCollection` too).

    `dp_group` is the pure data-parallel group (`pg_collection.dp`), `cp_group` the context-parallel
    one (`pg_collection.cp`). With `config`, the DP size it implies (world / (TP x PP x CP)) must be
    `dp_group`'s size, which refuses a DP x CP or world group; VPP comes from the config.
    """
    if pg_collection is not None:
        dp_group = dp_group if dp_group is not None else pg_collection.dp
        cp_group = cp_group if cp_group is not None else getattr(pg_collection, "cp", None)
    if dp_group is None:
        raise ValueError(
            "FlopsAccumulator.from_process_groups: pass dp_group= (the pure data-parallel group)"
        )
    size = torch.distributed.get_world_size(dp_group)
    cp = torch.distributed.get_world_size(cp_group) if cp_group is not None else 1
    vpp = getattr(config, "virtual_pipeline_model_parallel_size", None)
    _check_config(config, cp, vpp)
    if config is not None:
        model_parallel = config.tensor_model_parallel_size * config.pipeline_model_parallel_size * cp
        check_dp_group(dp_group, torch.distributed.get_world_size() // model_parallel)
    layout = ParallelLayout(dp_size=size, cp_size=cp, vpp_size=vpp, dp_group=dp_group, seq_length=seq_length)
    return accumulator_for_layout(cls, packed, layout, **kwargs)
