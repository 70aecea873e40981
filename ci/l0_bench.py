"""L0 serial against L0 parallel under admission, side by side: wall, CPU and peak memory of each.

    python -m ci l0-bench [--workers N] [--reports DIR] [pytest args]
    python -m ci l0-bench --against [REF] [--workers N] [--reports DIR] [pytest args]

The second form runs L0 of a previous commit against L0 of this tree and prints where the time
goes (`ci.l0_compare`). The first:

Runs this repository's L0 as the CPU row does (`ci.jobs` L0-cpu: its environment, KIT_HOST_MEMORY
included, and its pytest arguments) twice, first in one process, then on N xdist workers (default
the row's), each into its own report directory, and prints for each: wall time; CPU time (user +
system of the whole process tree, read from the kernel's accounting of reaped children); the
peak of the tree's summed resident memory, sampled every 0.2 s; the session's peak of admitted
memory against the limit (from its report); outcome counts. Each session's output is in its
report directory's ``pytest.log``. Then the ratio parallel / serial and
its floor on this machine, the serial run's CPU time over N cores' worth of its wall time. Figures
on a shared machine are load-dependent: the command is the same on a quiet one. The nightly
benchmark row runs it through ``ci/benchmarks/test_bench_l0.py``.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

from ci.jobs import JOBS
from ci.l0_run import ROOT, ROW, run_l0


def compare(serial: dict[str, Any], parallel: dict[str, Any]) -> dict[str, float]:
    """parallel / serial wall, and its floor: the serial CPU time over N cores' worth of its wall."""
    return {
        "parallel / serial wall": round(parallel["wall_s"] / serial["wall_s"], 3),
        "floor (serial CPU / (N x serial wall))": round(
            serial["cpu_s"] / (parallel["workers"] * serial["wall_s"]), 3
        ),
    }


def table(serial: dict[str, Any], parallel: dict[str, Any]) -> list[str]:
    """The side-by-side table for people."""

    def gib(value: Any) -> str:
        return f"{value / 2**30:.2f} GiB" if isinstance(value, int) else "-"

    lines = ["run        wall     CPU      peak RSS (tree)  peak admitted / limit   outcomes"]
    for name, f in (("serial", serial), (f"-n {parallel['workers']}", parallel)):
        lines.append(
            f"{name:9s}  {f['wall_s']:6.1f}s  {f['cpu_s']:6.1f}s  {gib(f['peak_tree_rss_bytes']):>15s}  "
            f"{gib(f.get('admission_peak_bytes')):>9s} / {gib(f.get('admission_limit_bytes')):9s}  "
            f"{f.get('outcome_counts')}"
        )
    lines += [f"{k}: {v}" for k, v in compare(serial, parallel).items()]
    lines.append(f"load average (1, 5, 15 min) at the end: {os.getloadavg()}")
    return lines


def main(argv: list[str] | None = None) -> int:
    """Run both and print the table; exit 1 if either session failed."""
    parser = argparse.ArgumentParser(prog="python -m ci l0-bench", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--workers", type=int, default=JOBS[ROW].workers, help="xdist workers of the parallel run"
    )
    parser.add_argument(
        "--reports", type=Path, default=ROOT / "reports" / "l0-bench", help="report directories go here"
    )
    parser.add_argument(
        "--against",
        nargs="?",
        const="",
        metavar="REF",
        help="instead: L0 of the commit REF (default origin/main, or HEAD~ where that is this commit) "
        "against L0 of this tree, and where the time goes (ci.l0_compare)",
    )
    args, extra = parser.parse_known_args(argv)
    if args.against is not None:
        from ci import l0_compare

        ref = args.against or l0_compare.default_ref()
        return l0_compare.run(ref, args.workers, args.reports, extra)
    serial = run_l0(1, args.reports / "serial", extra)
    parallel = run_l0(args.workers, args.reports / "parallel", extra)
    for line in table(serial, parallel):
        print(line)
    (args.reports / "l0-bench.json").write_text(
        json.dumps({"serial": serial, "parallel": parallel}, indent=2)
    )
    return 0 if serial["returncode"] == parallel["returncode"] == 0 else 1
