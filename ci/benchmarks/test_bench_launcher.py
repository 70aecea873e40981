"""The launcher's overhead next to `torch.multiprocessing.spawn` doing the same work.

Two measurements, each for both launchers: a 2-rank no-op (spawn, import torch, a gloo process
group on a FileStore, one barrier, destroy, collect), and the time to a verdict when rank 1's real allocation
fails while rank 0 waits in an all-reduce (`run_ranks` raises `RankFailure` naming rank 1 ``oom``;
`spawn` raises `ProcessRaisedException` once it has terminated rank 0). Whole launches are slow
(seconds), so each is a few pedantic rounds of one call. ``ci/bench_compare.py`` compares
ours/spawn within each group, run against run.
"""

from __future__ import annotations

import os
import tempfile

import pytest
import torch.multiprocessing as mp

from megatron_testkit.ranks import RankFailure, run_ranks

pytestmark = [pytest.mark.L2]

ROUNDS = int(os.environ.get("KIT_BENCH_LAUNCH_ROUNDS", "3"))


def noop_rank(rank: int, world_size: int) -> int:
    import torch.distributed as dist

    # One barrier: without it, a rank that returns at once can tear its group down while its
    # peer is still connecting (gloo's connectFullMesh then fails with "Connection closed by
    # peer" and run_ranks reports that peer as an error), which happens under load.
    dist.barrier()
    return rank


def oom_rank(rank: int, world_size: int) -> None:
    import torch
    import torch.distributed as dist

    if rank == 1:
        torch.empty(2**50, dtype=torch.uint8)  # a real allocation failure (1 PiB)
    dist.all_reduce(torch.ones(1))


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


def _ours_oom() -> RankFailure:
    try:
        run_ranks(oom_rank, 2, backend="gloo", timeout=120)
    except RankFailure as failure:
        return failure
    raise AssertionError("run_ranks(oom_rank) did not fail")


def _spawn_oom() -> BaseException:
    try:
        spawn_ranks("oom_rank")
    except mp.ProcessRaisedException as exc:
        return exc
    raise AssertionError("spawn(oom_rank) did not fail")


@pytest.mark.benchmark(group="launch-noop-2ranks")
def test_noop_run_ranks(benchmark) -> None:
    benchmark.extra_info["role"] = "subject"
    result = benchmark.pedantic(run_ranks, args=(noop_rank, 2), kwargs={"backend": "gloo"}, rounds=ROUNDS)
    assert result == [0, 1]


@pytest.mark.benchmark(group="launch-noop-2ranks")
def test_noop_torch_spawn(benchmark) -> None:
    benchmark.extra_info["role"] = "baseline"
    benchmark.pedantic(spawn_ranks, args=("noop_rank",), rounds=ROUNDS)


@pytest.mark.benchmark(group="launch-oom-verdict")
def test_oom_verdict_run_ranks(benchmark) -> None:
    benchmark.extra_info["role"] = "subject"
    failure = benchmark.pedantic(_ours_oom, rounds=ROUNDS)
    assert (failure.rank, failure.kind) == (1, "oom"), str(failure)[:500]


@pytest.mark.benchmark(group="launch-oom-verdict")
def test_oom_verdict_torch_spawn(benchmark) -> None:
    benchmark.extra_info["role"] = "baseline"
    exc = benchmark.pedantic(_spawn_oom, rounds=ROUNDS)
    assert "can't allocate memory" in str(exc) or "allocate" in str(exc), str(exc)[:500]
