"""How fast the launcher names a failure, and what it costs when nothing fails.

    python -m ci.bench_launcher [--repeat 3] [--hang-timeout 15] [--json]

Prints, over ``--repeat`` runs each (median, min, max, in seconds):

- ``oom -> RankFailure``: from the moment rank 1's real allocation failure is recorded to the
  moment `run_ranks` raises in the parent (rank 0 waits in an all_reduce meanwhile);
- ``crash -> RankFailure``: from just before rank 1 SIGKILLs itself to the raise;
- ``hang detection delay``: how long past ``timeout`` the hang verdict (with every stack) comes;
- ``2-rank no-op``: wall time of ``run_ranks(noop, 2)``, split into start-up (spawn, imports,
  process group) up to the function's entry and the rest (teardown and collection).

Figures depend heavily on machine load: on a shared 2-core runner, spawning two ranks that import
torch dominates everything.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import tempfile
import time
from typing import Any

from megatron_testkit.ranks import RankFailure, run_ranks


def oom_rank(rank: int, world_size: int) -> None:
    import torch
    import torch.distributed as dist

    if rank == 1:
        torch.empty(2**50, dtype=torch.uint8)  # a real allocation failure
    dist.all_reduce(torch.ones(1))


def crash_rank(rank: int, world_size: int, stamp: str) -> None:
    import torch
    import torch.distributed as dist

    if rank == 1:
        with open(stamp, "w") as f:
            f.write(repr(time.time()))
        os.kill(os.getpid(), signal.SIGKILL)
    dist.all_reduce(torch.ones(1))


def sleep_rank(rank: int, world_size: int) -> None:
    time.sleep(3600)


def noop_rank(rank: int, world_size: int) -> float:
    return time.time()


def _expect_failure(fn: Any, **kwargs: Any) -> tuple[RankFailure, float]:
    try:
        run_ranks(fn, 2, **kwargs)
    except RankFailure as failure:
        raised = time.time()
        if failure.log_dir:
            shutil.rmtree(failure.log_dir, ignore_errors=True)  # kept for people; not needed here
        return failure, raised
    raise AssertionError(f"{fn.__name__} did not fail")


def bench_oom() -> float:
    failure, raised = _expect_failure(oom_rank, timeout=120)
    assert (failure.rank, failure.kind) == (1, "oom"), str(failure)[:500]
    return raised - failure.records[1].time


def bench_crash() -> float:
    with tempfile.TemporaryDirectory() as tmp:
        stamp = os.path.join(tmp, "t")
        failure, raised = _expect_failure(crash_rank, timeout=120, args=(stamp,))
        assert (failure.rank, failure.kind) == (1, "crash"), str(failure)[:500]
        with open(stamp) as f:
            return raised - float(f.read())


def bench_hang(timeout: float) -> float:
    start = time.time()
    failure, raised = _expect_failure(sleep_rank, timeout=timeout)
    assert failure.kind == "hang", str(failure)[:500]
    return raised - (start + timeout)


def bench_noop() -> tuple[float, float, float]:
    start = time.time()
    entered = run_ranks(noop_rank, 2, timeout=120)
    end = time.time()
    return end - start, max(entered) - start, end - max(entered)


def _stats(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--hang-timeout", type=float, default=15.0)
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    options = parser.parse_args(argv)
    figures: dict[str, list[float]] = {k: [] for k in ("oom", "crash", "hang", "noop", "startup", "teardown")}
    for _ in range(options.repeat):
        figures["oom"].append(bench_oom())
        figures["crash"].append(bench_crash())
        figures["hang"].append(bench_hang(options.hang_timeout))
        total, startup, teardown = bench_noop()
        figures["noop"].append(total)
        figures["startup"].append(startup)
        figures["teardown"].append(teardown)
    result = {name: _stats(values) for name, values in figures.items()}
    result["cpu_count"] = os.cpu_count()
    result["load_average"] = os.getloadavg()
    if options.json:
        print(json.dumps(result, indent=2))
        return 0
    labels = {
        "oom": "oom -> RankFailure",
        "crash": "crash -> RankFailure",
        "hang": f"hang detection delay (past a {options.hang_timeout:g} s timeout)",
        "noop": "2-rank no-op, total",
        "startup": "  of which spawn + imports + process group",
        "teardown": "  of which teardown and collection",
    }
    print(f"launcher figures over {options.repeat} runs (seconds; median [min, max])")
    for key, label in labels.items():
        s = result[key]
        print(f"  {label:<52} {s['median']:6.2f}  [{s['min']:.2f}, {s['max']:.2f}]")
    load = ", ".join(f"{x:.1f}" for x in result["load_average"])
    print(f"  ({result['cpu_count']} CPUs, load average {load}: figures are noisy on a shared machine)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
