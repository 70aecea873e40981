"""The CI jobs as data: one row per job, read by the workflows and by `python -m ci repro`.

Every GitHub workflow job calls the reusable `.github/workflows/kit-job.yml` with a row's name,
whose test step is the kit's composite action (``action.yml``, as any caller uses it) running
`python3 -m ci job <name>`: the row's command with the row's environment (its megatron-core release
in KIT_MEGATRON_CORE); the action then writes the job summary (`summary_markdown`, once), the
annotations and the artifact. `python -m ci repro` builds its pytest command and environment from
the same row. `unit/test_workflows.py` checks that each caller passes exactly
one row and agrees with it on runner labels, container, Python and timeout, so the CI job and
its local reproduction cannot drift apart.

Stdlib only: the workflow runs this before the kit's dependencies are installed.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TIERS = ("L0", "L1", "L2")

# Names the kit's plugin and rank launcher read:
HOST_MEMORY_ENV = "KIT_HOST_MEMORY"  # the runner's memory for the whole run, e.g. "7GB"
DEVICE_MEMORY_ENV = "KIT_DEVICE_MEMORY"  # per-GPU cap emulating the CI card, e.g. "40GiB"
REQUIRE_GPUS_ENV = "KIT_REQUIRE_GPUS"  # a GPU test skipped for want of GPUs fails instead
MEGATRON_CORE_ENV = "KIT_MEGATRON_CORE"  # the megatron-core release ci/setup.sh installs
JOB_ENV = "KIT_CI_JOB"  # the row's name, so a report (and `repro --from-report`) knows its row
ALLOWED_SKIPS_ENV = "KIT_ALLOWED_SKIPS"  # what the row's machine lacks: any other skip fails
WORKERS_ENV = "KIT_TEST_WORKERS"  # xdist workers ci/test.sh runs the tests on (1: one process)
# A CPU runner's tests run on one xdist worker per core (GitHub's runner: 2), whole files to a
# worker, under the kit's memory admission (the runner's KIT_HOST_MEMORY is shared between them).
# A GPU row runs one: admission holds host memory, not the two GPUs' memory.
CPU_WORKERS = 2

# What each kind of runner lacks, in megatron_testkit.skips' vocabulary. A CPU runner has no CUDA
# (so no GPUs and no Transformer Engine, which needs them) and, on GitHub's hosted runners, no
# writable memory cgroup; it has nvdlfw-inspect (the `inspect` extra) and matplotlib (`charts`).
# A GPU row runs NGC's container, which ships TE and nvdlfw-inspect: it lacks only a CUDA-free
# machine (the CPU-path checks). An older megatron-core lacks what newer releases added.
CPU_ALLOWED_SKIPS = ("cuda", "gpus", "te", "cgroup")
GPU_ALLOWED_SKIPS = ("no-cuda",)

# The supported megatron-core releases: the newest is what L0 runs (what users train with), the
# oldest runs in L1. 0.17+ need Python 3.12; 0.16.1 is the last release that installs on 3.11.
MEGATRON_NEWEST = "0.19.2"
MEGATRON_OLDEST = "0.16.1"
# setup-python's version on GitHub's runners (the GPU container brings its own 3.12).
RUNNER_PYTHON = "3.12"

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

# The nightly fault campaign runs its full count (functional/test_fault_campaign.py); a local
# `ci/test.sh all` runs a shorter, still randomized, campaign.
_NIGHTLY_ENV = {"KIT_FAULT_TRIALS": "200"}

# What a row runs: "tests" is pytest on its tier (`ci/test.sh <tier>`); "bench" the benchmarks of
# ci/benchmarks (`ci/test.sh bench`, i.e. `python -m ci bench`), compared with earlier runs.
SUITES = ("tests", "bench")
# The benchmark row's earlier runs: the workflow restores this directory before the run and saves
# it (with tonight's run added) after a green one (actions/cache), so each night is compared, by
# ratio, with the previous green night; `python -m ci bench --history` reads and prunes it.
BENCH_HISTORY = "reports/benchmarks"
BENCH_MARKDOWN = "reports/bench-report.md"  # the ratio table, for the job summary
# The nightly properties row: hypothesis draws new examples (conftest.py's `explore` profile, a
# seed ci/test.sh chooses and prints) instead of replaying the PR rows' derandomised ones.
EXPLORE_PROFILE = "explore"


@dataclass(frozen=True)
class Job:
    """One CI job: which tier it runs, where, on which megatron-core, under which limits and environment.

    `markexpr` is the pytest mark expression (the tier, or `<tier> and gpu` on the GPU rows: the
    CPU/gloo tests run in the CPU job, never over NCCL). `python` is setup-python's version on a
    GitHub runner (None in a container, which brings its own). `suite` is what it runs (`SUITES`);
    `history` a directory the workflow keeps from one run of the row to the next (None: nothing).
    """

    name: str
    tier: str
    runs_on: tuple[str, ...]
    timeout_minutes: int
    megatron_core: str = MEGATRON_NEWEST
    gpus: int = 0
    container: str | None = None
    python: str | None = RUNNER_PYTHON
    lint: bool = False
    host_memory: str | None = None
    device_memory: str | None = None
    markexpr: str = ""
    allowed_skips: tuple[str, ...] = ()
    env: Mapping[str, str] = field(default_factory=dict)
    pytest_args: tuple[str, ...] = _COMMON_PYTEST_ARGS
    suite: str = "tests"
    history: str | None = None
    summary_files: tuple[str, ...] = ()  # Markdown files of the report folder the summary adds
    workers: int = 1

    def __post_init__(self) -> None:
        if self.suite not in SUITES:
            raise ValueError(f"row {self.name}: suite {self.suite!r} is not one of {', '.join(SUITES)}")

    @property
    def select(self) -> str:
        """The mark expression the job runs (its tier unless the row narrows it)."""
        return self.markexpr or self.tier

    @property
    def job_id(self) -> str:
        """The workflow job id calling this row (GitHub ids allow no dots: 0.16.1 -> 0_16_1)."""
        return self.name.replace(".", "_")

    def environment(self, reports: Path) -> dict[str, str]:
        """The variables this job sets, with `{reports}` resolved and the limits and release included."""
        env = {key: value.replace("{reports}", str(reports)) for key, value in self.env.items()}
        env[JOB_ENV] = self.name
        env[MEGATRON_CORE_ENV] = self.megatron_core
        env[ALLOWED_SKIPS_ENV] = ",".join(self.allowed_skips)
        env[WORKERS_ENV] = str(self.workers)
        if self.gpus:
            env[REQUIRE_GPUS_ENV] = str(self.gpus)
        if self.host_memory is not None:
            env[HOST_MEMORY_ENV] = self.host_memory
        if self.device_memory is not None:
            env[DEVICE_MEMORY_ENV] = self.device_memory
        return env

    def parallel_args(self) -> list[str]:
        """The xdist arguments ci/test.sh adds for the row's workers (none for one). `repro` leaves
        them out: it reruns a few failed tests, whose verdicts are the launcher's either way."""
        return ["-n", str(self.workers), "--dist", "loadfile"] if self.workers > 1 else []

    def extra_pytest_args(self) -> list[str]:
        """What the job adds to `ci/test.sh <tier>`: its narrower selection (a later -m wins), its args."""
        narrowed = ["-m", self.select] if self.select != self.tier else []
        return [*narrowed, *self.pytest_args]

    def command(self) -> list[str]:
        """What the workflow step runs: the README's command for this tier, plus the job's args.

        A benchmark row runs `ci/test.sh bench`: saves the run into its history, compares it with
        the earlier runs there and writes the table for the summary (`python -m ci bench`).
        """
        if self.suite == "bench":
            history = ["--history", self.history] if self.history else []
            return ["bash", "ci/test.sh", "bench", *history, "--markdown", BENCH_MARKDOWN, *self.pytest_args]
        return ["bash", "ci/test.sh", self.tier, *self.extra_pytest_args()]


def release_skips(megatron_core: str) -> tuple[str, ...]:
    """An older release may skip the tests of what the newest added (declared as megatron>=<newest minor>)."""
    if megatron_core == MEGATRON_NEWEST:
        return ()
    return (f"megatron>={'.'.join(MEGATRON_NEWEST.split('.')[:2])}",)


def _row(tier: str, kind: str, timeout_minutes: int, megatron_core: str = MEGATRON_NEWEST) -> Job:
    suffix = "" if megatron_core == MEGATRON_NEWEST else f"-mcore-{megatron_core}"
    # An older release's row runs L0 too: the L0 tests that import or branch on megatron-core.
    markexpr = f"L0 or {tier}" if megatron_core != MEGATRON_NEWEST and tier != "L0" else ""
    if kind == "cpu":
        return Job(
            name=f"{tier}-cpu{suffix}",
            tier=tier,
            runs_on=CPU_RUNNER,
            timeout_minutes=timeout_minutes,
            megatron_core=megatron_core,
            lint=tier == "L0",
            host_memory="7GB",
            markexpr=markexpr,
            allowed_skips=CPU_ALLOWED_SKIPS + release_skips(megatron_core),
            env={**_COMMON_ENV, **_CPU_ENV, **(_NIGHTLY_ENV if tier == "L2" else {})},
            workers=CPU_WORKERS,
        )
    return Job(
        name=f"{tier}-gpu{suffix}",
        tier=tier,
        runs_on=GPU_RUNNER,
        timeout_minutes=timeout_minutes,
        megatron_core=megatron_core,
        gpus=2,
        container=GPU_CONTAINER,
        python=None,
        device_memory="40GiB",
        markexpr=f"{tier} and gpu",
        allowed_skips=GPU_ALLOWED_SKIPS + release_skips(megatron_core),
        env={**_COMMON_ENV, **_GPU_ENV},
    )


def _nightly_cpu_row(
    name: str,
    tier: str,
    timeout_minutes: int,
    *,
    markexpr: str = "",
    env: Mapping[str, str] | None = None,
    suite: str = "tests",
    history: str | None = None,
) -> Job:
    """A nightly row beside L2 on the CPU runner, with the CPU rows' environment and declared skips."""
    return Job(
        name=name,
        tier=tier,
        runs_on=CPU_RUNNER,
        timeout_minutes=timeout_minutes,
        host_memory="7GB",
        markexpr=markexpr,
        allowed_skips=CPU_ALLOWED_SKIPS,
        env={**_COMMON_ENV, **_CPU_ENV, **(env or {})},
        pytest_args=_COMMON_PYTEST_ARGS if suite == "tests" else (),
        suite=suite,
        history=history,
        summary_files=(Path(BENCH_MARKDOWN).name,) if suite == "bench" else (),
        workers=CPU_WORKERS if suite == "tests" else 1,
    )


JOBS: dict[str, Job] = {
    job.name: job
    for job in (
        _row("L0", "cpu", 30),
        _row("L0", "gpu", 45),
        _row("L1", "cpu", 90),
        _row("L1", "cpu", 90, MEGATRON_OLDEST),
        _row("L1", "gpu", 90),
        _row("L2", "cpu", 180),
        _row("L2", "gpu", 180),
        # After the tier rows, so `job_for` (what `repro L0` emulates) finds those first.
        # The properties (hypothesis tests, all in L0) exploring: fresh seed, more examples.
        _nightly_cpu_row(
            "explore-cpu", "L0", 60, markexpr="L0 and hypothesis", env={"HYPOTHESIS_PROFILE": EXPLORE_PROFILE}
        ),
        # The benchmarks (marked L2), compared with the previous green night's by ratio.
        _nightly_cpu_row("bench-cpu", "L2", 60, suite="bench", history=BENCH_HISTORY),
    )
}


def job_for(tier: str, gpus: int, megatron_core: str | None = None) -> Job:
    """The row `repro` emulates: the GPU or CPU job of `tier`, on `megatron_core` (default the newest)."""
    if tier not in TIERS:
        raise ValueError(f"unknown tier {tier!r}: expected one of {', '.join(TIERS)}")
    kind = "gpu" if gpus > 0 else "cpu"
    release = megatron_core or MEGATRON_NEWEST
    for job in JOBS.values():
        if (
            job.suite == "tests"
            and job.tier == tier
            and (job.gpus > 0) == (gpus > 0)
            and job.megatron_core == release
        ):
            return job
    rows = sorted(j.name for j in JOBS.values() if j.tier == tier)
    raise ValueError(f"no {kind} row of tier {tier} runs megatron-core {release}: rows are {', '.join(rows)}")


def pytest_args(job: Job, reports: Path | str) -> list[str]:
    """The pytest arguments `ci/test.sh <tier> <job args>` ends up with, for a report directory.

    `ci/test.sh` runs `pytest -m <tier> --kit-report reports --junitxml reports/junit.xml "$@"`;
    `repro` runs the same with its own report directory. The `--opt=value` form matters: pytest
    picks its rootdir and config file before it loads plugins, so a plugin option's value given as
    a separate word counts as a path there, and a report directory outside the project made the
    session run without pyproject.toml's settings (rootdir = the report directory).
    """
    reports = str(reports)
    return [
        "-m",
        job.tier,
        f"--kit-report={reports}",
        f"--junitxml={reports}/junit.xml",
        *job.extra_pytest_args(),
    ]


def describe(job: Job, reports: Path) -> str:
    """One line a log reader can paste: the environment and the command of the job."""
    env = " ".join(f"{key}={shlex.quote(value)}" for key, value in sorted(job.environment(reports).items()))
    return f"{env} {shlex.join(job.command())}"


# What the reusable workflow gives the kit's action for every row: the artifact holding the report
# folder, and this repository's repro command (its rows are ci/jobs.py's, not a pyproject's).
ARTIFACT = "kit-reports-{name}"
REPRO_COMMAND = "python -m ci repro"


def summary_markdown(job: Job, reports: Path) -> str:
    """What the job summary holds for a row, as the kit's action writes it (`python -m
    megatron_testkit summary` with the arguments kit-job.yml passes): the kit report, its memory
    chart, the golden files to make (when its platform lacks some), the NCCL dumps, how to rerun;
    a benchmark row's ratio table instead of a kit report."""
    from megatron_testkit.summary import job_summary, repro_command

    artifact = ARTIFACT.format(name=job.name)
    return job_summary(
        reports,
        ROOT,
        artifact=artifact,
        repro=repro_command(artifact, REPRO_COMMAND),
        also=[reports / name for name in job.summary_files],
    )


def run_job(name: str, *, dry_run: bool = False) -> int:
    """Run job `name` as the workflow does and return its exit code (2 for an unknown name).

    Afterwards the memory chart's PNG goes to reports/ when matplotlib is installed. The job
    summary is the kit's action's (kit-job.yml), written once after this returns.
    """
    job = JOBS.get(name)
    if job is None:
        print(f"ci job: unknown job {name!r}: expected one of {', '.join(JOBS)}", file=sys.stderr, flush=True)
        return 2
    reports = ROOT / "reports"
    print(f"ci job {job.name}: {describe(job, reports)}", flush=True)
    if dry_run:
        return 0
    (reports / "nccl").mkdir(parents=True, exist_ok=True)
    for stale in ("kit-report.json", "kit-report.md", Path(BENCH_MARKDOWN).name):
        (reports / stale).unlink(missing_ok=True)  # a previous run's report is not this run's
    from megatron_testkit.child import (
        run_child,  # SIGTERM/SIGINT reach pytest, and the summary is still written
    )

    returncode = run_child(job.command(), cwd=ROOT, env={**os.environ, **job.environment(reports)})
    if job.suite == "tests":
        from megatron_testkit.charts import write_png

        png = write_png(reports / "kit-report.json", reports / "kit-memory.png")
        print(f"ci job {job.name}: {png}", flush=True)
    return returncode


def append_summary(job: Job, reports: Path, summary: Path) -> None:
    """Append `summary_markdown` to a summary file (what the action does with the step summary)."""
    with open(summary, "a") as f:
        f.write(summary_markdown(job, reports))


def run_setup(name: str) -> int:
    """`ci job NAME --setup`: only `ci/setup.sh`, with the row's environment (its megatron-core)."""
    job = JOBS.get(name)
    if job is None:
        print(f"ci job: unknown job {name!r}: expected one of {', '.join(JOBS)}", file=sys.stderr, flush=True)
        return 2
    env = {**os.environ, **job.environment(ROOT / "reports")}
    print(f"ci job {job.name}: {MEGATRON_CORE_ENV}={job.megatron_core} bash ci/setup.sh", flush=True)
    return subprocess.run(["bash", "ci/setup.sh"], cwd=ROOT, env=env).returncode
