"""`run_ranks` inside a torchrun job: run on this rank, in this process, with the job's group.

torchrun has already started one process per rank and handles tearing the job down, so nothing is
spawned here. Unless the job already has a default process group, one is created for the call from
the environment (``env://``) and destroyed after it, as each spawned launch has its own. Each such
group keys its rendezvous under a prefix of its own (`_GROUPS` counts them; every rank makes the
same calls in the same order): torchrun's agent store outlives the groups, and an unprefixed second
group could read a peer's gloo address of the previous one and be refused. Every rank gets every
rank's return value, as with the spawning launcher, through the job's store rather than a
collective: the gather is bounded (the stall rule's verdict, `megatron_testkit.torchrun_watch`, or
the call's timeout) and never waits in a collective a blocked peer cannot join. An interrupt (the
plugin turns the agent's SIGTERM into a KeyboardInterrupt) is told to the peers and goes on
unwrapped, so it ends the rank's session with its report.

The test's ``memory_budget`` holds each rank as it does a spawned one, on the peak since the call:
the rank is this pytest process, so its high-water mark is reset before ``fn`` (VmHWM through
``/proc/self/clear_refs``, CUDA's peak statistics) and read after it. A rank over its budget is a
``MemoryBudgetExceeded`` outcome in the gather that already follows ``fn``, so every rank fails the
test as ``oom`` naming that rank. Stopping the rank the moment it crosses (as a spawned rank's
watchdog does) would end this pytest session with it: the check comes after ``fn``.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

_GROUPS = itertools.count()  # the default groups this process created, in order (a store prefix each)
_CALLS = itertools.count()  # every call, in order: the store prefix of its watch and gather
GATHER_POLL_S = 0.05  # how often the gather looks for the peers' outcomes and a verdict


def run_in_torchrun(
    fn: Callable[..., Any],
    world_size: int,
    *,
    backend: str = "auto",
    args: Sequence[Any] = (),
    timeout: float = 300.0,
    stall_window: float | str | None = "default",
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on this torchrun rank and gather every rank's outcome.

    ``timeout`` bounds the gather (from this rank's arrival: a peer still in ``fn`` that long is
    named; `run_ranks` passes its own, ``KIT_RANK_TIMEOUT`` by default); ``stall_window`` is the
    deadlock rule's, resolved as `run_ranks` resolves it.
    """
    __tracebackhide__ = True
    import torch
    import torch.distributed as dist

    from megatron_testkit import attribution, stall
    from megatron_testkit.torchrun_watch import CallWatch

    rank, job_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if job_size != world_size:
        raise ValueError(
            f"run_ranks(world_size={world_size}) inside a torchrun job of WORLD_SIZE={job_size}: "
            f"launch the job with --nproc-per-node/--nnodes giving {world_size} ranks"
        )
    if stall_window == "default":
        context = attribution.current()
        stall_window = (
            context.stall_window
            if context is not None and context.stall_window != "default"
            else stall.default_window()
        )
    window = stall.check_window(stall_window)
    started = time.time()
    # A restarted job (torchrun --max-restarts) keeps its agent's store: the keys of a restart are its own.
    call = f"megatron_testkit/torchrun/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/{next(_CALLS)}"
    created = not dist.is_initialized()
    if created:
        if backend == "auto":
            backend = "nccl" if torch.cuda.is_available() else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        job_store, _, _ = next(dist.rendezvous("env://", rank, world_size))
        store = dist.PrefixStore(f"megatron_testkit/run_ranks/{next(_GROUPS)}", job_store)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size)
    else:
        from torch.distributed import distributed_c10d

        job_store = distributed_c10d._get_default_store()
    watch = CallWatch(job_store, call, rank, world_size, window, _end_blocked_rank).start()
    try:
        return _run_and_gather(fn, rank, world_size, args, backend, created, started, watch, timeout)
    finally:
        watch.stop()
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
    watch: Any,
    bound: float,
) -> list[Any]:
    """``fn`` on this rank, then every rank's outcome, gathered through the job's store: a rank whose
    ``fn`` raised (or broke its memory budget) is named on every rank (one RankFailure, the same
    root cause), so its peers end the test too instead of waiting for results that never come.
    The gather is bounded: it ends on the stall rule's verdict (a peer blocked in a collective this
    rank never joins), or names the peers still in ``fn`` ``bound`` seconds after this rank arrived."""
    __tracebackhide__ = True
    import torch.distributed as dist

    from megatron_testkit.budgets import MemoryBudgetExceeded
    from megatron_testkit.diagnosis import RankRecord, judge

    in_use = backend if created else dist.get_backend() if dist.is_initialized() else backend
    measured = _PeakSinceCall(in_use)
    try:
        outcome: tuple[str, Any] = ("ok", fn(rank, world_size, *args))
        measured.check()
    except Exception as exc:
        if isinstance(exc, MemoryBudgetExceeded):
            exc.__traceback__ = None  # the kit's check, not the test's code
        outcome = ("failed", _failed_record(rank, exc))
    except BaseException as exc:
        # An interrupt (the agent's SIGTERM, Ctrl-C): it ends this rank's session, as pytest ends
        # any session on one. The peers are told (their gather ends) and it goes on unwrapped: as a
        # test failure it would let the session run its next test.
        with contextlib.suppress(Exception):
            watch.arrive(("failed", _failed_record(rank, exc)))
        raise
    outcomes = _gather(watch, outcome, rank, world_size, bound)
    _record(world_size, in_use, started, measured)
    if all(status == "ok" for status, _ in outcomes):
        return [value for _, value in outcomes]
    records = [
        value if status == "failed" else RankRecord(rank=r, status="ok")
        for r, (status, value) in enumerate(outcomes)
    ]
    failure = judge(records)
    assert failure is not None
    raise failure


def _gather(watch: Any, outcome: tuple[str, Any], rank: int, world_size: int, bound: float) -> list[Any]:
    """Every rank's outcome from the store (see `_run_and_gather`); RankFailure on a verdict or the bound."""
    __tracebackhide__ = True
    import pickle

    watch.arrive(outcome)
    arrived: dict[int, Any] = {}
    deadline = time.monotonic() + bound
    while True:
        for r in range(world_size):
            if r not in arrived and (raw := watch.get(f"outcome/{r}")) is not None:
                arrived[r] = pickle.loads(raw)  # a peer of this job: as all_gather_object trusts them
        if len(arrived) == world_size:
            return [arrived[r] for r in range(world_size)]
        verdict = watch.verdict()
        if verdict is not None:
            stacks = watch.stacks([r for r in verdict.get("blocked", []) if r not in arrived])
            watch.seen()
            raise _verdict_failure(verdict, arrived, stacks, world_size)
        if time.monotonic() > deadline:
            raise _missing_failure(arrived, world_size, bound)
        time.sleep(GATHER_POLL_S)


def _ranks_records(arrived: dict[int, Any], world_size: int, missing: Callable[[int], Any]) -> list[Any]:
    from megatron_testkit.diagnosis import RankRecord

    records = []
    for r in range(world_size):
        if r not in arrived:
            records.append(missing(r))
        else:
            status, value = arrived[r]
            records.append(value if status == "failed" else RankRecord(rank=r, status="ok"))
    return records


def _verdict_failure(
    verdict: dict[str, Any], arrived: dict[int, Any], stacks: dict[int, str], world_size: int
) -> Any:
    """The stall rule's verdict as the call's RankFailure: the rank it names, the cycle, each rank's
    wait; the blocked ranks' stacks as they posted them."""
    from megatron_testkit.diagnosis import RankFailure, RankRecord, Verdict, format_failure
    from megatron_testkit.stall import Stall

    records = _ranks_records(
        arrived,
        world_size,
        lambda r: RankRecord(rank=r, status="hung", kind="hang", stack=stacks.get(r) or None),
    )
    root = records[int(verdict["rank"])]
    if root.status != "failed":
        root.kind = "hang"
    stall = Stall(
        int(verdict["rank"]),
        str(verdict["why"]),
        tuple(verdict.get("lines", ())),
        tuple(verdict.get("waits", ())),
        tuple(verdict.get("cycle", ())),
    )
    message = format_failure(Verdict(root, records, stall=stall))
    if root.kind != "hang":  # format_failure leads with the verdict only for a hang
        first, _, rest = message.partition("\n")
        message = f"{first}\n{verdict['why']}\n{rest}"
    message += (
        "\ntorchrun: a rank blocked in a collective cannot go back to its session; it wrote its report "
        "and exits, which ends the job"
    )
    return RankFailure(message, rank=root.rank, kind=root.kind or "error", records=records, log_dir=None)


def _missing_failure(arrived: dict[int, Any], world_size: int, bound: float) -> Any:
    """The peers that did not finish the call within ``bound`` of this rank, named as hung."""
    from megatron_testkit.diagnosis import RankFailure, RankRecord, Verdict, format_failure

    missing = [r for r in range(world_size) if r not in arrived]
    records = _ranks_records(arrived, world_size, lambda r: RankRecord(rank=r, status="hung", kind="hang"))
    failed = [rec for rec in records if rec.status == "failed"]
    root = min(failed, key=lambda rec: (rec.time or 0.0, rec.rank)) if failed else records[missing[0]]
    names = ", ".join(map(str, missing))
    message = (
        f"rank {missing[0]} hang: rank(s) {names} did not finish the call within {bound:g} s of this "
        f"rank's finishing it (still in the function: computing, or blocked where the stall rule could "
        f"not judge it)\n\n" + format_failure(Verdict(root, records))
    )
    return RankFailure(message, rank=missing[0], kind="hang", records=records, log_dir=None)


def _end_blocked_rank(watch: Any, verdict: dict[str, Any], stacks: dict[int, str]) -> None:
    """This rank is blocked in a collective the verdict names: its report, with the verdict as the
    running test's failure (the peers' outcomes as they posted them), then its end
    (`megatron_testkit.last_words`)."""
    import pickle

    from megatron_testkit import last_words

    arrived = {}
    for r in range(watch.world_size):
        raw = watch.get(f"outcome/{r}")
        if raw is not None:
            arrived[r] = pickle.loads(raw)
    failure = _verdict_failure(verdict, arrived, stacks, watch.world_size)
    last_words.end_process(
        f"rank {os.environ.get('RANK')} blocked in a deadlock the stall rule named; ending it: "
        + str(failure).splitlines()[0],
        failure.to_failure(),
        1,
        1,
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
        from megatron_testkit.budgets import check_peaks

        check_peaks(
            self.host(),
            self.device(),
            self.budget_host,
            self.budget_device,
            since=" since the call",
            note=" (torchrun: checked after the call)",
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
    from megatron_testkit.platforms import launch_platform
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
