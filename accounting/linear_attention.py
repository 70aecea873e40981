"""Gated DeltaNet linear attention (Qwen3-Next; megatron-core's `experimental_attention_variant`
"gated_delta_net", renamed "gdn" in newer cores): which layers use it, and its cost per token.

Gated DeltaNet (Yang, Kautz, Hatamizadeh 2024, arXiv:2412.06464, eq. 10; megatron-core's
`GatedDeltaNet`): in_proj h -> q, k (K_h heads of d_k), v and the output gate z (V_h heads of
d_v), beta and alpha (one per value head); a depthwise causal conv over q, k, v; per value head the
state S (d_k x d_v) follows S_t = a_t S_{t-1} (I - b_t k_t k_tᵀ) + b_t k_t v_tᵀ, o_t = S_tᵀ q_t;
out_proj V_h d_v -> h. The recurrence is linear in tokens and restarts at each document.
"""

from __future__ import annotations

__all__ = ["GDN_VARIANTS", "gdn_forward_flops_per_token", "linear_layer_pattern"]

GDN_VARIANTS = ("gated_delta_net", "gdn")


def linear_layer_pattern(freq: int | tuple[int, ...], num_layers: int) -> tuple[int, ...]:
    """1 for each gated-DeltaNet layer, 0 for each softmax-attention layer (Megatron-LM's rule:
    with an int N, 0-based layer i is linear unless (i + 1) % N == 0; a list gives 1/0 per layer)."""
    if isinstance(freq, tuple):
        return freq
    return tuple(0 if (i + 1) % freq == 0 else 1 for i in range(num_layers))


def gdn_forward_flops_per_token(
    hidden_size: int, key_head_dim: int, value_head_dim: int, key_heads: int, value_heads: int, conv: int
) -> tuple[int, int]:
    """Forward FLOPs per token of one gated-DeltaNet mixer: (with weights, the recurrence).

    GEMMs: in_proj h x (2 K_h d_k + 2 V_h d_v + 2 V_h), out_proj V_h d_v x h; conv: (2 K_h d_k +
    V_h d_v) channels x `conv` taps (2 FLOPs per multiply-add). Recurrence per value head: S k
    (d_k d_v multiply-adds), the decay a S (d_k d_v multiplies), the rank-one update
    b k (v - S k)ᵀ (d_k d_v multiply-adds), the read-out Sᵀ q (d_k d_v multiply-adds):
    7 d_k d_v FLOPs, plus 3 d_v for v - S k and its scaling by b.
    """
    qk, v = key_heads * key_head_dim, value_heads * value_head_dim
    weights = 2 * (hidden_size * (2 * qk + 2 * v + 2 * value_heads) + v * hidden_size + (2 * qk + v) * conv)
    scan = value_heads * (7 * key_head_dim * value_head_dim + 3 * value_head_dim)
    return weights, scan
