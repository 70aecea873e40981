"""A rank that runs out of memory is ``oom`` however it dies, when its output says so.

CUDA's out-of-memory errors do not always reach Python: a C++ ``terminate`` after "CUDA error: out
of memory" aborts the process, and cuBLAS/cuDNN report a failed allocation as
``*_STATUS_ALLOC_FAILED`` or ``cudaErrorMemoryAllocation`` inside an ordinary RuntimeError. Each
rank here prints that text and dies the same way (no GPU is needed to print and abort). A SIGKILL
stays a crash without the launcher's evidence: the OOM killer prints nothing to the rank.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import pytest

from fixtures import faults
from megatron_testkit import kernel_log, runner_limit, skips
from megatron_testkit.ranks import RankFailure, run_ranks

pytestmark = pytest.mark.L0

# What CUDA, cuBLAS and cuDNN print when an allocation fails (torch's messages, shortened).
TERMINATE_OOM = (
    "terminate called after throwing an instance of 'c10::OutOfMemoryError'\n"
    "  what():  CUDA error: out of memory\n"
    "CUDA kernel errors might be asynchronously reported at some other API call"
)
CUBLAS = "CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"
CUDNN = "cuDNN error: CUDNN_STATUS_ALLOC_FAILED"
RUNTIME = "CUDA runtime error: cudaErrorMemoryAllocation"


def print_then_die(rank: int, world_size: int, text: str, how: str) -> None:
    print(text, file=sys.stderr, flush=True)
    if how == "abort":
        os.abort()  # SIGABRT, as std::terminate ends the process
    elif how == "exit":
        os._exit(1)  # a non-zero exit without a Python exception
    elif how == "raise":
        raise RuntimeError(text.splitlines()[-1])
    elif how == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)


def join_group_and_grow(rank: int, world_size: int, group: str) -> None:
    import torch

    Path(group, "cgroup.procs").write_text(str(os.getpid()))
    held = []
    while True:  # past the group's cap: the kernel's OOM killer SIGKILLs this rank
        held.append(torch.ones(8 * 2**20))  # 32 MiB, touched


def _failure(text: str, how: str) -> RankFailure:
    with pytest.raises(RankFailure) as info:
        run_ranks(print_then_die, 1, args=(text, how), timeout=60)
    return info.value


@pytest.mark.parametrize(
    ("text", "line"),
    [
        (TERMINATE_OOM, "what():  CUDA error: out of memory"),
        (CUBLAS, CUBLAS),
        (CUDNN, CUDNN),
        (RUNTIME, RUNTIME),
    ],
    ids=["cuda", "cublas", "cudnn", "runtime"],
)
def test_an_abort_after_an_out_of_memory_message_is_oom_naming_the_line(text: str, line: str) -> None:
    failure = _failure(text, "abort")
    assert failure.kind == "oom", str(failure)
    assert str(failure).splitlines()[0] == f"rank 0 oom: killed by SIGABRT after printing: {line}"


def test_an_exit_after_an_out_of_memory_message_is_oom() -> None:
    failure = _failure(TERMINATE_OOM, "exit")
    assert failure.kind == "oom", str(failure)
    assert "exited with code 1 without a Python exception after printing: " in str(failure)


@pytest.mark.parametrize("text", [CUBLAS, CUDNN, RUNTIME], ids=["cublas", "cudnn", "runtime"])
def test_an_exception_naming_a_failed_cuda_allocation_is_oom(text: str) -> None:
    failure = _failure(text, "raise")
    assert failure.kind == "oom", str(failure)
    assert str(failure).startswith(f"rank 0 oom: RuntimeError: {text}")


def test_a_sigkill_after_an_out_of_memory_message_is_still_a_crash_without_evidence() -> None:
    failure = _failure(TERMINATE_OOM, "sigkill")
    assert failure.kind == "crash", str(failure)
    assert str(failure).splitlines()[0] == "rank 0 crash: killed by SIGKILL (possibly the kernel OOM killer)"


def test_an_abort_without_an_out_of_memory_message_is_still_a_crash() -> None:
    failure = _failure("about to abort", "abort")
    assert failure.kind == "crash", str(failure)
    assert str(failure).splitlines()[0] == "rank 0 crash: killed by SIGABRT"


def test_a_sigkill_the_kernel_logged_as_an_oom_kill_is_oom_quoting_the_log(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A real kernel OOM kill in a memory cgroup the launcher does not watch (the rank joins it by
    # itself; no KIT_RANK_CGROUP): the kernel's log is the only evidence that it was memory.
    available, why = faults.kernel_oom_availability()
    if not available:
        skips.skip("cgroup", why)
    if not kernel_log.readable():
        skips.skip(
            "cgroup", "the kernel's log (/dev/kmsg) cannot be read here, so its OOM records cannot be seen"
        )
    monkeypatch.delenv(runner_limit.RANK_CGROUP_ENV, raising=False)
    group = faults.CappedCgroup()
    try:
        with pytest.raises(RankFailure) as info:
            run_ranks(join_group_and_grow, 1, args=(str(group.path),), timeout=60)
        assert group.oom_kills() == 1  # the ground truth: the group's own counter saw the kill
    finally:
        assert group.remove()
    failure = info.value
    assert failure.kind == "oom", str(failure)
    first = str(failure).splitlines()[0]
    pid = failure.records[0].pid
    assert first.startswith(
        "rank 0 oom: megatron_testkit.RunnerMemoryExceeded: killed by the kernel OOM killer"
    )
    assert f"pid={pid}," in first or f"Killed process {pid} " in first
