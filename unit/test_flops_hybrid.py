"""Hybrid layer patterns (Mamba-2 / attention / MLA / DSA / MLP / MoE, megatron's alphabet): FLOPs
against an oracle re-derived from the Mamba-2 definition, and `ModelShape.from_megatron` with
`hybrid_pattern`. `+` (MLA) and `D` (DSA) layers are re-derived from MLA's GEMMs (DeepSeek-V2
§2.1) and the DSA definition in unit/test_flops_dsa.py, with a per-query loop over the top-k cap.

Mamba-2 (Dao & Gu 2024, arXiv:2405.21060, the Mamba-2 block and SSD recurrence): in_proj
h -> (z, x, B, C, dt) of widths (d, d, GN, GN, H) with d = H·P; a depthwise conv of 4 taps over
(x, B, C); per head the recurrence S_t = a_t S_{t-1} + x_t B_tᵀ (P x N), y_t = S_t C_t + D x_t;
out_proj d -> h.
"""

from __future__ import annotations

import dataclasses
from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from accounting import ModelShape, SeqlenStats, training_flops
from fixtures.oracles import causal_pairs
from megatron_testkit import skips
from unit.strategies import doc_lengths, pack_stats

pytestmark = pytest.mark.L0


@st.composite
def hybrid_shapes(draw) -> ModelShape:
    main = draw(st.lists(st.sampled_from("M*-E"), min_size=1, max_size=8))
    cut = draw(st.integers(0, len(main)))
    depths = draw(st.lists(st.text("M*-E", min_size=1, max_size=3), max_size=2))
    pattern = "".join(main[:cut]) + ("|" if 0 < cut < len(main) else "") + "".join(main[cut:])
    pattern += "".join("/" + d for d in depths)
    heads = draw(st.sampled_from([2, 4]))
    groups = draw(st.sampled_from([g for g in (1, 2) if heads % g == 0]))
    experts = draw(st.integers(1, 4))
    return ModelShape(
        num_layers=len(main),
        hidden_size=draw(st.sampled_from([16, 32])),
        ffn_hidden_size=draw(st.sampled_from([24, 40])),
        num_attention_heads=draw(st.sampled_from([1, 2, 4])),
        vocab_size=draw(st.sampled_from([50, 64])),
        gated_linear_unit=draw(st.booleans()),
        num_moe_experts=experts,
        moe_router_topk=draw(st.integers(1, experts)),
        moe_ffn_hidden_size=8,
        hybrid_pattern=pattern,
        mamba_num_heads=heads,
        mamba_head_dim=draw(st.sampled_from([4, 8])),
        mamba_num_groups=groups,
        mamba_state_dim=draw(st.sampled_from([2, 8])),
    )


def oracle(s: ModelShape, lengths: list[int], frozen: bool = False) -> Fraction:
    """Training FLOPs of a pack, layer symbol by layer symbol (2 FLOPs per multiply-add)."""
    w = 2 if frozen else 3
    h, H, P, G, N = s.hidden_size, s.mamba_num_heads, s.mamba_head_dim, s.mamba_num_groups, s.mamba_state_dim
    d = H * P
    mats = 3 if s.gated_linear_unit else 2
    q, kv = s.kv_channels * s.num_attention_heads, s.kv_channels * s.num_query_groups
    weights = {  # multiply-adds per token of each symbol's weight matrices (and the conv's taps)
        "M": h * d + h * d + h * G * N + h * G * N + h * H + (d + 2 * G * N) * 4 + d * h,
        "*": h * q + h * kv + h * kv + q * h,
        "-": mats * h * s.ffn_hidden_size,
        # routed experts, plus the router's h x experts GEMM
        "E": mats * h * s.moe_router_topk * s.moe_ffn_hidden_size + h * (s.num_moe_experts or 0),
    }
    # The scan, per token and head: decay P·N multiplies, x Bᵀ P·N multiply-adds, S C P·N
    # multiply-adds, D x P multiply-adds -> P·N + 2·(2·P·N) + 2·P FLOPs.
    scan = H * (P * N + 4 * P * N + 2 * P)
    symbols = [c for c in s.hybrid_pattern if c not in "|/"]
    depths = s.hybrid_pattern.count("/")
    tokens = sum(lengths)
    total = w * 2 * tokens * sum(weights[c] for c in symbols)
    total += 3 * tokens * scan * symbols.count("M")
    total += 3 * 2 * (2 * q) * sum(Fraction(x * x, 2) for x in lengths) * symbols.count("*")
    total += w * 2 * tokens * depths * (2 * h * h + 3 * h)  # MTP projection (Megatron-LM's term)
    total += w * 2 * tokens * h * s.vocab_size * (1 + depths)
    return total


@given(hybrid_shapes(), doc_lengths(min_docs=1, max_docs=5, max_len=40), st.booleans())
@settings(max_examples=60)
def test_hybrid_training_flops_equal_the_symbol_by_symbol_oracle(shape, lengths, frozen):
    assert training_flops(shape, pack_stats(lengths), frozen_base=frozen).total == oracle(
        shape, lengths, frozen
    )


@given(hybrid_shapes(), doc_lengths(min_docs=1, max_docs=5, max_len=40))
@settings(max_examples=30)
def test_hybrid_model_flops_of_a_pack_equal_the_sum_of_its_documents_alone(shape, lengths):
    whole = training_flops(shape, pack_stats(lengths)).total
    assert whole == sum(training_flops(shape, SeqlenStats.dense(1, x)).total for x in lengths)


def test_mamba_width_is_heads_times_head_dim_not_twice_hidden():
    # Both peers hard-code d = 2h; megatron-core builds d = mamba_num_heads * mamba_head_dim.
    base = {
        "num_layers": 1,
        "hidden_size": 64,
        "num_attention_heads": 1,
        "vocab_size": 8,
        "hybrid_pattern": "M",
    }
    narrow = training_flops(ModelShape(**base, mamba_num_heads=8, mamba_head_dim=8), SeqlenStats.dense(1, 1))
    default = training_flops(ModelShape(**base, mamba_head_dim=8), SeqlenStats.dense(1, 1))
    assert ModelShape(**base, mamba_head_dim=8).mamba_num_heads == 16  # expand 2: 2 * 64 / 8
    g, n = 8, 128  # megatron's default groups and state size
    # in_proj: 64 x (2*64 + 2*8*128 + 8) ; out_proj 64 x 64 ; conv (64 + 2048) x 4 taps.
    assert narrow.terms["mamba"] == 3 * 2 * (64 * (128 + 2 * g * n + 8) + 64 * 64 + (64 + 2 * g * n) * 4)
    assert default.terms["mamba"] > narrow.terms["mamba"]


@pytest.mark.parametrize(
    ("pattern", "message"),
    [
        ("MD*", r"mixes '\*' attention with '\+' MLA or 'D' DSA layers, which megatron-core refuses"),
        ("M+*", r"mixes '\*' attention with '\+' MLA or 'D' DSA layers"),
        ("M+", r"has '\+' MLA or 'D' DSA layers but multi_latent_attention is False"),
        ("MX*", r"hybrid_pattern\[1\] = 'X' is not a megatron hybrid symbol"),
        ("M*/", r"an MTP depth after '/' has no layer"),
        ("M*-", r"has 3 main layers but num_layers = 2"),
    ],
)
def test_bad_hybrid_patterns_name_the_symbol_and_position(pattern, message):
    with pytest.raises(ValueError, match=message):
        ModelShape(
            num_layers=2,
            hidden_size=16,
            num_attention_heads=1,
            vocab_size=8,
            hybrid_pattern=pattern,
            mamba_head_dim=8,
        )


def test_a_hybrid_shape_parses_its_pattern_once_however_many_steps_it_counts(monkeypatch):
    # The pattern is fixed for a shape's life; a step must not re-read it per term.
    import accounting.flops
    from accounting.hybrid import parse_hybrid_pattern
    from accounting.presets import preset

    parses = []

    def counting(pattern: str):
        parses.append(pattern)
        return parse_hybrid_pattern(pattern)  # the real parser: only its calls are counted

    monkeypatch.setattr(accounting.flops, "parse_hybrid_pattern", counting)
    shape = dataclasses.replace(preset("nemotron-h-8b"))  # built (and checked) under the count
    steps = [training_flops(shape, SeqlenStats.dense(2, 64)).total for _ in range(3)]
    assert len(parses) == 1 and steps[0] == steps[1] == steps[2] > 0
    assert shape.hybrid_layers is not None and len(shape.hybrid_layers.main) == shape.num_layers


def test_nemotron_h_8b_preset_counts_the_published_8b_parameters():
    # Megatron-Bridge's Nemotron-H docs: 8B parameters. Weight FLOPs per token are 2 per weight.
    from accounting.presets import preset

    terms = training_flops(preset("nemotron-h-8b"), SeqlenStats.dense(1, 1)).terms
    weights = sum(terms[t] for t in ("attention_projections", "mamba", "mlp", "logits")) // 6
    params = weights + 4096 * 131072  # plus the input embedding
    assert 7.9e9 < params < 8.2e9
    # The Mamba in_proj of the 8B model is 18560 x 4096 (2*8192 + 2*8*128 + 128 outputs).
    assert 2 * 8192 + 2 * 8 * 128 + 128 == 18560


def test_from_megatron_reads_a_real_hybrid_config_with_its_pattern():
    skips.require_megatron()
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(
        num_layers=4,
        hidden_size=64,
        num_attention_heads=4,
        ffn_hidden_size=96,
        is_hybrid_model=True,
        mamba_num_heads=8,
        mamba_head_dim=16,
        mamba_state_dim=16,
        mamba_num_groups=2,
        add_bias_linear=False,
    )
    with pytest.raises(ValueError, match="is_hybrid_model = True: pass hybrid_pattern="):
        ModelShape.from_megatron(config, vocab_size=128)
    shape = ModelShape.from_megatron(config, vocab_size=128, hybrid_pattern="M*|M-/M-")
    assert (shape.mamba_num_heads, shape.mamba_head_dim, shape.mamba_state_dim) == (8, 16, 16)
    assert shape.mamba_num_groups == 2 and shape.mtp_num_layers == 1
    assert training_flops(shape, SeqlenStats.dense(1, 9)).total == oracle(shape, [9])


# ---------------------------------------------------------------- '+' MLA and 'D' DSA layers


@st.composite
def latent_hybrid_shapes(draw) -> ModelShape:
    main = draw(st.lists(st.sampled_from("M+D-E"), min_size=1, max_size=6))
    depths = draw(st.lists(st.text("M+D-E", min_size=1, max_size=2), max_size=1))
    pattern = "".join(main) + "".join("/" + d for d in depths)
    experts = draw(st.integers(1, 3))
    return ModelShape(
        num_layers=len(main),
        hidden_size=16,
        ffn_hidden_size=24,
        num_attention_heads=draw(st.sampled_from([1, 2])),
        vocab_size=50,
        gated_linear_unit=draw(st.booleans()),
        num_moe_experts=experts,
        moe_router_topk=draw(st.integers(1, experts)),
        moe_ffn_hidden_size=8,
        hybrid_pattern=pattern,
        mamba_num_heads=2,
        mamba_head_dim=4,
        mamba_num_groups=1,
        mamba_state_dim=2,
        multi_latent_attention=True,
        q_lora_rank=draw(st.sampled_from([None, 12])),
        kv_lora_rank=8,
        qk_head_dim=4,
        qk_pos_emb_head_dim=2,
        v_head_dim=draw(st.sampled_from([4, 6])),
        dsa_indexer_n_heads=2,
        dsa_indexer_head_dim=4,
        dsa_indexer_topk=draw(st.integers(1, 10)),
        dsa_indexer_loss_coeff=draw(st.sampled_from([None, 0.5])),
        dsa_indexer_use_sparse_loss=draw(st.booleans()),
    )


def latent_oracle(s: ModelShape, lengths: list[int]) -> Fraction:
    """Training FLOPs of a pack with '+' and 'D' layers, symbol by symbol, query by query."""
    h, n, tokens = s.hidden_size, s.num_attention_heads, sum(lengths)
    qk, rope, v, rank, latent = (
        s.qk_head_dim,
        s.qk_pos_emb_head_dim,
        s.v_head_dim,
        s.kv_lora_rank,
        s.q_lora_rank,
    )
    query = h * n * (qk + rope) if latent is None else h * latent + latent * n * (qk + rope)
    # MLA: q, kv down (latent + rope key), kv up (n x (qk + v)) from the latent, output.
    mla = query + h * (rank + rope) + rank * n * (qk + v) + n * v * h
    H, P, G, N = s.mamba_num_heads, s.mamba_head_dim, s.mamba_num_groups, s.mamba_state_dim
    d = H * P
    mats = 3 if s.gated_linear_unit else 2
    weights = {
        "M": h * (2 * d + 2 * G * N + H) + (d + 2 * G * N) * 4 + d * h,
        "+": mla,
        "D": mla,  # absorbed: n·qk·rank + n·rank·v per token, the same multiply-adds as kv up
        "-": mats * h * s.ffn_hidden_size,
        # routed experts, plus the router's h x experts GEMM
        "E": mats * h * s.moe_router_topk * s.moe_ffn_hidden_size + h * (s.num_moe_experts or 0),
    }
    symbols = [c for c in s.hybrid_pattern if c not in "|/"]
    depths = s.hybrid_pattern.count("/")
    total = 3 * 2 * tokens * sum(weights[c] for c in symbols)
    total += 3 * tokens * H * (5 * P * N + 2 * P) * symbols.count("M")
    total += 3 * 2 * n * (qk + rope + v) * causal_pairs(lengths, None) * symbols.count("+")
    dsa = symbols.count("D")
    hi, di, k = s.dsa_indexer_n_heads, s.dsa_indexer_head_dim, s.dsa_indexer_topk
    loss = bool(s.dsa_indexer_loss_coeff)
    total += 3 * 2 * n * (2 * rank + rope) * causal_pairs(lengths, k) * dsa
    indexer = (h if latent is None else latent) * hi * di + h * di + h * hi
    total += (2 if loss else 1) * 2 * tokens * indexer * dsa
    total += (3 if loss else 1) * 2 * hi * (di + 1) * causal_pairs(lengths, None) * dsa
    if loss:
        cap = k if s.dsa_indexer_use_sparse_loss else None
        total += 2 * n * (rank + rope) * causal_pairs(lengths, cap) * dsa
    total += 3 * 2 * tokens * depths * (2 * h * h + 3 * h)
    total += 3 * 2 * tokens * h * s.vocab_size * (1 + depths)
    return total


def _latent_stats(shape: ModelShape, lengths: list[int]) -> SeqlenStats:
    import torch

    from accounting import seqlen_stats
    from unit.strategies import cu_from_lengths

    cu = torch.tensor(cu_from_lengths(lengths, len(lengths) + 1, "repeat"))
    return seqlen_stats(cu, window_size=shape.stats_window)


@given(latent_hybrid_shapes(), doc_lengths(min_docs=1, max_docs=4, max_len=25))
@settings(max_examples=60)
def test_mla_and_dsa_hybrid_flops_equal_the_symbol_by_symbol_oracle(shape, lengths):
    assert training_flops(shape, _latent_stats(shape, lengths)).total == latent_oracle(shape, lengths)


@given(latent_hybrid_shapes(), doc_lengths(min_docs=1, max_docs=4, max_len=25))
@settings(max_examples=30)
def test_mla_and_dsa_hybrid_flops_of_a_pack_equal_the_sum_of_its_documents_alone(shape, lengths):
    whole = training_flops(shape, _latent_stats(shape, lengths)).total
    alone = (SeqlenStats.dense(1, x, window_size=shape.stats_window) for x in lengths)
    assert whole == sum(training_flops(shape, one).total for one in alone)


def test_from_megatron_reads_a_real_mla_hybrid_config_with_plus_and_d_layers():
    skips.require_megatron()
    try:
        from megatron.core.models.hybrid.hybrid_layer_allocation import Symbols
    except ImportError:  # megatron-core 0.16.1: megatron/core/ssm/mamba_hybrid_layer_allocation.py
        from megatron.core.ssm.mamba_hybrid_layer_allocation import Symbols
    if not hasattr(Symbols, "MLA") or not hasattr(Symbols, "DS_ATTENTION"):
        skips.skip(
            "megatron>=0.19",
            "this megatron-core release has no '+' (MLA) or 'D' (DSA) hybrid symbols (0.16.1 has M * - E)",
        )
    assert (Symbols.MLA, Symbols.DS_ATTENTION) == ("+", "D")
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    config = MLATransformerConfig(
        num_layers=4,
        hidden_size=64,
        num_attention_heads=4,
        ffn_hidden_size=96,
        q_lora_rank=24,
        kv_lora_rank=16,
        qk_head_dim=8,
        qk_pos_emb_head_dim=4,
        v_head_dim=8,
        is_hybrid_model=True,
        mamba_num_heads=8,
        mamba_head_dim=16,
        mamba_state_dim=16,
        mamba_num_groups=2,
        dsa_indexer_n_heads=2,
        dsa_indexer_head_dim=8,
        dsa_indexer_topk=4,
        add_bias_linear=False,
    )
    shape = ModelShape.from_megatron(config, vocab_size=128, hybrid_pattern="M+|D-")
    assert shape.multi_latent_attention and shape.dsa_layers == 1 and shape.stats_window == (3, -1)
    assert (shape.dsa_indexer_n_heads, shape.dsa_indexer_head_dim, shape.dsa_indexer_loss) == (2, 8, False)
    lengths = [7, 2, 5]
    assert training_flops(shape, _latent_stats(shape, lengths)).total == latent_oracle(shape, lengths)
