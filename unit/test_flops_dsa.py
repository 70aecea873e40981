"""DeepSeek sparse attention (DSA): FLOPs against an oracle re-derived from the published
definition and megatron-core 0.19.2's module shapes, with a brute-force loop over each query.

Definition (DeepSeek-V3.2-Exp report §2.1; megatron-core's `DSAIndexer`, `DSAttention`,
`AbsorbedMLASelfAttention`): the indexer projects the query latent (q_lora_rank, or the hidden
state without one) to H_I heads of d_I, the hidden state to one key of d_I and to H_I weights;
its score of a (query, key) pair is Σ_j w_j ReLU(q_j · k). Each query then attends to the top-k
keys of its document: query i (0-based) sees min(i + 1, k) keys. The attention runs absorbed:
QKᵀ over kv_lora_rank + rope dims and AV over kv_lora_rank, per head. The kit's causal convention
counts half the diagonal: a query with m visible keys counts m - 1/2 pairs.
"""

from __future__ import annotations

import dataclasses
from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from accounting import ModelShape, SeqlenStats, seqlen_stats, training_flops
from fixtures.oracles import causal_pairs
from megatron_testkit import skips
from unit.strategies import cu_from_lengths, doc_lengths

pytestmark = pytest.mark.L0


@st.composite
def dsa_shapes(draw) -> ModelShape:
    heads = draw(st.sampled_from([1, 2, 4]))
    experts = draw(st.integers(1, 4))
    moe = draw(st.booleans())
    layers = draw(st.integers(1, 3))
    return ModelShape(
        num_layers=layers,
        hidden_size=draw(st.sampled_from([16, 32])),
        ffn_hidden_size=draw(st.sampled_from([24, 40])),
        num_attention_heads=heads,
        vocab_size=draw(st.sampled_from([50, 64])),
        gated_linear_unit=draw(st.booleans()),
        num_moe_experts=experts if moe else None,
        moe_router_topk=draw(st.integers(1, experts)) if moe else 2,
        moe_ffn_hidden_size=8 if moe else None,
        mtp_num_layers=draw(st.integers(0, 1)),
        multi_latent_attention=True,
        q_lora_rank=draw(st.sampled_from([None, 12])),
        kv_lora_rank=draw(st.sampled_from([8, 16])),
        qk_head_dim=draw(st.sampled_from([4, 8])),
        qk_pos_emb_head_dim=draw(st.sampled_from([2, 4])),
        v_head_dim=draw(st.sampled_from([4, 8])),
        experimental_attention_variant="dsa",
        dsa_indexer_n_heads=draw(st.sampled_from([1, 2, 4])),
        dsa_indexer_head_dim=draw(st.sampled_from([4, 8])),
        dsa_indexer_topk=draw(st.integers(1, 12)),
        dsa_indexer_loss_coeff=draw(st.sampled_from([None, 0.0, 0.5])),
        dsa_indexer_use_sparse_loss=draw(st.booleans()),
    )


def stats(shape: ModelShape, lengths: list[int]) -> SeqlenStats:
    """Statistics of one unpadded pack, with the window the DSA shape asks for."""
    import torch

    cu = torch.tensor(cu_from_lengths(lengths, len(lengths) + 1, "repeat"))
    return seqlen_stats(cu, window_size=shape.stats_window)


def oracle_terms(s: ModelShape, lengths: list[int]) -> dict[str, Fraction]:
    """Training FLOPs of each DSA-specific quantity and of the whole model, GEMM by GEMM."""
    h, n = s.hidden_size, s.num_attention_heads
    layers = s.num_layers + s.mtp_num_layers
    tokens = sum(lengths)
    qk, rope, v, rank = s.qk_head_dim, s.qk_pos_emb_head_dim, s.v_head_dim, s.kv_lora_rank
    hi, di, k = s.dsa_indexer_n_heads, s.dsa_indexer_head_dim, s.dsa_indexer_topk
    latent = s.q_lora_rank
    # Absorbed MLA per token: q (via the latent or direct), kv down (latent + shared rope key),
    # q_nope absorbed into the latent (n x qk x rank), the latent output up to v (n x rank x v),
    # and the output projection.
    query = h * n * (qk + rope) if latent is None else h * latent + latent * n * (qk + rope)
    mla = query + h * (rank + rope) + n * qk * rank + n * rank * v + n * v * h
    indexer = (h if latent is None else latent) * hi * di + h * di + h * hi
    loss = bool(s.dsa_indexer_loss_coeff)
    glu = 3 if s.gated_linear_unit else 2
    ffn = []
    for layer in range(layers):
        moe = s.num_moe_experts is not None and s.moe_layer_pattern[min(layer, s.num_layers - 1)]
        shared = s.moe_shared_expert_intermediate_size or 0
        routed = s.moe_router_topk * s.moe_ffn_hidden_size
        router = h * s.num_moe_experts if moe else 0  # the router's h x experts GEMM
        ffn.append(glu * h * (routed + shared) + router if moe else glu * h * s.ffn_hidden_size)
    terms = {
        "mla_projections": 3 * 2 * tokens * layers * mla,
        "core_attention": 3 * 2 * layers * n * ((rank + rope) + rank) * causal_pairs(lengths, k),
        "dsa_indexer": (2 if loss else 1) * 2 * tokens * layers * indexer,
        "dsa_indexer_scores": (3 if loss else 1) * 2 * layers * hi * (di + 1) * causal_pairs(lengths, None),
        "dsa_indexer_loss": 0,
    }
    if loss:
        cap = k if s.dsa_indexer_use_sparse_loss else None
        terms["dsa_indexer_loss"] = 2 * layers * n * (rank + rope) * causal_pairs(lengths, cap)
    rest = 3 * 2 * tokens * sum(ffn)
    rest += 3 * 2 * tokens * s.mtp_num_layers * (2 * h * h + 3 * h)  # MTP eh projection, norms
    rest += 3 * 2 * tokens * h * s.vocab_size * (1 + s.mtp_num_layers)
    terms["total"] = sum(terms.values()) + rest
    return terms


@given(dsa_shapes(), doc_lengths(min_docs=1, max_docs=5, max_len=30))
@settings(max_examples=60)
def test_dsa_training_flops_equal_the_gemm_by_gemm_and_query_by_query_oracle(shape, lengths):
    got = training_flops(shape, stats(shape, lengths))
    want = oracle_terms(shape, lengths)
    for name in (
        "mla_projections",
        "core_attention",
        "dsa_indexer",
        "dsa_indexer_scores",
        "dsa_indexer_loss",
    ):
        assert got.terms[name] == want[name], name
    assert got.total == want["total"]


@given(dsa_shapes(), doc_lengths(min_docs=1, max_docs=5, max_len=30))
@settings(max_examples=30)
def test_dsa_model_flops_of_a_pack_equal_the_sum_of_its_documents_alone(shape, lengths):
    whole = training_flops(shape, stats(shape, lengths)).total
    alone = [SeqlenStats.dense(1, x, window_size=shape.stats_window) for x in lengths]
    assert whole == sum(training_flops(shape, one).total for one in alone)


@given(dsa_shapes(), st.data())
@settings(max_examples=30)
def test_a_document_no_longer_than_top_k_costs_exactly_the_dense_causal_count(shape, data):
    length = data.draw(st.integers(1, shape.dsa_indexer_topk))
    got = training_flops(shape, SeqlenStats.dense(1, length, window_size=shape.stats_window))
    unbounded = dataclasses.replace(shape, dsa_indexer_topk=10**6)
    dense = training_flops(unbounded, SeqlenStats.dense(1, length, window_size=unbounded.stats_window))
    assert got.terms == dense.terms
    # Dense causal: s²/2 pairs per layer (Megatron-LM's convention), absorbed pair cost.
    n, rank, rope = shape.num_attention_heads, shape.kv_lora_rank, shape.qk_pos_emb_head_dim
    layers = shape.num_layers + shape.mtp_num_layers
    assert got.terms["core_attention"] == 3 * 2 * layers * n * (2 * rank + rope) * Fraction(length**2, 2)


def test_a_long_document_attends_k_keys_per_query_past_the_first_k():
    # One layer, one head: a document of 10 tokens, k = 4: queries see 1, 2, 3, 4, 4, 4, 4, 4, 4, 4
    # keys = 34 pairs, minus half the diagonal (5) = 29; k(k+1)/2 + (s-k)k = 10 + 24 = 34 as well.
    shape = ModelShape(
        num_layers=1,
        hidden_size=16,
        num_attention_heads=1,
        vocab_size=8,
        multi_latent_attention=True,
        kv_lora_rank=8,
        qk_pos_emb_head_dim=2,
        experimental_attention_variant="dsa",
        dsa_indexer_n_heads=1,
        dsa_indexer_head_dim=4,
        dsa_indexer_topk=4,
    )
    assert 4 * 5 // 2 + (10 - 4) * 4 == 34
    got = training_flops(shape, stats(shape, [10]))
    assert got.terms["core_attention"] == 3 * 2 * (8 + 2 + 8) * 29
    # The indexer scores every causal pair: 55 - 5 = 50, forward only (no indexer loss).
    assert got.terms["dsa_indexer_scores"] == 2 * (4 + 1) * 50


def test_stats_without_the_top_k_window_are_refused_with_what_to_pass():
    from accounting.presets import preset

    shape = preset("deepseek-v3.2")
    assert shape.stats_window == (2047, -1)
    with pytest.raises(ValueError, match=r"pass window_size=\(2047, -1\)"):
        training_flops(shape, SeqlenStats.dense(1, 4096))


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"dsa_indexer_topk": None}, "dsa_indexer_topk is None"),
        ({"dsa_indexer_n_heads": 0}, "dsa_indexer_n_heads"),
        ({"multi_latent_attention": False, "kv_lora_rank": None}, "needs multi_latent_attention"),
        ({"window_size": 4}, "window_size"),
        ({"causal": False}, "causal = False"),
        ({"linear_attention_freq": 2}, "linear_attention_freq"),
        ({"dsa_indexer_loss_coeff": -1.0}, "dsa_indexer_loss_coeff"),
    ],
)
def test_invalid_dsa_shapes_name_the_field(overrides, message):
    base = {
        "num_layers": 2,
        "hidden_size": 16,
        "num_attention_heads": 2,
        "vocab_size": 8,
        "multi_latent_attention": True,
        "kv_lora_rank": 8,
        "experimental_attention_variant": "dsa",
        "dsa_indexer_n_heads": 2,
        "dsa_indexer_head_dim": 4,
        "dsa_indexer_topk": 3,
    }
    with pytest.raises(ValueError, match=message):
        ModelShape(**{**base, **overrides})


def test_frozen_base_with_dsa_is_refused():
    from accounting.presets import preset

    shape = preset("deepseek-v3.2")
    with pytest.raises(ValueError, match="frozen_base with DeepSeek sparse attention"):
        training_flops(shape, SeqlenStats.dense(1, 8, window_size=shape.stats_window), frozen_base=True)


# ---------------------------------------------------------------- from real megatron-core configs


def _dsa_config(**overrides):
    skips.require_megatron()
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    base = {
        "num_layers": 3,
        "hidden_size": 64,
        "num_attention_heads": 4,
        "ffn_hidden_size": 96,
        "q_lora_rank": 24,
        "kv_lora_rank": 16,
        "qk_head_dim": 8,
        "qk_pos_emb_head_dim": 4,
        "v_head_dim": 8,
        "mtp_num_layers": 1,
        "add_bias_linear": False,
        "apply_rope_fusion": False,
        "experimental_attention_variant": "dsa",
        "dsa_indexer_n_heads": 2,
        "dsa_indexer_head_dim": 8,
        "dsa_indexer_topk": 5,
        "dsa_indexer_loss_coeff": 0.1,
        "dsa_indexer_use_sparse_loss": True,
    }
    return MLATransformerConfig(**{**base, **overrides})


def _has_field(name: str) -> bool:
    skips.require_megatron()
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    return name in {f.name for f in dataclasses.fields(MLATransformerConfig)}


def test_from_megatron_reads_a_real_dsa_config_or_refuses_a_pre_0_19_one():
    config = _dsa_config()
    if not _has_field("dsa_indexer_topk_freq"):
        # megatron-core 0.16.1: DSA on un-absorbed MLA with one causal mask over the whole pack.
        with pytest.raises(ValueError, match=r"older than 0\.19"):
            ModelShape.from_megatron(config, vocab_size=128)
        return
    shape = ModelShape.from_megatron(config, vocab_size=128)
    assert (shape.dsa_indexer_n_heads, shape.dsa_indexer_head_dim, shape.dsa_indexer_topk) == (2, 8, 5)
    assert shape.dsa_indexer_loss and shape.dsa_indexer_use_sparse_loss and shape.dsa_layers == 4
    lengths = [9, 3, 6]
    assert training_flops(shape, stats(shape, lengths)).total == oracle_terms(shape, lengths)["total"]


def test_from_megatron_refuses_cross_layer_top_k_sharing():
    if not _has_field("dsa_indexer_topk_freq"):
        skips.skip(
            "megatron>=0.19",
            "megatron-core before 0.19 has no dsa_indexer_topk_freq (cross-layer top-k sharing)",
        )
    with pytest.raises(ValueError, match="dsa_indexer_topk_freq = 2"):
        ModelShape.from_megatron(_dsa_config(dsa_indexer_topk_freq=2), vocab_size=128)


# ---------------------------------------------------------------- the preset, through the CLI


def test_cli_prints_deepseek_v3_2_exact_flops_equal_to_the_oracle(capsys):
    from accounting.cli import main
    from accounting.presets import preset

    shape = preset("deepseek-v3.2")
    assert shape.dsa_layers == 62 and shape.stats_window == (2047, -1)
    lengths = [4096, 2048, 1024, 1024]  # the 4096-token document passes the top-k of 2048
    assert main(["flops", "--preset", "deepseek-v3.2", "--docs", ",".join(map(str, lengths))]) == 0
    out = capsys.readouterr().out
    want = oracle_terms(shape, lengths)
    assert f"model FLOPs (exact): {want['total']}" in out
    assert "dsa_indexer_scores" in out and "dsa_indexer_loss" in out
