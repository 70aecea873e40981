"""Hybrid layer patterns in megatron-core's alphabet, and the Mamba-2 mixer's cost per token.

The alphabet is that of megatron-core's `hybrid_layer_allocation.Symbols`: `M` Mamba-2, `*`
attention, `-` MLP, `E` MoE, `|` a pipeline cut (no layer), `/` the start of one MTP depth (each
`/`-separated part after the main pattern is the layer pattern of one depth), `G` gated DeltaNet
(see accounting.linear_attention), `+` multi-latent attention (megatron's `MLASelfAttention`), `D`
DeepSeek sparse attention (absorbed MLA with the lightning indexer, see accounting.sparse_attention).
`*` is always standard attention (megatron builds `SelfAttention` for it, MLA config or not), and
megatron refuses `*` together with `+` or `D` in one model.

Mamba-2 (Dao & Gu 2024, "Transformers are SSMs", §7 and the Mamba-2 block; megatron-core's
`MambaMixer`): with H heads of width P (inner width d = H·P), G groups and state size N,
in_proj h -> 2d + 2GN + H (z, x, B, C, dt), a depthwise causal conv of width 4 over x, B, C
(d + 2GN channels), the selective scan, and out_proj d -> h.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

__all__ = ["MAMBA_CONV_WIDTH", "HybridLayers", "mamba_forward_flops_per_token", "parse_hybrid_pattern"]

MAMBA_CONV_WIDTH = 4  # megatron-core's MambaMixer d_conv (not a config field)
_LAYERS = {"M": "mamba", "G": "gdn", "*": "attention", "+": "mla", "D": "dsa", "-": "mlp", "E": "moe"}


@dataclass(frozen=True)
class HybridLayers:
    """Layer counts of a hybrid pattern: the main decoder's and all MTP depths' together."""

    main: tuple[str, ...]  # the main decoder's layer symbols, pipeline cuts removed
    mtp_depths: int
    counts: dict[str, int]  # "mamba", "gdn", "attention", "mla", "dsa", "mlp", "moe" -> main + MTP layers


def parse_hybrid_pattern(pattern: str) -> HybridLayers:
    """Counts the layers of `pattern`; ValueError naming the symbol and position otherwise."""
    if not isinstance(pattern, str) or not pattern.split("/")[0].replace("|", ""):
        raise ValueError(f"hybrid_pattern = {pattern!r}: expected a non-empty string of megatron symbols")
    counts: Counter[str] = Counter()
    for i, symbol in enumerate(pattern):
        if symbol in ("|", "/"):
            continue
        if symbol not in _LAYERS:
            raise ValueError(
                f"hybrid_pattern[{i}] = {symbol!r} is not a megatron hybrid symbol (M G * - E | / + D)"
            )
        counts[_LAYERS[symbol]] += 1
    parts = pattern.split("/")
    if any(not part for part in parts[1:]):
        raise ValueError(f"hybrid_pattern = {pattern!r}: an MTP depth after '/' has no layer")
    main = tuple(parts[0].replace("|", ""))
    if counts["attention"] and (counts["mla"] or counts["dsa"]):
        raise ValueError(
            f"hybrid_pattern = {pattern!r} mixes '*' attention with '+' MLA or 'D' DSA layers, "
            "which megatron-core refuses"
        )
    return HybridLayers(main=main, mtp_depths=len(parts) - 1, counts={k: counts[k] for k in _LAYERS.values()})


def mamba_forward_flops_per_token(
    hidden_size: int, num_heads: int, head_dim: int, num_groups: int, state_dim: int
) -> tuple[int, int]:
    """Forward FLOPs per token of one Mamba-2 mixer (2 per multiply-add): (with weights, scan).

    The first part has weights (projections, conv), the scan has none (a frozen base keeps its
    backward).
    GEMMs: in_proj h x (2d + 2GN + H), out_proj d x h. Conv: (d + 2GN) channels x 4 taps. Scan
    (the recurrence, linear in tokens): per head the state S (P x N) is decayed (PN multiplies),
    x Bᵀ added (PN multiply-adds), read out as S C (PN multiply-adds), plus the D skip (P
    multiply-adds): 5PN + 2P FLOPs per head. Gating and norms are elementwise and not counted.
    """
    d = num_heads * head_dim
    bc = 2 * num_groups * state_dim
    gemms = hidden_size * (2 * d + bc + num_heads) + d * hidden_size
    conv = (d + bc) * MAMBA_CONV_WIDTH
    scan = num_heads * (5 * head_dim * state_dim + 2 * head_dim)
    return 2 * (gemms + conv), scan
