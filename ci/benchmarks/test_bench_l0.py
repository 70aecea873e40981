"""L0 serial against L0 parallel under memory admission, in one run (`python -m ci l0-bench`, `ci.l0_bench`).

One round (each side is a whole L0 session, minutes): serial first, then on the CPU row's xdist
workers. ``extra_info`` holds each side's wall, CPU and peak memory (the process tree's sampled
RSS, and the session's peak of admitted memory against the runner's), and the ratio
``parallel / serial`` that `python -m ci bench` compares night to night, with its floor on the
machine (the serial CPU time over the workers' cores' worth of its wall time).
"""

from __future__ import annotations

import os

import pytest

from ci import l0_bench

pytestmark = [pytest.mark.L2]


@pytest.mark.benchmark(group="l0-serial-vs-parallel")
def test_l0_serial_and_parallel(benchmark, tmp_path) -> None:
    sides: dict[str, dict] = {}

    def both() -> None:
        sides["serial"] = l0_bench.run_l0(1, tmp_path / "serial", [])
        sides["parallel"] = l0_bench.run_l0(l0_bench.JOBS[l0_bench.ROW].workers, tmp_path / "parallel", [])

    benchmark.pedantic(both, rounds=1, iterations=1)
    serial, parallel = sides["serial"], sides["parallel"]
    assert serial["returncode"] == 0 and parallel["returncode"] == 0, (serial, parallel)
    assert serial["outcome_counts"] == parallel["outcome_counts"]  # the same tests, the same outcomes
    ratios = l0_bench.compare(serial, parallel)
    for side, figures in sides.items():
        for key in ("wall_s", "cpu_s", "peak_tree_rss_bytes", "admission_peak_bytes", "queued_s"):
            benchmark.extra_info[f"{side}_{key}"] = figures.get(key)
    benchmark.extra_info["admission_limit_bytes"] = parallel.get("admission_limit_bytes")
    benchmark.extra_info["floor"] = ratios["floor (serial CPU / (N x serial wall))"]
    benchmark.extra_info["ratios"] = {"parallel / serial wall": ratios["parallel / serial wall"]}
    benchmark.extra_info["load_average_1min"] = os.getloadavg()[0]
    print("\n".join(l0_bench.table(serial, parallel)))
