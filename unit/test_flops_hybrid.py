"""Hybrid layer patterns (Mamba-2 / attention / MLP / MoE, megatron's alphabet): FLOPs against an
oracle re-derived from the Mamba-2 definition, and `ModelShape.from_megatron` with `hybrid_pattern`.

Mamba-2 (Dao & Gu 2024, arXiv:2405.21060, the Mamba-2 block and SSD recurrence): in_proj
h -> (z, x, B, C, dt) of widths (d, d, GN, GN, H) with d = H·P; a depthwise conv of 4 taps over
(x, B, C); per head the recurrence S_t = a_t S_{t-1} + x_t B_tᵀ (P x N), y_t = S_t C_t + D x_t;
out_proj d -> h.
"""

from __future__ import annotations

from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from accounting import ModelShape, SeqlenStats, training_flops
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
        "E": mats * h * s.moe_router_topk * s.moe_ffn_hidden_size,
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
        ("MD*", r"hybrid_pattern\[1\] = 'D' \(DeepSeek sparse attention layer\) is not modelled yet"),
        ("M+*", r"hybrid_pattern\[1\] = '\+' \(MLA layer\)"),
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
    pytest.importorskip("megatron.core")
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
