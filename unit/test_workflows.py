"""The GitHub workflows are valid, and they run exactly the jobs of ci/jobs.py.

A broken workflow fails here rather than on GitHub: each file is validated against GitHub's
workflow schema (check-jsonschema's vendored copy, offline), and its structure is checked against
what the CI issue asks for: tiers and triggers, timeouts, concurrency, permissions, caches, the
report in the job summary and the artifacts uploaded even when tests fail.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from ci.jobs import JOBS, ROOT, Job, pytest_args

pytestmark = pytest.mark.L0

WORKFLOWS = ROOT / ".github" / "workflows"
WORKFLOW_FILES = sorted(WORKFLOWS.glob("*.yml"))
GITHUB_LABELS = {"self-hosted", "linux", "x64", "arm64", "ubuntu-latest", "ubuntu-24.04", "ubuntu-22.04"}


def validate(*paths: Path) -> subprocess.CompletedProcess[str]:
    """Run check-jsonschema with GitHub's workflow schema as shipped inside the package (no network)."""
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


def load(path: Path) -> dict[str, Any]:
    doc = yaml.safe_load(path.read_text())
    # YAML 1.1 reads the key `on` as the boolean True.
    if True in doc:
        doc["on"] = doc.pop(True)
    return doc


def all_jobs() -> dict[str, tuple[str, dict[str, Any]]]:
    """Every job of every workflow: id -> (workflow file name, job mapping)."""
    jobs: dict[str, tuple[str, dict[str, Any]]] = {}
    for path in WORKFLOW_FILES:
        for job_id, job in load(path)["jobs"].items():
            assert job_id not in jobs, f"job id {job_id} is used in {jobs[job_id][0]} and {path.name}"
            jobs[job_id] = (path.name, job)
    return jobs


def test_there_are_three_workflows() -> None:
    assert [p.name for p in WORKFLOW_FILES] == ["ci.yml", "l1.yml", "nightly.yml"]


def test_workflows_validate_against_githubs_schema() -> None:
    result = validate(*WORKFLOW_FILES)
    assert result.returncode == 0, result.stdout + result.stderr


BREAKAGES = {
    # (what to replace, with what, a word the validator's message must contain)
    "job without runs-on": ("    runs-on: ubuntu-latest\n", "", "runs-on"),
    "misspelled trigger": ("  pull_request:\n", "  pull_requests:\n", "pull_requests"),
    "timeout that is not a number": (
        "timeout-minutes: 30",
        "timeout-minutes: half an hour",
        "timeout-minutes",
    ),
}


@pytest.mark.parametrize("breakage", sorted(BREAKAGES))
def test_a_broken_workflow_is_rejected_by_the_same_validator(tmp_path: Path, breakage: str) -> None:
    old, new, word = BREAKAGES[breakage]
    text = (WORKFLOWS / "ci.yml").read_text()
    assert old in text, f"the breakage {breakage!r} no longer applies to ci.yml"
    broken = tmp_path / "ci.yml"
    broken.write_text(text.replace(old, new, 1))
    result = validate(broken)
    assert result.returncode == 1, result.stdout + result.stderr
    assert word in result.stdout + result.stderr


@pytest.mark.parametrize("path", WORKFLOW_FILES, ids=lambda p: p.name)
def test_least_privilege_and_superseded_runs_are_cancelled(path: Path) -> None:
    doc = load(path)
    assert doc["permissions"] == {"contents": "read"}
    assert all("permissions" not in job for job in doc["jobs"].values()), "no job widens the permissions"
    assert "github.workflow" in doc["concurrency"]["group"]
    assert "github.ref" in doc["concurrency"]["group"]
    assert doc["concurrency"]["cancel-in-progress"] is True


def test_every_job_has_a_timeout_and_the_row_timeout() -> None:
    for job_id, (name, job) in all_jobs().items():
        assert isinstance(job.get("timeout-minutes"), int), f"{name}:{job_id} has no timeout-minutes"
        assert job["timeout-minutes"] == JOBS[job_id].timeout_minutes


def test_every_row_of_ci_jobs_is_one_workflow_job_and_nothing_else_runs_tests() -> None:
    jobs = all_jobs()
    assert sorted(jobs) == sorted(JOBS)
    for job_id, (name, job) in jobs.items():
        runs = [step["run"] for step in job["steps"] if "run" in step]
        test_steps = [run for run in runs if "python3 -m ci job" in run]
        assert test_steps == [f"python3 -m ci job {job_id}"], f"{name}:{job_id}"
        for run in runs:
            assert "pytest" not in run and "ci/test.sh" not in run, (
                f"{name}:{job_id} runs tests around ci/jobs.py"
            )


def _row(job_id: str) -> Job:
    return JOBS[job_id]


def test_runners_and_containers_match_the_rows() -> None:
    for job_id, (_, job) in all_jobs().items():
        row = _row(job_id)
        runs_on = [job["runs-on"]] if isinstance(job["runs-on"], str) else job["runs-on"]
        assert tuple(runs_on) == row.runs_on
        container = job.get("container", {})
        assert (container.get("image") if container else None) == row.container


def test_gpu_jobs_run_in_the_pytorch_container_with_nccl_flight_recorder_and_a_device_budget() -> None:
    gpu_jobs = {job_id: job for job_id, (_, job) in all_jobs().items() if _row(job_id).gpus}
    assert sorted(gpu_jobs) == ["L0-gpu", "L1-gpu", "L2-gpu"]
    for job_id, job in gpu_jobs.items():
        row = _row(job_id)
        assert row.gpus == 2 and "self-hosted" in job["runs-on"]
        assert job["container"]["image"].startswith("nvcr.io/nvidia/pytorch:")
        assert job["container"]["image"].endswith("-py3")
        assert "--gpus all" in job["container"]["options"]
        env = row.environment(Path("/x/reports"))
        assert env["KIT_SYSTEM_PYTHON"] == "1"
        assert env["KIT_DEVICE_MEMORY"] == row.device_memory
        assert env["TORCH_FR_DUMP_TEMP_FILE"].startswith("/x/reports/")
        assert env["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"] == env["TORCH_FR_DUMP_TEMP_FILE"]
        summary = next(s["run"] for s in job["steps"] if "GITHUB_STEP_SUMMARY" in s.get("run", ""))
        assert (
            "nccl_flight_recorder_rank" in summary
            and "nccl_flight_recorder_rank" in env["TORCH_FR_DUMP_TEMP_FILE"]
        )
        assert int(env["TORCH_NCCL_TRACE_BUFFER_SIZE"]) > 0 and env["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"


def test_cpu_jobs_use_gloo_and_the_runners_memory() -> None:
    for job_id, (_, job) in all_jobs().items():
        row = _row(job_id)
        if row.gpus:
            continue
        assert job["runs-on"] == "ubuntu-latest"
        env = row.environment(Path("reports"))
        assert env["CUDA_VISIBLE_DEVICES"] == ""
        assert env["KIT_HOST_MEMORY"] == row.host_memory == "7GB"


def test_report_goes_to_the_summary_and_artifacts_upload_even_on_failure() -> None:
    for job_id, (name, job) in all_jobs().items():
        steps = job["steps"]
        test_index = next(
            i for i, step in enumerate(steps) if step.get("run", "").startswith("python3 -m ci job")
        )
        after = steps[test_index + 1 :]
        summary = [step for step in after if "GITHUB_STEP_SUMMARY" in step.get("run", "")]
        assert len(summary) == 1 and summary[0]["if"] == "always()", f"{name}:{job_id}"
        assert "reports/kit-report.md" in summary[0]["run"]
        uploads = [step for step in after if step.get("uses", "").startswith("actions/upload-artifact@")]
        assert len(uploads) == 1, f"{name}:{job_id}"
        upload = uploads[0]
        assert upload["if"] == "always()"
        assert upload["with"]["path"].rstrip("/") == "reports", (
            "report, junit.xml and logs/ all live in reports/"
        )
        assert upload["with"]["name"] == f"kit-reports-{job_id}"


def test_lint_runs_before_the_l0_tests_on_the_cpu_runner() -> None:
    _, job = all_jobs()["L0-cpu"]
    runs = [step.get("run", "") for step in job["steps"]]
    check = runs.index(".venv/bin/ruff check .")
    fmt = runs.index(".venv/bin/ruff format --check .")
    assert check < fmt < runs.index("python3 -m ci job L0-cpu")


def test_pip_caches_are_keyed_on_the_project_files() -> None:
    for job_id, (name, job) in all_jobs().items():
        steps = job["steps"]
        setup = [s for s in steps if s.get("uses", "").startswith("actions/setup-python@")]
        cache = [s for s in steps if s.get("uses", "").startswith("actions/cache@")]
        if _row(job_id).gpus:
            assert len(cache) == 1, f"{name}:{job_id}"
            key = cache[0]["with"]["key"]
            assert "hashFiles('pyproject.toml', 'ci/setup.sh')" in key
            assert cache[0]["with"]["path"] == "~/.cache/pip"
        else:
            assert len(setup) == 1, f"{name}:{job_id}"
            assert setup[0]["with"]["cache"] == "pip"
            assert setup[0]["with"]["cache-dependency-path"].split() == ["pyproject.toml", "ci/setup.sh"]


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
    assert sorted(doc["jobs"]) == ["L1-cpu", "L1-gpu"]
    for job in doc["jobs"].values():
        assert "github.event_name == 'push'" in job["if"]
        assert "contains(github.event.pull_request.labels.*.name, 'needs-more-tests')" in job["if"]


def test_l2_runs_nightly_and_on_manual_dispatch() -> None:
    doc = load(WORKFLOWS / "nightly.yml")
    assert set(doc["on"]) == {"schedule", "workflow_dispatch"}
    assert len(doc["on"]["schedule"][0]["cron"].split()) == 5
    assert sorted(doc["jobs"]) == ["L2-cpu", "L2-gpu"]


def test_self_hosted_jobs_never_run_pull_requests_from_forks() -> None:
    for job_id, (_, job) in all_jobs().items():
        if "self-hosted" in job["runs-on"] and job_id != "L2-gpu":  # L2 has no pull_request trigger
            assert "github.event.pull_request.head.repo.full_name == github.repository" in job["if"]


def test_actionlint_config_lists_every_self_hosted_label() -> None:
    config = yaml.safe_load((ROOT / ".github" / "actionlint.yaml").read_text())
    listed = set(config["self-hosted-runner"]["labels"])
    used = {
        label
        for _, job in all_jobs().values()
        for label in job["runs-on"]
        if isinstance(job["runs-on"], list)
    }
    assert used - GITHUB_LABELS == listed


def test_ci_test_sh_passes_the_same_report_arguments_as_the_rows() -> None:
    """ci/test.sh hard-codes its report arguments; they must be the prefix `repro` uses too."""
    script = (ROOT / "ci" / "test.sh").read_text()
    pattern = r'-m pytest "\$\{select\[@\]\}" --kit-report[= ]reports --junitxml[= ]reports/junit\.xml "\$@"'
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


def test_the_job_command_prints_what_it_runs() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "ci", "job", "L0-cpu", "--dry-run"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert "KIT_HOST_MEMORY=7GB" in result.stdout
    assert result.stdout.rstrip().endswith("bash ci/test.sh L0 -p no:randomly --durations=20")
    unknown = subprocess.run(
        [sys.executable, "-m", "ci", "job", "L3-cpu"], capture_output=True, text=True, cwd=ROOT, timeout=60
    )
    assert unknown.returncode == 2 and "unknown job 'L3-cpu'" in unknown.stdout
