"""Gated DeltaNet linear attention (Qwen3-Next): FLOPs against an oracle re-derived from the
published recurrence, both variant names, MTP taking the last layer's kind, hybrid `G` layers,
and `ModelShape.from_megatron` on a real TransformerConfig.

Gated DeltaNet (Yang et al. 2024, arXiv:2412.06464, eq. 10): per value head, state S (d_k x d_v),
S_t = a_t S_{t-1} (I - b_t k_t k_tᵀ) + b_t k_t v_tᵀ, o_t = S_tᵀ q_t. Written as a delta rule:
u = S k (d_k d_v multiply-adds), S <- a S (d_k d_v multiplies), S += k (b (v - a u))ᵀ... the
kit's count per head and token is 7 d_k d_v + 3 d_v FLOPs (see the oracle below).
"""

from __future__ import annotations

import dataclasses
from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from accounting import ModelShape, SeqlenStats, training_flops
from megatron_testkit import skips
from unit.strategies import doc_lengths, pack_stats

pytestmark = pytest.mark.L0


@st.composite
def gdn_shapes(draw) -> ModelShape:
    layers = draw(st.integers(1, 6))
    freq = draw(
        st.one_of(st.integers(1, 4), st.lists(st.sampled_from([0, 1]), min_size=layers, max_size=layers))
    )
    return ModelShape(
        num_layers=layers,
        hidden_size=draw(st.sampled_from([16, 32])),
        ffn_hidden_size=draw(st.sampled_from([24, 40])),
        num_attention_heads=draw(st.sampled_from([2, 4])),
        num_query_groups=2,
        kv_channels=draw(st.sampled_from([4, 8])),
        vocab_size=50,
        gated_linear_unit=draw(st.booleans()),
        attention_output_gate=draw(st.booleans()),
        mtp_num_layers=draw(st.sampled_from([None, 1])),
        experimental_attention_variant=draw(st.sampled_from(["gated_delta_net", "gdn"])),
        linear_attention_freq=freq,
        linear_key_head_dim=draw(st.sampled_from([4, 8])),
        linear_value_head_dim=draw(st.sampled_from([4, 6])),
        linear_num_key_heads=draw(st.sampled_from([1, 2])),
        linear_num_value_heads=draw(st.sampled_from([2, 4])),
        linear_conv_kernel_dim=draw(st.sampled_from([2, 4])),
    )


def gdn_layer(s: ModelShape) -> tuple[int, int]:
    """(weight multiply-adds, recurrence FLOPs) per token of one gated-DeltaNet layer."""
    h, dk, dv = s.hidden_size, s.linear_key_head_dim, s.linear_value_head_dim
    kh, vh, conv = s.linear_num_key_heads, s.linear_num_value_heads, s.linear_conv_kernel_dim
    # q, k (kh heads of dk), v, z (vh heads of dv), beta, alpha (one per value head); out_proj.
    projections = h * kh * dk * 2 + h * vh * dv * 2 + h * vh * 2 + vh * dv * h
    convolution = (2 * kh * dk + vh * dv) * conv  # depthwise: one multiply-add per tap per channel
    # Per value head: u = S k (2 dk dv), a S (dk dv), v - a u and its scaling by b (3 dv),
    # S += k wᵀ (2 dk dv), o = Sᵀ q (2 dk dv).
    recurrence = vh * (2 * dk * dv + dk * dv + 3 * dv + 2 * dk * dv + 2 * dk * dv)
    return projections + convolution, recurrence


def oracle(s: ModelShape, lengths: list[int]) -> Fraction:
    if isinstance(s.linear_attention_freq, tuple):
        kinds = list(s.linear_attention_freq)
    else:
        kinds = [0 if (i + 1) % s.linear_attention_freq == 0 else 1 for i in range(s.num_layers)]
    kinds += [kinds[-1]] * s.mtp_num_layers  # an MTP layer takes the last decoder layer's kind
    h, q, kv = s.hidden_size, s.kv_channels * s.num_attention_heads, s.kv_channels * s.num_query_groups
    gate = q if s.attention_output_gate else 0
    weights, recurrence = gdn_layer(s)
    attention = h * (q + 2 * kv + gate) + q * h
    mlp = (3 if s.gated_linear_unit else 2) * h * s.ffn_hidden_size
    tokens = sum(lengths)
    per_token = sum(weights if k else attention for k in kinds) + len(kinds) * mlp
    per_token += s.mtp_num_layers * (2 * h * h + 3 * h) + h * s.vocab_size * (1 + s.mtp_num_layers)
    total = 3 * 2 * per_token * tokens + 3 * recurrence * kinds.count(1) * tokens
    total += 3 * 2 * (2 * q) * sum(Fraction(x * x, 2) for x in lengths) * kinds.count(0)
    return total


@given(gdn_shapes(), doc_lengths(min_docs=1, max_docs=5, max_len=40))
@settings(max_examples=60)
def test_gdn_training_flops_equal_the_recurrence_oracle(shape, lengths):
    assert training_flops(shape, pack_stats(lengths)).total == oracle(shape, lengths)


@given(gdn_shapes(), doc_lengths(min_docs=1, max_docs=5, max_len=40))
@settings(max_examples=30)
def test_gdn_model_flops_of_a_pack_equal_the_sum_of_its_documents_alone(shape, lengths):
    whole = training_flops(shape, pack_stats(lengths)).total
    assert whole == sum(training_flops(shape, SeqlenStats.dense(1, x)).total for x in lengths)


def test_both_variant_names_give_the_same_count():
    from accounting.presets import preset

    old = preset("qwen3-next-80b-a3b")
    new = dataclasses.replace(old, experimental_attention_variant="gdn")
    stats = SeqlenStats.dense(1, 64)
    assert training_flops(old, stats).total == training_flops(new, stats).total


def test_a_hybrid_g_layer_costs_what_a_linear_layer_costs():
    base = {
        "num_layers": 2,
        "hidden_size": 16,
        "num_attention_heads": 2,
        "vocab_size": 8,
        "ffn_hidden_size": 32,
    }
    linear = {
        "linear_key_head_dim": 4,
        "linear_value_head_dim": 4,
        "linear_num_key_heads": 1,
        "linear_num_value_heads": 2,
    }
    hybrid = ModelShape(**base, **linear, hybrid_pattern="G-")
    per_layer, recurrence = gdn_layer(hybrid)
    got = training_flops(hybrid, SeqlenStats.dense(1, 5))
    assert got.terms["gdn"] == 3 * 2 * per_layer * 5 and got.terms["gdn_scan"] == 3 * recurrence * 5
    assert got.terms["core_attention"] == 0 and got.terms["mlp"] == 3 * 2 * 2 * 16 * 32 * 5


def test_qwen3_next_preset_activates_about_the_published_3b_parameters():
    # Qwen3-Next-80B-A3B: "A3B", about 3B activated (non-embedding) parameters per token.
    from accounting.presets import preset

    main = dataclasses.replace(preset("qwen3-next-80b-a3b"), mtp_num_layers=0)
    terms = training_flops(main, SeqlenStats.dense(1, 1)).terms
    weights = sum(terms[t] for t in ("attention_projections", "gdn", "moe")) // 6
    assert round(weights / 1e9) == 3


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        (
            {"experimental_attention_variant": "dsa", "linear_attention_freq": 2},
            "experimental_attention_variant",
        ),
        ({"experimental_attention_variant": "gdn"}, "needs linear_attention_freq"),
        ({"experimental_attention_variant": "gdn", "linear_attention_freq": [1]}, "linear_attention_freq"),
        ({"linear_attention_freq": 2}, "needs experimental_attention_variant"),
        (
            {
                "experimental_attention_variant": "gdn",
                "linear_attention_freq": 2,
                "linear_num_value_heads": 0,
            },
            "linear_num_value_heads",
        ),
    ],
)
def test_invalid_linear_attention_shapes_name_the_field(overrides, field):
    with pytest.raises(ValueError, match=field):
        ModelShape(num_layers=2, hidden_size=16, num_attention_heads=2, vocab_size=8, **overrides)


def test_from_megatron_reads_gated_delta_net_from_a_real_transformer_config():
    skips.require_megatron()
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(
        num_layers=4,
        hidden_size=64,
        num_attention_heads=4,
        ffn_hidden_size=96,
        experimental_attention_variant="gated_delta_net",
        linear_attention_freq=2,
        linear_key_head_dim=8,
        linear_value_head_dim=8,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        add_bias_linear=False,
    )
    shape = ModelShape.from_megatron(config, vocab_size=128)
    assert (shape.experimental_attention_variant, shape.linear_attention_freq) == ("gated_delta_net", 2)
    assert (shape.linear_num_key_heads, shape.linear_num_value_heads, shape.linear_key_head_dim) == (2, 4, 8)
    assert shape.linear_layers == 2
    assert training_flops(shape, SeqlenStats.dense(1, 11)).total == oracle(shape, [11])
