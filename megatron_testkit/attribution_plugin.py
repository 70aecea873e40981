"""Per-test attribution: which test is running while it launches ranks (`megatron_testkit.attribution`),
and what the kit measured for it attached to each of its reports (``report.kit``: its launches,
budget, a rank failure, the pytest process' RSS before and after, leaked processes, the CPU
layer's substitutions), which xdist carries to the controller's report. A plugin module
registered by `megatron_testkit.plugin`.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterator
from dataclasses import asdict
from typing import Any

import psutil
import pytest

from megatron_testkit import attribution, cuda_context, per_test
from megatron_testkit.leak_guard_plugin import LEAKED

_RSS_BEFORE = pytest.StashKey[int]()
_SENT = pytest.StashKey[int]()  # how many of the test's launches its earlier reports carried


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    attribution.begin_test(item.nodeid, None)
    item.stash[_RSS_BEFORE] = rss()
    cuda_context.observe(cuda_context.OUTSIDE)  # a context before the test: not its code's
    try:
        return (yield)
    finally:
        attribution.end_test()
        cuda_context.observe(cuda_context.TEST, item.nodeid)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[Any]:
    report = yield
    context = attribution.current()
    kit: dict[str, Any] = {}
    if context is not None:
        sent = item.stash.get(_SENT, 0)
        kit["runs"] = [run.to_json() for run in context.runs[sent:]]
        item.stash[_SENT] = len(context.runs)
        if context.budget is not None:
            kit["budget_host_bytes"] = context.budget.host_bytes
            kit["budget_device_bytes"] = context.budget.device_bytes
    if call.excinfo is not None:
        from megatron_testkit.diagnosis import RankFailure

        exc = call.excinfo.value
        if isinstance(exc, RankFailure):
            kit["failure"] = asdict(exc.to_failure(limit=20000))
    if call.when == "setup":
        kit["pytest_rss_before_bytes"] = item.stash.get(_RSS_BEFORE, None)
    if call.when == "teardown":
        kit["pytest_rss_after_bytes"] = rss()
        kit["leaked_processes"] = item.stash.get(LEAKED, 0)
    kit["worker"] = os.environ.get("PYTEST_XDIST_WORKER")
    substituted = taken_substitutions()
    if substituted:  # the CPU layer's, in this process and the test's ranks: the report's header
        kit["cpu_substitutions"] = substituted
    report.kit = kit
    return report


def rss() -> int:
    """The pytest process' resident memory now, in bytes, once the C allocator has handed back the
    free pages it keeps (glibc's ``malloc_trim``): a test's growth is then memory still held, not
    the freed tensors' pages that malloc's arenas keep or not depending on the order tests ran in
    (measured: one test's 4 MiB temporaries left +2 MiB in one run, +42 MiB in another)."""
    _trim_free_heap()
    return psutil.Process().memory_info().rss


def _free_heap_trimmer() -> Callable[[], object]:
    """glibc's ``malloc_trim(0)``, or a no-op where the C library has none (musl, macOS)."""
    import ctypes

    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return lambda: None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return lambda: trim(0)


_trim_free_heap = _free_heap_trimmer()


def taken_substitutions() -> dict[str, int]:
    """The CPU layer's substitutions of this process not yet given to a test's report (none in a
    per-test rank's session: the rank's record carries them to the launching session)."""
    shim = sys.modules.get("megatron_testkit.megatron_cpu")
    if per_test.inside_rank():
        return {}
    return shim.take_substitutions() if shim is not None else {}
