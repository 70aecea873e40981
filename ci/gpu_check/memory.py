"""Step ``memory``: `memory_report` on CUDA in an NCCL rank, and a planted CUDA OOM named as rank 0's.

Also the host RSS a CUDA rank carries: the figure behind the CUDA host allowance.
Rank functions are module-level so `run_ranks` can import them by name in fresh processes.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from ci.gpu_check.summary import StepFailed, expect

if TYPE_CHECKING:
    from ci.gpu_check.summary import CheckState

GiB = 1024**3


def _host_rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def memory_rank(rank: int, world_size: int) -> dict[str, Any]:
    """memory_report on CUDA in an NCCL rank, before and after an allocation and a collective."""
    import torch
    import torch.distributed as dist

    from accounting import memory_report

    x = torch.empty(64 * 2**20, dtype=torch.uint8, device="cuda")
    t = torch.ones(1, device="cuda")
    dist.all_reduce(t)
    torch.cuda.synchronize()
    report = memory_report()
    free, total = torch.cuda.mem_get_info()
    return {
        "report": report,
        "tensor_bytes": x.numel(),
        "host_rss_bytes": _host_rss(),  # a CUDA + NCCL rank's RSS: the host allowance's figure
        "card_used_bytes": total - free,  # context + NCCL + allocator: what the cap does not see
        "all_reduce": float(t.item()),
    }


def oom_rank(rank: int, world_size: int, size_bytes: int) -> None:
    """Allocate past the device budget the launcher capped this rank to."""
    import torch

    torch.empty(size_bytes, dtype=torch.uint8, device="cuda")


def step(check: CheckState) -> dict[str, Any]:
    """A 1 GiB device budget caps the card at 1 GiB; on the GPU, the report and the planted OOM."""
    from megatron_testkit import devices
    from megatron_testkit.budgets import MemoryBudget

    budget = MemoryBudget.parse(device="1GiB")
    cap = devices.device_memory_cap(budget.device_bytes, {})
    expect(cap == GiB, f"device cap of a 1GiB budget is {cap}")
    if check.dry:
        return {"device_cap_bytes": cap, "planted_oom_bytes": 2 * GiB}
    figures = _report_on_cuda(check)
    figures.update(_planted_oom(check, budget))
    return figures


def _report_on_cuda(check: CheckState) -> dict[str, Any]:
    """memory_report's device keys, as ints, with the peak at least the rank's own tensor."""
    from megatron_testkit.ranks import run_ranks

    got = run_ranks(memory_rank, 1, backend="nccl", timeout=min(90, check.remaining()))[0]
    report = got["report"]
    expect("allocated_bytes" in report, f"memory_report() on a CUDA rank gave host keys: {sorted(report)}")
    expect(
        report["peak_allocated_bytes"] >= got["tensor_bytes"],
        f"peak_allocated_bytes {report['peak_allocated_bytes']} < the {got['tensor_bytes']} B tensor",
    )
    expect(all(type(v) is int for v in report.values()), f"non-int values in {report}")
    return {
        "cuda_rank_host_rss_bytes": got["host_rss_bytes"],
        "card_used_bytes": got["card_used_bytes"],
        "allocator_reserved_bytes": report["reserved_bytes"],
    }


def _planted_oom(check: CheckState, budget: Any) -> dict[str, Any]:
    """2 GiB under a 1 GiB device budget: `RankFailure` names rank 0 ``oom`` in its first words."""
    from megatron_testkit.ranks import RankFailure, run_ranks

    start = time.monotonic()
    try:
        run_ranks(
            oom_rank, 1, backend="nccl", args=(2 * GiB,), budget=budget, timeout=min(90, check.remaining())
        )
    except RankFailure as failure:
        first_line = str(failure).splitlines()[0]
        expect(
            (failure.rank, failure.kind) == (0, "oom"),
            f"planted CUDA OOM gave rank {failure.rank} {failure.kind}: {first_line}",
        )
        expect(str(failure).startswith("rank 0 oom"), f"message does not lead with the rank: {failure}")
        return {"oom_verdict_s": round(time.monotonic() - start, 2), "oom_first_line": first_line}
    raise StepFailed("allocating 2 GiB under a 1 GiB device budget succeeded: the cap was not applied")
