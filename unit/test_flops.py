"""training_flops / ModelShape: Megatron-LM's formula as an oracle, upstream totals, brute-force attention."""

from __future__ import annotations

import dataclasses
import math
from fractions import Fraction
from types import SimpleNamespace

import pytest
import torch
from hypothesis import assume, given
from hypothesis import strategies as st

from accounting import ModelShape, SeqlenStats, seqlen_stats, training_flops
from accounting.presets import PRESETS
from megatron_testkit import skips
from unit.strategies import dense_megatron_shapes, doc_lengths, model_shapes, packs

pytestmark = pytest.mark.L0


def megatron_num_floating_point_operations(args, batch_size, seqlen_squared_sum=None):
    """Megatron-LM's `num_floating_point_operations` (transformer path), re-typed from
    Megatron-LM's training.py: T = B*s real tokens times the
    linear terms, plus Σsᵢ² (B*s² when dense) * attention layers * 6 * Q. Pass Fractions to keep
    the `/ 2 * 2` exact."""
    if not args.group_query_attention:
        args.num_query_groups = args.num_attention_heads
    if args.num_experts is None:
        num_dense_layers, num_moe_layers, num_experts_routed_to, last_layer_is_moe = args.num_layers, 0, 0, 0
    else:
        if isinstance(args.moe_layer_freq, int):
            pattern = [1 if (i % args.moe_layer_freq == 0) else 0 for i in range(args.num_layers)]
        else:
            pattern = list(args.moe_layer_freq)
        num_moe_layers = sum(pattern)
        num_dense_layers = args.num_layers - num_moe_layers
        num_experts_routed_to = args.moe_router_topk
        last_layer_is_moe = pattern[-1]
    if args.mtp_num_layers is not None:
        mtp_num_layers = args.mtp_num_layers
        num_moe_layers += last_layer_is_moe * mtp_num_layers
        num_dense_layers += (1 - last_layer_is_moe) * mtp_num_layers
        num_layers = args.num_layers + mtp_num_layers
    else:
        mtp_num_layers = 0
        num_layers = args.num_layers
    moe_ffn_hidden_size = (
        args.moe_ffn_hidden_size if args.moe_ffn_hidden_size is not None else args.ffn_hidden_size
    )
    shared = (
        0 if args.moe_shared_expert_intermediate_size is None else args.moe_shared_expert_intermediate_size
    )
    fwd_bwd, fma = 3, 2
    ffn_expansion_factor = 3 if args.swiglu else 2
    query_projection_size = args.kv_channels * args.num_attention_heads
    key_projection_size = args.kv_channels * args.num_query_groups
    value_projection_size = args.kv_channels * args.num_query_groups
    gate_projection_size = query_projection_size if args.attention_output_gate else 0
    seq = args.seq_length
    if seqlen_squared_sum is not None:  # THD: s is replaced per token by Σsᵢ²/T
        seq = Fraction(seqlen_squared_sum, batch_size * args.seq_length)
    self_attn_term = num_layers * (
        fwd_bwd
        * fma
        * (
            args.hidden_size
            * (query_projection_size + key_projection_size + value_projection_size + gate_projection_size)
            + query_projection_size * seq / 2 * 2
            + query_projection_size * args.hidden_size
        )
    )
    return (
        batch_size
        * args.seq_length
        * (
            fwd_bwd
            * fma
            * args.hidden_size
            * (
                (args.ffn_hidden_size * ffn_expansion_factor) * num_dense_layers
                + (moe_ffn_hidden_size * num_experts_routed_to * ffn_expansion_factor) * num_moe_layers
                + (shared * ffn_expansion_factor) * num_moe_layers
            )
            + self_attn_term
            + fwd_bwd
            * fma
            * mtp_num_layers
            * (3 * args.hidden_size + 2 * args.hidden_size * args.hidden_size)
            + fwd_bwd * fma * args.hidden_size * args.padded_vocab_size * (mtp_num_layers + 1)
        )
    )


def megatron_args(shape: ModelShape, seq_length) -> SimpleNamespace:
    """Megatron-LM argument names for a shape (written from the shape's public fields)."""
    return SimpleNamespace(
        num_layers=shape.num_layers,
        hidden_size=shape.hidden_size,
        ffn_hidden_size=shape.ffn_hidden_size,
        num_attention_heads=shape.num_attention_heads,
        group_query_attention=shape.num_query_groups != shape.num_attention_heads,
        num_query_groups=shape.num_query_groups,
        kv_channels=shape.kv_channels,
        swiglu=shape.gated_linear_unit,
        num_experts=shape.num_moe_experts,
        moe_router_topk=shape.moe_router_topk,
        moe_ffn_hidden_size=shape.moe_ffn_hidden_size,
        moe_shared_expert_intermediate_size=shape.moe_shared_expert_intermediate_size,
        moe_layer_freq=shape.moe_layer_freq,
        mtp_num_layers=shape.mtp_num_layers or None,
        attention_output_gate=shape.attention_output_gate,
        padded_vocab_size=shape.vocab_size,
        seq_length=seq_length,
    )


def without_router(result) -> int:
    """The total without the MoE router's GEMM, which Megatron-LM and Megatron-Bridge do not count."""
    return result.total - result.terms["moe_router"]


def _attended_pairs(length: int, window, causal: bool) -> int:
    """Brute force: (query, key) pairs of one document the attention computes."""
    left, right = window if window is not None else (-1, -1)
    count = 0
    for i in range(length):
        for j in range(length):
            if causal and j > i:
                continue
            if left >= 0 and j < i - left:
                continue
            if right >= 0 and j > i + right:
                continue
            count += 1
    return count


# ---------------------------------------------------------------- Megatron-LM and upstream oracles


@given(dense_megatron_shapes(), st.integers(1, 8), st.integers(1, 256))
def test_dense_batches_give_exactly_megatron_lm_num_floating_point_operations(shape, batch, seq_len):
    expected = megatron_num_floating_point_operations(megatron_args(shape, Fraction(seq_len)), batch)
    result = training_flops(shape, SeqlenStats.dense(batch, seq_len))
    assert type(result.total) is int
    assert without_router(result) == expected


@given(dense_megatron_shapes(), doc_lengths(min_docs=1, max_docs=6, max_len=128))
def test_packs_give_megatron_lm_thd_formula_with_real_squared_sum(shape, lengths):
    total = sum(lengths)
    cu = torch.tensor([0, *[sum(lengths[: i + 1]) for i in range(len(lengths))]])
    expected = megatron_num_floating_point_operations(
        megatron_args(shape, Fraction(total)), 1, seqlen_squared_sum=sum(s * s for s in lengths)
    )
    assert without_router(training_flops(shape, seqlen_stats(cu))) == expected


@pytest.mark.parametrize(
    ("name", "seq_len", "reference"),
    [("llama3-8b", 8192, 4.22e14), ("llama3-70b", 8192, 3.68e15), ("qwen3-30b-a3b", 4096, 9.42e13)],
)
def test_presets_reproduce_upstream_gbs1_totals_to_three_significant_figures(name, seq_len, reference):
    # Megatron-Bridge tests/functional_tests/test_groups/utils/test_flop_utils.py pins these.
    total = without_router(training_flops(PRESETS[name], SeqlenStats.dense(1, seq_len)))
    assert float(f"{total:.2e}") == reference


# Megatron-LM's transformer formula (as restated here) covers every preset but the MLA, hybrid and
# gated-DeltaNet ones (their oracles: unit/test_flops_mla.py, test_flops_hybrid.py,
# test_flops_gdn.py); the LoRA preset's base is llama3-70b, trained in full here.
MEGATRON_GQA_PRESETS = sorted(
    n
    for n, s in PRESETS.items()
    if not s.multi_latent_attention and s.hybrid_pattern is None and s.experimental_attention_variant is None
)


@pytest.mark.parametrize("name", MEGATRON_GQA_PRESETS)
def test_presets_equal_megatron_lm_formula_evaluated_in_floats(name):
    shape = PRESETS[name]
    upstream = megatron_num_floating_point_operations(megatron_args(shape, 4096), 8)  # floats, as upstream
    ours = without_router(training_flops(shape, SeqlenStats.dense(8, 4096)))
    assert math.isclose(ours, upstream, rel_tol=1e-12)


def test_totals_beyond_two_to_the_53_stay_exact_python_ints():
    shape = PRESETS["llama3-70b"]
    total = training_flops(shape, SeqlenStats.dense(1_000_003, 8192)).total
    assert total > 2**53
    assert total == megatron_num_floating_point_operations(megatron_args(shape, Fraction(8192)), 1_000_003)


# ---------------------------------------------------------------- properties of the count


@given(model_shapes(window=False), doc_lengths(min_docs=1, max_docs=1, max_len=300))
def test_a_pack_of_one_sequence_equals_the_dense_batch(shape, lengths):
    (s,) = lengths
    pack = training_flops(shape, seqlen_stats(torch.tensor([0, s]), pack_len=s))
    dense = training_flops(shape, SeqlenStats.dense(1, s))
    assert (pack.total, pack.hardware_total, pack.terms) == (dense.total, dense.hardware_total, dense.terms)


@given(model_shapes(), packs(), packs(), st.sampled_from([None, "full", "selective"]))
def test_flops_are_additive_over_microbatches(shape, a, b, recompute):
    w = shape.window_size
    sa = seqlen_stats(a.cu_seqlens(), a.cu_seqlens_padded(), window_size=w, pack_len=a.pack_len)
    sb = seqlen_stats(b.cu_seqlens(), b.cu_seqlens_padded(), window_size=w, pack_len=b.pack_len)
    fa, fb = training_flops(shape, sa, recompute=recompute), training_flops(shape, sb, recompute=recompute)
    both = training_flops(shape, sa + sb, recompute=recompute)
    assert both.total == fa.total + fb.total
    assert both.hardware_total == fa.hardware_total + fb.hardware_total


@given(model_shapes(window=False), packs(max_len=30))
def test_causal_core_attention_is_exactly_half_the_non_causal_one(shape, pack):
    stats = seqlen_stats(pack.cu_seqlens())
    causal = training_flops(dataclasses.replace(shape, causal=True), stats).terms["core_attention"]
    full = training_flops(dataclasses.replace(shape, causal=False), stats).terms["core_attention"]
    assert 2 * causal == full


def _is_window_layer(shape: ModelShape, layer_number: int) -> bool:
    """megatron-core's `is_layer_window_attention` rule, re-typed (layer_number is 1-based)."""
    skip = shape.window_attn_skip_freq
    if shape.window_size is None:
        return False
    if skip is None:
        return True
    if isinstance(skip, int):
        return layer_number % skip != 0
    return bool(skip[layer_number - 1])


@given(model_shapes(window=True), packs(max_len=20))
def test_windowed_core_attention_equals_a_brute_force_per_layer_per_document_pair_count(shape, pack):
    stats = seqlen_stats(pack.cu_seqlens(), window_size=shape.window_size)
    q = shape.kv_channels * shape.num_attention_heads
    last_is_window = _is_window_layer(shape, shape.num_layers)
    expected_doubled = 0
    for layer in range(1, shape.num_layers + shape.mtp_num_layers + 1):
        windowed = _is_window_layer(shape, layer) if layer <= shape.num_layers else last_is_window
        window = shape.window_size if windowed else None
        pairs = sum(_attended_pairs(s, window, shape.causal) for s in pack.lengths)
        # Megatron's causal convention: s²/2 per document, i.e. the exact count minus half the diagonal.
        expected_doubled += 2 * pairs - sum(pack.lengths) if shape.causal else 2 * pairs
    # 3 (fwd + bwd) * 2 (FLOPs per FMA) * 2 (QK^T and AV) * q per pair.
    assert 2 * training_flops(shape, stats).terms["core_attention"] == 3 * 2 * 2 * q * expected_doubled


@given(model_shapes(window=True))
def test_window_layer_pattern_agrees_with_megatron_core(shape):
    skips.require_megatron()
    import megatron.core.transformer.utils as utils

    skip = shape.window_attn_skip_freq
    skip = list(skip) if isinstance(skip, tuple) else skip
    expected = tuple(
        int(utils.is_layer_window_attention(shape.window_size, skip, layer))
        for layer in range(1, shape.num_layers + 1)
    )
    assert shape.window_layer_pattern == expected


@given(model_shapes(window=False), packs(max_len=40))
def test_a_window_wider_than_every_document_changes_nothing(shape, pack):
    longest = max(pack.lengths + pack.padded_lengths, default=0)
    windowed = dataclasses.replace(shape, window_size=(longest, longest))
    plain = training_flops(shape, seqlen_stats(pack.cu_seqlens(), pack.cu_seqlens_padded()))
    clipped = training_flops(
        windowed, seqlen_stats(pack.cu_seqlens(), pack.cu_seqlens_padded(), window_size=windowed.window_size)
    )
    assert (clipped.total, clipped.hardware_total) == (plain.total, plain.hardware_total)


_GROWABLE = ("num_layers", "hidden_size", "ffn_hidden_size", "kv_channels", "vocab_size", "mtp_num_layers")


@given(
    model_shapes(), packs(), st.sampled_from((*_GROWABLE, "heads", "document", "topk", "moe_ffn", "window"))
)
def test_flops_are_monotone_in_every_size(shape, pack, what):
    stats = seqlen_stats(pack.cu_seqlens(), pack.cu_seqlens_padded(), window_size=shape.window_size)
    before = training_flops(shape, stats)
    bigger, bigger_stats = shape, stats
    if what == "num_layers":
        # MTP layers copy the last layer's kind (MoE or dense, windowed or full), so the new layer
        # goes before the last one; with a frequency instead of a per-layer pattern a new last
        # layer may turn them from MoE to dense or from full to windowed attention.
        freq, skip = shape.moe_layer_freq, shape.window_attn_skip_freq
        assume(shape.mtp_num_layers == 0 or shape.num_moe_experts is None or isinstance(freq, tuple))
        assume(shape.mtp_num_layers == 0 or shape.window_size is None or isinstance(skip, tuple))
        freq = (*freq[:-1], 1, freq[-1]) if isinstance(freq, tuple) else freq
        skip = (*skip[:-1], 1, skip[-1]) if isinstance(skip, tuple) else skip
        bigger = dataclasses.replace(
            shape, num_layers=shape.num_layers + 1, moe_layer_freq=freq, window_attn_skip_freq=skip
        )
    elif what in _GROWABLE:
        bigger = dataclasses.replace(shape, **{what: getattr(shape, what) + 1})
    elif what == "heads":
        bigger = dataclasses.replace(shape, num_attention_heads=2 * shape.num_attention_heads)
    elif what == "topk":
        assume(shape.num_moe_experts is not None and shape.moe_router_topk < shape.num_moe_experts)
        bigger = dataclasses.replace(shape, moe_router_topk=shape.moe_router_topk + 1)
    elif what == "moe_ffn":
        bigger = dataclasses.replace(shape, moe_ffn_hidden_size=shape.moe_ffn_hidden_size + 1)
    elif what == "window":
        assume(shape.window_size is not None)
        left, right = shape.window_size
        bigger = dataclasses.replace(
            shape, window_size=(left + 1 if left >= 0 else -1, right + 1 if right >= 0 else -1)
        )
    if what == "document":  # one more document of 5 tokens
        bigger_stats = stats + seqlen_stats(torch.tensor([0, 5]), window_size=shape.window_size)
    elif what == "window":
        bigger_stats = seqlen_stats(
            pack.cu_seqlens(), pack.cu_seqlens_padded(), window_size=bigger.window_size
        )
    after = training_flops(bigger, bigger_stats)
    assert after.total >= before.total
    assert after.hardware_total >= before.hardware_total


@given(model_shapes(), packs())
def test_terms_sum_to_totals_and_padding_only_adds_hardware_flops(shape, pack):
    stats = seqlen_stats(
        pack.cu_seqlens(), pack.cu_seqlens_padded(), window_size=shape.window_size, pack_len=pack.pack_len
    )
    result = training_flops(shape, stats)
    assert sum(result.terms.values()) == result.total
    assert sum(result.hardware_terms.values()) == result.hardware_total
    assert all(result.hardware_terms[k] >= v for k, v in result.terms.items())


@given(model_shapes(), packs())
def test_unpadded_packs_without_recompute_have_hardware_equal_to_model_flops(shape, pack):
    stats = seqlen_stats(pack.cu_seqlens(), window_size=shape.window_size)
    result = training_flops(shape, stats)
    assert result.hardware_total == result.total


@given(model_shapes(), packs())
def test_recompute_adds_exactly_one_forward_of_what_it_recomputes(shape, pack):
    stats = seqlen_stats(
        pack.cu_seqlens(), pack.cu_seqlens_padded(), window_size=shape.window_size, pack_len=pack.pack_len
    )
    base = training_flops(shape, stats)
    full = training_flops(shape, stats, recompute="full")
    selective = training_flops(shape, stats, recompute="selective")
    layer_terms = base.hardware_total - base.hardware_terms["logits"]
    assert 3 * (full.hardware_total - base.hardware_total) == layer_terms
    assert 3 * (selective.hardware_total - base.hardware_total) == base.hardware_terms["core_attention"]
    assert full.total == selective.total == base.total


@given(model_shapes(moe=True, window=False, mtp=False), packs())
def test_moe_layer_freq_int_equals_its_explicit_list(shape, pack):
    assume(isinstance(shape.moe_layer_freq, int))
    f = shape.moe_layer_freq
    listed = dataclasses.replace(
        shape, moe_layer_freq=[1 if i % f == 0 else 0 for i in range(shape.num_layers)]
    )
    stats = seqlen_stats(pack.cu_seqlens())
    assert training_flops(listed, stats).terms == training_flops(shape, stats).terms


# ---------------------------------------------------------------- examples


def test_moe_example_counts_routed_and_shared_experts_per_moe_layer():
    shape = ModelShape(
        num_layers=4, hidden_size=8, ffn_hidden_size=32, num_attention_heads=2, vocab_size=10,
        num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=6,
        moe_shared_expert_intermediate_size=5, moe_layer_freq=[0, 1, 1, 0], gated_linear_unit=True,
    )  # fmt: skip
    terms = training_flops(shape, SeqlenStats.dense(1, 3)).terms
    tokens = 3
    assert terms["moe"] == 3 * tokens * 2 * 2 * (8 * 6 * 2 * 3 + 8 * 5 * 3)  # 2 MoE layers
    assert terms["mlp"] == 3 * tokens * 2 * 2 * 8 * 32 * 3  # 2 dense layers


def test_mtp_layers_repeat_the_last_layer_kind_and_add_their_projection():
    shape = ModelShape(
        num_layers=2, hidden_size=4, num_attention_heads=1, vocab_size=3, ffn_hidden_size=8, mtp_num_layers=1
    )
    terms = training_flops(shape, SeqlenStats.dense(1, 1)).terms
    assert terms["mtp"] == 3 * 2 * (3 * 4 + 2 * 4 * 4)
    assert terms["mlp"] == 3 * 2 * 3 * 4 * 8 * 2  # 2 layers + 1 MTP layer, not gated
    assert terms["logits"] == 3 * 2 * 4 * 3 * 2


def test_model_flops_use_real_tokens_and_hardware_flops_padded_ones():
    shape = ModelShape(num_layers=1, hidden_size=4, num_attention_heads=1, vocab_size=2, ffn_hidden_size=4)
    stats = seqlen_stats(torch.tensor([0, 3, 5]), torch.tensor([0, 4, 8]), pack_len=10)
    result = training_flops(shape, stats)
    per_token_mlp = 3 * 2 * 4 * 4 * 2
    assert result.terms["mlp"] == 5 * per_token_mlp and result.hardware_terms["mlp"] == 10 * per_token_mlp
    q = 4
    assert result.terms["core_attention"] == 3 * 2 * q * (9 + 4)
    assert result.hardware_terms["core_attention"] == 3 * 2 * q * (16 + 16)


def test_gqa_counts_fewer_projection_flops_than_mha():
    mha = ModelShape(num_layers=1, hidden_size=64, num_attention_heads=8, vocab_size=8)
    gqa = dataclasses.replace(mha, num_query_groups=2)
    stats = SeqlenStats.dense(1, 16)
    h, q, k = 64, 64, 16
    assert training_flops(gqa, stats).terms["attention_projections"] == 3 * 2 * 16 * (h * (q + 2 * k) + q * h)
    assert training_flops(gqa, stats).total < training_flops(mha, stats).total


def test_stats_computed_without_the_shapes_window_are_refused():
    shape = ModelShape(num_layers=1, hidden_size=4, num_attention_heads=1, vocab_size=2, window_size=8)
    with pytest.raises(ValueError, match=r"window_size=\(8, 0\)"):
        training_flops(shape, SeqlenStats.dense(1, 16))


def test_unknown_recompute_mode_is_refused():
    shape = ModelShape(num_layers=1, hidden_size=4, num_attention_heads=1, vocab_size=2)
    with pytest.raises(ValueError, match="recompute"):
        training_flops(shape, SeqlenStats.dense(1, 4), recompute="some")


def test_arguments_of_the_wrong_kind_are_refused_naming_the_argument():
    shape = ModelShape(num_layers=1, hidden_size=4, num_attention_heads=1, vocab_size=2)
    with pytest.raises(ValueError, match=r"^training_flops: stats must be a SeqlenStats"):
        training_flops(shape, torch.tensor([0, 4]))
    with pytest.raises(ValueError, match=r"^training_flops: shape must be a ModelShape, got dict"):
        training_flops({"num_layers": 1}, SeqlenStats.dense(1, 4))


def test_model_shape_resolves_megatron_defaults():
    shape = ModelShape(
        num_layers=2, hidden_size=64, num_attention_heads=8, vocab_size=100, moe_layer_freq=[1, 0]
    )
    assert (shape.ffn_hidden_size, shape.num_query_groups, shape.kv_channels) == (256, 8, 8)
    assert shape.mtp_num_layers == 0 and shape.moe_layer_freq == (1, 0) and shape.window_size is None
    hash(shape)  # frozen and hashable


_BASE = {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 8, "vocab_size": 100}


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"num_layers": 0}, "num_layers"),
        ({"hidden_size": -1}, "hidden_size"),
        ({"num_attention_heads": 0}, "num_attention_heads"),
        ({"vocab_size": 2.5}, "vocab_size"),
        ({"ffn_hidden_size": 0}, "ffn_hidden_size"),
        ({"num_query_groups": 3}, "num_query_groups"),
        ({"num_query_groups": 0}, "num_query_groups"),
        ({"kv_channels": 0}, "kv_channels"),
        ({"hidden_size": 60}, "kv_channels"),
        ({"num_layers": True}, "num_layers"),
        ({"num_moe_experts": 0}, "num_moe_experts"),
        ({"num_moe_experts": 4, "moe_router_topk": 5}, "moe_router_topk"),
        ({"num_moe_experts": 4, "moe_layer_freq": [1, 0, 1]}, "moe_layer_freq"),
        ({"num_moe_experts": 4, "moe_layer_freq": [1, 2]}, "moe_layer_freq"),
        ({"num_moe_experts": 4, "moe_layer_freq": 0}, "moe_layer_freq"),
        ({"num_moe_experts": 4, "moe_ffn_hidden_size": -4}, "moe_ffn_hidden_size"),
        (
            {"num_moe_experts": 4, "moe_shared_expert_intermediate_size": -1},
            "moe_shared_expert_intermediate_size",
        ),
        ({"mtp_num_layers": -1}, "mtp_num_layers"),
        ({"window_size": (-3, 0)}, "window_size"),
        ({"window_attn_skip_freq": 0}, "window_attn_skip_freq"),
        ({"window_attn_skip_freq": [1, 0, 1]}, "window_attn_skip_freq"),
        ({"causal": "yes"}, "causal"),
    ],
)
def test_invalid_shapes_raise_value_error_naming_the_field(overrides, field):
    with pytest.raises(ValueError, match=field):
        ModelShape(**{**_BASE, **overrides})


def test_from_megatron_reads_a_real_transformer_config():
    skips.require_megatron()
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(
        num_layers=4,
        hidden_size=64,
        num_attention_heads=8,
        num_query_groups=2,
        ffn_hidden_size=160,
        gated_linear_unit=True,
        num_moe_experts=4,
        moe_router_topk=2,
        moe_ffn_hidden_size=48,
        moe_shared_expert_intermediate_size=32,
        moe_layer_freq=[0, 1, 1, 1],
        mtp_num_layers=1,
        window_size=(16, 0),
        window_attn_skip_freq=[1, 1, 0, 1],
        add_bias_linear=False,
    )
    shape = ModelShape.from_megatron(config, vocab_size=128)
    assert (shape.num_layers, shape.hidden_size, shape.num_attention_heads) == (4, 64, 8)
    assert (shape.num_query_groups, shape.kv_channels, shape.ffn_hidden_size) == (2, 8, 160)
    assert shape.gated_linear_unit and shape.vocab_size == 128
    assert (shape.num_moe_experts, shape.moe_router_topk, shape.moe_ffn_hidden_size) == (4, 2, 48)
    assert shape.moe_shared_expert_intermediate_size == 32 and shape.moe_layer_freq == (0, 1, 1, 1)
    assert shape.mtp_num_layers == 1 and shape.window_size == (16, 0) and shape.causal
    assert shape.window_attn_skip_freq == (1, 1, 0, 1)

    dense = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4)
    dense_shape = ModelShape.from_megatron(dense, vocab_size=64)
    # megatron-core resolves its own defaults; both must agree.
    assert dense_shape.ffn_hidden_size == dense.ffn_hidden_size == 128
    assert dense_shape.kv_channels == dense.kv_channels == 8
    assert dense_shape.num_query_groups == 4


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        # What the kit does not model yet raises, naming the field, instead of a wrong count.
        ({"experimental_attention_variant": "some_new_variant"}, "experimental_attention_variant"),
        ({"is_hybrid_model": True}, "is_hybrid_model"),
        ({"heterogeneous_block_specs": True}, "heterogeneous_block_specs"),
    ],
)
def test_from_megatron_refuses_what_it_does_not_model_naming_the_field(overrides, field):
    config = SimpleNamespace(num_layers=1, hidden_size=8, num_attention_heads=1, **overrides)
    with pytest.raises(ValueError, match=field):
        ModelShape.from_megatron(config, vocab_size=8)


def test_from_megatron_names_a_field_of_a_newer_release_set_away_from_its_default():
    skips.require_megatron()
    from megatron.core.transformer.transformer_config import TransformerConfig

    # A release newer than the kit knows: a real TransformerConfig with one more field.
    @dataclasses.dataclass
    class NewerConfig(TransformerConfig):
        sparse_mixer_heads: int = 0

    plain = NewerConfig(num_layers=2, hidden_size=32, num_attention_heads=4)
    assert ModelShape.from_megatron(plain, vocab_size=64).num_layers == 2  # at its default: harmless
    newer = NewerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, sparse_mixer_heads=3)
    with pytest.raises(
        ValueError, match=r"NewerConfig\.sparse_mixer_heads = 3: a field .* does not understand"
    ):
        ModelShape.from_megatron(newer, vocab_size=64)


def test_the_known_fields_cover_every_field_of_the_installed_megatron_core():
    skips.require_megatron()
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    from accounting.megatron_config import KNOWN_FIELDS

    missing = {f.name for f in dataclasses.fields(MLATransformerConfig)} - KNOWN_FIELDS
    assert not missing


def test_a_new_last_layer_changes_what_the_mtp_layers_copy():
    # Why the monotonicity property above inserts its new layer before the last one: MTP layers
    # repeat the last layer's kind, so a windowed new last layer makes the MTP layer windowed too.
    shape = ModelShape(
        num_layers=1,
        hidden_size=16,
        num_attention_heads=4,
        vocab_size=64,
        ffn_hidden_size=32,
        mtp_num_layers=1,
        window_size=(0, 0),
        window_attn_skip_freq=(0,),
        causal=False,
    )
    stats = seqlen_stats(torch.tensor([0, 55]), window_size=shape.window_size)
    appended = dataclasses.replace(shape, num_layers=2, window_attn_skip_freq=(0, 1))
    inserted = dataclasses.replace(shape, num_layers=2, window_attn_skip_freq=(1, 0))
    full_pairs = 55 * 55  # causal=False: every pair, for the full layer and its MTP copy
    core = training_flops(shape, stats).terms["core_attention"]
    assert training_flops(appended, stats).terms["core_attention"] < core  # the MTP layer got windowed
    assert training_flops(inserted, stats).terms["core_attention"] > core
    assert core % full_pairs == 0
