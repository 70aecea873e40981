"""`python -m ci repro`: the kit's repro (`megatron_testkit.repro`) with this repository's rows.

The shipped command reads a project's rows from its pyproject; this repository's rows are the
CI jobs of `ci/jobs.py` (what the workflows run), so the same command here emulates exactly them:
each `Job` becomes a `Row` with the same pytest arguments, environment, limits and megatron-core
release, and the hint for another release is this repository's ``ci/setup.sh`` line.
"""

from __future__ import annotations

from pathlib import Path

from ci.jobs import JOBS, ROOT, Job
from megatron_testkit import repro as kit_repro
from megatron_testkit.repro_rows import Row

PROG = "python -m ci repro"
# What the tests of this module use from the shipped command, under the names they always had.
format_comparison = kit_repro.format_comparison
recorded_seed = kit_repro.recorded_seed
collected_ids = kit_repro.collected_ids
with_kills = kit_repro.with_kills
_note_in_markdown = kit_repro._note_in_markdown


def row(job: Job) -> Row:
    """The kit's row for one of this repository's CI jobs."""
    release = job.megatron_core
    return Row(
        name=job.name,
        tier=job.tier,
        selection=("-m", job.tier),
        pytest_args=tuple(job.extra_pytest_args()),
        env=job.environment(Path("{reports}")),
        host_memory=job.host_memory,
        device_memory=job.device_memory,
        gpus=job.gpus,
        megatron_core=release,
        runs_on=job.runs_on,
        runs_tests=job.suite == "tests",
        not_tests="the benchmarks, not tests: python -m ci bench",
        setup_hint=(
            f"KIT_MEGATRON_CORE={release} KIT_VENV=.venv-{release} bash ci/setup.sh, "
            f"then .venv-{release}/bin/python -m ci repro ..."
        ),
    )


def rows(_root: Path) -> dict[str, Row]:
    """Every row of `ci/jobs.py`, in its order (whatever project `--root` names)."""
    return {name: row(job) for name, job in JOBS.items()}


PROJECT = kit_repro.Project(prog=PROG, name="ci repro", rows=rows, default_root=ROOT)


def main(argv: list[str] | None = None) -> int:
    """`python -m ci repro ...`: the kit's repro with this repository's rows."""
    return kit_repro.main(argv, PROJECT)
