"""The kit's composite action (action.yml) is valid, its scripts are clean, and its steps do their job.

actionlint reads workflows only, so the action is checked on its own: against GitHub's action
schema (check-jsonschema's vendored `vendor.github-actions`, offline) and each `run:` script with
shellcheck, a deliberately broken copy rejected by each. Its steps run here as a runner runs them
(`fixtures.github_action`) on a tiny project with this environment's kit: the tests with the kit
report, the summary, one `::error` per failed test, the artifact and the repro line, the tests'
exit code. `functional/test_fresh_project.py` runs them again with only the kit's wheel installed.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

from fixtures.github_action import run_action

pytestmark = pytest.mark.L0

ROOT = Path(__file__).resolve().parent.parent
ACTION = ROOT / "action.yml"


def _steps() -> list[dict]:
    return yaml.safe_load(ACTION.read_text())["runs"]["steps"]


def _validate(path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "check_jsonschema", "--builtin-schema", "vendor.github-actions", str(path)],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_the_action_validates_against_githubs_action_schema() -> None:
    result = _validate(ACTION)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize(
    ("old", "new", "word"),
    [
        ("  using: composite\n", "  using: compose\n", "using"),
        ("      shell: bash\n", "      shell: [bash]\n", "shell"),
    ],
    ids=["unknown runs.using", "a shell that is not a string"],
)
def test_a_broken_action_is_rejected_by_the_schema(tmp_path: Path, old: str, new: str, word: str) -> None:
    text = ACTION.read_text()
    assert old in text, f"the breakage no longer applies: {old!r}"
    broken = tmp_path / "action.yml"
    broken.write_text(text.replace(old, new, 1))
    result = _validate(broken)
    assert result.returncode == 1, result.stdout + result.stderr
    assert word in result.stdout + result.stderr


def _shellcheck(script: str, tmp_path: Path, name: str) -> subprocess.CompletedProcess[str]:
    found = shutil.which("shellcheck")
    if found is None:
        pytest.fail(
            "shellcheck is not installed (apt-get install -y shellcheck; ci/setup.sh does on CI runners)"
        )
    path = tmp_path / f"{name}.sh"
    # GitHub runs a composite step's script as `bash --noprofile --norc -eo pipefail FILE`.
    path.write_text("#!/usr/bin/env bash\nset -eo pipefail\n" + script)
    return subprocess.run([found, "-s", "bash", str(path)], capture_output=True, text=True, timeout=120)


def test_every_run_script_is_shellcheck_clean_and_reads_its_inputs_from_the_environment(
    tmp_path: Path,
) -> None:
    scripts = [(step["name"], step["run"]) for step in _steps() if "run" in step]
    assert len(scripts) >= 4
    for name, script in scripts:
        # An input expanded into a script is code injection (a caller's text run as shell).
        assert "${{" not in script, f"{name}: inputs reach a script through env:, never expanded in it"
        result = _shellcheck(script, tmp_path, f"step{len(name)}")
        assert result.returncode == 0, f"{name}:\n{result.stdout}"
    # Negative control: shellcheck does find a finding in such a script.
    broken = _shellcheck(scripts[0][1] + "\nls $HOME/*\n", tmp_path, "broken")
    assert broken.returncode == 1 and "SC2086" in broken.stdout, broken.stdout


PROJECT = {
    "tests/test_plain.py": textwrap.dedent(
        """
        import pytest


        def test_passes():
            assert True


        def test_fails():
            assert 1 == 2, "one is not two"


        def test_plain_skip():
            pytest.skip("not today")
        """
    ),
}


def _project(root: Path) -> Path:
    for name, text in PROJECT.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


def test_the_steps_run_the_tests_write_the_summary_annotate_upload_and_print_the_repro(
    tmp_path: Path,
) -> None:
    project = _project(tmp_path / "project")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GITHUB_", "PYTEST_", "KIT_"))}
    env["PYTHONPATH"] = str(ROOT)  # this checkout's kit, as installed in this environment
    run = run_action(
        ACTION,
        {
            "pytest-args": "-p no:randomly -p no:cacheprovider tests",
            "install": "false",
            "python": sys.executable,
        },
        cwd=project,
        env=env,
        github={"job": "unit", "run_id": "42", "repository": "me/proj"},
    )
    tests = run.step("Tests with the kit report")
    assert tests.ran and tests.returncode == 0, tests.output  # the step records the code, goes on
    assert "kit: the tests exited with 1" in tests.output
    assert (project / "reports" / "kit-report.json").is_file() and (
        project / "reports" / "junit.xml"
    ).is_file()
    # The job summary: the report's table once, and the exact repro of this run's artifact.
    assert run.summary.count("## Kit report") == 1
    repro = (
        "gh run download 42 --repo me/proj --name kit-reports-unit --dir kit-reports-unit && "
        "python -m megatron_testkit repro --from-report kit-reports-unit/kit-report.json"
    )
    assert repro in run.summary
    summary_step = run.step("Job summary, memory chart and annotations")
    errors = [line for line in summary_step.output.splitlines() if line.startswith("::error")]
    # line=: the test function's line, counted in the file as written above.
    line = (project / "tests" / "test_plain.py").read_text().splitlines().index("def test_fails():") + 1
    assert errors == [
        f"::error file=tests/test_plain.py,line={line},title=tests/test_plain.py%3A%3Atest_fails%3A error::"
        "AssertionError: one is not two"
    ], summary_step.output
    # A plain skip says nothing of the kit's skip policy, in the log or the summary.
    assert "capabilit" not in run.log + run.summary
    upload = run.step("Upload the report folder")
    assert upload.uses == "actions/upload-artifact@v7"
    assert upload.given["name"] == "kit-reports-unit" and upload.given["path"] == "reports"
    last = run.step("The command that reproduces this job")
    assert repro in last.output
    assert run.returncode == 1 and run.outputs == {"exit-code": "1", "artifact-name": "kit-reports-unit"}


def test_the_documented_caller_workflows_pass_actionlint_and_the_schema(tmp_path: Path) -> None:
    """docs/github-action.md's CPU and GPU callers, with the action at `./` (its published name is a
    placeholder), in a repository of their own: what a user copies must lint clean."""
    from unit.test_workflows import actionlint, validate

    text = (ROOT / "docs" / "github-action.md").read_text()
    blocks = [b.split("\n```", 1)[0] for b in text.split("```yaml\n")[1:]]
    workflows = [b for b in blocks if b.startswith("name:")]
    assert len(workflows) == 2, "a CPU and a GPU caller"
    (tmp_path / ".git").mkdir()
    shutil.copy(ACTION, tmp_path / "action.yml")
    shutil.copytree(ROOT / ".github", tmp_path / ".github", ignore=shutil.ignore_patterns("workflows"))
    folder = tmp_path / ".github" / "workflows"
    folder.mkdir()
    for i, workflow in enumerate(workflows):
        assert "uses: <org>/<repo>@<ref>" in workflow
        (folder / f"caller{i}.yml").write_text(workflow.replace("uses: <org>/<repo>@<ref>", "uses: ./"))
    linted = actionlint(tmp_path)
    assert linted.returncode == 0 and linted.stdout == "", linted.stdout + linted.stderr
    checked = validate(*sorted(folder.glob("*.yml")))
    assert checked.returncode == 0, checked.stdout + checked.stderr
