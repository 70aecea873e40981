"""Exact training accounting for Megatron-style LLM training: THD-aware FLOPs, throughput, memory.

The public names load on first use (PEP 562), so that importing one stdlib-only submodule
(`accounting.json_input`, the bounded reader the kit's plugin and the CI tools share) does not
import torch: the kit's plugin must load where torch is not installed.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from accounting.accumulator import FlopsAccumulator
    from accounting.adapters import LoraAdapter
    from accounting.flops import FlopsBreakdown, ModelShape, training_flops
    from accounting.inspector import InspectConfig, TensorInspector
    from accounting.memory import memory_report, reduce_max_memory
    from accounting.seqlens import SeqlenStats, seqlen_stats, validate_cu_seqlens
    from accounting.stage_memory import MemoryEstimate, ParallelLayout, memory_estimate
    from accounting.throughput import IntervalThroughput

# Each public name and the module that defines it.
_HOMES = {
    "FlopsAccumulator": "accounting.accumulator",
    "FlopsBreakdown": "accounting.flops",
    "InspectConfig": "accounting.inspector",
    "IntervalThroughput": "accounting.throughput",
    "LoraAdapter": "accounting.adapters",
    "MemoryEstimate": "accounting.stage_memory",
    "ModelShape": "accounting.flops",
    "ParallelLayout": "accounting.stage_memory",
    "SeqlenStats": "accounting.seqlens",
    "TensorInspector": "accounting.inspector",
    "memory_estimate": "accounting.stage_memory",
    "memory_report": "accounting.memory",
    "reduce_max_memory": "accounting.memory",
    "seqlen_stats": "accounting.seqlens",
    "training_flops": "accounting.flops",
    "validate_cu_seqlens": "accounting.seqlens",
}

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


def __getattr__(name: str) -> Any:
    """A public name, imported from its module on first use (then cached in the package)."""
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'accounting' has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_HOMES])
