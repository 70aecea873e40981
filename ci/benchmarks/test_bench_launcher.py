"""The launcher: its overhead next to `torch.multiprocessing.spawn` doing the same work, and how fast it names a failure.

Each of `test_noop`, `test_oom_verdict` and `test_crash_verdict` launches `run_ranks` and `spawn`
doing the same, alternately, round by round (the order swapped every round), and records the
ratio of their median wall times, ``extra_info["ratios"] = {"run_ranks / torch_spawn": ...}``,
what `python -m ci bench` compares run against run. The work: a 2-rank no-op (spawn, import torch,
a gloo process group on a FileStore, one barrier, destroy, collect), and the time to a verdict when
rank 1's real allocation fails, or rank 1 SIGKILLs itself, while rank 0 waits in an all-reduce
(`run_ranks` raises `RankFailure` naming rank 1 ``oom`` / ``crash``; `spawn` raises once it has
terminated rank 0). A hang has no baseline (`spawn` never calls one). Whole launches are slow
(seconds), so each is a few pedantic rounds. Round by round, because timed in separate tests
the same tree's ratios moved by up to 29% from run to run on a 2-core machine.

The figures a person reads are in ``extra_info`` (medians over the rounds, seconds): the no-op's
start-up (spawn, imports, process group, up to the function's entry) and teardown, the time from
the failure to the raise for oom and crash, the hang verdict's delay past its timeout, and the
machine's CPU count and load (figures are noisy on a shared machine).
"""

from __future__ import annotations

import os
import shutil
import signal
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch.multiprocessing as mp

from megatron_testkit.ranks import RankFailure, run_ranks

pytestmark = [pytest.mark.L2]

ROUNDS = int(os.environ.get("KIT_BENCH_LAUNCH_ROUNDS", "5"))  # pairs of launches
HANG_TIMEOUT_S = 5.0  # the hang verdict's timeout: short, the delay past it is the figure


def noop_rank(rank: int, world_size: int) -> tuple[int, float]:
    """One barrier, then the rank and the moment it entered (after spawn, imports, process group)."""
    import torch.distributed as dist

    entered = time.time()
    # One barrier: without it, a rank that returns at once can tear its group down while its
    # peer is still connecting (gloo's connectFullMesh then fails with "Connection closed by
    # peer" and run_ranks reports that peer as an error), which happens under load.
    dist.barrier()
    return rank, entered


def oom_rank(rank: int, world_size: int) -> None:
    import torch
    import torch.distributed as dist

    if rank == 1:
        torch.empty(2**50, dtype=torch.uint8)  # a real allocation failure (1 PiB)
    dist.all_reduce(torch.ones(1))


def crash_rank(rank: int, world_size: int, stamp: str = "") -> None:
    """Rank 1 writes the moment it dies to `stamp` (when given), then SIGKILLs itself."""
    import torch
    import torch.distributed as dist

    if rank == 1:
        if stamp:
            with open(stamp, "w") as f:
                f.write(repr(time.time()))
        os.kill(os.getpid(), signal.SIGKILL)
    dist.all_reduce(torch.ones(1))


def sleep_rank(rank: int, world_size: int) -> None:
    time.sleep(3600)


def _spawned(rank: int, fn_name: str, world_size: int, store: str) -> None:
    """What each `run_ranks` rank does around the function: a gloo group on a FileStore."""
    import torch.distributed as dist

    os.environ["OMP_NUM_THREADS"] = "1"
    dist.init_process_group("gloo", store=dist.FileStore(store, world_size), rank=rank, world_size=world_size)
    try:
        globals()[fn_name](rank, world_size)
    finally:
        dist.destroy_process_group()


def spawn_ranks(fn_name: str, world_size: int = 2) -> None:
    with tempfile.TemporaryDirectory(prefix="bench-spawn-") as tmp:
        mp.spawn(_spawned, args=(fn_name, world_size, os.path.join(tmp, "store")), nprocs=world_size)


def _spawn_failure(fn_name: str) -> BaseException:
    try:
        spawn_ranks(fn_name)
    except (mp.ProcessRaisedException, mp.ProcessExitedException) as exc:
        return exc
    raise AssertionError(f"spawn({fn_name}) did not fail")


def _figures(benchmark: Any, samples: dict[str, list[float]]) -> None:
    """Medians of the per-round figures, and the machine they were taken on, into extra_info."""
    for name, values in samples.items():
        benchmark.extra_info[f"{name}_median_s"] = statistics.median(values)
    benchmark.extra_info["cpu_count"] = os.cpu_count()
    benchmark.extra_info["load_average_1min"] = os.getloadavg()[0]


def _failure(fn: Callable[..., Any], **kwargs: Any) -> tuple[RankFailure, float]:
    """The `RankFailure` of a 2-rank launch of `fn`, and the moment it was raised (its logs removed)."""
    try:
        run_ranks(fn, 2, backend="gloo", **kwargs)
    except RankFailure as failure:
        raised = time.time()
        if failure.log_dir:
            shutil.rmtree(failure.log_dir, ignore_errors=True)  # kept for people; not needed here
        return failure, raised
    raise AssertionError(f"run_ranks({fn.__name__}) did not fail")


def _alternate(
    benchmark: Any, ours: Callable[[], Any], theirs: Callable[[], Any]
) -> tuple[list[Any], list[Any]]:
    """`ours` (run_ranks) and `theirs` (spawn) round by round; their wall-time ratio into extra_info.

    Returns every round's result of each.
    """
    sides = {"run_ranks": ours, "torch_spawn": theirs}
    times: dict[str, list[float]] = {side: [] for side in sides}
    results: dict[str, list[Any]] = {side: [] for side in sides}

    def one_round() -> None:
        order = list(sides) if len(times["run_ranks"]) % 2 == 0 else list(reversed(sides))
        for side in order:
            start = time.perf_counter()
            results[side].append(sides[side]())
            times[side].append(time.perf_counter() - start)

    benchmark.pedantic(one_round, rounds=ROUNDS)
    medians = {side: statistics.median(values) for side, values in times.items()}
    benchmark.extra_info.update(
        run_ranks_median_s=medians["run_ranks"],
        torch_spawn_median_s=medians["torch_spawn"],
        ratios={"run_ranks / torch_spawn": medians["run_ranks"] / medians["torch_spawn"]},
    )
    return results["run_ranks"], results["torch_spawn"]


@pytest.mark.benchmark(group="launch-noop-2ranks")
def test_noop(benchmark) -> None:
    samples: dict[str, list[float]] = {"startup": [], "teardown": []}

    def launch() -> list[tuple[int, float]]:
        start = time.time()
        result = run_ranks(noop_rank, 2, backend="gloo")
        end = time.time()
        entered = max(when for _rank, when in result)
        samples["startup"].append(entered - start)  # spawn + imports + process group
        samples["teardown"].append(end - entered)  # teardown and collection
        return result

    results, _spawned = _alternate(benchmark, launch, lambda: spawn_ranks("noop_rank"))
    assert all([rank for rank, _when in result] == [0, 1] for result in results)
    _figures(benchmark, samples)


@pytest.mark.benchmark(group="launch-oom-verdict")
def test_oom_verdict(benchmark) -> None:
    samples: dict[str, list[float]] = {"oom_to_raise": []}

    def launch() -> RankFailure:
        failure, raised = _failure(oom_rank, timeout=120)
        samples["oom_to_raise"].append(raised - failure.records[1].time)  # from the failure's record
        return failure

    failures, excs = _alternate(benchmark, launch, lambda: _spawn_failure("oom_rank"))
    for failure in failures:
        assert (failure.rank, failure.kind) == (1, "oom"), str(failure)[:500]
    # spawn reports whichever process it sees fail first: rank 1's allocation failure, or rank 0's
    # all-reduce failing because its peer is gone (it cannot tell the cause from the consequence).
    named = ["allocate" in str(exc) for exc in excs]
    for exc, said in zip(excs, named, strict=True):
        assert said or getattr(exc, "error_index", None) == 0, str(exc)[:500]
    benchmark.extra_info["spawn_named_the_oom"] = f"{sum(named)} of {len(named)}"
    _figures(benchmark, samples)


@pytest.mark.benchmark(group="launch-crash-verdict")
def test_crash_verdict(benchmark, tmp_path) -> None:
    stamp = tmp_path / "killed-at"
    samples: dict[str, list[float]] = {"crash_to_raise": []}

    def launch() -> RankFailure:
        failure, raised = _failure(crash_rank, timeout=120, args=(str(stamp),))
        samples["crash_to_raise"].append(raised - float(stamp.read_text()))  # from just before SIGKILL
        return failure

    failures, excs = _alternate(benchmark, launch, lambda: _spawn_failure("crash_rank"))
    for failure, exc in zip(failures, excs, strict=True):
        assert (failure.rank, failure.kind) == (1, "crash"), str(failure)[:500]
        assert "SIGKILL" in str(exc) or "Connection closed" in str(exc), str(exc)[:500]
    _figures(benchmark, samples)


@pytest.mark.benchmark(group="launch-hang-verdict")
def test_hang_verdict_run_ranks(benchmark) -> None:
    # No baseline: spawn never calls a hang. The figure is how long past its timeout the verdict comes.
    benchmark.extra_info["timeout_s"] = HANG_TIMEOUT_S
    samples: dict[str, list[float]] = {"hang_delay_past_timeout": []}

    def launch() -> RankFailure:
        start = time.time()
        failure, raised = _failure(sleep_rank, timeout=HANG_TIMEOUT_S)
        samples["hang_delay_past_timeout"].append(raised - (start + HANG_TIMEOUT_S))
        return failure

    failure = benchmark.pedantic(launch, rounds=ROUNDS)
    assert failure.kind == "hang", str(failure)[:500]
    _figures(benchmark, samples)
