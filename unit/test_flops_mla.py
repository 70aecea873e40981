"""Multi-latent attention (MLA), a frozen base with a LoRA adapter: FLOPs against oracles re-derived
from the published definitions, and `ModelShape.from_megatron` on real megatron-core configs.

MLA (DeepSeek-V2, arXiv:2405.04434, §2.1.2-2.1.3; DeepSeek-V3 arXiv:2412.19437 §2.1.1): per token
and layer the weight matrices are W^DQ (h x d_c'), W^UQ (d_c' x n d_h), W^QR (d_c' x n d_R) (or,
without a query compression, W^Q (h x n d_h) and W^QR (h x n d_R)), W^DKV (h x d_c),
W^KR (h x d_R), W^UK (d_c x n d_h), W^UV (d_c x n d_v), W^O (n d_v x h). Each head scores a
(query, key) pair over d_h + d_R and mixes values of width d_v. LoRA (Hu et al. 2021, §4.1): a
rank-r adapter on W (d_in x d_out) adds A (d_in x r) and B (r x d_out).
"""

from __future__ import annotations

from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from accounting import LoraAdapter, ModelShape, SeqlenStats, training_flops
from megatron_testkit import skips
from unit.strategies import doc_lengths, pack_stats

pytestmark = pytest.mark.L0


@st.composite
def mla_shapes(draw) -> ModelShape:
    """A small MLA shape, with or without query compression, MoE (some dense layers) and MTP."""
    layers = draw(st.integers(1, 4))
    kwargs = {}
    if draw(st.booleans()):
        experts = draw(st.integers(2, 8))
        kwargs.update(
            num_moe_experts=experts,
            moe_router_topk=draw(st.integers(1, experts)),
            moe_ffn_hidden_size=draw(st.sampled_from([8, 24])),
            moe_shared_expert_intermediate_size=draw(st.sampled_from([None, 16])),
            moe_layer_freq=draw(st.lists(st.sampled_from([0, 1]), min_size=layers, max_size=layers)),
        )
    return ModelShape(
        num_layers=layers,
        hidden_size=draw(st.sampled_from([16, 32])),
        num_attention_heads=draw(st.sampled_from([1, 2, 4])),
        vocab_size=draw(st.sampled_from([64, 100])),
        ffn_hidden_size=draw(st.sampled_from([32, 48])),
        gated_linear_unit=draw(st.booleans()),
        mtp_num_layers=draw(st.sampled_from([None, 1, 2])),
        multi_latent_attention=True,
        q_lora_rank=draw(st.sampled_from([None, 8, 12])),
        kv_lora_rank=draw(st.sampled_from([4, 8])),
        qk_head_dim=draw(st.sampled_from([4, 8])),
        qk_pos_emb_head_dim=draw(st.sampled_from([2, 4])),
        v_head_dim=draw(st.sampled_from([4, 6])),
        **kwargs,
    )


def mla_weight_macs(s: ModelShape) -> int:
    """Multiply-adds per token of one MLA layer's weight matrices, one matrix at a time (paper order)."""
    h, n, dh, dr, dv, dc = (
        s.hidden_size,
        s.num_attention_heads,
        s.qk_head_dim,
        s.qk_pos_emb_head_dim,
        s.v_head_dim,
        s.kv_lora_rank,
    )
    if s.q_lora_rank is None:
        matrices = [(h, n * dh), (h, n * dr)]  # W^Q, W^QR
    else:
        matrices = [(h, s.q_lora_rank), (s.q_lora_rank, n * dh), (s.q_lora_rank, n * dr)]
    matrices += [(h, dc), (h, dr), (dc, n * dh), (dc, n * dv), (n * dv, h)]  # W^DKV W^KR W^UK W^UV W^O
    return sum(a * b for a, b in matrices)


def ffn_macs(s: ModelShape, moe_layer: bool) -> int:
    """Multiply-adds per token of one layer's MLP (dense) or MoE block (router, top-k routed + shared)."""
    mats = 3 if s.gated_linear_unit else 2  # gate, up, down  |  up, down
    if not moe_layer:
        return mats * s.hidden_size * s.ffn_hidden_size
    shared = s.moe_shared_expert_intermediate_size or 0
    router = s.hidden_size * s.num_moe_experts
    return mats * s.hidden_size * (s.moe_router_topk * s.moe_ffn_hidden_size + shared) + router


def oracle(s: ModelShape, lengths: list[int], frozen: bool = False) -> Fraction:
    """Training FLOPs of a pack from the definitions: 2 FLOPs per multiply-add; a trained weight
    runs forward, data gradient and weight gradient (3x), a frozen one forward and data gradient
    (2x); attention over s²/2 causal pairs per document (Megatron-LM's convention), always 3x.
    MTP depths repeat the last layer's kind, plus Megatron-LM's 2h x h projection and 3h term."""
    w = 2 if frozen else 3
    kinds = [bool(x) for x in (s.moe_layer_pattern if s.num_moe_experts else [0] * s.num_layers)]
    kinds += [kinds[-1]] * s.mtp_num_layers
    tokens = sum(lengths)
    per_token = sum(mla_weight_macs(s) + ffn_macs(s, k) for k in kinds)
    per_token += s.mtp_num_layers * (2 * s.hidden_size * s.hidden_size + 3 * s.hidden_size)
    per_token += s.hidden_size * s.vocab_size * (1 + s.mtp_num_layers)
    pair = s.num_attention_heads * (s.qk_head_dim + s.qk_pos_emb_head_dim + s.v_head_dim)
    pairs = sum(Fraction(x * x, 2) for x in lengths) * len(kinds)
    return w * 2 * per_token * tokens + 3 * 2 * pair * pairs


@given(mla_shapes(), doc_lengths(min_docs=1, max_docs=5, max_len=40), st.booleans())
@settings(max_examples=60)
def test_mla_training_flops_equal_the_matrix_by_matrix_oracle(shape, lengths, frozen):
    got = training_flops(shape, pack_stats(lengths), frozen_base=frozen)
    assert got.total == oracle(shape, lengths, frozen)
    assert got.terms["attention_projections"] == 0 and got.terms["mla_projections"] > 0


@given(mla_shapes(), doc_lengths(min_docs=1, max_docs=5, max_len=40))
@settings(max_examples=40)
def test_mla_model_flops_of_a_pack_equal_the_sum_of_its_documents_alone(shape, lengths):
    whole = training_flops(shape, pack_stats(lengths)).total
    assert whole == sum(training_flops(shape, SeqlenStats.dense(1, x)).total for x in lengths)


def test_mla_without_query_compression_projects_queries_directly():
    base = {
        "num_layers": 1,
        "hidden_size": 8,
        "num_attention_heads": 2,
        "vocab_size": 4,
        "multi_latent_attention": True,
        "kv_lora_rank": 3,
        "qk_head_dim": 2,
        "qk_pos_emb_head_dim": 1,
        "v_head_dim": 2,
    }
    direct = training_flops(ModelShape(**base), SeqlenStats.dense(1, 1)).terms["mla_projections"]
    lowrank = training_flops(ModelShape(**base, q_lora_rank=5), SeqlenStats.dense(1, 1)).terms[
        "mla_projections"
    ]
    # Per token, by hand: query 8*2*(2+1) = 48 vs 8*5 + 5*2*(2+1) = 70; kv 8*(3+1) + 3*2*(2+2) = 56;
    # output 2*2*8 = 32. 2 FLOPs per multiply-add, 3x for training.
    assert (direct, lowrank) == (6 * (48 + 56 + 32), 6 * (70 + 56 + 32))


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"kv_lora_rank": 0}, "kv_lora_rank"),
        ({"q_lora_rank": -1}, "q_lora_rank"),
        ({"v_head_dim": 1.5}, "v_head_dim"),
        ({"multi_latent_attention": False, "kv_lora_rank": 4}, "kv_lora_rank"),
        ({"attention_output_gate": True}, "attention_output_gate"),
    ],
)
def test_invalid_mla_shapes_name_the_field(overrides, field):
    base = {"num_layers": 1, "hidden_size": 8, "num_attention_heads": 2, "vocab_size": 4}
    with pytest.raises(ValueError, match=field):
        ModelShape(**{**base, "multi_latent_attention": True, **overrides})


def test_mla_fields_default_to_megatron_cores_mla_config_defaults():
    shape = ModelShape(
        num_layers=1, hidden_size=8, num_attention_heads=2, vocab_size=4, multi_latent_attention=True
    )
    assert (shape.q_lora_rank, shape.kv_lora_rank, shape.qk_head_dim) == (None, 512, 128)
    assert (shape.qk_pos_emb_head_dim, shape.v_head_dim) == (64, 128)


# ---------------------------------------------------------------- frozen base + LoRA adapter

DENSE = ModelShape(
    num_layers=3,
    hidden_size=32,
    num_attention_heads=4,
    num_query_groups=2,
    vocab_size=50,
    ffn_hidden_size=40,
    gated_linear_unit=True,
)


def dense_weight_macs(s: ModelShape) -> int:
    """Per token, all layers: q, k, v, o projections, the MLP, and the output layer."""
    h, q, kv = s.hidden_size, s.kv_channels * s.num_attention_heads, s.kv_channels * s.num_query_groups
    per_layer = h * q + 2 * h * kv + q * h + 3 * h * s.ffn_hidden_size
    return s.num_layers * per_layer + h * s.vocab_size


def lora_macs(s: ModelShape, rank: int, targets) -> int:
    """Per token: r (d_in + d_out) for each adapted matrix of each layer."""
    h, q, kv = s.hidden_size, s.kv_channels * s.num_attention_heads, s.kv_channels * s.num_query_groups
    dims = {
        "linear_qkv": (h, q + 2 * kv),
        "linear_proj": (q, h),
        "linear_fc1": (h, 2 * s.ffn_hidden_size),  # gate and up, fused
        "linear_fc2": (s.ffn_hidden_size, h),
    }
    return s.num_layers * sum(rank * (dims[t][0] + dims[t][1]) for t in targets)


@given(
    doc_lengths(min_docs=1, max_docs=5, max_len=40),
    st.integers(1, 16),
    st.lists(
        st.sampled_from(["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"]), min_size=1, unique=True
    ),
)
def test_a_frozen_base_drops_weight_gradients_and_the_adapter_trains(lengths, rank, targets):
    got = training_flops(
        DENSE, pack_stats(lengths), frozen_base=True, adapter=LoraAdapter(rank=rank, targets=targets)
    )
    tokens, pairs = sum(lengths), sum(Fraction(x * x, 2) for x in lengths)
    q = DENSE.kv_channels * DENSE.num_attention_heads
    core = 3 * 2 * (2 * q) * pairs * DENSE.num_layers  # QK^T and AV: 2q multiply-adds per pair, 3x
    assert got.terms["adapter"] == 3 * 2 * lora_macs(DENSE, rank, targets) * tokens
    assert got.total == 2 * 2 * dense_weight_macs(DENSE) * tokens + core + got.terms["adapter"]
    assert got.terms["core_attention"] == core


def test_without_an_adapter_shape_there_is_no_adapter_term_and_a_trained_base_is_unchanged():
    stats = SeqlenStats.dense(2, 16)
    assert training_flops(DENSE, stats, frozen_base=True).terms["adapter"] == 0
    assert training_flops(DENSE, stats).total == training_flops(DENSE, stats, frozen_base=False).total


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"rank": 0}, "rank"),
        ({"rank": 4, "targets": ("linear_q",)}, "targets"),
        ({"rank": 4, "targets": ()}, "targets"),
    ],
)
def test_invalid_adapters_name_the_field(kwargs, message):
    with pytest.raises(ValueError, match=message):
        LoraAdapter(**kwargs)


# ---------------------------------------------------------------- from real megatron-core configs


def _mla_config(**overrides):
    skips.require_megatron()
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    base = {
        "num_layers": 4,
        "hidden_size": 64,
        "num_attention_heads": 4,
        "ffn_hidden_size": 96,
        "gated_linear_unit": True,
        "q_lora_rank": 24,
        "kv_lora_rank": 16,
        "qk_head_dim": 8,
        "qk_pos_emb_head_dim": 4,
        "v_head_dim": 8,
        "num_moe_experts": 4,
        "moe_router_topk": 2,
        "moe_ffn_hidden_size": 16,
        "moe_shared_expert_intermediate_size": 16,
        "moe_layer_freq": [0, 1, 1, 1],
        "mtp_num_layers": 1,
        "add_bias_linear": False,
    }
    return MLATransformerConfig(**{**base, **overrides})


def test_from_megatron_reads_a_real_mla_config_with_moe_and_mtp():
    config = _mla_config()
    shape = ModelShape.from_megatron(config, vocab_size=128)
    assert shape.multi_latent_attention
    assert (shape.q_lora_rank, shape.kv_lora_rank, shape.qk_head_dim) == (24, 16, 8)
    assert (shape.qk_pos_emb_head_dim, shape.v_head_dim) == (4, 8)
    assert (shape.num_moe_experts, shape.moe_layer_freq, shape.mtp_num_layers) == (4, (0, 1, 1, 1), 1)
    assert training_flops(shape, SeqlenStats.dense(1, 10)).total == oracle(shape, [10])


def test_from_megatron_reads_a_direct_query_projection_as_q_lora_rank_none():
    shape = ModelShape.from_megatron(_mla_config(q_lora_rank=None), vocab_size=128)
    assert shape.q_lora_rank is None
    assert training_flops(shape, SeqlenStats.dense(1, 7)).total == oracle(shape, [7])


# ---------------------------------------------------------------- presets, through the CLI


def test_deepseek_v3_preset_activates_the_published_37b_parameters_per_token():
    # DeepSeek-V3 (arXiv:2412.19437, abstract): 37B activated parameters per token. Forward weight
    # FLOPs per token are 2 per activated weight; the input embedding (a lookup) adds h x vocab.
    import dataclasses

    from accounting.presets import preset

    main_model = dataclasses.replace(preset("deepseek-v3"), mtp_num_layers=0)
    terms = training_flops(main_model, SeqlenStats.dense(1, 1)).terms
    weights = sum(terms[t] for t in ("mla_projections", "mlp", "moe", "logits")) // 6
    assert round((weights + 7168 * 129280) / 1e9) == 37


def test_cli_prints_deepseek_v3_exact_flops_equal_to_the_oracle(capsys):
    from accounting.cli import main
    from accounting.presets import preset

    lengths = [4096, 2048, 1024, 1024]
    assert main(["flops", "--preset", "deepseek-v3", "--docs", ",".join(map(str, lengths))]) == 0
    out = capsys.readouterr().out
    assert f"model FLOPs (exact): {oracle(preset('deepseek-v3'), lengths)}" in out
    assert "mla_projections" in out and "attention_projections" not in out  # no term it lacks


def test_cli_lora_preset_counts_a_frozen_llama3_70b_and_its_rank_16_adapter(capsys):
    import json

    from accounting.cli import main

    assert main(["flops", "--preset", "llama3-70b-lora", "--docs", "3000,1000", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    h, q, kv, ffn, layers, vocab, r = 8192, 8192, 1024, 28672, 80, 128256, 16
    weights = layers * (h * q + 2 * h * kv + q * h + 3 * h * ffn) + h * vocab
    lora = layers * r * ((h + q + 2 * kv) + (q + h) + (h + 2 * ffn) + (ffn + h))
    core = 3 * 2 * (2 * q) * layers * Fraction(3000**2 + 1000**2, 2)
    assert data["frozen_base"] and data["adapter"]["rank"] == 16
    assert data["terms"]["adapter"] == 6 * lora * 4000
    assert data["model_flops"] == 4 * weights * 4000 + core + 6 * lora * 4000
