"""Tensor statistics for training runs: per-layer min/max/mean/std/norms/nan/inf every N steps.

One job per module: `tensor_stats` (mergeable partial sums), `config` (what to record, the
defaults), `names` (nvdlfw-inspect's layer names), `hooks` (the torch-hook backend), `sinks`
(TensorBoard / JSON lines), `nvdlfw` (the nvdlfw-inspect session and TE backend), `inspector`
(`TensorInspector`, which ties them together). No module keeps process-global mutable state;
the nvdlfw-inspect session's listeners belong to the `NvdlfwSession` object.

The package is named `inspector`, not `inspect`: a module named `inspect` shadows the stdlib's
whenever its folder is on `sys.path` (e.g. `python accounting/seqlens.py` broke `dataclasses`).
Imports only torch (and, lazily, nvdlfw-inspect/TE on the TE path).
"""

from accounting.inspector.config import SUPPORTED_TENSORS, InspectConfig
from accounting.inspector.inspector import TensorInspector
from accounting.inspector.names import layer_names
from accounting.inspector.nvdlfw import (
    TE_STATS,
    TE_TENSORS,
    NvdlfwSession,
    end_nvdlfw_session,
    start_nvdlfw_session,
)
from accounting.inspector.sinks import ScalarWriter, StatsSink
from accounting.inspector.tensor_stats import SUPPORTED_STATS, combine_partials, partial_stats

__all__ = [
    "SUPPORTED_STATS",
    "SUPPORTED_TENSORS",
    "TE_STATS",
    "TE_TENSORS",
    "InspectConfig",
    "NvdlfwSession",
    "ScalarWriter",
    "StatsSink",
    "TensorInspector",
    "combine_partials",
    "end_nvdlfw_session",
    "layer_names",
    "partial_stats",
    "start_nvdlfw_session",
]
