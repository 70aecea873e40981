"""memory_estimate: published parameter counts, sharding sums, the static-byte convention, the
activation formula per recompute mode, in-flight microbatches, and the `memory` command line.

The real-model check (parameters and static bytes of built megatron-core models) is
functional/test_memory_estimate.py.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from accounting import ModelShape
from accounting.cli import main
from accounting.presets import PRESETS
from accounting.stage_memory import ParallelLayout, memory_estimate, stage_layers

pytestmark = pytest.mark.L0


def one_rank(shape: ModelShape, **layout) -> int:
    return memory_estimate(shape, ParallelLayout(seq_len=8, **layout)).stages[0].params


# ---------------------------------------------------------------- parameters


@pytest.mark.parametrize(
    ("name", "published"),
    [
        # Exact counts of the published checkpoints (their safetensors' parameter totals).
        ("llama3-8b", 8_030_261_248),
        ("llama3-70b", 70_553_706_496),
    ],
)
def test_dense_presets_hold_exactly_the_published_parameter_count(name, published):
    assert one_rank(PRESETS[name]) == published


@pytest.mark.parametrize(
    ("name", "billions"),
    [
        ("gpt3-175b", 175),  # Brown et al. 2020, Table 2.1
        ("qwen3-30b-a3b", 30.5),  # model card: 30.5B in total
        ("qwen3-235b-a22b", 235),  # model card: 235B in total
        ("nemotron-h-8b", 8.1),  # 8B class; Megatron-Bridge's docs
        ("qwen3-next-80b-a3b", 81),  # 80B class
    ],
)
def test_presets_hold_their_published_size(name, billions):
    # Rounded to the published figure's digits (Qwen3's q/k norms, 2 x head_dim per layer, are
    # not a ModelShape field: 12,288 parameters in 30.5 billion).
    digits = 1 if billions != int(billions) else 0
    assert round(one_rank(PRESETS[name]) / 1e9, digits) == billions


def test_deepseek_v3_main_model_is_671b():
    # DeepSeek-V3's model card: 671B in the main model (MTP's 14B in the checkpoint includes its
    # own copies of the embedding and head, which Megatron-LM shares with the main model).
    shape = dataclasses.replace(PRESETS["deepseek-v3"], mtp_num_layers=0)
    assert round(one_rank(shape) / 1e9) == 671


def small(**fields) -> ModelShape:
    base = dict(num_layers=8, hidden_size=64, num_attention_heads=4, num_query_groups=2, vocab_size=256)
    base.update(fields)
    return ModelShape(gated_linear_unit=True, ffn_hidden_size=96, **base)


def layer_params(shape: ModelShape) -> int:
    """One SwiGLU GQA layer, written out: qkv, proj, three MLP matrices, two RMSNorms."""
    h, q, kv = (
        shape.hidden_size,
        shape.kv_channels * shape.num_attention_heads,
        shape.kv_channels * shape.num_query_groups,
    )
    return h * (q + 2 * kv) + q * h + 3 * h * shape.ffn_hidden_size + 2 * h


def test_stages_hold_their_layers_the_embedding_first_and_the_head_last():
    shape = small()
    rows = memory_estimate(shape, ParallelLayout(pp=4, seq_len=8)).stages
    h, v = 64, 256
    assert [r.params for r in rows] == [
        2 * layer_params(shape) + v * h,
        2 * layer_params(shape),
        2 * layer_params(shape),
        2 * layer_params(shape) + h + v * h,  # final norm and output layer
    ]


def test_virtual_chunks_go_round_robin_over_the_stages():
    # 8 layers, PP 2 x VPP 2: chunks of 2 layers; stage 0 holds chunks 0 and 2 (layers 0, 1, 4, 5).
    assert stage_layers(8, ParallelLayout(pp=2, vpp=2, seq_len=8)) == [[0, 1, 4, 5], [2, 3, 6, 7]]


@given(st.sampled_from([1, 2, 4, 8]), st.booleans())
@settings(max_examples=10)
def test_stages_sum_to_the_whole_model(pp, moe):
    shape = small(num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32) if moe else small()
    whole = one_rank(shape)
    assert sum(r.params for r in memory_estimate(shape, ParallelLayout(pp=pp, seq_len=8)).stages) == whole


def test_tensor_parallel_shards_linears_and_vocab_but_not_norms():
    shape = small()
    norms = 8 * 2 * 64 + 64
    sharded = one_rank(shape) - norms
    assert one_rank(shape, tp=2) == sharded // 2 + norms


def test_expert_parallel_splits_routed_experts_only():
    shape = small(
        num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32, moe_shared_expert_intermediate_size=16
    )
    one, two = (memory_estimate(shape, ParallelLayout(ep=ep, dp=2, seq_len=8)).stages[0] for ep in (1, 2))
    experts = 8 * 4 * 3 * 64 * 32  # 8 layers x 4 experts x 3 matrices of 64 x 32
    assert one.expert_params == experts and two.expert_params == experts // 2
    assert one.params - one.expert_params == two.params - two.expert_params  # router, shared: all ranks


def test_tied_embeddings_keep_one_copy_only_without_a_pipeline():
    shape = small()
    untied = one_rank(shape)
    assert (
        memory_estimate(shape, ParallelLayout(seq_len=8), tied_embeddings=True).stages[0].params
        == untied - 256 * 64
    )
    rows = memory_estimate(shape, ParallelLayout(pp=2, seq_len=8), tied_embeddings=True).stages
    assert sum(r.params for r in rows) == untied  # the last stage holds its own copy


# ---------------------------------------------------------------- static bytes


def test_static_bytes_are_megatron_lms_18_per_parameter():
    rows = memory_estimate(small(), ParallelLayout(pp=2, seq_len=8)).stages
    assert [r.static_bytes for r in rows] == [18 * r.params for r in rows]


def test_distributed_optimizer_shards_the_12_bytes_over_dp_times_cp():
    shape = small(num_layers=4, vocab_size=128)
    params = one_rank(shape)
    row = memory_estimate(shape, ParallelLayout(dp=4, cp=2, seq_len=8, distributed_optimizer=True)).stages[0]
    assert row.static_bytes == 6 * params + -(-12 * params // 8)


def test_expert_optimizer_state_shards_over_the_experts_own_data_parallel_ranks():
    shape = small(num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32)
    row = memory_estimate(shape, ParallelLayout(dp=4, ep=2, seq_len=8, distributed_optimizer=True)).stages[0]
    dense, experts = row.params - row.expert_params, row.expert_params
    assert row.static_bytes == 6 * row.params + -(-12 * dense // 4) + -(-12 * experts // 2)


def test_fp32_training_is_16_bytes_per_parameter():
    row = memory_estimate(small(), ParallelLayout(seq_len=8), precision="fp32").stages[0]
    assert row.static_bytes == 16 * row.params


# ---------------------------------------------------------------- activations


GPT = ModelShape(num_layers=4, hidden_size=1024, num_attention_heads=16, vocab_size=1024)  # GeLU MLP 4h


def test_activation_formula_per_recompute_mode_is_korthikantis():
    s, b, h, a, layers = 2048, 1, 1024, 16, 4
    logits = 4 * s * b * 1024
    for recompute, attention, per_layer in (
        ("selective", "fused", 34 * s * b * h),  # 34 sbh for a 4h GeLU MLP
        ("selective", "unfused", 34 * s * b * h),  # the scores are recomputed: none kept either way
        (None, "unfused", 34 * s * b * h + 5 * a * s * s * b),  # plus the attention scores
        (None, "fused", 34 * s * b * h + 4 * a * s * b),  # plus the fp32 softmax statistics instead
        ("full", "fused", 2 * s * b * h),  # each layer's input only
    ):
        layout = ParallelLayout(seq_len=s, recompute=recompute, attention=attention)
        row = memory_estimate(GPT, layout).stages[0]
        assert row.activation_bytes == layers * per_layer + logits, (recompute, attention)


def test_tensor_and_sequence_parallel_divide_the_activations():
    s, h, t = 2048, 1024, 4
    no_sp = memory_estimate(GPT, ParallelLayout(tp=t, seq_len=s, recompute="selective")).stages[0]
    sp = memory_estimate(
        GPT, ParallelLayout(tp=t, seq_len=s, recompute="selective", sequence_parallel=True)
    ).stages[0]
    logits = 4 * s * 1024 // t
    assert no_sp.activation_bytes == 4 * s * h * (10 + 24 // t) + logits  # Korthikanti's 10 + 24/t
    assert sp.activation_bytes == 4 * 34 * s * h // t + logits


def test_context_parallel_divides_the_sequence():
    one = memory_estimate(GPT, ParallelLayout(seq_len=4096, recompute="selective")).stages[0]
    two = memory_estimate(GPT, ParallelLayout(seq_len=4096, cp=2, dp=1, recompute="selective")).stages[0]
    assert two.activation_bytes * 2 == one.activation_bytes


def test_1f1b_stage_p_holds_pp_minus_p_microbatches_and_the_first_stage_the_peak():
    shape = dataclasses.replace(GPT, num_layers=8)
    rows = memory_estimate(shape, ParallelLayout(pp=4, seq_len=1024, recompute="selective")).stages
    per_layer = 34 * 1024 * 1024
    logits = 4 * 1024 * 1024
    assert [r.activation_bytes for r in rows] == [
        4 * 2 * per_layer,
        3 * 2 * per_layer,
        2 * 2 * per_layer,
        2 * per_layer + logits,
    ]
    assert memory_estimate(shape, ParallelLayout(pp=4, seq_len=1024)).max_stage == 0
    # With fewer microbatches than stages, no stage holds more than there are.
    few = memory_estimate(
        shape, ParallelLayout(pp=4, seq_len=1024, recompute="selective", num_microbatches=2)
    ).stages
    assert few[0].activation_bytes == 2 * 2 * per_layer


def test_interleaving_holds_megatron_lms_extra_share_on_the_first_stage():
    # Megatron-LM's theoretical memory: the first stage holds PP microbatches of its L/PP layers,
    # times 1 + (PP - 1) / (PP x VPP) under interleaving: here 16 x (1 + 3/8) = 22 layers' worth.
    shape = dataclasses.replace(GPT, num_layers=16)
    layout = ParallelLayout(pp=4, vpp=2, seq_len=1024, recompute="selective")
    row = memory_estimate(shape, layout).stages[0]
    assert row.activation_bytes == 22 * 34 * 1024 * 1024


# ---------------------------------------------------------------- errors


@pytest.mark.parametrize(
    ("layout", "message"),
    [
        (dict(seq_len=0), "seq_len"),
        (dict(seq_len=8, vpp=2), "vpp"),
        (dict(seq_len=8, ep=3, dp=2), "ep = 3"),
        (dict(seq_len=7, cp=2, dp=1), "divisible by cp"),
        (dict(seq_len=8, recompute="some"), "recompute"),
    ],
)
def test_bad_layouts_raise_naming_the_field(layout, message):
    with pytest.raises(ValueError, match=message):
        ParallelLayout(**layout)


def test_layers_must_split_evenly_over_the_chunks():
    with pytest.raises(ValueError, match="not divisible by pp x vpp"):
        memory_estimate(small(num_layers=6), ParallelLayout(pp=4, seq_len=8))


# ---------------------------------------------------------------- command line


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "accounting", *args], capture_output=True, text=True, check=False
    )


def test_memory_json_gives_every_stage_and_the_max(capsys):
    argv = ["memory", "--preset", "qwen3-30b-a3b", "--pp", "2", "--ep", "4", "--dp", "4", "--seq-len", "4096"]
    assert main([*argv, "--json", "--recompute", "selective", "--sequence-parallel"]) == 0
    data = json.loads(capsys.readouterr().out)
    want = memory_estimate(
        PRESETS["qwen3-30b-a3b"],
        ParallelLayout(pp=2, ep=4, dp=4, seq_len=4096, recompute="selective", sequence_parallel=True),
    )
    assert data == want.to_dict()
    assert set(data["stages"][0]) >= {"stage", "params", "static_bytes", "activation_bytes", "total_bytes"}


def test_memory_table_sets_the_peak_against_the_device(capsys):
    argv = ["memory", "--preset", "llama3-70b", "--tp", "8", "--pp", "4", "--vpp", "5", "--dp", "2"]
    assert (
        main(
            [
                *argv,
                "--seq-len",
                "8192",
                "--sequence-parallel",
                "--recompute",
                "selective",
                "--device-memory",
                "80GiB",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "max: stage 0" in out and "device memory 80.00 GiB: fits" in out
    assert main([*argv, "--seq-len", "8192", "--device-memory", "10GB"]) == 0
    assert "does not fit" in capsys.readouterr().out


def test_memory_reads_an_hf_config_and_its_tied_embeddings(tmp_path):
    config = {
        "model_type": "llama", "num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 96,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256, "tie_word_embeddings": True,
    }  # fmt: skip
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    result = run_cli("memory", "--hf-config", str(path), "--seq-len", "8", "--json")
    assert result.returncode == 0, result.stderr
    shape = small(num_layers=2)
    assert json.loads(result.stdout)["stages"][0]["params"] == 2 * layer_params(shape) + 64 + 256 * 64


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--preset", "llama3-8b", "--seq-len", "8", "--tp", "x"), "invalid int value"),
        (("--preset", "llama3-8b", "--seq-len", "8", "--device-memory", "lots"), "--device-memory 'lots'"),
        (("--preset", "deepseek-v3", "--seq-len", "8", "--pp", "8"), "not divisible by pp x vpp"),
        (("--preset", "llama3-8b", "--seq-len", "8", "--vpp", "2"), "vpp = 2"),
        (
            (
                "--seq-len",
                "8",
            ),
            "one of the arguments --preset --hf-config is required",
        ),
        (("--preset", "llama3-8b", "--hf-config", "x.json", "--seq-len", "8"), "not allowed with"),
    ],
)
def test_memory_bad_arguments_are_one_line_with_exit_2(args, message):
    result = run_cli("memory", *args)
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and message in result.stderr, result.stderr


def test_uneven_pipelines_take_megatrons_first_and_last_stage_layers():
    # DeepSeek-V3's 61 layers on 16 stages: 3 + 14 x 4 + 2.
    layout = ParallelLayout(pp=16, seq_len=8, first_stage_layers=3, last_stage_layers=2)
    layers = stage_layers(61, layout)
    assert [len(x) for x in layers] == [3] + [4] * 14 + [2]
    assert [i for stage in layers for i in stage] == list(range(61))
    assert [len(x) for x in stage_layers(10, ParallelLayout(pp=3, seq_len=8, first_stage_layers=2))] == [
        2,
        4,
        4,
    ]
    with pytest.raises(ValueError, match="do not split evenly over 14 stages"):
        stage_layers(60, layout)
    with pytest.raises(ValueError, match="needs pp >= 2 and no virtual pipeline"):
        ParallelLayout(pp=2, vpp=2, seq_len=8, first_stage_layers=1)


def test_memory_answers_for_deepseek_v3_on_an_uneven_pipeline(capsys):
    argv = ["memory", "--preset", "deepseek-v3", "--tp", "2", "--pp", "16", "--ep", "64", "--dp", "64"]
    argv += ["--first-stage-layers", "3", "--last-stage-layers", "2", "--seq-len", "4096", "--json"]
    assert main(argv) == 0
    data = json.loads(capsys.readouterr().out)
    assert len(data["stages"]) == 16
    # Every stage's parameters add up to the whole model on TP x EP ranks: experts / 64, the rest / 2
    # (norms and routers replicated): the sum over stages of one rank's routed experts is the whole
    # model's 58 + 1 (MTP) MoE layers x 256 experts x 3 x 7168 x 2048 / (64 x 2).
    experts = sum(row["expert_params"] for row in data["stages"])
    assert experts == 59 * 256 * 3 * 7168 * 2048 // (64 * 2)


# ---------------------------------------------------------------- attention, units, layouts

GiB = 2**30


def refused(capsys, *argv: str) -> str:
    """The one-line error of a command that must exit 2 (in process: cheaper than a subprocess)."""
    assert main(list(argv)) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    return err


def llama3_8b_tp2_sp_pp4(**extra) -> ParallelLayout:
    return ParallelLayout(tp=2, pp=4, seq_len=8192, sequence_parallel=True, **extra)


def test_llama3_8b_fits_80gib_with_fused_attention_and_the_unfused_option_keeps_the_scores():
    # The hand count of what stage 0 keeps with fused attention: 4 microbatches in flight (1F1B,
    # PP = 4) x 8 layers, each s*b*(18h + 6f)/t bytes with SP (Korthikanti's tensors: norms, QKV
    # input, Q, K, V, attention output, SwiGLU's three MLP tensors, two dropout masks), plus the
    # fp32 softmax statistics 4*a*s*b/t. The independent count of those tensors: 17-20 GiB.
    s, b, h, f, a, t = 8192, 1, 4096, 14336, 32, 2
    per_layer = s * b * (18 * h + 6 * f) // t + 4 * a * s * b // t
    fused = memory_estimate(PRESETS["llama3-8b"], llama3_8b_tp2_sp_pp4()).stages[0]
    assert fused.activation_bytes == 32 * per_layer
    assert 17 * GiB <= fused.activation_bytes <= 20 * GiB
    assert fused.total_bytes <= 80 * GiB
    # The unfused option is the former default: plus 5*a*s*s*b/t of scores per layer, 179.5 GiB.
    unfused = memory_estimate(PRESETS["llama3-8b"], llama3_8b_tp2_sp_pp4(attention="unfused")).stages[0]
    scores = 5 * a * s * s * b // t
    assert unfused.activation_bytes == 32 * (per_layer - 4 * a * s * b // t + scores)
    assert round(unfused.activation_bytes / GiB, 2) == 179.5


def test_memory_says_which_attention_it_assumed(capsys):
    argv = [
        "memory",
        "--preset",
        "llama3-8b",
        "--tp",
        "2",
        "--sequence-parallel",
        "--pp",
        "4",
        "--seq-len",
        "8192",
    ]
    assert main([*argv, "--device-memory", "80GiB"]) == 0
    out = capsys.readouterr().out
    assert "attention: fused" in out and "device memory 80.00 GiB: fits" in out
    assert main([*argv, "--device-memory", "80GiB", "--attention", "unfused"]) == 0
    out = capsys.readouterr().out
    assert "attention: unfused" in out and "does not fit (248.2% of it)" in out
    assert main([*argv, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["attention"] == "fused"


@pytest.mark.parametrize(
    ("text", "size"),
    [
        ("80GiB", 80 * 2**30),
        ("80GB", 80 * 10**9),
        ("81920MiB", 80 * 2**30),
        ("1.5TiB", 3 * 2**39),
        ("141 gb", 141 * 10**9),
        ("512B", 512),
    ],
)
def test_device_memory_takes_a_size_with_its_unit(text, size):
    from accounting.memory_cli import parse_size

    assert parse_size(text) == size


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("80", "--device-memory `80`: give a unit, for example `80GiB`"),
        ("80.5", "--device-memory `80.5`: give a unit, for example `80.5GiB`"),
        ("80GiBs", "unknown unit 'GiBs'"),
        ("0GiB", "out of range"),
        ("9000000000EB", "unknown unit"),
        ("8000000000TiB", "out of range"),
    ],
)
def test_a_bare_or_impossible_device_memory_is_refused(capsys, value, message):
    assert message in refused(
        capsys, "memory", "--preset", "llama3-8b", "--seq-len", "8", "--device-memory", value
    )


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--tp", "3"), "tp = 3 must divide num_attention_heads = 32"),
        (("--tp", "16"), "tp = 16 must divide num_query_groups = 8"),
        (
            ("--tp", "4", "--sequence-parallel", "--seq-len", "8190"),
            "tp = 4 must divide the sequence per CP rank",
        ),
        (("--cp", "2", "--seq-len", "8190"), "divisible by 2 x cp = 4"),
        (("--pp", "3"), "num_layers = 32 is not divisible by pp x vpp = 3"),
        (("--pp", "4", "--vpp", "3"), "num_layers = 32 is not divisible by pp x vpp = 12"),
    ],
)
def test_impossible_layouts_of_llama3_8b_are_refused_with_the_reason(capsys, args, message):
    argv = ["memory", "--preset", "llama3-8b", *args]
    if "--seq-len" not in args:
        argv += ["--seq-len", "8192"]
    assert message in refused(capsys, *argv)


def test_expert_and_expert_width_splits_are_checked():
    moe = small(num_moe_experts=6, moe_router_topk=2, moe_ffn_hidden_size=32)
    with pytest.raises(ValueError, match=r"^ep = 4 must divide num_moe_experts = 6 \("):
        memory_estimate(moe, ParallelLayout(ep=4, dp=4, seq_len=8))
    odd = ModelShape(num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=256, ffn_hidden_size=90)
    with pytest.raises(ValueError, match=r"^tp = 4 must divide ffn_hidden_size = 90 \("):
        memory_estimate(odd, ParallelLayout(tp=4, seq_len=8))
    experts = small(num_query_groups=4, num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=30)
    with pytest.raises(ValueError, match=r"^tp = 4 must divide moe_ffn_hidden_size = 30 \("):
        memory_estimate(experts, ParallelLayout(tp=4, seq_len=8))


def test_an_uneven_split_given_explicitly_is_accepted():
    # 32 layers over PP = 3 are refused evenly, accepted as 10 + 12 + 10.
    layout = ParallelLayout(pp=3, seq_len=8, first_stage_layers=10, last_stage_layers=10)
    assert [r.params > 0 for r in memory_estimate(PRESETS["llama3-8b"], layout).stages] == [True] * 3


@pytest.mark.parametrize(
    ("seq_len", "message"),
    [
        (str(10**23), "--seq-len 100000000000000000000000 is out of range: expected"),
        (str(2**32), "--seq-len: 4294967296 tokens in one pack; 4294967296**2 >= 2**63"),
    ],
)
def test_memory_takes_the_flops_commands_bounds(capsys, seq_len, message):
    for command in ("memory", "flops"):
        assert message in refused(capsys, command, "--preset", "llama3-8b", "--seq-len", seq_len), command
    big = refused(capsys, "memory", "--preset", "llama3-8b", "--seq-len", "8", "--dp", str(2**63))
    assert "--dp 9223372036854775808 is out of range" in big
