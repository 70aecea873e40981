"""The MoE router's GEMM: a named term, counted layer by layer by an independent oracle.

The router of every MoE layer (megatron-core's `TopKRouter`, a `[experts, hidden]` weight) multiplies
each token's hidden state into one logit per expert: hidden x experts multiply-adds per token and
MoE layer, forward; it trains (data and weight gradients), so 3x in training, 2x on a frozen base.
"""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from accounting import SeqlenStats, training_flops
from accounting.presets import PRESETS
from unit.strategies import model_shapes, pack_stats

pytestmark = pytest.mark.L0


def router_oracle(shape, tokens: int, *, frozen: bool = False) -> int:
    """6 (or 4 frozen) x tokens x hidden x experts for each MoE layer, walked layer by layer.

    Layer i (0-based) is MoE when `moe_layer_freq` lists 1 for it or, as an int N, when i % N == 0;
    each MTP depth repeats the last layer's kind (Megatron-LM's convention).
    """
    if shape.num_moe_experts is None:
        return 0
    freq = shape.moe_layer_freq
    kinds = [freq[i] if isinstance(freq, tuple) else int(i % freq == 0) for i in range(shape.num_layers)]
    kinds += [kinds[-1]] * shape.mtp_num_layers
    factor = 2 if frozen else 3
    return factor * 2 * tokens * sum(kinds) * shape.hidden_size * shape.num_moe_experts


@given(model_shapes(moe=True, window=False), st.lists(st.integers(1, 40), min_size=1, max_size=4))
@settings(max_examples=60)
def test_router_term_equals_the_layer_by_layer_oracle(shape, lengths):
    result = training_flops(shape, pack_stats(lengths))
    assert result.terms["moe_router"] == router_oracle(shape, sum(lengths))
    assert sum(result.terms.values()) == result.total  # the router is part of the total


@given(model_shapes(moe=True, window=False), st.integers(1, 64))
@settings(max_examples=30)
def test_a_frozen_router_has_no_weight_gradient_and_full_recompute_repeats_its_forward(shape, tokens):
    stats = SeqlenStats.dense(1, tokens)
    assert training_flops(shape, stats, frozen_base=True).terms["moe_router"] == router_oracle(
        shape, tokens, frozen=True
    )
    full = training_flops(shape, stats, recompute="full")
    forward = router_oracle(shape, tokens) // 3
    assert full.hardware_terms["moe_router"] == full.terms["moe_router"] + forward


@given(model_shapes(moe=False, window=False), st.integers(1, 64))
@settings(max_examples=20)
def test_a_dense_model_has_no_router(shape, tokens):
    assert training_flops(shape, SeqlenStats.dense(1, tokens)).terms["moe_router"] == 0


@pytest.mark.parametrize(
    ("name", "moe_layers", "share"),
    [
        # 48 MoE layers + 1 MTP depth, 2048 x 512: 1.2% of the model FLOPs at 4096 tokens.
        ("qwen3-next-80b-a3b", 49, 0.012),
        # 58 MoE layers (after 3 dense ones) + 1 MTP depth, 7168 x 256: 0.25%.
        ("deepseek-v3", 59, 0.0025),
    ],
)
def test_preset_router_shares_are_the_published_models_figures(name, moe_layers, share):
    shape = PRESETS[name]
    result = training_flops(shape, SeqlenStats.dense(1, 4096))
    assert result.terms["moe_router"] == 6 * 4096 * moe_layers * shape.hidden_size * shape.num_moe_experts
    # The share, rounded to the figure's two significant digits.
    assert float(f"{result.terms['moe_router'] / result.total:.2g}") == share


def test_the_router_reads_the_hidden_state_even_with_a_latent_moe():
    # With moe_latent_size the experts run in the latent space; the router still sees hidden_size.
    shape = dataclasses.replace(PRESETS["qwen3-30b-a3b"], moe_latent_size=256)
    result = training_flops(shape, SeqlenStats.dense(1, 10))
    assert result.terms["moe_router"] == 6 * 10 * 48 * 2048 * 128
