"""One L0 session as the L0-cpu row runs it, measured: wall, CPU of the process tree, its peak memory.

Shared by `ci.l0_bench` (serial against parallel) and `ci.l0_compare` (previous main against this tree).
"""

from __future__ import annotations

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
