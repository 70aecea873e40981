"""Exact training accounting for Megatron-style LLM training: THD-aware FLOPs, throughput, memory."""

from accounting.accumulator import FlopsAccumulator
from accounting.adapters import LoraAdapter
from accounting.flops import FlopsBreakdown, ModelShape, training_flops
from accounting.inspector import InspectConfig, TensorInspector
from accounting.memory import memory_report, reduce_max_memory
from accounting.seqlens import SeqlenStats, seqlen_stats, validate_cu_seqlens
from accounting.stage_memory import MemoryEstimate, ParallelLayout, memory_estimate
from accounting.throughput import IntervalThroughput

__all__ = [
    "FlopsAccumulator",
    "FlopsBreakdown",
    "InspectConfig",
    "IntervalThroughput",
    "LoraAdapter",
    "MemoryEstimate",
    "ModelShape",
    "ParallelLayout",
    "SeqlenStats",
    "TensorInspector",
    "memory_estimate",
    "memory_report",
    "reduce_max_memory",
    "seqlen_stats",
    "training_flops",
    "validate_cu_seqlens",
]
