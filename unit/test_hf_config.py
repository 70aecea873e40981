"""ModelShape.from_hf_config: the presets' published configs give the presets; other families
give the shapes their configs describe; anything that may change the FLOPs and is not understood
is refused with one line naming it (a ValueError; exit 2 on the command line).

unit/data/hf_configs/<preset>.json are copies of the published config.json of each preset's
model (the repositories the presets name), written from the published values; one value JSON
cannot hold is replaced: Nemotron-H's `time_step_limit` upper bound `Infinity` is null here
(a Mamba initialisation bound, which changes no FLOPs). gpt3-175b has no published config.json
(GPT-3 was never released); llama3-70b-lora is llama3-70b's shape. Qwen3-Next-80B-A3B's published
file has no MTP key: it reads with no MTP layer, as Qwen3NextConfig reads it, and the preset adds
the model card's one MTP layer (`PRESET_OVERRIDES`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from accounting import ModelShape, SeqlenStats, training_flops
from accounting.presets import PRESETS

pytestmark = pytest.mark.L0

DATA = Path(__file__).parent / "data" / "hf_configs"
# DeepSeek-V3.2's indexer training is a training choice (the preset's: the sparse KL loss).
CALLER = {"deepseek-v3.2": {"dsa_indexer_loss_coeff": 1.0, "dsa_indexer_use_sparse_loss": True}}
WITHOUT_CONFIG = {"gpt3-175b", "llama3-70b-lora"}
# What a preset counts beyond its published config.json (docs/accounting.md says so beside it).
PRESET_OVERRIDES = {"qwen3-next-80b-a3b": {"mtp_num_layers": 1}}


def test_every_preset_but_gpt3_has_its_published_config():
    assert {p.stem for p in DATA.glob("*.json")} == set(PRESETS) - WITHOUT_CONFIG


@pytest.mark.parametrize("name", sorted(set(PRESETS) - WITHOUT_CONFIG))
def test_published_config_gives_the_preset(name):
    extra = {**CALLER.get(name, {}), **PRESET_OVERRIDES.get(name, {})}
    shape = ModelShape.from_hf_config(DATA / f"{name}.json", **extra)
    assert shape == PRESETS[name]
    stats = SeqlenStats.dense(1, 4096)
    if shape.stats_window is None:
        assert training_flops(shape, stats).total == training_flops(PRESETS[name], stats).total


def test_a_dict_is_read_like_a_file():
    config = json.loads((DATA / "llama3-8b.json").read_text())
    assert ModelShape.from_hf_config(config) == PRESETS["llama3-8b"]


def llama(**fields) -> dict:
    base = {
        "model_type": "llama", "num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 96,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256, "rope_theta": 1e4,
    }  # fmt: skip
    base.update(fields)
    return base


def test_missing_head_dim_is_hidden_over_heads_and_a_given_one_wins():
    assert ModelShape.from_hf_config(llama()).kv_channels == 16
    assert ModelShape.from_hf_config(llama(head_dim=32)).kv_channels == 32


def test_mixtral_is_every_layer_moe_with_experts_of_intermediate_size():
    # mistralai/Mixtral-8x7B-v0.1 config.json.
    config = {
        "model_type": "mixtral", "architectures": ["MixtralForCausalLM"], "hidden_size": 4096,
        "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
        "num_key_value_heads": 8, "num_local_experts": 8, "num_experts_per_tok": 2, "vocab_size": 32000,
        "sliding_window": None, "rope_theta": 1e6, "router_aux_loss_coef": 0.02, "tie_word_embeddings": False,
        "max_position_embeddings": 32768, "rms_norm_eps": 1e-5, "hidden_act": "silu", "output_router_logits": False,
    }  # fmt: skip
    want = ModelShape(
        num_layers=32, hidden_size=4096, ffn_hidden_size=14336, num_attention_heads=32, num_query_groups=8,
        vocab_size=32000, gated_linear_unit=True, num_moe_experts=8, moe_router_topk=2, moe_ffn_hidden_size=14336,
    )  # fmt: skip
    assert ModelShape.from_hf_config(config) == want


def test_mistral_sliding_window_of_w_sees_w_keys():
    # mistralai/Mistral-7B-v0.1: sliding_window 4096 on every layer; a query sees itself and the
    # 4095 keys before it.
    shape = ModelShape.from_hf_config(llama(model_type="mistral", sliding_window=4096))
    assert shape.window_size == (4095, 0) and shape.window_layer_pattern == (1, 1)
    assert ModelShape.from_hf_config(llama(model_type="mistral", sliding_window=None)).window_size is None


def test_gemma2_slides_on_even_layers_and_gemma3_follows_layer_types():
    gemma2 = llama(model_type="gemma2", num_hidden_layers=4, sliding_window=8, head_dim=32,
                   query_pre_attn_scalar=32, attn_logit_softcapping=50.0, final_logit_softcapping=30.0)  # fmt: skip
    shape = ModelShape.from_hf_config(gemma2)
    assert shape.window_size == (7, 0) and shape.window_layer_pattern == (1, 0, 1, 0)
    types = ["sliding_attention"] * 5 + ["full_attention"]
    gemma3 = llama(
        model_type="gemma3_text", num_hidden_layers=6, sliding_window=4, layer_types=types, head_dim=16
    )
    assert ModelShape.from_hf_config(gemma3).window_layer_pattern == (1, 1, 1, 1, 1, 0)


def test_qwen_sliding_window_starts_at_max_window_layers():
    config = llama(model_type="qwen2", num_hidden_layers=4, use_sliding_window=True, sliding_window=16,
                   max_window_layers=2)  # fmt: skip
    shape = ModelShape.from_hf_config(config)
    assert shape.window_size == (15, 0) and shape.window_layer_pattern == (0, 0, 1, 1)
    off = llama(model_type="qwen2", use_sliding_window=False, sliding_window=16, max_window_layers=2)
    assert ModelShape.from_hf_config(off).window_size is None


def test_qwen3_moe_mlp_only_layers_and_sparse_step_choose_the_moe_layers():
    config = llama(model_type="qwen3_moe", num_hidden_layers=4, num_experts=4, num_experts_per_tok=2,
                   moe_intermediate_size=32, decoder_sparse_step=2, mlp_only_layers=[3])  # fmt: skip
    assert ModelShape.from_hf_config(config).moe_layer_pattern == (0, 1, 0, 0)


def test_deepseek_v3_without_a_query_latent_reads_q_lora_rank_null():
    config = json.loads((DATA / "deepseek-v3.json").read_text())
    shape = ModelShape.from_hf_config({**config, "q_lora_rank": None})
    assert shape.q_lora_rank is None
    assert shape == dataclasses.replace(PRESETS["deepseek-v3"], q_lora_rank=None)


# ---------------------------------------------------------------- refusals, one line each


def _edited(name: str, **changes) -> dict:
    config = json.loads((DATA / f"{name}.json").read_text())
    for key, value in changes.items():
        if value is ...:
            del config[key]
        else:
            config[key] = value
    return config


@pytest.mark.parametrize(
    ("config", "message"),
    [
        (llama(model_type="gpt2"), "model_type 'gpt2' is not supported"),
        (llama(model_type=None), "model_type None is not supported"),
        (llama(attention_sink_size=4), "field 'attention_sink_size' (= 4) is not understood"),
        (
            llama(model_type="mistral", num_key_value_heads=..., sliding_window=None),
            "'num_key_value_heads' is missing",
        ),
        (llama(model_type="qwen3", head_dim=...), "field 'head_dim' is missing"),
        (llama(hidden_size=...), "field 'hidden_size' is missing"),
        (llama(intermediate_size="96"), "field intermediate_size = '96' must be an int"),
        (_edited("deepseek-v3", moe_layer_freq=2), "moe_layer_freq = 2"),
        (_edited("deepseek-v3", first_k_dense_replace=...), "'first_k_dense_replace' is missing"),
        (_edited("nemotron-h-8b", conv_kernel=3), "conv_kernel = 3"),
        (_edited("nemotron-h-8b", hybrid_override_pattern="ME" * 26), "only M, * and - layers"),
        (_edited("qwen3-next-80b-a3b", num_experts=...), "'num_experts' is missing"),
        (_edited("qwen3-next-80b-a3b", head_dim=...), "'head_dim' is missing"),
        (
            _edited("qwen3-30b-a3b", use_sliding_window=True, max_window_layers=0, sliding_window=...),
            "'sliding_window' is missing",
        ),
    ],
)
def test_what_may_change_the_flops_and_is_not_understood_is_refused(config, message):
    config = {k: v for k, v in config.items() if v is not ...}
    with pytest.raises(ValueError, match=r"^hf config ") as err:
        ModelShape.from_hf_config(config)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_deepseek_v32_needs_the_indexer_training_choice_from_the_caller():
    with pytest.raises(
        ValueError, match="needs dsa_indexer_loss_coeff, dsa_indexer_use_sparse_loss from the caller"
    ):
        ModelShape.from_hf_config(DATA / "deepseek-v3.2.json")


def test_missing_and_non_json_files_are_one_line_errors(tmp_path):
    with pytest.raises(ValueError, match="cannot read it"):
        ModelShape.from_hf_config(tmp_path / "nope.json")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ValueError, match="not JSON"):
        ModelShape.from_hf_config(tmp_path / "bad.json")
    (tmp_path / "list.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="expected a JSON object, got list"):
        ModelShape.from_hf_config(tmp_path / "list.json")


# ---------------------------------------------------------------- command line


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "accounting", *args], capture_output=True, text=True, check=False
    )


def test_cli_hf_config_gives_the_presets_numbers():
    by_file = run_cli(
        "flops", "--hf-config", str(DATA / "qwen3-30b-a3b.json"), "--docs", "3000,1096", "--json"
    )
    by_name = run_cli("flops", "--preset", "qwen3-30b-a3b", "--docs", "3000,1096", "--json")
    assert by_file.returncode == by_name.returncode == 0, by_file.stderr
    a, b = json.loads(by_file.stdout), json.loads(by_name.stdout)
    assert (a["model_flops"], a["hardware_flops"], a["terms"]) == (
        b["model_flops"],
        b["hardware_flops"],
        b["terms"],
    )
    assert a["hf_config"] == str(DATA / "qwen3-30b-a3b.json") and a["preset"] is None


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda d: d / "missing.json", "cannot read it"),
        (lambda d: (d / "x.json").write_text("nope") and d / "x.json", "not JSON"),
        (
            lambda d: (d / "y.json").write_text(json.dumps(llama(model_type="bert"))) and d / "y.json",
            "'bert'",
        ),
    ],
)
def test_cli_bad_config_files_are_one_line_with_exit_2(tmp_path, make, message):
    result = run_cli("flops", "--hf-config", str(make(tmp_path)), "--seq-len", "8")
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and message in result.stderr, result.stderr


def test_cli_preset_and_hf_config_are_exclusive():
    result = run_cli("flops", "--preset", "llama3-8b", "--hf-config", "x.json", "--seq-len", "8")
    assert result.returncode == 2 and "not allowed with" in result.stderr


def test_qwen3_next_layer_types_mark_the_linear_attention_layers():
    # With the model card's MTP layer, which the preset counts and the published file leaves out.
    config = {**json.loads((DATA / "qwen3-next-80b-a3b.json").read_text()), "mtp_num_hidden_layers": 1}
    types = ["linear_attention", "linear_attention", "linear_attention", "full_attention"] * 12
    assert ModelShape.from_hf_config({**config, "layer_types": types}) == PRESETS["qwen3-next-80b-a3b"]
    types[0] = "full_attention"  # a different pattern is read as a per-layer list
    # 35 linear layers; the last layer is full attention, so the MTP depth is too
    assert ModelShape.from_hf_config({**config, "layer_types": types}).linear_layers == 35
    with pytest.raises(ValueError, match="layer_types holds 'sliding_attention'"):
        ModelShape.from_hf_config({**config, "layer_types": ["sliding_attention"] * 48})


def test_deepseek_derived_head_dims_are_checked_not_trusted():
    config = json.loads((DATA / "deepseek-v3.json").read_text())
    assert ModelShape.from_hf_config({**config, "qk_head_dim": 192, "head_dim": 64}) == PRESETS["deepseek-v3"]
    with pytest.raises(ValueError, match="qk_head_dim = 128 disagrees"):
        ModelShape.from_hf_config({**config, "qk_head_dim": 128})


def test_gemma2_sliding_window_size_must_agree_with_sliding_window():
    config = llama(model_type="gemma2", sliding_window=8, sliding_window_size=8, head_dim=16)
    assert ModelShape.from_hf_config(config).window_size == (7, 0)
    with pytest.raises(ValueError, match="sliding_window_size = 16 differs"):
        ModelShape.from_hf_config({**config, "sliding_window_size": 16})


# ---- --hf-config reads through it -----------------------------------------------------------------


def _flops_cli(config: Path) -> subprocess.CompletedProcess[str]:
    # A timeout, not a hang: the old reader waited on a FIFO forever and read /dev/zero into memory.
    return subprocess.run(
        [sys.executable, "-m", "accounting", "flops", "--hf-config", str(config), "--seq-len", "8"],
        cwd=Path(__file__).resolve().parent.parent, capture_output=True, text=True, timeout=60,
    )  # fmt: skip


def test_hf_config_that_is_a_fifo_or_dev_zero_is_a_one_line_error(tmp_path: Path) -> None:
    fifo = tmp_path / "config.json"
    os.mkfifo(fifo)
    zero = tmp_path / "zero.json"
    zero.symlink_to("/dev/zero")
    for path in (fifo, zero):
        result = _flops_cli(path)
        assert result.returncode == 2, result.stderr
        assert "is not a regular file" in result.stderr and result.stderr.count("\n") == 1, result.stderr


def test_hf_config_with_nan_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    path.write_text('{"model_type": "llama", "hidden_size": NaN}')
    with pytest.raises(ValueError, match=r"^hf config .*NaN is not a JSON number"):
        ModelShape.from_hf_config(path)


# ---------------------------------------------------------------- derived and structural keys


def test_a_llama_without_num_key_value_heads_is_multi_head_as_llamaconfig_reads_it():
    without = llama(num_key_value_heads=...)
    without = {k: v for k, v in without.items() if v is not ...}
    assert ModelShape.from_hf_config(without) == ModelShape.from_hf_config(llama(num_key_value_heads=4))
    assert ModelShape.from_hf_config(llama(num_key_value_heads=None)).num_query_groups == 4
    published = json.loads((DATA / "llama3-8b.json").read_text())
    del published["num_key_value_heads"]
    assert ModelShape.from_hf_config(published) == dataclasses.replace(
        PRESETS["llama3-8b"], num_query_groups=32
    )


def test_the_same_llama_without_hidden_size_is_refused_naming_it():
    published = json.loads((DATA / "llama3-8b.json").read_text())
    for key in ("hidden_size", "num_hidden_layers", "intermediate_size", "vocab_size", "num_attention_heads"):
        config = {k: v for k, v in published.items() if k not in (key, "num_key_value_heads")}
        with pytest.raises(ValueError, match=rf"field '{key}' is missing .*LlamaConfig does not derive it"):
            ModelShape.from_hf_config(config)


def test_the_published_qwen3_next_config_reads_with_no_mtp_layer_as_its_class_reads_it():
    published = json.loads((DATA / "qwen3-next-80b-a3b.json").read_text())
    assert not any("mtp" in key for key in published)
    shape = ModelShape.from_hf_config(published)
    assert shape.mtp_num_layers == 0
    assert shape == dataclasses.replace(PRESETS["qwen3-next-80b-a3b"], mtp_num_layers=0)
    # A later Qwen release's key is read when present.
    assert (
        ModelShape.from_hf_config({**published, "mtp_num_hidden_layers": 1}) == PRESETS["qwen3-next-80b-a3b"]
    )


def test_deepseek_v3_without_an_mtp_key_has_no_mtp_layer_and_without_q_lora_rank_is_refused():
    config = _edited("deepseek-v3", num_nextn_predict_layers=...)
    assert ModelShape.from_hf_config(config).mtp_num_layers == 0
    with pytest.raises(ValueError, match="field 'q_lora_rank' is missing"):
        ModelShape.from_hf_config(_edited("deepseek-v3", q_lora_rank=...))


def test_mistral_without_sliding_window_is_refused_because_its_class_means_4096():
    config = llama(model_type="mistral")
    with pytest.raises(ValueError, match=r"field 'sliding_window' is missing .*MistralConfig"):
        ModelShape.from_hf_config(config)
    mixtral = llama(model_type="mixtral", num_local_experts=4, num_experts_per_tok=2)
    assert ModelShape.from_hf_config(mixtral).window_size is None  # MixtralConfig's default is null


def test_every_supported_type_has_a_row_naming_its_config_class():
    from accounting.hf_config import SUPPORTED_MODEL_TYPES
    from accounting.hf_derived import DERIVED

    assert set(DERIVED) == set(SUPPORTED_MODEL_TYPES)
    assert all(row.config_class.endswith("Config") for row in DERIVED.values())


def test_absent_tie_word_embeddings_is_the_classes_default():
    from accounting.hf_config import tied_embeddings

    assert tied_embeddings(llama()) is False  # LlamaConfig: tie_word_embeddings=False
    assert tied_embeddings(llama(model_type="gemma2")) is True  # Gemma2Config: True
    assert tied_embeddings(llama(tie_word_embeddings=True)) is True


# ---------------------------------------------------------------- bounds and booleans


@pytest.mark.parametrize(
    ("field", "value", "bound"),
    [
        ("num_hidden_layers", 300_000_000, "[1, 10000]"),  # took 2.5 GiB and 30 s
        ("num_hidden_layers", 10**11, "[1, 10000]"),  # a MemoryError traceback
        ("vocab_size", 10**41, "[1, 16777216]"),  # absurd output, silently
        ("hidden_size", 2**24 + 64, "[1, 16777216]"),
    ],
)
def test_a_count_past_any_published_model_is_a_one_line_error_naming_it(tmp_path, field, value, bound):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(llama(**{field: value})))
    result = _flops_cli(path)
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
    assert f"field {field} = {value} must be an int in {bound}" in result.stderr, result.stderr


def test_the_largest_layer_count_allowed_is_counted():
    shape = ModelShape.from_hf_config(llama(num_hidden_layers=10_000))
    two = ModelShape.from_hf_config(llama(num_hidden_layers=2))
    stats = SeqlenStats.dense(1, 8)
    # Every layer is the same: the layer terms scale by 5000, the logits stay.
    one_layer = (
        training_flops(two, stats).total
        - training_flops(ModelShape.from_hf_config(llama(num_hidden_layers=1)), stats).total
    )
    assert training_flops(shape, stats).total == training_flops(two, stats).total + 9_998 * one_layer


@pytest.mark.parametrize("value", ["false", 0, "true", 1])
def test_a_boolean_field_takes_json_true_or_false_only(value):
    from accounting.hf_config import tied_embeddings

    with pytest.raises(ValueError, match=r"field tie_word_embeddings = .* must be true or false"):
        tied_embeddings(llama(tie_word_embeddings=value))
    qwen = _edited("qwen3-30b-a3b", use_sliding_window=value)
    with pytest.raises(ValueError, match=r"field use_sliding_window = .* must be true or false"):
        ModelShape.from_hf_config(qwen)
    assert tied_embeddings(llama(tie_word_embeddings=False)) is False
    assert tied_embeddings(llama(tie_word_embeddings=True)) is True
