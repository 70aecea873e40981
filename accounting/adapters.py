"""Trainable adapters on a frozen base (LoRA): their shape and their multiply-adds per token.

A LoRA adapter on a linear layer `d_in -> d_out` adds `x A B` with `A: d_in x r`, `B: r x d_out`:
`r * (d_in + d_out)` multiply-adds per token (Hu et al. 2021, "LoRA", §4.1). The targets are named
as megatron-core's linear layers (Megatron-Bridge's PEFT LoRA uses the same names): `linear_qkv`,
`linear_proj` on every attention layer, `linear_fc1`, `linear_fc2` on every dense-MLP layer.

This module imports nothing from the rest of `accounting`: `accounting.flops` uses it, and it reads
the model through `AdapterBase`, the fields of `ModelShape` it needs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

__all__ = ["LORA_TARGETS", "AdapterBase", "LoraAdapter", "adapter_macs_per_token"]

LORA_TARGETS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")


class AdapterBase(Protocol):
    """The frozen model an adapter sits on: the `accounting.flops.ModelShape` fields it reads."""

    @property
    def num_layers(self) -> int: ...
    @property
    def mtp_num_layers(self) -> int: ...
    @property
    def hidden_size(self) -> int: ...
    @property
    def num_attention_heads(self) -> int: ...
    @property
    def num_query_groups(self) -> int: ...
    @property
    def kv_channels(self) -> int: ...
    @property
    def ffn_hidden_size(self) -> int: ...
    @property
    def gated_linear_unit(self) -> bool: ...
    @property
    def attention_output_gate(self) -> bool: ...
    @property
    def multi_latent_attention(self) -> bool: ...
    @property
    def hybrid_pattern(self) -> str | None: ...
    @property
    def moe_layer_pattern(self) -> tuple[int, ...]: ...


@dataclass(frozen=True, kw_only=True)
class LoraAdapter:
    """LoRA of rank `rank` on the named linear layers of every layer that has them."""

    rank: int
    targets: tuple[str, ...] = LORA_TARGETS

    def __post_init__(self) -> None:
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank <= 0:
            raise ValueError(f"rank = {self.rank!r} must be a positive int")
        targets = tuple(self.targets)
        object.__setattr__(self, "targets", targets)
        unknown = [t for t in targets if t not in LORA_TARGETS]
        if unknown or not targets or len(set(targets)) != len(targets):
            raise ValueError(f"targets = {list(targets)!r}: expected distinct names among {LORA_TARGETS}")


def adapter_macs_per_token(shape: AdapterBase, adapter: LoraAdapter) -> int:
    """Forward multiply-adds per token of `adapter` over all layers of `shape` (MTP layers included)."""
    if shape.multi_latent_attention and {"linear_qkv", "linear_proj"} & set(adapter.targets):
        raise ValueError(
            "LoraAdapter on linear_qkv/linear_proj of a multi-latent-attention model is not modelled"
        )
    if any(shape.moe_layer_pattern) and {"linear_fc1", "linear_fc2"} & set(adapter.targets):
        raise ValueError("LoraAdapter on linear_fc1/linear_fc2 of MoE experts is not modelled")
    if shape.hybrid_pattern is not None:
        raise ValueError("LoraAdapter on a hybrid_pattern model is not modelled")
    h, r = shape.hidden_size, adapter.rank
    q = shape.kv_channels * shape.num_attention_heads
    kv = shape.kv_channels * shape.num_query_groups
    gate = q if shape.attention_output_gate else 0
    fc1_out = shape.ffn_hidden_size * (2 if shape.gated_linear_unit else 1)
    dims = {
        "linear_qkv": (h, q + 2 * kv + gate),
        "linear_proj": (q, h),
        "linear_fc1": (h, fc1_out),
        "linear_fc2": (shape.ffn_hidden_size, h),
    }
    layers = shape.num_layers + shape.mtp_num_layers
    per_layer = {t: r * sum(dims[t]) for t in adapter.targets}
    attention = per_layer.get("linear_qkv", 0) + per_layer.get("linear_proj", 0)
    mlp = per_layer.get("linear_fc1", 0) + per_layer.get("linear_fc2", 0)
    return layers * (attention + mlp)
