"""Reads a Hugging Face `config.json` into `ModelShape` fields, refusing what it cannot count.

Supported `model_type`s: llama, mistral, qwen2, qwen3 (dense, SwiGLU), qwen3_moe, mixtral,
deepseek_v3 (MLA, routed + shared experts, first dense layers, MTP), deepseek_v32 (plus the
lightning indexer), nemotron_h (Mamba-2 / attention / MLP pattern), qwen3_next (gated DeltaNet
hybrid with gated attention) and gemma2 / gemma3_text (sliding-window layers).

Every field of the file is accounted for: read into the shape, known not to change the FLOPs
(norm epsilons, RoPE settings, token ids, dropout, routing heuristics, dtypes...), or refused
with a ValueError naming it. An absent field is read as the model type's transformers config
class reads it (`accounting.hf_derived`): a *derived* field takes the value the class derives
(`num_key_value_heads` = `num_attention_heads` for Llama, `head_dim` = hidden_size /
num_attention_heads, no MTP key = no MTP layer); a *structural* one (the sizes: layers, widths,
heads, vocabulary, experts, and the constants a class holds for them) is refused, naming it.
`vocab_size` is taken as the embedding's row count (the published vocabularies are already
padded). An HF `sliding_window` of W lets a query see W keys, itself included (transformers'
mask: `kv_idx > q_idx - W`), i.e. `window_size = (W - 1, 0)`.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from accounting.hf_derived import DERIVED, tied_default
from accounting.json_input import load_json, printable

__all__ = [
    "SUPPORTED_MODEL_TYPES",
    "hf_shape_kwargs",
    "load_hf_config",
    "shape_kwargs_from_hf",
    "tied_embeddings",
]

# A config.json is a few kB; a whole tokenizer inlined in one is a few MB.
MAX_HF_CONFIG_BYTES = 16 * 2**20

# Fields of any model type that do not change what is counted (no GEMM, conv or scan).
_NEUTRAL = frozenset(
    """
    _name_or_path architectures auto_map transformers_version torch_dtype dtype model_type
    bos_token_id eos_token_id pad_token_id initializer_range rms_norm_eps layer_norm_epsilon
    norm_epsilon use_cache rope_theta rope_scaling rope_parameters rope_interleave partial_rotary_factor
    max_position_embeddings original_max_position_embeddings attention_dropout hidden_dropout
    hidden_act hidden_activation attention_bias mlp_bias pretraining_tp tie_word_embeddings
    output_router_logits router_aux_loss_coef router_jitter_noise norm_topk_prob use_return_dict
    output_attentions output_hidden_states quantization_config num_logits_to_keep
    """.split()  # noqa: SIM905 (one name per word reads better than quoted strings)
)
# Per model type, further fields known not to change the counted FLOPs.
_NEUTRAL_BY_TYPE = {
    "qwen2": {"max_window_layers", "sliding_window"},
    "qwen3": {"max_window_layers", "sliding_window"},
    "qwen3_moe": {"max_window_layers", "sliding_window"},
    "deepseek_v3": {
        "n_group", "topk_group", "topk_method", "scoring_func", "routed_scaling_factor",
        "aux_loss_alpha", "seq_aux", "ep_size", "num_key_value_heads", "moe_layer_freq",
    },
    "nemotron_h": {
        "chunk_size", "mamba_hidden_act", "mamba_proj_bias", "mamba_conv_bias", "use_bias",
        "use_conv_bias", "mlp_hidden_act", "residual_in_fp32", "rescale_prenorm_residual",
        "time_step_min", "time_step_max", "time_step_floor", "time_step_limit", "time_step_rank",
        "mamba_chunk_size", "layer_types", "use_mamba_kernels",
    },
    "qwen3_next": {"mtp_use_dedicated_embeddings", "layer_types", "sliding_window", "max_window_layers"},
    "gemma2": {"query_pre_attn_scalar", "attn_logit_softcapping", "final_logit_softcapping",
               "cache_implementation", "layer_types", "sliding_window"},
    "gemma3_text": {"query_pre_attn_scalar", "attn_logit_softcapping", "final_logit_softcapping",
                    "cache_implementation", "layer_types", "sliding_window", "sliding_window_pattern",
                    "rope_local_base_freq", "use_bidirectional_attention"},
}  # fmt: skip
_NEUTRAL_BY_TYPE["deepseek_v32"] = _NEUTRAL_BY_TYPE["deepseek_v3"]
_NEUTRAL_BY_TYPE["mistral"] = {"sliding_window"}
_NEUTRAL_BY_TYPE["mixtral"] = {"sliding_window"}


# Ceilings on a config's counts, far above any published model, so that a crafted file cannot
# make the count's per-layer patterns take unbounded memory and time (3e8 layers took 2.5 GiB and
# 30 s; 1e11 a MemoryError): 10,000 layers (the largest published: 126), 2**24 for every other
# count (vocabularies of 256k, widths and FFNs of 10^5, context windows of 10^6 and 10^7 fit).
_MAXIMA = {"num_hidden_layers": 10_000}
MAX_FIELD = 2**24


class _Fields:
    """The config's fields, with a record of which ones were read and its type's derived keys."""

    def __init__(self, config: Mapping[str, Any], source: str) -> None:
        self.config, self.source, self.read = config, source, set()
        self.derived = DERIVED[config["model_type"]]

    def error(self, message: str) -> ValueError:
        return ValueError(f"hf config {self.source}: {message}")

    def get(self, name: str, default: Any = None) -> Any:
        self.read.add(name)
        return self.config.get(name, default)

    def missing(self, name: str) -> ValueError:
        return self.error(
            f"field {name!r} is missing (it changes the FLOPs, and {self.derived.config_class} does not "
            "derive it from the other fields: a file without it is truncated or misspelt)"
        )

    def derives(self, name: str) -> bool:
        """Whether `name` is absent (or null) where its config class derives it."""
        rule = self.derived.keys.get(name)
        if rule is None:
            return False
        if name not in self.config:
            return rule.absent
        return self.config[name] is None and rule.null

    def flag(self, name: str) -> bool:
        """A boolean field (absent or null: False); JSON ``true``/``false`` only, else refused
        naming it: the string ``"false"`` is truthy, and read as Python reads it, it meant true."""
        value = self.get(name)
        if value is None:
            return False
        if not isinstance(value, bool):
            raise self.error(f"field {name} = {value!r} must be true or false")
        return value

    def int(self, name: str, *, minimum: int = 1) -> int:
        """An int field: given, or derived as its config class derives it; else refused, naming it."""
        if self.derives(name):
            self.read.add(name)
            try:
                return self.derived.keys[name].value(lambda other: self.int(other), self.config)
            except ValueError as err:
                raise self.error(str(err)) from None
        if name not in self.config:
            raise self.missing(name)
        value = self.get(name)
        maximum = _MAXIMA.get(name, MAX_FIELD)
        if isinstance(value, bool) or not isinstance(value, int) or not minimum <= value <= maximum:
            raise self.error(
                f"field {name} = {printable(repr(value), 80)} must be an int in [{minimum}, {maximum}]"
            )
        return value

    def unread(self, neutral: set[str]) -> None:
        """Refuses the first field neither read nor known to leave the FLOPs unchanged."""
        for name in self.config:
            if name not in self.read and name not in _NEUTRAL and name not in neutral:
                raise self.error(
                    f"field {name!r} (= {self.config[name]!r}) is not understood for model_type "
                    f"{self.config['model_type']!r}; it may change the FLOPs"
                )


def _attention(f: _Fields) -> dict[str, Any]:
    """Layers, widths, grouped-query attention and vocabulary common to every supported type."""
    heads = f.int("num_attention_heads")
    return {  # in this order: a missing structural field is named before a derived one fails
        "num_layers": f.int("num_hidden_layers"),
        "hidden_size": f.int("hidden_size"),
        "num_attention_heads": heads,
        "num_query_groups": f.int("num_key_value_heads"),
        "kv_channels": f.int("head_dim"),
        "vocab_size": f.int("vocab_size"),
    }


def _window_pattern(
    f: _Fields, layers: int, default: Callable[[int], bool], marked: str = "sliding_attention"
) -> tuple[int, ...]:
    """1 per `marked` layer (sliding window, or linear attention) from `layer_types`, else from
    the model type's own rule; the other layers must be "full_attention"."""
    types = f.get("layer_types")
    if types is None:
        return tuple(int(default(i)) for i in range(layers))
    if not isinstance(types, list) or len(types) != layers:
        raise f.error(f"field layer_types must list one entry per layer ({layers}), got {types!r}")
    bad = [t for t in types if t not in (marked, "full_attention")]
    if bad:
        raise f.error(f"field layer_types holds {bad[0]!r}, not {marked!r} or 'full_attention'")
    return tuple(int(t == marked) for t in types)


def _window(f: _Fields, kwargs: dict[str, Any], pattern: tuple[int, ...]) -> None:
    """Sets window_size (W - 1 keys left) and the per-layer pattern, when any layer slides."""
    if not any(pattern):
        return
    width = f.int("sliding_window")
    kwargs["window_size"] = (width - 1, 0)
    if not all(pattern):
        kwargs["window_attn_skip_freq"] = pattern


def _dense(f: _Fields) -> dict[str, Any]:
    """Llama, Mistral, Qwen2, Qwen3: GQA attention and a SwiGLU MLP in every layer."""
    kwargs = _attention(f)
    kwargs.update(ffn_hidden_size=f.int("intermediate_size"), gated_linear_unit=True)
    _sliding(f, kwargs)
    return kwargs


def _sliding(f: _Fields, kwargs: dict[str, Any]) -> None:
    """Mistral's window on every layer; Qwen's on the layers from `max_window_layers` on."""
    layers, kind = kwargs["num_layers"], f.config["model_type"]
    if kind in ("mistral", "mixtral"):
        if "sliding_window" not in f.config and not f.derives("sliding_window"):
            raise f.missing("sliding_window")  # MistralConfig's 4096 is a constant: null is no window
        on = f.config.get("sliding_window") is not None
        _window(f, kwargs, (int(on),) * layers)
    elif kind.startswith("qwen") and f.flag("use_sliding_window"):
        first = f.int("max_window_layers", minimum=0)
        _window(f, kwargs, _window_pattern(f, layers, lambda i: i >= first))


def _qwen_moe_pattern(f: _Fields, layers: int) -> int | tuple[int, ...]:
    """Qwen MoE: layer i is MoE unless listed in mlp_only_layers, when (i + 1) % decoder_sparse_step == 0."""
    step = f.int("decoder_sparse_step")
    dense = f.get("mlp_only_layers", [])
    if not isinstance(dense, list) or any(not isinstance(i, int) for i in dense):
        raise f.error(f"field mlp_only_layers = {dense!r} must be a list of layer indices")
    pattern = tuple(int(i not in dense and (i + 1) % step == 0) for i in range(layers))
    return 1 if all(pattern) else pattern  # every layer MoE: megatron's moe_layer_freq = 1


def _qwen3_moe(f: _Fields) -> dict[str, Any]:
    kwargs = _dense(f)
    kwargs.update(
        num_moe_experts=f.int("num_experts"),
        moe_router_topk=f.int("num_experts_per_tok"),
        moe_ffn_hidden_size=f.int("moe_intermediate_size"),
        moe_layer_freq=_qwen_moe_pattern(f, kwargs["num_layers"]),
    )
    return kwargs


def _mixtral(f: _Fields) -> dict[str, Any]:
    """Mixtral: every layer MoE, each expert a SwiGLU MLP of `intermediate_size`."""
    kwargs = _dense(f)
    kwargs.update(
        num_moe_experts=f.int("num_local_experts"),
        moe_router_topk=f.int("num_experts_per_tok"),
        moe_ffn_hidden_size=kwargs["ffn_hidden_size"],
    )
    return kwargs


def _deepseek_v3(f: _Fields) -> dict[str, Any]:
    """DeepSeek-V3: MLA; dense first layers, then routed + shared experts; MTP depths."""
    heads = f.int("num_attention_heads")
    layers = f.int("num_hidden_layers")
    dense = f.int("first_k_dense_replace", minimum=0)
    freq = f.config.get("moe_layer_freq", 1)
    if freq != 1:
        raise f.error(
            f"field moe_layer_freq = {freq!r}: only 1 (every layer after the dense ones) is modelled"
        )
    expert = f.int("moe_intermediate_size")
    nope, rope = f.int("qk_nope_head_dim"), f.int("qk_rope_head_dim")
    # Newer transformers save the derived qk_head_dim (nope + rope) and head_dim (rope): checked.
    for name, want in (("qk_head_dim", nope + rope), ("head_dim", rope)):
        if f.get(name, want) != want:
            raise f.error(
                f"field {name} = {f.config[name]!r} disagrees with qk_nope/qk_rope_head_dim ({want})"
            )
    return {
        "num_layers": layers,
        "hidden_size": f.int("hidden_size"),
        "num_attention_heads": heads,
        "vocab_size": f.int("vocab_size"),
        "ffn_hidden_size": f.int("intermediate_size"),
        "gated_linear_unit": True,
        "num_moe_experts": f.int("n_routed_experts"),
        "moe_router_topk": f.int("num_experts_per_tok"),
        "moe_ffn_hidden_size": expert,
        "moe_shared_expert_intermediate_size": f.int("n_shared_experts", minimum=0) * expert or None,
        "moe_layer_freq": tuple(int(i >= dense) for i in range(layers)),
        "mtp_num_layers": f.int("num_nextn_predict_layers", minimum=0),
        "multi_latent_attention": True,
        # null: a direct query projection; absent: refused (DeepseekV3Config's 1536 is a constant).
        "q_lora_rank": None if f.get("q_lora_rank", 0) is None else f.int("q_lora_rank"),
        "kv_lora_rank": f.int("kv_lora_rank"),
        "qk_head_dim": nope,
        "qk_pos_emb_head_dim": rope,
        "v_head_dim": f.int("v_head_dim"),
    }


def _deepseek_v32(f: _Fields) -> dict[str, Any]:
    """DeepSeek-V3.2: V3 plus the lightning indexer on every layer. How the indexer trains (its
    KL loss) is not in config.json: the caller passes dsa_indexer_loss_coeff (see `from_hf_config`)."""
    kwargs = _deepseek_v3(f)
    kwargs.update(
        experimental_attention_variant="dsa",
        dsa_indexer_n_heads=f.int("index_n_heads"),
        dsa_indexer_head_dim=f.int("index_head_dim"),
        dsa_indexer_topk=f.int("index_topk"),
    )
    return kwargs


def _nemotron_h(f: _Fields) -> dict[str, Any]:
    """Nemotron-H: megatron's hybrid alphabet in `hybrid_override_pattern` (M, *, -); squared-ReLU MLP."""
    pattern = f.get("hybrid_override_pattern")
    if not isinstance(pattern, str) or set(pattern) - set("M*-"):
        raise f.error(f"field hybrid_override_pattern = {pattern!r}: only M, * and - layers are modelled")
    kwargs = _attention(f)
    if kwargs["num_layers"] != len(pattern):
        raise f.error(f"num_hidden_layers = {kwargs['num_layers']} but the pattern has {len(pattern)} layers")
    if f.int("conv_kernel") != 4:
        raise f.error(f"field conv_kernel = {f.config['conv_kernel']!r}: megatron's Mamba-2 conv has width 4")
    if f.get("sliding_window") is not None:
        raise f.error(
            f"field sliding_window = {f.config['sliding_window']!r} in a hybrid model is not modelled"
        )
    if f.get("attention_head_dim", kwargs["kv_channels"]) != kwargs["kv_channels"]:
        raise f.error(f"field attention_head_dim = {f.config['attention_head_dim']!r} differs from head_dim")
    heads, head_dim = f.int("mamba_num_heads"), f.int("mamba_head_dim")
    expand = f.get("expand")
    if expand is not None and expand * kwargs["hidden_size"] != heads * head_dim:
        raise f.error(f"field expand = {expand!r} disagrees with mamba_num_heads x mamba_head_dim")
    kwargs.update(
        ffn_hidden_size=f.int("intermediate_size"),
        hybrid_pattern=pattern,
        mamba_num_heads=heads,
        mamba_head_dim=head_dim,
        mamba_state_dim=f.int("ssm_state_size"),
        mamba_num_groups=f.int("n_groups"),
    )
    return kwargs


def _qwen3_next(f: _Fields) -> dict[str, Any]:
    """Qwen3-Next: gated DeltaNet layers with gated attention every `full_attention_interval`; MoE."""
    kwargs = _attention(f)
    if f.flag("use_sliding_window"):
        raise f.error("field use_sliding_window = true in a gated-DeltaNet hybrid is not modelled")
    layers, interval = kwargs["num_layers"], f.int("full_attention_interval")
    linear = _window_pattern(f, layers, lambda i: (i + 1) % interval != 0, marked="linear_attention")
    kwargs.update(
        ffn_hidden_size=f.int("intermediate_size"),
        gated_linear_unit=True,
        attention_output_gate=True,
        num_moe_experts=f.int("num_experts"),
        moe_router_topk=f.int("num_experts_per_tok"),
        moe_ffn_hidden_size=f.int("moe_intermediate_size"),
        moe_shared_expert_intermediate_size=f.int("shared_expert_intermediate_size", minimum=0) or None,
        moe_layer_freq=_qwen_moe_pattern(f, layers),
        mtp_num_layers=f.int("mtp_num_hidden_layers", minimum=0),
        experimental_attention_variant="gated_delta_net",
        linear_attention_freq=interval if linear == _every(interval, layers) else linear,
        linear_key_head_dim=f.int("linear_key_head_dim"),
        linear_value_head_dim=f.int("linear_value_head_dim"),
        linear_num_key_heads=f.int("linear_num_key_heads"),
        linear_num_value_heads=f.int("linear_num_value_heads"),
        linear_conv_kernel_dim=f.int("linear_conv_kernel_dim"),
    )
    return kwargs


def _every(interval: int, layers: int) -> tuple[int, ...]:
    return tuple(int((i + 1) % interval != 0) for i in range(layers))


def _gemma(f: _Fields) -> dict[str, Any]:
    """Gemma 2 / 3: GeGLU MLP (3 matrices), sliding-window layers per `layer_types` or the type's rule."""
    kwargs = _attention(f)
    kwargs.update(ffn_hidden_size=f.int("intermediate_size"), gated_linear_unit=True)
    layers = kwargs["num_layers"]
    if f.get("sliding_window_size", f.config.get("sliding_window")) != f.config.get("sliding_window"):
        raise f.error(
            f"field sliding_window_size = {f.config['sliding_window_size']!r} differs from sliding_window"
        )
    if f.config["model_type"] == "gemma2":
        rule = lambda i: i % 2 == 0  # noqa: E731 (transformers' Gemma2: even layers slide)
    else:
        every = f.int("sliding_window_pattern") if "layer_types" not in f.config else 1
        rule = lambda i: (i + 1) % every != 0  # noqa: E731 (Gemma 3: every Nth layer is global)
    _window(f, kwargs, _window_pattern(f, layers, rule))
    return kwargs


_READERS: dict[str, Callable[[_Fields], dict[str, Any]]] = {
    "llama": _dense,
    "mistral": _dense,
    "qwen2": _dense,
    "qwen3": _dense,
    "qwen3_moe": _qwen3_moe,
    "mixtral": _mixtral,
    "deepseek_v3": _deepseek_v3,
    "deepseek_v32": _deepseek_v32,
    "nemotron_h": _nemotron_h,
    "qwen3_next": _qwen3_next,
    "gemma2": _gemma,
    "gemma3_text": _gemma,
}
SUPPORTED_MODEL_TYPES = tuple(sorted(_READERS))


def load_hf_config(source: str | os.PathLike[str] | Mapping[str, Any]) -> tuple[dict[str, Any], str]:
    """The config as a dict and a name for messages; ValueError (one line) for a missing or non-JSON file."""
    if isinstance(source, Mapping):
        return dict(source), "(dict)"
    path = Path(source)
    # Bounded and strict (a FIFO or /dev/zero is refused; no NaN): json_input's one-line errors.
    config = load_json(path, limit=MAX_HF_CONFIG_BYTES, what="hf config")
    if not isinstance(config, dict):
        raise ValueError(f"hf config {path}: expected a JSON object, got {type(config).__name__}")
    return config, str(path)


def shape_kwargs_from_hf(config: Mapping[str, Any], source: str = "(dict)") -> dict[str, Any]:
    """`ModelShape` keyword arguments for an HF config dict; ValueError naming what is refused."""
    kind = config.get("model_type")
    if kind not in _READERS:
        raise ValueError(
            f"hf config {source}: model_type {kind!r} is not supported "
            f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
        )
    fields = _Fields(config, source)
    kwargs = _READERS[kind](fields)
    fields.unread(_NEUTRAL_BY_TYPE.get(kind, set()))
    return kwargs


def tied_embeddings(config: Mapping[str, Any]) -> bool:
    """Whether the output layer shares the embedding's weight (`tie_word_embeddings`; when absent,
    the model type's config class default: False for Llama, True for Gemma, see `hf_derived`).

    It changes the parameter count, never the FLOPs (the output GEMM runs either way).
    """
    value = config.get("tie_word_embeddings")
    if value is None:
        return tied_default(str(config.get("model_type")))
    if not isinstance(value, bool):  # "false" is a truthy string: it would have counted as tied
        raise ValueError(
            f"hf config: field tie_word_embeddings = {printable(repr(value), 80)} must be true or false"
        )
    return value


# Training choices a config.json does not hold, which a model type needs from the caller.
_CALLER_FIELDS = {"deepseek_v32": ("dsa_indexer_loss_coeff", "dsa_indexer_use_sparse_loss")}


def hf_shape_kwargs(source: str | os.PathLike[str] | Mapping[str, Any], **overrides: Any) -> dict[str, Any]:
    """`ModelShape` keyword arguments for a config.json path or dict, with the caller's `overrides`.

    DeepSeek-V3.2's indexer loss (whether and how the indexer trains) is a training choice, not in
    config.json: the caller must pass `dsa_indexer_loss_coeff` (0 for no loss) and
    `dsa_indexer_use_sparse_loss`.
    """
    config, name = load_hf_config(source)
    kwargs = shape_kwargs_from_hf(config, name)
    missing = [k for k in _CALLER_FIELDS.get(config["model_type"], ()) if k not in overrides]
    if missing:
        raise ValueError(
            f"hf config {name}: model_type {config['model_type']!r} needs {', '.join(missing)} from the caller "
            "(a training choice that config.json does not hold)"
        )
    return {**kwargs, **overrides}
