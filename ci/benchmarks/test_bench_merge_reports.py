"""`merge-reports` on large jobs: 2 processes x 100,000 tests, and 64 processes x 5,000 tests.

Each shape writes one torchrun job's per-process reports (``node<N>/rank<R>/kit-report.json``, the
layout `megatron_testkit.torchrun_merge` documents: lean passing rows of one rank, one failed test in
a thousand with a failure on every process), then times the three steps of the command on them:
reading the reports (`find_reports`, the bounded reader and the schema check), merging them
(`merge`) and writing the result (`write`). The merge used to be quadratic in tests x process
reports (16 x 5,000 took 74 s, 2 x 100,000 was killed after 9 minutes); it is linear now, so its
time grows like the reading's. The figures (seconds of wall time, and of this process' CPU time,
which the machine's load moves less) are printed and kept in ``extra_info``;
``extra_info["ratios"]["merge / read"]`` (in CPU time) is what `python -m ci bench` compares run against run (a
merge that turned super-linear again multiplies it).
"""

from __future__ import annotations

import itertools
import json
import os
import time
from pathlib import Path

import pytest

from megatron_testkit import torchrun_merge

pytestmark = [pytest.mark.L2, pytest.mark.benchmark]

# (processes, tests per process), the two shapes the merge must take in seconds.
SHAPES = [(2, 100_000), (64, 5_000)]
PER_NODE = 8  # ranks of one node (their reports share a node<N> folder)
FAIL_EVERY = 1_000  # one failed test in this many, failed on every process


def _row(i: int, rank: int) -> dict:
    failed = i % FAIL_EVERY == 0
    row = {
        "nodeid": f"tests/test_mod{i // 100}.py::test_case_{i}",
        "outcome": "failed" if failed else "passed",
        "duration_s": 0.01,
        "world_size": 2,
        "backend": "gloo (torchrun)",
        "peak_host_bytes": 1000 + rank,
        "ranks": [{"rank": rank, "peak_host_bytes": 1000 + rank}],
    }
    if failed:
        row["failure"] = {"rank": rank, "kind": "error", "first_line": f"rank {rank} error: ValueError: {i}"}
    return row


def write_job(base: Path, processes: int, tests: int) -> Path:
    """One job's per-process reports under `base` (compact JSON, as the plugin's size cap allows)."""
    for rank in range(processes):
        folder = base / f"node{rank // PER_NODE}" / f"rank{rank}"
        folder.mkdir(parents=True)
        report = {
            "version": 1,
            "session": {"host": f"host{rank // PER_NODE}", "duration_s": 60.0, "outcome_counts": {}},
            "tests": [_row(i, rank) for i in range(tests)],
        }
        (folder / "kit-report.json").write_text(json.dumps(report, separators=(",", ":")))
    return base


@pytest.mark.parametrize(("processes", "tests"), SHAPES, ids=[f"{p}x{t}" for p, t in SHAPES])
def test_merge_reports(benchmark, tmp_path: Path, capsys, processes: int, tests: int) -> None:
    reports = write_job(tmp_path / "reports", processes, tests)
    figures: dict[str, float] = {}

    def one_round() -> dict:
        clocks = [(time.perf_counter(), time.process_time())]
        sources = torchrun_merge.find_reports([reports])
        clocks.append((time.perf_counter(), time.process_time()))
        merged = torchrun_merge.merge(sources)
        clocks.append((time.perf_counter(), time.process_time()))
        torchrun_merge.write(merged, tmp_path / "out")
        clocks.append((time.perf_counter(), time.process_time()))
        for step, (before, after) in zip(("read", "merge", "write"), itertools.pairwise(clocks), strict=True):
            figures[f"{step}_s"] = after[0] - before[0]
            figures[f"{step}_cpu_s"] = after[1] - before[1]  # this process only: less moved by load
        return merged

    merged = benchmark.pedantic(one_round, rounds=1, iterations=1)
    # What the merge must give at this size: every test once, each with every process' rank.
    assert len(merged["tests"]) == tests
    assert all(len(row["ranks"]) == processes for row in merged["tests"][:: max(1, tests // 100)])
    failing = [row for row in merged["tests"] if row["failure"]]
    assert len(failing) == len(range(0, tests, FAIL_EVERY))
    assert all(len(row["failures"]) == processes for row in failing)
    benchmark.extra_info.update(
        {
            **{k: round(v, 3) for k, v in figures.items()},
            "ratios": {"merge / read": figures["merge_cpu_s"] / figures["read_cpu_s"]},
        }
    )
    with capsys.disabled():
        print(
            f"\nmerge-reports {processes} x {tests:,} tests, wall (CPU): "
            + ", ".join(
                f"{step} {figures[f'{step}_s']:.2f} s ({figures[f'{step}_cpu_s']:.2f} s)"
                for step in ("read", "merge", "write")
            )
            + f"; load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs"
        )
