"""memory_report on this process, and reduce_max_memory's no-op paths (the collective paths run on
real gloo groups in functional/test_accounting_collectives.py)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given

from accounting import memory_report, reduce_max_memory
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
        pytest.skip("this machine has CUDA: the default report is the allocator's (see the gpu test)")
    assert set(memory_report()) == {"rss_bytes", "peak_rss_bytes"}


def test_asking_for_cuda_without_cuda_is_refused_not_answered_with_zeros():
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA (see the gpu test)")
    with pytest.raises(ValueError, match=r"memory_report\(device='cuda'\): CUDA is not available"):
        memory_report("cuda")


@pytest.mark.gpu
def test_cuda_report_reads_the_caching_allocator():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
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
