"""Reads a real megatron-core `TransformerConfig` / `MLATransformerConfig` into `ModelShape` fields.

Duck-typed (nothing from megatron is imported). Every field of every supported release
(megatron-core 0.16.1 through 0.19.2, `ModelParallelConfig` included) is listed in `KNOWN_FIELDS`:
a field outside it that differs from its default belongs to a newer release, and may change the
FLOPs, so it raises ValueError naming it rather than giving a silently wrong count. Known fields
that change the FLOPs in a way `ModelShape` does not model raise too (`_UNMODELLED`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

__all__ = ["KNOWN_FIELDS", "shape_kwargs"]

# The fields of ModelParallelConfig, TransformerConfig and MLATransformerConfig in megatron-core
# 0.16.1 and 0.19.2 (read from both releases' transformer_config.py / model_parallel_config.py).
KNOWN_FIELDS = frozenset(
    """
    _cpu_offloading_context account_for_embedding_in_pipeline_split
    account_for_loss_in_pipeline_split activation_func activation_func_clamp_value
    activation_func_fp8_input_store activation_offload_fraction add_bias_linear add_qkv_bias
    apply_query_key_layer_scaling apply_residual_connection_post_layernorm apply_rope_fusion
    async_tensor_model_parallel_allreduce attention_backend attention_dropout attention_output_gate
    attention_softmax_in_fp32 autocast_dtype barrier_with_L1_time batch_invariant_mode
    batch_p2p_comm batch_p2p_sync beta_fast beta_slow bf16 bias_activation_fusion
    bias_dropout_fusion cache_mla_latents calculate_per_token_loss clone_scatter_output_in_embedding
    config_logger_dir context_parallel_size cp_comm_type cpu_offloading cpu_offloading_activations
    cpu_offloading_double_buffering cpu_offloading_num_layers
    cpu_offloading_retain_pinned_cpu_buffers cpu_offloading_weights cross_entropy_fusion_impl
    cross_entropy_loss_fusion cuda_graph_impl cuda_graph_modules cuda_graph_retain_backward_graph
    cuda_graph_scope cuda_graph_use_single_mempool cuda_graph_warmup_steps
    deallocate_pipeline_outputs defer_embedding_wgrad_compute delay_offload_until_cuda_graph
    delay_wgrad_compute delta_offload_bytes_across_pp_ranks deterministic_mode
    disable_bf16_reduced_precision_matmul disable_parameter_transpose_cache
    distribute_saved_activations dsa_indexer_head_dim dsa_indexer_k_norm_epsilon
    dsa_indexer_k_norm_fp32 dsa_indexer_loss_coeff dsa_indexer_n_heads dsa_indexer_rope_interleaved
    dsa_indexer_rotate_activation dsa_indexer_scoring_relu dsa_indexer_skip_topk_offset
    dsa_indexer_topk dsa_indexer_topk_freq dsa_indexer_use_sparse_loss dsa_kernel_backend
    embedding_init_method embedding_init_method_std enable_autocast enable_cuda_graph
    ep_overlap_early_attn_memory_release experimental_attention_variant
    experimental_attention_variant_loss_scale_func expert_gtp_weight_remat_size
    expert_model_parallel_size expert_tensor_parallel_num_weight_shards expert_tensor_parallel_size
    external_cuda_graph ffn_hidden_size finalize_model_grads_func fine_grained_activation_offloading
    fine_grained_offloading_max_inflight_offloads first_last_layers_bf16 flash_attention_version
    flash_decode fp16 fp32_residual_connection fp4 fp4_param fp4_quantizer_factory fp4_recipe fp8
    fp8_amax_compute_algo fp8_amax_history_len fp8_dot_product_attention fp8_interval fp8_margin
    fp8_multi_head_attention fp8_output_proj fp8_param fp8_quantizer_factory fp8_recipe fp8_wgrad
    fused_residual_rmsnorm fused_single_qkv_rope gated_linear_unit glu_linear_offset grad_scale_func
    grad_sync_func gradient_accumulation_fusion gtp_weight_remat_size hetereogenous_dist_checkpoint
    heterogeneous_block_specs hidden_dropout hidden_size hierarchical_context_parallel_sizes
    high_priority_a2a_comm_stream hybrid_context_parallel inference_cuda_graph_scope
    inference_disable_triton_nvls_kernels inference_fuse_tp_communication
    inference_grouped_gemm_backend inference_moe_disable_fused_quant_kernels
    inference_moe_token_dispatcher_type inference_rng_tracker inference_sampling_seed init_method
    init_method_std init_model_with_meta_device is_hybrid_model kitchen_attention_backend
    kv_channels kv_lora_rank layernorm_epsilon layernorm_zero_centered_gamma linear_attention_freq
    linear_conv_kernel_dim linear_key_head_dim linear_num_key_heads linear_num_value_heads
    linear_value_head_dim log_max_attention_logit mamba_head_dim mamba_num_groups mamba_num_heads
    mamba_state_dim mamba_training_ssm_states_dtype masked_softmax_fusion max_seqlen_per_dp_cp_rank
    memory_efficient_layer_norm microbatch_group_size_per_vp_stage min_offloaded_tensor_size
    mla_down_proj_fusion mlp_chunks_for_prefill mlp_chunks_for_training moe_apply_probs_on_input
    moe_aux_loss_coeff moe_deepep_num_sms moe_enable_deepep moe_enable_routing_replay
    moe_expert_capacity_factor moe_expert_rank_capacity_factor moe_extended_tp moe_ffn_hidden_size
    moe_flex_dispatcher_backend moe_flex_dispatcher_num_sms moe_grad_scale_func moe_grouped_gemm
    moe_hybridep_num_blocks_permute moe_hybridep_num_blocks_unpermute moe_hybridep_num_sms
    moe_hybridep_num_sms_preprocessing moe_hybridep_pad_uneven_dispatch_inputs moe_input_jitter_eps
    moe_latent_size moe_layer_freq moe_layer_recompute moe_mlp_glu_interleave_size
    moe_ncclep_static_shape moe_ncclep_zero_copy moe_pad_expert_input_to_capacity
    moe_pad_experts_for_cuda_graph_inference moe_paged_stash moe_paged_stash_buffer_size_factor_cpu
    moe_paged_stash_buffer_size_factor_cuda moe_paged_stash_page_size moe_per_layer_logging
    moe_permute_fusion moe_permute_fusion_into_hybridep moe_router_bias_update_rate moe_router_dtype
    moe_router_enable_expert_bias moe_router_force_biased moe_router_force_load_balancing
    moe_router_fusion moe_router_group_topk moe_router_load_balancing_type moe_router_num_groups
    moe_router_padding_for_fp8 moe_router_padding_for_quantization moe_router_pre_softmax
    moe_router_quantile_balancing_ema moe_router_score_function moe_router_topk
    moe_router_topk_limited_devices moe_router_topk_scaling_factor moe_shared_expert_gate
    moe_shared_expert_glu_interleave_size moe_shared_expert_intermediate_size
    moe_shared_expert_overlap moe_single_grouped_bias moe_single_grouped_weight
    moe_token_dispatcher_type moe_token_drop_policy moe_token_dropping moe_use_legacy_grouped_gemm
    moe_z_loss_coeff mrope_section mscale mscale_all_dim mtp_detach_heads mtp_grad_scale_func
    mtp_hybrid_override_pattern mtp_loss_scaling_factor mtp_num_layers mtp_standalone
    mtp_use_repeated_layer multi_latent_attention mup_attn_scale_power mup_base_head_dim
    mup_base_hidden_size mup_embedding_mult mup_output_mult mup_width_mult
    nccl_all_reduce_for_prefill no_rope_freq no_sync_func normalization num_attention_heads
    num_layers num_layers_at_end_in_bf16 num_layers_at_start_in_bf16
    num_layers_in_first_pipeline_stage num_layers_in_last_pipeline_stage
    num_microbatches_with_partial_activation_checkpoints num_moe_experts num_query_groups
    offload_modules original_max_position_embeddings output_layer_init_method
    overlap_dispatch_backward_with_experts_wgrad overlap_moe_expert_parallel_comm overlap_p2p_comm
    overlap_p2p_comm_warmup_flush param_sync_func params_dtype perform_initialization
    persist_layer_norm pipeline_dtype pipeline_model_parallel_comm_backend
    pipeline_model_parallel_layout pipeline_model_parallel_size q_lora_rank qk_clip qk_clip_alpha
    qk_clip_threshold qk_head_dim qk_l2_norm qk_layernorm qk_pos_emb_head_dim quant_recipe
    recompute_granularity recompute_method recompute_modules recompute_num_layers rope_type
    rotary_base rotary_interleaved rotary_percent rotary_scaling_factor sequence_parallel
    softmax_scale softmax_type symmetric_ar_type tensor_model_parallel_size
    tensor_parallel_num_weight_shards test_mode timers tp_comm_atomic_ag tp_comm_atomic_rs
    tp_comm_bootstrap_backend tp_comm_bulk_dgrad tp_comm_bulk_wgrad tp_comm_overlap
    tp_comm_overlap_ag tp_comm_overlap_disable_fc1 tp_comm_overlap_disable_qkv tp_comm_overlap_rs
    tp_comm_overlap_rs_dgrad tp_comm_split_ag tp_comm_split_rs tp_only_amax_red transformer_impl
    use_cpu_initialization use_fused_weighted_squared_relu use_grouped_gemm_for_dense_mlp
    use_grouped_gemm_for_shared_expert use_inference_optimized_layers use_kitchen
    use_kitchen_attention use_mamba_mem_eff_path use_mup use_ring_exchange_p2p
    use_te_activation_func use_te_rng_tracker use_transformer_engine_op_fuser v_head_dim
    variable_seq_lengths virtual_pipeline_model_parallel_size wgrad_deferral_limit
    window_attn_skip_freq window_size
    """.split()  # noqa: SIM905 (one name per word reads better than 325 quoted strings)
)


def _variant(value: Any) -> bool:
    return value not in (None, "", "none", "gated_delta_net", "gdn", "dsa")


# Known fields whose non-default values change the FLOPs in ways ModelShape does not model yet.
_UNMODELLED: dict[str, tuple[Any, str]] = {
    "experimental_attention_variant": (
        _variant,
        "only gated DeltaNet ('gated_delta_net' or 'gdn') and DeepSeek sparse attention ('dsa') are modelled",
    ),
    # Layers that reuse an earlier layer's top-k skip their indexer (megatron's
    # is_dsa_skip_topk_layer); which MTP layers would is not settled here.
    "dsa_indexer_topk_freq": (
        lambda v: v not in (None, 1),
        "cross-layer DSA top-k sharing (indexer layers skipped) is not modelled yet",
    ),
    "heterogeneous_block_specs": (bool, "per-layer heterogeneous blocks are not modelled"),
    "moe_expert_capacity_factor": (
        lambda v: v is not None,
        "experts drop the tokens routed beyond their capacity, and the count gives every token its "
        "top-k experts (an over-count); train dropless (None) or count from the router's real token counts",
    ),
    "mtp_hybrid_override_pattern": (
        lambda v: v is not None,
        "hybrid MTP layer patterns are not modelled yet",
    ),
}


def _defaults(config: Any) -> dict[str, Any]:
    out = {}
    for f in dataclasses.fields(config):
        if f.default is not dataclasses.MISSING:
            out[f.name] = f.default
        elif f.default_factory is not dataclasses.MISSING:
            out[f.name] = f.default_factory()
    return out


def _check_fields(config: Any) -> None:
    """ValueError naming the first field this module does not understand or does not model."""
    if dataclasses.is_dataclass(config):
        defaults = _defaults(config)
        names = [f.name for f in dataclasses.fields(config)]
    else:
        defaults, names = {}, list(vars(config))
    for name in names:
        value = getattr(config, name, None)
        if name not in KNOWN_FIELDS:
            if name in defaults and _same(value, defaults[name]):
                continue
            raise ValueError(
                f"{type(config).__name__}.{name} = {value!r}: a field ModelShape.from_megatron does not "
                "understand (newer than megatron-core 0.19.2?); its effect on the FLOPs is unknown"
            )
        rule = _UNMODELLED.get(name)
        if rule is not None and rule[0](value):
            raise ValueError(f"{name} = {value!r}: {rule[1]}")


def _same(a: Any, b: Any) -> bool:
    try:
        return bool(a == b)
    except Exception:  # tensors, arrays: an ambiguous comparison is a difference
        return a is b


def _tuple_or(value: Any) -> Any:
    return tuple(value) if isinstance(value, (list, tuple)) else value


def shape_kwargs(config: Any, hybrid_pattern: str | None = None) -> dict[str, Any]:
    """`ModelShape` keyword arguments (all but vocab_size and causal) read from `config`.

    A hybrid model (`is_hybrid_model`) needs its layer pattern, which megatron-core keeps outside
    the config (`--hybrid-layer-pattern`): pass it as `hybrid_pattern`.
    """
    _check_fields(config)
    if getattr(config, "is_hybrid_model", False) and hybrid_pattern is None:
        raise ValueError(
            "is_hybrid_model = True: pass hybrid_pattern= (megatron's layer pattern, e.g. 'M-M*-') to count its layers"
        )
    variant = getattr(config, "experimental_attention_variant", None)
    _check_dsa_release(config, variant)
    kwargs = _dense_kwargs(config)
    kwargs.update(_dsa_kwargs(config, variant, hybrid_pattern))
    kwargs.update(_variant_kwargs(config, variant, hybrid_pattern))
    kwargs.update(_gdn_kwargs(config, variant, hybrid_pattern))
    if hybrid_pattern is not None:
        kwargs.update(_hybrid_kwargs(config, hybrid_pattern, kwargs["mtp_num_layers"]))
    kwargs.update(_attention_kwargs(config))
    return kwargs


def _dense_kwargs(config: Any) -> dict[str, Any]:
    """The fields every decoder has: sizes, MLP, MoE, MTP depth, sliding window, output gate."""
    return {
        "num_layers": config.num_layers,
        "hidden_size": config.hidden_size,
        "num_attention_heads": config.num_attention_heads,
        "ffn_hidden_size": getattr(config, "ffn_hidden_size", None),
        "gated_linear_unit": bool(getattr(config, "gated_linear_unit", False)),
        "num_moe_experts": getattr(config, "num_moe_experts", None),
        "moe_router_topk": getattr(config, "moe_router_topk", 2),
        "moe_ffn_hidden_size": getattr(config, "moe_ffn_hidden_size", None),
        "moe_shared_expert_intermediate_size": getattr(config, "moe_shared_expert_intermediate_size", None),
        "moe_layer_freq": _tuple_or(getattr(config, "moe_layer_freq", 1)),
        "moe_latent_size": getattr(config, "moe_latent_size", None),
        "mtp_num_layers": getattr(config, "mtp_num_layers", None),
        "window_size": _tuple_or(getattr(config, "window_size", None)),
        "window_attn_skip_freq": _tuple_or(getattr(config, "window_attn_skip_freq", None)),
        "attention_output_gate": bool(getattr(config, "attention_output_gate", False)),
    }


def _check_dsa_release(config: Any, variant: Any) -> None:
    """Refuses DSA from a release older than the one whose DSA the kit counts."""
    if variant == "dsa" and not hasattr(config, "dsa_indexer_topk_freq"):
        # Before 0.19 (e.g. 0.16.1) megatron's DSA ran un-absorbed MLA with a grad-tracked indexer
        # and one causal mask over the whole pack (no per-document THD mask): another count.
        raise ValueError(
            "experimental_attention_variant = 'dsa' from a megatron-core release without "
            "dsa_indexer_topk_freq (older than 0.19): its DSA (un-absorbed MLA, no per-document mask) "
            "is not modelled; the kit counts megatron-core 0.19's"
        )


def _dsa_kwargs(config: Any, variant: Any, hybrid_pattern: str | None) -> dict[str, Any]:
    """The DSA indexer's fields, when every layer or a hybrid pattern's `D` layers are DSA."""
    if not (variant == "dsa" or (hybrid_pattern is not None and "D" in hybrid_pattern)):
        return {}
    names = ("dsa_indexer_n_heads", "dsa_indexer_head_dim", "dsa_indexer_topk", "dsa_indexer_loss_coeff")
    kwargs = {name: getattr(config, name, None) for name in names}
    kwargs["dsa_indexer_use_sparse_loss"] = bool(getattr(config, "dsa_indexer_use_sparse_loss", False))
    return kwargs


def _variant_kwargs(config: Any, variant: Any, hybrid_pattern: str | None) -> dict[str, Any]:
    """`experimental_attention_variant` (a hybrid pattern's `G` layers imply gated DeltaNet) and,
    for gated DeltaNet, which layers are linear."""
    if variant not in (None, "", "none"):
        kwargs = {"experimental_attention_variant": variant}
    elif hybrid_pattern is not None and "G" in hybrid_pattern:
        kwargs = {"experimental_attention_variant": "gdn"}
    else:
        return {}
    if variant != "dsa":
        kwargs["linear_attention_freq"] = _tuple_or(getattr(config, "linear_attention_freq", None))
    return kwargs


def _gdn_kwargs(config: Any, variant: Any, hybrid_pattern: str | None) -> dict[str, Any]:
    """Gated DeltaNet's head and conv sizes that the config sets (the rest keep ModelShape's defaults)."""
    if not (variant in ("gated_delta_net", "gdn") or (hybrid_pattern is not None and "G" in hybrid_pattern)):
        return {}
    names = (
        "linear_key_head_dim",
        "linear_value_head_dim",
        "linear_num_key_heads",
        "linear_num_value_heads",
        "linear_conv_kernel_dim",
    )
    return {name: getattr(config, name) for name in names if getattr(config, name, None) is not None}


def _hybrid_kwargs(config: Any, hybrid_pattern: str, mtp_num_layers: Any) -> dict[str, Any]:
    """The pattern, the Mamba mixer's sizes the config has, and the MTP depth the pattern decides."""
    kwargs: dict[str, Any] = {"hybrid_pattern": hybrid_pattern}
    for name in ("mamba_state_dim", "mamba_head_dim", "mamba_num_groups", "mamba_num_heads"):
        if hasattr(config, name):
            kwargs[name] = getattr(config, name)
    if mtp_num_layers is not None and "/" in hybrid_pattern:
        kwargs["mtp_num_layers"] = None  # the pattern's depths decide
    return kwargs


def _attention_kwargs(config: Any) -> dict[str, Any]:
    """Multi-latent attention's ranks and head dims, or grouped-query attention's groups and channels."""
    if getattr(config, "multi_latent_attention", False):
        names = ("q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim")
        return {"multi_latent_attention": True, **{name: getattr(config, name, None) for name in names}}
    return {
        "num_query_groups": getattr(config, "num_query_groups", None),
        "kv_channels": getattr(config, "kv_channels", None),
    }
