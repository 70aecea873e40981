"""Published model shapes, by name, for the CLI and for tests that need a real-sized model.

Vocabulary sizes are the padded sizes the output layer multiplies by. Reference totals (one
sequence, GBS=1) from Megatron-Bridge's functional FLOPs test are listed where they exist; the
presets reproduce them to 3 significant figures (an independent oracle, see unit/test_flops*;
Megatron-Bridge does not count the MoE router, so the comparison leaves the `moe_router` term out).

Each preset but gpt3-175b (GPT-3 has no published config.json) equals `ModelShape.from_hf_config`
of its model's published config.json (copies in unit/data/hf_configs/, unit/test_hf_config.py),
but one: qwen3-next-80b-a3b counts the model card's one MTP layer, which the published file
(and transformers' Qwen3NextConfig) leaves out: `from_hf_config(path, mtp_num_layers=1)` adds it. DeepSeek-V3.2's indexer training (its KL loss over the
top-k keys) is a training choice that config.json does not hold: the preset chooses it. Qwen3's
per-head q/k norms are not a shape field (no FLOPs; 2 x head_dim parameters per layer).
"""

from __future__ import annotations

import dataclasses

from accounting.adapters import LoraAdapter
from accounting.flops import ModelShape

__all__ = ["PRESETS", "PRESET_ADAPTERS", "REFERENCE_TOTALS", "preset", "preset_adapter"]

PRESETS: dict[str, ModelShape] = {
    # GPT-3 175B: Brown et al. 2020, "Language Models are Few-Shot Learners", Table 2.1 (96 layers,
    # d_model 12288, 96 heads, d_ff = 4 d_model); vocab 50257 padded to a multiple of 128 = 50304
    # (Megatron-LM's --make-vocab-size-divisible-by 128). Context 2048.
    "gpt3-175b": ModelShape(
        num_layers=96, hidden_size=12288, ffn_hidden_size=49152, num_attention_heads=96, vocab_size=50304
    ),
    # Llama 3 8B: meta-llama/Meta-Llama-3-8B config.json (32 layers, hidden 4096, intermediate 14336,
    # 32 heads, 8 KV heads, vocab 128256, SwiGLU).
    "llama3-8b": ModelShape(
        num_layers=32,
        hidden_size=4096,
        ffn_hidden_size=14336,
        num_attention_heads=32,
        num_query_groups=8,
        kv_channels=128,
        vocab_size=128256,
        gated_linear_unit=True,
    ),
    # Llama 3 70B: meta-llama/Meta-Llama-3-70B config.json (80 layers, hidden 8192, intermediate
    # 28672, 64 heads, 8 KV heads, vocab 128256, SwiGLU).
    "llama3-70b": ModelShape(
        num_layers=80,
        hidden_size=8192,
        ffn_hidden_size=28672,
        num_attention_heads=64,
        num_query_groups=8,
        kv_channels=128,
        vocab_size=128256,
        gated_linear_unit=True,
    ),
    # Qwen3-30B-A3B: Qwen/Qwen3-30B-A3B config.json (48 layers, hidden 2048, 32 heads, 4 KV heads,
    # head_dim 128, 128 experts, 8 routed per token, moe_intermediate_size 768, every layer MoE,
    # no shared expert, vocab 151936, SwiGLU).
    "qwen3-30b-a3b": ModelShape(
        num_layers=48,
        hidden_size=2048,
        ffn_hidden_size=6144,
        num_attention_heads=32,
        num_query_groups=4,
        kv_channels=128,
        vocab_size=151936,
        gated_linear_unit=True,
        num_moe_experts=128,
        moe_router_topk=8,
        moe_ffn_hidden_size=768,
    ),
    # Qwen3-235B-A22B: Qwen/Qwen3-235B-A22B config.json (94 layers, hidden 4096, 64 heads, 4 KV
    # heads, head_dim 128, 128 experts, 8 routed, moe_intermediate_size 1536, vocab 151936).
    "qwen3-235b-a22b": ModelShape(
        num_layers=94,
        hidden_size=4096,
        ffn_hidden_size=12288,
        num_attention_heads=64,
        num_query_groups=4,
        kv_channels=128,
        vocab_size=151936,
        gated_linear_unit=True,
        num_moe_experts=128,
        moe_router_topk=8,
        moe_ffn_hidden_size=1536,
    ),
    # DeepSeek-V3: deepseek-ai/DeepSeek-V3 config.json (61 layers, hidden 7168, 128 heads, MLA with
    # q_lora_rank 1536, kv_lora_rank 512, qk_nope_head_dim 128, qk_rope_head_dim 64, v_head_dim 128;
    # first_k_dense_replace 3 dense layers of intermediate 18432, then MoE: 256 routed experts, 8 per
    # token, moe_intermediate_size 2048, n_shared_experts 1 (one expert's width: 2048); SwiGLU;
    # num_nextn_predict_layers 1 MTP depth; vocab 129280). Arxiv 2412.19437 Table/§4.2 agrees.
    "deepseek-v3": ModelShape(
        num_layers=61,
        hidden_size=7168,
        ffn_hidden_size=18432,
        num_attention_heads=128,
        vocab_size=129280,
        gated_linear_unit=True,
        num_moe_experts=256,
        moe_router_topk=8,
        moe_ffn_hidden_size=2048,
        moe_shared_expert_intermediate_size=2048,
        moe_layer_freq=(0,) * 3 + (1,) * 58,
        mtp_num_layers=1,
        multi_latent_attention=True,
        q_lora_rank=1536,
        kv_lora_rank=512,
        qk_head_dim=128,
        qk_pos_emb_head_dim=64,
        v_head_dim=128,
    ),
    # Nemotron-H 8B: Megatron-Bridge docs/models/llm/nemotronh.md "Nemotron H 8B Specifications" and
    # nvidia/Nemotron-H-8B-Base-8K config.json (52 layers in the pattern below: 24 Mamba-2, 4
    # attention, 24 MLP; hidden 4096, FFN 21504 squared-ReLU (not gated), 32 heads, 8 KV groups,
    # head dim 128; Mamba: 128 heads x 64, state 128, 8 groups; vocab 131072). Re-checked against
    # transformers' NemotronHConfig defaults (which are this model's: intermediate_size 21504,
    # mamba_num_heads 128, mamba_head_dim 64, n_groups 8, ssm_state_size 128, conv 4) and the 8B
    # checkpoint's in_proj width 18560 = 2*8192 + 2*8*128 + 128 (z, x, B, C, dt).
    "nemotron-h-8b": ModelShape(
        num_layers=52,
        hidden_size=4096,
        ffn_hidden_size=21504,
        num_attention_heads=32,
        num_query_groups=8,
        kv_channels=128,
        vocab_size=131072,
        hybrid_pattern="M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-",
        mamba_num_heads=128,
        mamba_head_dim=64,
        mamba_state_dim=128,
        mamba_num_groups=8,
    ),
    # Qwen3-Next-80B-A3B: Qwen/Qwen3-Next-80B-A3B-Instruct config.json (48 layers, hidden 2048;
    # full_attention_interval 4: every 4th layer gated softmax attention (16 heads, 2 KV heads,
    # head_dim 256, attention output gate), the others gated DeltaNet (16 key heads, 32 value
    # heads, head dims 128, conv 4); every layer MoE: 512 experts, 10 routed, moe_intermediate_size
    # 512, one shared expert of 512; SwiGLU; vocab 151936; one MTP depth). Re-checked against that
    # config.json (full_attention_interval 4, head_dim 256, hidden 2048, intermediate 5120 (unused:
    # every layer is MoE, decoder_sparse_step 1), linear_* as above, moe_intermediate_size 512) and
    # the model card (48 layers, 16 Q / 2 KV heads, 512 experts, 10 routed + 1 shared). The card's
    # MTP layer is not in that config.json (it has no MTP key): counted here on purpose.
    "qwen3-next-80b-a3b": ModelShape(
        num_layers=48,
        hidden_size=2048,
        ffn_hidden_size=5120,
        num_attention_heads=16,
        num_query_groups=2,
        kv_channels=256,
        vocab_size=151936,
        gated_linear_unit=True,
        attention_output_gate=True,
        num_moe_experts=512,
        moe_router_topk=10,
        moe_ffn_hidden_size=512,
        moe_shared_expert_intermediate_size=512,
        mtp_num_layers=1,
        experimental_attention_variant="gated_delta_net",
        linear_attention_freq=4,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        linear_num_key_heads=16,
        linear_num_value_heads=32,
        linear_conv_kernel_dim=4,
    ),
}
# DeepSeek-V3.2-Exp: deepseek-ai/DeepSeek-V3.2-Exp config.json, DeepSeek-V3 (above) plus the
# lightning indexer on every layer: index_n_heads 64, index_head_dim 128, index_topk 2048
# (megatron-core's dsa_indexer_n_heads / _head_dim / _topk; megatron-core's installed source ships
# no DSA recipe to cross-check). Trained as in the report's sparse stage (DeepSeek_V3_2.pdf §2.1):
# the indexer learns from its KL loss over the selected keys only (dsa_indexer_use_sparse_loss).
# The loss coefficient scales a gradient, not the FLOPs: any value > 0 counts the same.
PRESETS["deepseek-v3.2"] = dataclasses.replace(
    PRESETS["deepseek-v3"],
    experimental_attention_variant="dsa",
    dsa_indexer_n_heads=64,
    dsa_indexer_head_dim=128,
    dsa_indexer_topk=2048,
    dsa_indexer_loss_coeff=1.0,
    dsa_indexer_use_sparse_loss=True,
)
# LoRA on a frozen Llama 3 70B: the shape of "llama3-70b"; the adapter is Megatron-Bridge's PEFT
# guide example (docs/training/peft.md: LoRA(target_modules=["linear_qkv", "linear_proj",
# "linear_fc1", "linear_fc2"], dim=16, alpha=32)).
PRESETS["llama3-70b-lora"] = PRESETS["llama3-70b"]

# Presets trained as adapters on a frozen base: `training_flops(..., frozen_base=True, adapter=...)`.
PRESET_ADAPTERS: dict[str, LoraAdapter] = {"llama3-70b-lora": LoraAdapter(rank=16)}

# (preset, sequence length) -> FLOPs of one sequence, as pinned by Megatron-Bridge's
# tests/functional_tests/test_groups/utils/test_flop_utils.py (3 significant figures).
REFERENCE_TOTALS: dict[tuple[str, int], float] = {
    ("llama3-8b", 8192): 4.22e14,
    ("llama3-70b", 8192): 3.68e15,
    ("qwen3-30b-a3b", 4096): 9.42e13,
    ("qwen3-235b-a22b", 4096): 6.06e14,
}


def preset(name: str) -> ModelShape:
    """The preset called `name`; ValueError listing the known names otherwise."""
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown preset {name!r} (known: {', '.join(sorted(PRESETS))})") from None


def preset_adapter(name: str) -> LoraAdapter | None:
    """The adapter a preset trains on its frozen base, or None for a fully trained preset."""
    preset(name)
    return PRESET_ADAPTERS.get(name)
