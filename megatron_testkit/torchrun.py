"""`run_ranks` inside a torchrun job: run on this rank, in this process, with the job's group.

torchrun has already started one process per rank and handles tearing the job down, so nothing is
spawned here. Unless the job already has a default process group, one is created for the call from
the environment (``env://``) and destroyed after it, as each spawned launch has its own. Each such
group keys its rendezvous under a prefix of its own (`_GROUPS` counts them; every rank makes the
same calls in the same order): torchrun's agent store outlives the groups, and an unprefixed second
group could read a peer's gloo address of the previous one and be refused. Every rank gets every
rank's return value, as with the spawning launcher. (The plugin turns the agent's SIGTERM into a
KeyboardInterrupt, so a rank's pytest writes its report when a peer fails.)

The test's ``memory_budget`` holds each rank as it does a spawned one, on the peak since the call:
the rank is this pytest process, so its high-water mark is reset before ``fn`` (VmHWM through
``/proc/self/clear_refs``, CUDA's peak statistics) and read after it. A rank over its budget is a
``MemoryBudgetExceeded`` outcome in the gather that already follows ``fn``, so every rank fails the
test as ``oom`` naming that rank. Stopping the rank the moment it crosses (as a spawned rank's
watchdog does) would end this pytest session with it: the check comes after ``fn``.
"""

from __future__ import annotations

import itertools
import os
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

_GROUPS = itertools.count()  # the default groups this process created, in order (a store prefix each)


def run_in_torchrun(
    fn: Callable[..., Any], world_size: int, *, backend: str = "auto", args: Sequence[Any] = ()
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on this torchrun rank and all-gather the results."""
    __tracebackhide__ = True
    import torch
    import torch.distributed as dist

    rank, job_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if job_size != world_size:
        raise ValueError(
            f"run_ranks(world_size={world_size}) inside a torchrun job of WORLD_SIZE={job_size}: "
            f"launch the job with --nproc-per-node/--nnodes giving {world_size} ranks"
        )
    started = time.time()
    created = not dist.is_initialized()
    if created:
        if backend == "auto":
            backend = "nccl" if torch.cuda.is_available() else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        store, _, _ = next(dist.rendezvous("env://", rank, world_size))
        store = dist.PrefixStore(f"megatron_testkit/run_ranks/{next(_GROUPS)}", store)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size)
    try:
        return _run_and_gather(fn, rank, world_size, args, backend, created, started)
    finally:
        if created and dist.is_initialized():
            dist.destroy_process_group()


def _run_and_gather(
    fn: Callable[..., Any],
    rank: int,
    world_size: int,
    args: Sequence[Any],
    backend: str,
    created: bool,
    started: float,
) -> list[Any]:
    """``fn`` on this rank, then every rank's outcome, gathered: a rank whose ``fn`` raised is named
    on every rank (one RankFailure, the same root cause), so its peers end the test too instead of
    waiting for results that never come (and the session's next test starts on every rank)."""
    __tracebackhide__ = True
    import torch.distributed as dist

    from megatron_testkit.budgets import MemoryBudgetExceeded
    from megatron_testkit.diagnosis import RankFailure, RankRecord, format_failure, root_cause

    in_use = backend if created else dist.get_backend() if dist.is_initialized() else backend
    measured = _PeakSinceCall(in_use)
    try:
        outcome: tuple[str, Any] = ("ok", fn(rank, world_size, *args))
        measured.check()
    except Exception as exc:
        if isinstance(exc, MemoryBudgetExceeded):
            exc.__traceback__ = None  # the kit's check, not the test's code
        outcome = ("failed", _failed_record(rank, exc))
    except BaseException as exc:  # an interrupt (the agent's SIGTERM): no peer to wait for
        record = _failed_record(rank, exc)
        raise RankFailure(
            format_failure(root_cause([record]) or record, [record]),
            rank=rank, kind=record.kind or "error", records=[record], log_dir=None,
        ) from exc  # fmt: skip
    outcomes: list[Any] = [None] * world_size
    dist.all_gather_object(outcomes, outcome)
    _record(world_size, in_use, started, measured)
    if all(status == "ok" for status, _ in outcomes):
        return [value for _, value in outcomes]
    records = [
        value if status == "failed" else RankRecord(rank=r, status="ok")
        for r, (status, value) in enumerate(outcomes)
    ]
    root = root_cause(records)
    assert root is not None
    raise RankFailure(
        format_failure(root, records),
        rank=root.rank,
        kind=root.kind or "error",
        records=records,
        log_dir=None,
    )


class _PeakSinceCall:
    """This rank's peaks from its construction on (made just before ``fn``), and its budget."""

    def __init__(self, backend: str) -> None:
        import torch

        from megatron_testkit import attribution, devices, procfs

        self.cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()
        # Without the reset, VmHWM is the session's peak so far: no figure of this call's own.
        self.host_known = procfs.reset_peak_rss()
        context = attribution.current()
        budget = context.budget if context is not None else None
        self.budget_host = (
            devices.rank_host_budget(budget.host_bytes, backend, gpu_test=context.gpu)
            if budget is not None and context is not None
            else None
        )
        self.budget_device = budget.device_bytes if budget is not None else None

    def host(self) -> int | None:
        """The peak RSS since the call (None where the peak could not be reset)."""
        from megatron_testkit.rank_worker import peak_rss_bytes

        return peak_rss_bytes() if self.host_known else None

    def device(self) -> int | None:
        """The peak CUDA memory allocated since the call (None without CUDA)."""
        from megatron_testkit.rank_worker import peak_device_bytes

        return peak_device_bytes()

    def check(self) -> None:
        """`MemoryBudgetExceeded` when a peak since the call broke the test's budget."""
        from megatron_testkit.budgets import MemoryBudgetExceeded, format_size

        host, device = self.host(), self.device()
        if self.budget_host and host is not None and host > self.budget_host:
            raise MemoryBudgetExceeded(
                f"host memory budget exceeded: peak RSS {format_size(host, self.budget_host)} since the "
                f"call > budget {format_size(self.budget_host, host)} (torchrun: checked after the call)"
            )
        if self.budget_device and device is not None and device > self.budget_device:
            raise MemoryBudgetExceeded(
                f"device memory budget exceeded: peak allocated {format_size(device, self.budget_device)} "
                f"since the call > budget {format_size(self.budget_device, device)} (torchrun: checked "
                "after the call)"
            )


def _failed_record(rank: int, exc: BaseException) -> Any:
    """This rank's failure as a RankRecord (picklable: it is gathered to every rank)."""
    from megatron_testkit.diagnosis import RankRecord

    return RankRecord(
        rank=rank,
        status="failed",
        time=time.time(),
        exc_type=f"{type(exc).__module__}.{type(exc).__qualname__}".removeprefix("builtins."),
        exc_message=str(exc),
        traceback="".join(traceback.format_exception(type(exc), exc, exc.__traceback__)),
    )


def _record(world_size: int, backend: str, started: float, measured: _PeakSinceCall) -> None:
    """Attribute the launch to the running test; only this rank's figures (its peaks since the
    call) are known here."""
    from megatron_testkit import attribution
    from megatron_testkit.devices import rank_device_name
    from megatron_testkit.golden import launch_platform
    from megatron_testkit.schema import RankPeak, Run

    test_id = attribution.current_test_id() or "torchrun"
    rank = int(os.environ["RANK"])
    device = rank_device_name()
    attribution.record_run(
        Run(
            world_size=world_size,
            backend=f"{backend} (torchrun)",
            started=started,
            seed=attribution.seed_for(test_id),
            duration_s=time.time() - started,
            log_dir=None,
            ranks=[
                RankPeak(
                    rank=rank,
                    peak_host_bytes=measured.host(),
                    peak_device_bytes=measured.device(),
                )
            ],
            device=device,
            platform=launch_platform(backend, device),
        )
    )
