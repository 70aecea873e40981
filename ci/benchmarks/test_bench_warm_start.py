"""Warm starts: `run_ranks` warm, `run_ranks` cold and a bare fork from a warm parent, side by side.

Round by round (the order rotated every round), the same work three ways: `run_ranks` forking its
ranks from the warm parent (`megatron_testkit.warm_start`), `run_ranks` spawning them
(``KIT_WARM_START=0``), and the floor: a process that imported torch once and forks the ranks
itself, with nothing of the kit around them. The work: 2 ranks, a gloo process group on a
FileStore, one all_reduce. ``extra_info`` holds each way's median wall time (seconds) and the
ratios ``run_ranks warm / bare fork`` and ``run_ranks cold / bare fork``, which `python -m ci
bench` prints and compares run against run, and ``warm_speedup`` (cold / warm).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time

import pytest

from megatron_testkit import warm_start
from megatron_testkit.ranks import run_ranks

pytestmark = [pytest.mark.L2]

ROUNDS = int(os.environ.get("KIT_BENCH_LAUNCH_ROUNDS", "5"))


def all_reduce_rank(rank: int, world_size: int) -> float:
    import torch
    import torch.distributed as dist

    t = torch.ones(1)
    dist.all_reduce(t)
    return float(t)


# The floor: import torch once, then per round fork 2 ranks that each init gloo on a FileStore, run
# one all_reduce and leave; the parent waits for both. Prints each round's wall time (seconds).
BARE_FORK = """
import json, os, sys, tempfile, time
from datetime import timedelta
import torch, torch.distributed as dist
rounds, world = int(sys.argv[1]), 2
times = []
for _ in range(rounds):
    folder = tempfile.mkdtemp()
    start = time.perf_counter()
    pids = []
    for rank in range(world):
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                store = dist.FileStore(os.path.join(folder, "store"), world)
                dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=60))
                t = torch.ones(1)
                dist.all_reduce(t)
                dist.barrier()
                dist.destroy_process_group()
                code = 0 if float(t) == world else 3
            finally:
                os._exit(code)
        pids.append(pid)
    codes = [os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) for pid in pids]
    times.append(time.perf_counter() - start)
    assert codes == [0] * world, codes
print(json.dumps(times))
"""


def _bare_fork_times(rounds: int) -> list[float]:
    env = {**os.environ, **warm_start.PARENT_ENV}
    out = subprocess.run(
        [sys.executable, "-c", BARE_FORK, str(rounds)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def _timed(fn, *args) -> float:
    start = time.perf_counter()
    fn(*args)
    return time.perf_counter() - start


def test_warm_start_two_rank_all_reduce(benchmark, monkeypatch: pytest.MonkeyPatch) -> None:
    """2 ranks, one gloo all_reduce: run_ranks warm, run_ranks cold, a bare fork from a warm parent."""

    def warm() -> None:
        assert run_ranks(all_reduce_rank, 2, timeout=120) == [2.0, 2.0]

    def cold() -> None:
        with monkeypatch.context() as m:
            m.setenv("KIT_WARM_START", "0")
            assert run_ranks(all_reduce_rank, 2, timeout=120) == [2.0, 2.0]

    warm()  # the warm parent is started (torch imported) before anything is timed
    times: dict[str, list[float]] = {"warm": [], "cold": []}

    def one_round() -> None:
        order = ["warm", "cold"] if len(times["warm"]) % 2 == 0 else ["cold", "warm"]
        for name in order:
            times[name].append(_timed(warm if name == "warm" else cold))

    benchmark.pedantic(one_round, rounds=ROUNDS, iterations=1)
    bare = _bare_fork_times(ROUNDS)
    medians = {
        "run_ranks warm": statistics.median(times["warm"]),
        "run_ranks cold": statistics.median(times["cold"]),
        "bare fork": statistics.median(bare),
    }
    benchmark.extra_info["median_s"] = {k: round(v, 4) for k, v in medians.items()}
    benchmark.extra_info["ratios"] = {
        "run_ranks warm / bare fork": round(medians["run_ranks warm"] / medians["bare fork"], 3),
        "run_ranks cold / bare fork": round(medians["run_ranks cold"] / medians["bare fork"], 3),
    }
    # Higher is better here, so it is a figure, not a ratio compared run against run.
    benchmark.extra_info["warm_speedup"] = round(medians["run_ranks cold"] / medians["run_ranks warm"], 2)
    benchmark.extra_info["cpu_count"] = os.cpu_count()
    benchmark.extra_info["load_1m"] = round(os.getloadavg()[0], 2)
    print(
        "\n2 ranks, one gloo all_reduce (median s): "
        + ", ".join(f"{k} {v:.3f}" for k, v in medians.items())
        + "; "
        + ", ".join(f"{k} {v}x" for k, v in benchmark.extra_info["ratios"].items())
        + f"; cold / warm {benchmark.extra_info['warm_speedup']}x"
    )
