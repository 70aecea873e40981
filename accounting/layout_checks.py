"""Which parallel layouts a model can run on: megatron-core's divisibility rules, each refused with its reason.

A layout megatron-core would refuse at start-up (a tensor-parallel size that splits a head, an
expert-parallel size that splits an expert) has no memory figure: `check_layout` raises a
one-line ValueError naming the size and the field it must divide, before anything is estimated.
The rules that need no model (a CP size that does not divide the sequence) live in
`stage_memory.ParallelLayout` itself; the split of the layers over the pipeline in
`stage_memory.stage_layers`.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from accounting.flops import ModelShape

__all__ = ["check_layout"]


def _divides(size_name: str, size: int, field: str, value: int | None, why: str) -> None:
    if value is not None and value % size:
        raise ValueError(f"{size_name} = {size} must divide {field} = {value} ({why})")


def check_layout(shape: ModelShape, layout: Any, kinds: Iterable[tuple[str, str]]) -> None:
    """Refuses a layout that megatron-core could not build for `shape`: ValueError naming the rule.

    `layout` is a `stage_memory.ParallelLayout`; `kinds` the (mixer, ffn) of each decoder layer,
    so that only the layers the model has are checked (an MTP depth repeats the last layer's kind).
    """
    kinds = list(kinds)
    mixers, ffns = {mixer for mixer, _ in kinds}, {ffn for _, ffn in kinds}
    t = layout.tp
    heads = "each tensor-parallel rank computes whole attention heads"
    if mixers & {"attention", "mla"}:
        _divides("tp", t, "num_attention_heads", shape.num_attention_heads, heads)
    if "attention" in mixers:
        _divides("tp", t, "num_query_groups", shape.num_query_groups, "each rank holds whole query groups")
    if "mamba" in mixers:
        _divides("tp", t, "mamba_num_heads", shape.mamba_num_heads, "each rank holds whole Mamba heads")
        _divides("tp", t, "mamba_num_groups", shape.mamba_num_groups, "each rank holds whole Mamba groups")
    if "gdn" in mixers:
        _divides("tp", t, "linear_num_key_heads", shape.linear_num_key_heads, "whole gated-DeltaNet heads")
        _divides(
            "tp", t, "linear_num_value_heads", shape.linear_num_value_heads, "whole gated-DeltaNet heads"
        )
    columns = "the column-parallel linear splits its output evenly"
    if "mlp" in ffns:
        _divides("tp", t, "ffn_hidden_size", shape.ffn_hidden_size, columns)
    if "moe" in ffns:
        _divides("ep", layout.ep, "num_moe_experts", shape.num_moe_experts, "each rank holds whole experts")
        _divides(
            "tp",
            t,
            "moe_ffn_hidden_size",
            shape.moe_ffn_hidden_size,
            f"expert tensor parallel = tp: {columns}",
        )
        shared = shape.moe_shared_expert_intermediate_size
        _divides("tp", t, "moe_shared_expert_intermediate_size", shared, columns)
    if layout.sequence_parallel:
        local = layout.seq_len // layout.cp
        _divides(
            "tp", t, "the sequence per CP rank (seq_len / cp)", local, "sequence parallel splits it over TP"
        )
