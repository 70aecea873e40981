"""The runner's memory limit in the launcher: a rank that pushes the launch over it is named `oom`.

Real ranks, real memory: rank 1 grows (touched pages, 8 MiB every 20 ms) while rank 0 waits in a
barrier. With ``KIT_HOST_MEMORY`` the launcher kills it on the ranks' summed RSS (the env method);
with ``KIT_RANK_CGROUP`` the ranks join a real memory cgroup at start and the kernel's OOM killer
kills it, which the launcher reads from the group's counters. The limit is the ranks' measured idle
footprint plus 150 MiB, so it is crossed only by the growth.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator

import pytest

from fixtures.ranks import RankFailure, run_ranks

pytestmark = pytest.mark.L0

MiB = 2**20
HEADROOM = 150 * MiB


def resident(rank: int, world_size: int) -> int:
    import torch.distributed as dist

    from megatron_testkit.procfs import current_rss_bytes

    dist.barrier()
    return current_rss_bytes()


def grow(rank: int, world_size: int, mib: int) -> int:
    import torch.distributed as dist

    blocks = []
    if rank == 1:
        for _ in range(mib // 8):
            blocks.append(b"\x01" * (8 * MiB))  # written, so resident
            time.sleep(0.02)
    dist.barrier()  # rank 0 waits here for rank 1
    return len(blocks)


@pytest.fixture(scope="module")
def limit() -> int:
    """Two idle ranks' summed RSS (after the process group and a barrier), plus the headroom."""
    sizes = run_ranks(resident, 2, backend="gloo", timeout=120)
    return sum(sizes) + HEADROOM


def test_kit_host_memory_kills_the_rank_that_pushed_the_sum_over_and_names_it(
    limit: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KIT_HOST_MEMORY", str(limit))
    monkeypatch.delenv("KIT_RANK_CGROUP", raising=False)
    started = time.monotonic()
    with pytest.raises(RankFailure) as info:
        run_ranks(grow, 2, backend="gloo", timeout=120, args=(600,))
    failure = info.value
    assert (failure.rank, failure.kind) == (1, "oom"), str(failure)
    first = str(failure).splitlines()[0]
    assert first.startswith("rank 1 oom: megatron_testkit.RunnerMemoryExceeded: the ranks' summed RSS ")
    assert f"> {limit / MiB:.2f} MiB (KIT_HOST_MEMORY" in first
    assert failure.records[1].signal == "SIGKILL"
    assert failure.records[0].kind != "oom"  # the rank that waited is a knock-on, not a culprit
    assert time.monotonic() - started < 60


def test_within_kit_host_memory_nothing_is_killed(limit: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KIT_HOST_MEMORY", str(limit))
    # 64 MiB of growth stays below the 150 MiB headroom.
    assert run_ranks(grow, 2, backend="gloo", timeout=120, args=(64,)) == [0, 8]


@pytest.fixture
def rank_cgroup(limit: int, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    from ci.limits import apply_memory_limit

    group = apply_memory_limit(limit)
    if group.cgroup is None:
        group.close()
        pytest.skip(
            f"no writable memory cgroup on this machine (the KIT_HOST_MEMORY variant runs): {group.describe()}"
        )
    monkeypatch.setenv("KIT_RANK_CGROUP", str(group.cgroup))
    monkeypatch.setenv("KIT_HOST_MEMORY", str(limit))  # as the repro sets both; the kernel enforces
    try:
        yield str(group.cgroup)
    finally:
        group.close()
    assert group.leftovers == 0


def memory_cgroup(rank: int, world_size: int) -> str:
    from pathlib import Path

    lines = Path("/proc/self/cgroup").read_text().splitlines()
    return next(
        line.split(":", 2)[2]
        for line in lines
        if "memory" in line.split(":")[1].split(",") or line.startswith("0::")
    )


def test_a_kernel_oom_kill_in_the_ranks_cgroup_is_named_oom_not_crash(rank_cgroup: str) -> None:
    # Each rank joins the group as its first act (nothing else moves them here).
    assert [
        rank_cgroup.endswith(path) for path in run_ranks(memory_cgroup, 2, backend="gloo", timeout=120)
    ] == [True] * 2
    with pytest.raises(RankFailure) as info:
        run_ranks(grow, 2, backend="gloo", timeout=120, args=(600,))
    failure = info.value
    assert (failure.rank, failure.kind) == (1, "oom"), str(failure)
    first = str(failure).splitlines()[0]
    assert first.startswith(
        "rank 1 oom: megatron_testkit.RunnerMemoryExceeded: killed by the kernel OOM killer"
    )
    assert f"memory cgroup {rank_cgroup} (" in first and "oom_kill 0 -> 1" in first, first
    assert failure.records[1].signal == "SIGKILL"
    # pytest (this process) stayed outside the group: it survived to see the verdict.
    with open(os.path.join(rank_cgroup, "cgroup.procs")) as f:
        assert str(os.getpid()) not in f.read().split()
