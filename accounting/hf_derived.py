"""What each transformers config class makes of a key a config.json leaves out: the derived keys.

A config.json is read the way its transformers config class reads it. Two kinds of absent key:

- a *derived* key, which the class computes from the others (`num_key_value_heads` from
  `num_attention_heads`, `head_dim` from `hidden_size / num_attention_heads`) or whose absence
  means a feature is off (no MTP key: no MTP layer). It takes that value here too: a file
  without it is a valid config in every tool that reads it;
- a *structural* key, for which the class holds a constant, the size of one published model
  (`hidden_size` 4096 for Llama, `head_dim` 256 for Gemma, `num_key_value_heads` 8 for
  Mistral). A file without one is truncated or misspelt, and counting the class's default model
  would be a silent wrong answer: the reader refuses it, naming the key.

`DERIVED` holds one row per `model_type`: the class (transformers' `configuration_<type>.py`, as
of transformers 4.57-5.x), and for each derived key the rule and whether an explicit `null`
derives too. A key not listed for a type is structural there.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["DERIVED", "Derived", "DerivedKeys", "tied_default"]


@dataclass(frozen=True)
class Derived:
    """One derived key: its value from the config's other keys, and when the rule applies.

    `value` gets a reader of the other keys (`read(name)` returns a checked int) and the config.
    `absent` and `null`: the rule applies to a missing key, to an explicit null, or both.
    """

    rule: str
    value: Callable[[Callable[[str], int], Mapping[str, Any]], Any]
    absent: bool = True
    null: bool = True


@dataclass(frozen=True)
class DerivedKeys:
    """A model type's config class, the keys it derives, and its `tie_word_embeddings` default."""

    config_class: str
    keys: Mapping[str, Derived]
    tied: bool = False


def _head_dim(read: Callable[[str], int], config: Mapping[str, Any]) -> int:
    hidden, heads = read("hidden_size"), read("num_attention_heads")
    if hidden % heads:
        raise ValueError(f"head_dim is not given and hidden_size {hidden} is not divisible by {heads} heads")
    return hidden // heads


KV_HEADS = Derived("num_attention_heads (multi-head attention)", lambda read, _: read("num_attention_heads"))
# Only an explicit null: the class's keyword default is a constant (8 for Mistral), kept when absent.
KV_HEADS_IF_NULL = Derived(KV_HEADS.rule, KV_HEADS.value, absent=False)
HEAD_DIM = Derived("hidden_size / num_attention_heads", _head_dim)
NO_MTP = Derived("0 (the class has no MTP key: no MTP layer is built)", lambda read, _: 0, null=False)
NO_WINDOW = Derived("null (no sliding window)", lambda read, _: None)

DERIVED: dict[str, DerivedKeys] = {
    "llama": DerivedKeys("LlamaConfig", {"num_key_value_heads": KV_HEADS, "head_dim": HEAD_DIM}),
    # MistralConfig: num_key_value_heads=8 and sliding_window=4096 are keyword constants.
    "mistral": DerivedKeys("MistralConfig", {"num_key_value_heads": KV_HEADS_IF_NULL, "head_dim": HEAD_DIM}),
    # Qwen2Config has no head_dim: the modelling code takes hidden_size // num_attention_heads.
    # num_key_value_heads defaults to the constant 32; only null becomes num_attention_heads.
    "qwen2": DerivedKeys("Qwen2Config", {"num_key_value_heads": KV_HEADS_IF_NULL, "head_dim": HEAD_DIM}),
    # Qwen3Config: head_dim = 128 and num_key_value_heads = 32 are constants.
    "qwen3": DerivedKeys("Qwen3Config", {"num_key_value_heads": KV_HEADS_IF_NULL}),
    # Qwen3MoeConfig has no head_dim (the modelling code's hidden_size // heads); 4 KV heads constant.
    "qwen3_moe": DerivedKeys("Qwen3MoeConfig", {"head_dim": HEAD_DIM}),
    # MixtralConfig: 8 KV heads constant; head_dim None and sliding_window None by default.
    "mixtral": DerivedKeys(
        "MixtralConfig",
        {"num_key_value_heads": KV_HEADS_IF_NULL, "head_dim": HEAD_DIM, "sliding_window": NO_WINDOW},
    ),
    # DeepseekV3Config derives qk_head_dim and head_dim (checked where read) and has no MTP key.
    "deepseek_v3": DerivedKeys("DeepseekV3Config", {"num_nextn_predict_layers": NO_MTP}),
    "deepseek_v32": DerivedKeys("DeepseekV32Config", {"num_nextn_predict_layers": NO_MTP}),
    # NemotronHConfig: 8 KV heads and head_dim 128 are constants; its earlier releases (the
    # published Nemotron-H files) name head_dim attention_head_dim.
    "nemotron_h": DerivedKeys(
        "NemotronHConfig",
        {
            "num_key_value_heads": KV_HEADS_IF_NULL,
            "head_dim": Derived(
                "attention_head_dim (the earlier name)", lambda read, _: read("attention_head_dim")
            ),
        },
    ),
    # Qwen3NextConfig: 2 KV heads and head_dim 256 are constants; it has no MTP key (later Qwen
    # releases' files add mtp_num_hidden_layers, read when present).
    "qwen3_next": DerivedKeys("Qwen3NextConfig", {"mtp_num_hidden_layers": NO_MTP}),
    # Gemma2Config / Gemma3TextConfig: 4 KV heads and head_dim 256 are constants; tied embeddings.
    "gemma2": DerivedKeys("Gemma2Config", {}, tied=True),
    "gemma3_text": DerivedKeys("Gemma3TextConfig", {}, tied=True),
}


def tied_default(model_type: str) -> bool:
    """`tie_word_embeddings` when the file leaves it out: the config class's default."""
    row = DERIVED.get(model_type)
    return row.tied if row is not None else True  # PretrainedConfig's own default
