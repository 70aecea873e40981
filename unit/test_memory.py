"""memory_report on this process, and reduce_max_memory's no-op paths (the collective paths run on
real gloo groups in functional/test_accounting_collectives.py)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from hypothesis import given

from accounting import memory_report, reduce_max_memory
from megatron_testkit import skips
from unit.strategies import memory_report_keys, memory_reports

pytestmark = pytest.mark.L0


def test_cpu_report_gives_current_and_peak_rss_as_ints():
    before = memory_report("cpu")
    assert set(before) == {"rss_bytes", "peak_rss_bytes"}
    assert all(type(v) is int for v in before.values())
    assert 0 < before["rss_bytes"] <= before["peak_rss_bytes"]
    block = bytearray(64 * 2**20)  # touch 64 MiB: the peak must reach at least the current RSS again
    block[::4096] = b"x" * len(block[::4096])
    after = memory_report("cpu")
    assert after["peak_rss_bytes"] >= after["rss_bytes"] >= before["rss_bytes"] + 32 * 2**20
    del block


def test_default_device_without_cuda_is_the_host():
    if torch.cuda.is_available():
        skips.skip(
            "no-cuda", "this machine has CUDA: the default report is the allocator's (see the gpu test)"
        )
    assert set(memory_report()) == {"rss_bytes", "peak_rss_bytes"}


def test_asking_for_cuda_without_cuda_is_refused_not_answered_with_zeros():
    if torch.cuda.is_available():
        skips.skip("no-cuda", "this machine has CUDA (see the gpu test)")
    with pytest.raises(ValueError, match=r"memory_report\(device='cuda'\): CUDA is not available"):
        memory_report("cuda")


def test_before_cuda_is_initialised_the_default_is_the_host_and_cuda_is_refused(monkeypatch):
    """A machine with CUDA whose process never touched it is simulated (no GPU here): availability
    is patched to True and `memory_stats` to what torch answers then, `{}`; the report must not
    read that as a peak of 0."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    monkeypatch.setattr(torch.cuda, "memory_stats", lambda device=None: {})
    default = memory_report()
    assert set(default) == {"rss_bytes", "peak_rss_bytes"} and default["peak_rss_bytes"] > 0
    for device in ("cuda", "cuda:0", 0, torch.device("cuda")):
        with pytest.raises(ValueError, match=r"has not initialised CUDA.*every counter would read 0"):
            memory_report(device)


_FRESH_PROCESS = """
import json
import torch
from accounting import memory_report

out = {"default_before": sorted(memory_report())}
try:
    memory_report("cuda")
    out["explicit_before"] = "answered"
except ValueError as exc:
    out["explicit_before"] = str(exc)
out["initialised_by_report"] = torch.cuda.is_initialized()
x = torch.empty(8 * 2**20, dtype=torch.uint8, device="cuda")
after = memory_report()
out["default_after"] = sorted(after)
out["allocated_after"] = after["allocated_bytes"]
print(json.dumps(out))
"""


@pytest.mark.gpu
def test_on_cuda_the_report_follows_the_first_allocation_and_never_initialises_cuda_itself():
    if not torch.cuda.is_available():
        skips.skip("cuda", "the CPU variant simulates the uninitialised state")
    run = subprocess.run([sys.executable, "-c", _FRESH_PROCESS], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert out["default_before"] == ["peak_rss_bytes", "rss_bytes"]
    assert "has not initialised CUDA" in out["explicit_before"]
    assert out["initialised_by_report"] is False
    assert "peak_allocated_bytes" in out["default_after"] and out["allocated_after"] >= 8 * 2**20


@pytest.mark.gpu
def test_cuda_report_reads_the_caching_allocator():
    if not torch.cuda.is_available():
        skips.skip("cuda", "reads the CUDA caching allocator")
    x = torch.empty(8 * 2**20, dtype=torch.uint8, device="cuda")
    report = memory_report("cuda")
    assert (
        report["allocated_bytes"] >= x.numel() and report["peak_allocated_bytes"] >= report["allocated_bytes"]
    )
    assert report["reserved_bytes"] >= report["allocated_bytes"]
    assert {"active_bytes", "inactive_split_bytes", "alloc_retries", "ooms"} <= set(report)
    assert all(type(v) is int for v in report.values())


class _SizedGroup:
    def __init__(self, n):
        self.n = n

    def size(self):
        return self.n


@given(memory_report_keys().flatmap(memory_reports))
def test_without_an_initialised_process_group_the_report_comes_back_unchanged(report):
    assert not torch.distributed.is_initialized()
    assert reduce_max_memory(report, _SizedGroup(4)) is report
    values, ranks = reduce_max_memory(report, _SizedGroup(4), return_ranks=True)
    assert values is report and ranks == dict.fromkeys(report, 0)


@pytest.fixture
def single_rank_group(tmp_path):
    """A real one-rank gloo process group in this process, destroyed afterwards."""
    store = torch.distributed.FileStore(str(tmp_path / "store"), 1)
    torch.distributed.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        yield torch.distributed.group.WORLD
    finally:
        torch.distributed.destroy_process_group()


def test_no_op_cases_with_an_initialised_group(single_rank_group):
    report = {"allocated_bytes": 5, "ooms": 0}
    assert reduce_max_memory({}, single_rank_group) == {}
    assert reduce_max_memory(report, single_rank_group) is report  # size 1
    assert reduce_max_memory(report, object()) is report  # no size()
    assert reduce_max_memory(report, type("G", (), {"size": 2})()) is report  # size not callable
    assert reduce_max_memory(report, None) is report
    values, ranks = reduce_max_memory(report, single_rank_group, return_ranks=True)
    assert values is report and ranks == {"allocated_bytes": 0, "ooms": 0}
