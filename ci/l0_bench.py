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
import dataclasses
import json
import os
import resource
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import psutil

from ci.jobs import JOBS, pytest_args

ROOT = Path(__file__).resolve().parent.parent
ROW = "L0-cpu"


class TreeMemory:
    """Samples the summed RSS of a process and all its descendants; keeps the peak."""

    def __init__(self, pid: int, every_s: float = 0.2) -> None:
        self.pid, self.every_s, self.peak = pid, every_s, 0
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self.done.is_set():
            try:
                root = psutil.Process(self.pid)
                procs = [root, *root.children(recursive=True)]
            except psutil.Error:
                return
            total = 0
            for proc in procs:
                try:
                    total += proc.memory_info().rss
                except psutil.Error:
                    continue
            self.peak = max(self.peak, total)
            self.done.wait(self.every_s)

    def __enter__(self) -> TreeMemory:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.done.set()
        self.thread.join()


def run_l0(
    workers: int,
    reports: Path,
    extra: list[str],
    root: Path = ROOT,
    more_env: dict[str, str] | None = None,
) -> dict[str, Any]:
    """One L0 session as the CPU row runs it, on ``workers`` xdist workers (1: one process), in the
    tree ``root`` (default this one; ``more_env`` adds variables, PYTHONPATH among them)."""
    job = dataclasses.replace(JOBS[ROW], workers=workers)
    # Its own session: its own ledger, and no enclosing xdist worker's variables.
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_XDIST_")}
    env.update(job.environment(reports))
    env.update(more_env or {})
    env.pop("KIT_ADMISSION_DIR", None)
    command = [sys.executable, "-m", "pytest", *pytest_args(job, reports), *job.parallel_args(), *extra]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.monotonic()
    reports.mkdir(parents=True, exist_ok=True)
    with open(reports / "pytest.log", "wb") as log:  # the session's output, beside its report
        proc = subprocess.Popen(command, cwd=root, env=env, stdout=log, stderr=subprocess.STDOUT)
        with TreeMemory(proc.pid) as memory:
            returncode = proc.wait()
    wall = time.monotonic() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    figures: dict[str, Any] = {
        "workers": workers,
        "returncode": returncode,
        "wall_s": round(wall, 1),
        "cpu_s": round(after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime, 1),
        "peak_tree_rss_bytes": memory.peak,
        "command": " ".join(command[1:]),
    }
    try:
        report = json.loads((reports / "kit-report.json").read_text())
    except (OSError, ValueError):
        return figures
    session = report["session"]
    figures.update(
        outcome_counts=session.get("outcome_counts"),
        admission_peak_bytes=session.get("admission_peak_bytes"),
        admission_limit_bytes=session.get("admission_limit_bytes"),
        queued_s=round(sum(r.get("queued_s") or 0 for r in report["tests"]), 1),
    )
    return figures


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
