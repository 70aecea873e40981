"""The kit's test markers read into the running test's launch context: memory budget, stall window,
fresh interpreter, and the GPU gate. Its own module so that the plugin and per-test ranks share it
without importing each other."""

from __future__ import annotations

import pytest

from megatron_testkit import attribution, skips, stall
from megatron_testkit.budgets import MemoryBudget


def apply_test_markers(item: pytest.Item) -> None:
    """The kit's markers for the running test's launches: its ``memory_budget``, ``stall_window``,
    ``fresh_interpreter`` and ``gpu`` (skipped or failed without enough GPUs)."""
    mark = item.get_closest_marker("memory_budget")
    context = attribution.current()
    if mark is not None and context is not None:
        context.budget = MemoryBudget.from_marker(mark)
    window = item.get_closest_marker("stall_window")
    if window is not None and context is not None:
        context.stall_window = _stall_window_of(window)
    gpu = item.get_closest_marker("gpu") is not None
    if context is not None:
        context.fresh_interpreter = item.get_closest_marker("fresh_interpreter") is not None
        context.gpu = gpu  # run_ranks gives NCCL and the GPUs only to `gpu` tests
    if not gpu:
        return
    from megatron_testkit.devices import gpu_gate, required_gpus
    from megatron_testkit.ranks import cuda_device_count

    ws = item.get_closest_marker("world_size")
    need = int(ws.args[0] if ws.args else ws.kwargs["n"]) if ws is not None else None
    # Too few GPUs skips, unless the job promised them (KIT_REQUIRE_GPUS): then it fails.
    gate = gpu_gate(cuda_device_count(), need, required_gpus())
    if gate.action == "fail":
        pytest.fail(gate.reason, pytrace=False)
    if gate.action == "skip":
        skips.skip(gate.capability, gate.reason)


def _stall_window_of(mark: pytest.Mark) -> float | None:
    """``stall_window(seconds)`` (None: off), checked; a bad value fails the test naming the marker."""
    if not mark.args and "seconds" not in mark.kwargs:
        pytest.fail("stall_window(seconds) needs its seconds, or None to turn the rule off", pytrace=False)
    value = mark.args[0] if mark.args else mark.kwargs["seconds"]
    try:
        return stall.check_window(value, "stall_window(seconds)")
    except (TypeError, ValueError) as exc:
        pytest.fail(str(exc), pytrace=False)
