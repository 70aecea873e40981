"""The runner's memory limit in the launcher: a rank that pushes the launch over it is named `oom`.

Real ranks, real memory: rank 1 grows (touched pages, 8 MiB every 20 ms) while rank 0 waits in a
barrier. With ``KIT_HOST_MEMORY`` the launcher kills it on the ranks' summed RSS (the env method);
with ``KIT_RANK_CGROUP`` the ranks join a real memory cgroup at start and the kernel's OOM killer
kills it, which the launcher reads from the group's counters; with neither, the launcher reads the
memory cgroup it runs in (a container's or a CI job's), here a fresh one it is moved into. The limit
is the measured idle footprint plus 150 MiB, so it is crossed only by the growth.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator

import pytest

from megatron_testkit import skips
from megatron_testkit.ranks import RankFailure, run_ranks

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
    from megatron_testkit.repro_limit import apply_memory_limit

    group = apply_memory_limit(limit)
    if group.cgroup is None:
        group.close()
        skips.skip(
            "cgroup",
            f"no writable memory cgroup on this machine (the KIT_HOST_MEMORY variant runs): {group.describe()}",
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


# The launcher (not pytest) runs in a fresh memory cgroup with no KIT_RANK_CGROUP, as on a CI runner
# or in a container whose own limit is the one crossed: its ranks are born in that group, and the
# launcher reads the group it finds itself in. The limit is set from inside, once the launcher's own
# footprint is known: its RSS + the two idle ranks' + the headroom.
_LAUNCHER_IN_ITS_OWN_CGROUP = """
import json, os, sys
from pathlib import Path

group, idle, headroom = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
(group / "cgroup.procs").write_text(str(os.getpid()))
from megatron_testkit.procfs import current_rss_bytes
from megatron_testkit.ranks import RankFailure, run_ranks
from functional.test_launcher_runner_limit import grow

limit = current_rss_bytes() + idle + headroom
for name in ("memory.max", "memory.limit_in_bytes", "memory.memsw.limit_in_bytes"):
    if (group / name).exists():
        (group / name).write_text(str(limit))
try:
    run_ranks(grow, 2, backend="gloo", timeout=120, args=(600,))
    print(json.dumps({"raised": False}))
except RankFailure as failure:
    print(json.dumps({"raised": True, "rank": failure.rank, "kind": failure.kind,
                      "first": str(failure).splitlines()[0], "signal": failure.records[1].signal}))
"""


def test_a_kernel_oom_kill_in_the_launchers_own_cgroup_is_named_oom_not_crash(limit: int) -> None:
    import json
    import subprocess
    import sys

    from megatron_testkit.repro_limit import apply_memory_limit

    group = apply_memory_limit(8 << 30)  # made here; the launcher lowers it from inside
    if group.cgroup is None:
        group.close()
        skips.skip(
            "cgroup",
            f"no writable memory cgroup on this machine (the KIT_HOST_MEMORY variant runs): {group.describe()}",
        )
    env = {k: v for k, v in os.environ.items() if k not in ("KIT_RANK_CGROUP", "KIT_HOST_MEMORY")}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = os.pathsep.join([root, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    try:
        run = subprocess.run(
            [sys.executable, "-c", _LAUNCHER_IN_ITS_OWN_CGROUP, str(group.cgroup), str(limit - HEADROOM), str(HEADROOM)],
            cwd=root, env=env, capture_output=True, text=True, timeout=300,
        )  # fmt: skip
    finally:
        group.close()
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    assert got["raised"], "the rank grew 600 MiB past a 150 MiB headroom and was not killed"
    assert (got["rank"], got["kind"], got["signal"]) == (1, "oom", "SIGKILL"), got
    assert got["first"].startswith(
        "rank 1 oom: megatron_testkit.RunnerMemoryExceeded: killed by the kernel OOM killer in the "
        f"launcher's own memory cgroup {group.cgroup} ("
    ), got["first"]
    assert "oom_kill 0 -> 1" in got["first"], got["first"]
    assert group.leftovers == 0
