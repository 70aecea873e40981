"""The CI jobs as data: one row per job, read by the workflows and by `python -m ci repro`.

Every GitHub workflow step that runs tests is literally `python3 -m ci job <name>`, which runs the
row's command with the row's environment; `python -m ci repro` builds its pytest command and
environment from the same row. A test (`unit/test_workflows.py`) checks that each workflow job
calls exactly one row and agrees with it on runner labels, container and timeout, so the CI job
and its local reproduction cannot drift apart.

Stdlib only: the workflow runs this before the kit's dependencies are installed.
"""

from __future__ import annotations

import os
import shlex
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TIERS = ("L0", "L1", "L2")

# Names the kit's plugin and rank launcher read (proposed in the CI issue's report):
HOST_MEMORY_ENV = "KIT_HOST_MEMORY"  # the runner's memory for the whole run, e.g. "7GB"
DEVICE_MEMORY_ENV = "KIT_DEVICE_MEMORY"  # per-GPU cap emulating the CI card, e.g. "40GiB"

# GitHub's standard Linux runner for private repositories: 2 cores, 7 GB (what L0 must fit).
CPU_RUNNER = ("ubuntu-latest",)
# A self-hosted machine with two GPUs; `gpu-x2` is listed in .github/actionlint.yaml.
GPU_RUNNER = ("self-hosted", "linux", "x64", "gpu-x2")
# NGC's PyTorch container ships torch, NCCL and Transformer Engine; the kit installs into it.
GPU_CONTAINER = "nvcr.io/nvidia/pytorch:25.08-py3"

# The same for every job: derandomised hypothesis, no pytest-randomly reordering, stable hashing,
# unbuffered output so a killed job still shows its last lines, tracebacks on fatal signals.
_COMMON_ENV = {
    "CI": "true",
    "HYPOTHESIS_PROFILE": "ci",
    "PYTHONHASHSEED": "0",
    "PYTHONUNBUFFERED": "1",
    "PYTHONFAULTHANDLER": "1",
}
_COMMON_PYTEST_ARGS = ("-p", "no:randomly", "--durations=20")

_CPU_ENV = {
    # gloo even on a developer's GPU machine, as on the CPU runner.
    "CUDA_VISIBLE_DEVICES": "",
}
# NCCL's flight recorder: each rank dumps its last collectives on a watchdog timeout into the
# report directory, which every job uploads. `{reports}` is replaced by that directory. The
# launcher points launches of `run_ranks` at their own log directory (under reports/logs/); these
# catch NCCL used any other way. Both names: TORCH_FR_* is the newer one, older torch reads the other.
_GPU_ENV = {
    "KIT_SYSTEM_PYTHON": "1",
    "TORCH_NCCL_TRACE_BUFFER_SIZE": "2000",
    "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
    "TORCH_FR_DUMP_TEMP_FILE": "{reports}/nccl/nccl_flight_recorder_rank_",
    "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": "{reports}/nccl/nccl_flight_recorder_rank_",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "3",
    "NCCL_DEBUG": "WARN",
}


@dataclass(frozen=True)
class Job:
    """One CI job: which tier it runs, where, under which limits and environment."""

    name: str
    tier: str
    runs_on: tuple[str, ...]
    timeout_minutes: int
    gpus: int = 0
    container: str | None = None
    host_memory: str | None = None
    device_memory: str | None = None
    env: Mapping[str, str] = field(default_factory=dict)
    pytest_args: tuple[str, ...] = _COMMON_PYTEST_ARGS

    def environment(self, reports: Path) -> dict[str, str]:
        """The variables this job sets, with `{reports}` resolved and the memory limits included."""
        env = {key: value.replace("{reports}", str(reports)) for key, value in self.env.items()}
        if self.host_memory is not None:
            env[HOST_MEMORY_ENV] = self.host_memory
        if self.device_memory is not None:
            env[DEVICE_MEMORY_ENV] = self.device_memory
        return env

    def command(self) -> list[str]:
        """What the workflow step runs: the README's command for this tier, plus the job's args."""
        return ["bash", "ci/test.sh", self.tier, *self.pytest_args]


def _row(tier: str, kind: str, timeout_minutes: int) -> Job:
    if kind == "cpu":
        return Job(
            name=f"{tier}-cpu",
            tier=tier,
            runs_on=CPU_RUNNER,
            timeout_minutes=timeout_minutes,
            host_memory="7GB",
            env={**_COMMON_ENV, **_CPU_ENV},
        )
    return Job(
        name=f"{tier}-gpu",
        tier=tier,
        runs_on=GPU_RUNNER,
        timeout_minutes=timeout_minutes,
        gpus=2,
        container=GPU_CONTAINER,
        device_memory="40GiB",
        env={**_COMMON_ENV, **_GPU_ENV},
    )


JOBS: dict[str, Job] = {
    job.name: job
    for job in (
        _row("L0", "cpu", 30),
        _row("L0", "gpu", 45),
        _row("L1", "cpu", 90),
        _row("L1", "gpu", 90),
        _row("L2", "cpu", 180),
        _row("L2", "gpu", 180),
    )
}


def job_for(tier: str, gpus: int) -> Job:
    """The row `repro` emulates: the GPU job of `tier` when GPUs are asked for, else the CPU one."""
    if tier not in TIERS:
        raise ValueError(f"unknown tier {tier!r}: expected one of {', '.join(TIERS)}")
    return JOBS[f"{tier}-{'gpu' if gpus > 0 else 'cpu'}"]


def pytest_args(job: Job, reports: Path | str) -> list[str]:
    """The pytest arguments `ci/test.sh <tier> <job args>` ends up with, for a report directory.

    `ci/test.sh` runs `pytest -m <tier> --kit-report reports --junitxml reports/junit.xml "$@"`;
    `repro` runs the same with its own report directory. The `--opt=value` form matters: pytest
    picks its rootdir and config file before it loads plugins, so a plugin option's value given as
    a separate word counts as a path there, and a report directory outside the project made the
    session run without pyproject.toml's settings (rootdir = the report directory).
    """
    reports = str(reports)
    return ["-m", job.tier, f"--kit-report={reports}", f"--junitxml={reports}/junit.xml", *job.pytest_args]


def describe(job: Job, reports: Path) -> str:
    """One line a log reader can paste: the environment and the command of the job."""
    env = " ".join(f"{key}={shlex.quote(value)}" for key, value in sorted(job.environment(reports).items()))
    return f"{env} {shlex.join(job.command())}"


def run_job(name: str, *, dry_run: bool = False) -> int:
    """Run job `name` as the workflow does (replacing this process); return 2 for an unknown name."""
    job = JOBS.get(name)
    if job is None:
        print(f"ci job: unknown job {name!r}: expected one of {', '.join(JOBS)}", flush=True)
        return 2
    reports = ROOT / "reports"
    print(f"ci job {job.name}: {describe(job, reports)}", flush=True)
    if dry_run:
        return 0
    (reports / "nccl").mkdir(parents=True, exist_ok=True)
    os.chdir(ROOT)
    os.execvpe(job.command()[0], job.command(), {**os.environ, **job.environment(reports)})
