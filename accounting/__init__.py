"""Exact training accounting for Megatron-style LLM training: THD-aware FLOPs, throughput, memory."""
