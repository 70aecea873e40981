"""The CPU layer covers what a torchrun-style suite calls where CUDA is absent, and counts it.

Single process, a real one-rank gloo group (a `HashStore`): the init megatron-core's own unit tests
use (``set_device(rank % device_count())``, then ``init_process_group(backend="nccl")``), a group
made with NCCL asked for, megatron-core's `initialize_model_parallel` with NCCL for its
pipeline groups, CUDA side streams, and the counts the report lists.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from megatron_testkit import megatron_cpu as mcpu
from megatron_testkit import skips
from megatron_testkit.report import ReportCollector

pytestmark = [
    pytest.mark.L0,
    skips.skip_if(torch.cuda.is_available(), "no-cuda", "the shim is a no-op where CUDA exists"),
]


@pytest.fixture(autouse=True)
def _fresh_counts() -> None:
    mcpu.take_substitutions()  # counts of earlier tests in this process are not this test's


def _one_rank_group() -> None:
    dist.init_process_group(backend="nccl", store=dist.HashStore(), rank=0, world_size=1)


def test_a_torchrun_init_divides_by_the_device_count_and_gets_gloo_for_nccl() -> None:
    rank = 3
    with mcpu.cpu_shim():
        torch.cuda.set_device(rank % torch.cuda.device_count())  # ZeroDivisionError without the shim
        _one_rank_group()
        try:
            assert dist.get_backend() == "gloo"
            group = dist.new_group([0], backend="nccl")
            assert dist.get_backend(group) == "gloo"
            total = torch.ones(2, device="cuda")
            dist.all_reduce(total, group=group)
            assert total.tolist() == [1.0, 1.0]
        finally:
            dist.destroy_process_group()
    counts = mcpu.take_substitutions()
    assert counts["torch.cuda.device_count"] == 1
    assert counts["torch.cuda.set_device"] == 1
    assert counts["torch.distributed.init_process_group(backend='nccl') -> gloo"] == 1
    assert counts["torch.distributed.new_group(backend='nccl') -> gloo"] == 1
    assert counts["a CUDA device argument -> cpu"] >= 1
    # Outside the shim, torch's own functions are back.
    assert torch.cuda.device_count() == 0
    assert dist.init_process_group.__module__ == "torch.distributed.distributed_c10d"


def test_a_backend_given_by_position_and_a_cuda_device_id_are_substituted_too() -> None:
    with mcpu.cpu_shim():
        dist.init_process_group("cpu:gloo,cuda:nccl", store=dist.HashStore(), rank=0, world_size=1,
                                device_id=torch.device("cuda", 0))  # fmt: skip
        try:
            assert dist.get_backend() == "gloo"
            assert dist.get_backend(dist.new_group([0], None, "nccl")) == "gloo"
        finally:
            dist.destroy_process_group()
    counts = mcpu.take_substitutions()
    assert counts["torch.distributed.init_process_group(backend='cpu:gloo,cuda:nccl') -> gloo"] == 1
    assert counts["torch.distributed.new_group(backend='nccl') -> gloo"] == 1
    assert counts["torch.distributed.init_process_group(device_id=...) -> dropped"] == 1


def test_a_gloo_request_is_left_alone_and_not_counted() -> None:
    with mcpu.cpu_shim():
        dist.init_process_group(backend="gloo", store=dist.HashStore(), rank=0, world_size=1)
        try:
            dist.new_group([0], backend="gloo")
        finally:
            dist.destroy_process_group()
    assert not any("gloo" in call or "device_id" in call for call in mcpu.take_substitutions())


def test_side_streams_are_cpu_stand_ins() -> None:
    with mcpu.cpu_shim():
        side = torch.cuda.Stream()
        with torch.cuda.stream(side):
            value = torch.ones(3, device="cuda") * 2
        torch.cuda.current_stream().wait_stream(side)
        side.synchronize()
        assert side.query() is True
        assert value.device.type == "cpu"
    counts = mcpu.take_substitutions()
    assert counts["torch.cuda.Stream() -> CPU stream"] == 1
    assert counts["torch.cuda.stream(...) -> no-op context"] == 1


def test_megatron_initialize_model_parallel_with_nccl_pipeline_groups_runs_on_gloo() -> None:
    skips.require_megatron()
    import inspect

    from megatron.core import parallel_state

    if (
        "pipeline_model_parallel_comm_backend"
        not in inspect.signature(parallel_state.initialize_model_parallel).parameters
    ):
        skips.skip("megatron", "this megatron-core release has no pipeline_model_parallel_comm_backend")
    with mcpu.cpu_shim():
        torch.cuda.set_device(0 % torch.cuda.device_count())
        _one_rank_group()
        try:
            parallel_state.initialize_model_parallel(1, 1, pipeline_model_parallel_comm_backend="nccl")
            assert dist.get_backend(parallel_state.get_pipeline_model_parallel_group()) == "gloo"
            parallel_state.destroy_model_parallel()
        finally:
            dist.destroy_process_group()
    counts = mcpu.take_substitutions()
    assert counts["torch.distributed.new_group(backend='nccl') -> gloo"] >= 1


def test_the_session_lists_each_substitution_once_with_its_count() -> None:
    # Counts arrive with each test's report (from this process or its ranks) and are summed.
    collector = ReportCollector()

    class Phase:
        def __init__(self, nodeid: str, when: str, kit: dict) -> None:
            self.nodeid, self.when, self.kit = nodeid, when, kit
            self.outcome, self.duration, self.longrepr = "passed", 0.1, None

    collector.add(Phase("t.py::a", "call", {"cpu_substitutions": {"torch.cuda.set_device": 2}}))
    collector.add(Phase("t.py::b", "call", {"cpu_substitutions": {"torch.cuda.set_device": 1, "x": 5}}))
    listed = collector.cpu_substitutions({"torch.cuda.set_device": 1})
    assert [(s.call, s.count) for s in listed or []] == [("x", 5), ("torch.cuda.set_device", 4)]
    assert ReportCollector().cpu_substitutions() is None
