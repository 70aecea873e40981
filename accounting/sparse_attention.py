"""DeepSeek sparse attention (DSA; DeepSeek-V3.2, megatron-core's `experimental_attention_variant`
"dsa" and the hybrid `D` layer): the lightning indexer's cost and the top-k attention's pairs.

megatron-core 0.19.2 (`transformer/experimental_attention_variant/dsa.py`, `absorbed_mla.py`) builds
a DSA layer as MLA in its absorbed form: the MLA projections are those of plain MLA (the key
up-projection is folded into the query, the value up-projection applied after attention: the same
multiply-adds per token), while core attention runs in MQA form on the shared latent, so one
attended pair costs, per head, kv_lora_rank + rope dims for QKᵀ and kv_lora_rank for AV.

The indexer (DeepSeek-V3.2-Exp report, DeepSeek_V3_2.pdf §2.1, eq. 1: I_ts = Σ_j w_tj ReLU(q_tj·k_s)):
`linear_wq_b` q_lora_rank (hidden_size without a query latent) -> H_I d_I, `linear_wk` h -> d_I,
`linear_weights_proj` h -> H_I, then per (query, key) pair H_I (d_I + 1) multiply-adds, over
every causal pair of the document. Norms, RoPE and the Hadamard rotation are not GEMMs and are
not counted. Each query then attends to its top-k keys: query i (0-based) of a document sees
min(i + 1, k) keys, which is a left window of k - 1 keys plus the diagonal, so the kit's
sliding-window statistics with window `(k - 1, -1)` count the pairs the cap removes.

Backward (megatron-core 0.19.2): the indexer's inputs are detached and it runs under no_grad
unless the indexer's KL loss is on (`dsa_indexer_loss_coeff > 0`); with the loss, its projections
get a weight gradient only (no data gradient through the detached inputs) and its scores a full
backward, and the loss's target (the main attention's detached QKᵀ, over all causal pairs, or
over the top-k pairs with `dsa_indexer_use_sparse_loss`) is a forward-only cost.
"""

from __future__ import annotations

__all__ = [
    "DSA_VARIANT",
    "absorbed_pair_macs",
    "indexer_pair_macs",
    "indexer_projection_macs",
    "loss_target_pair_macs",
    "topk_window",
]

DSA_VARIANT = "dsa"


def topk_window(topk: int) -> tuple[int, int]:
    """The window whose pairs-beyond count is what a top-k cap removes: k - 1 keys left, none right."""
    return (topk - 1, -1)


def indexer_projection_macs(hidden_size: int, q_lora_rank: int | None, heads: int, head_dim: int) -> int:
    """Multiply-adds per token of one indexer's projections (wq_b from the query latent, wk, weights)."""
    query_in = hidden_size if q_lora_rank is None else q_lora_rank
    return query_in * heads * head_dim + hidden_size * head_dim + hidden_size * heads


def indexer_pair_macs(heads: int, head_dim: int) -> int:
    """Multiply-adds of one (query, key) index score: a dot product per head, then the weighted sum."""
    return heads * (head_dim + 1)


def absorbed_pair_macs(heads: int, kv_lora_rank: int, rope_dim: int) -> int:
    """Multiply-adds of QKᵀ plus AV for one attended pair of absorbed (MQA-form) MLA, all heads."""
    return heads * ((kv_lora_rank + rope_dim) + kv_lora_rank)


def loss_target_pair_macs(heads: int, kv_lora_rank: int, rope_dim: int) -> int:
    """Multiply-adds of the indexer loss's target score (the main attention's QKᵀ) for one pair."""
    return heads * (kv_lora_rank + rope_dim)
