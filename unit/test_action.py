"""The kit's composite action (action.yml) is valid, its scripts are clean, and its steps do their job.

actionlint reads workflows only, so the action is checked on its own: against GitHub's action
schema (check-jsonschema's vendored `vendor.github-actions`, offline) and each `run:` script with
shellcheck, a deliberately broken copy rejected by each. Its steps run here as a runner runs them
(`fixtures.github_action`) on a tiny project with this environment's kit: the tests with the kit
report, the summary, one `::error` per failed test, the artifact and the repro line, the tests'
exit code. `functional/test_fresh_project.py` runs them again with only the kit's wheel installed.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

from fixtures.github_action import ActionRun, run_action

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
    # The step's own variables never reach the report as settings of the run (repro warned about
    # each: "KIT_COMMAND: not a setting of the kit"); only what it sets for the kit does.
    recorded = json.loads((project / "reports" / "kit-report.json").read_text())["session"]["settings"]
    assert [s["name"] for s in recorded if s["name"].startswith("KIT_")] == ["KIT_CI_JOB"], recorded
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


# A project whose conftest records the words pytest got (before any test runs) and takes any
# number of `--word TEXT` options, so that hostile text can reach pytest as plain values.
RECORDING = {
    "tests/conftest.py": textwrap.dedent(
        """
        import json


        def pytest_addoption(parser):
            parser.addoption("--word", action="append", default=[])


        def pytest_configure(config):
            with open("argv.json", "w") as f:
                json.dump(list(config.invocation_params.args), f)
        """
    ),
    "tests/test_plain.py": "def test_passes():\n    assert True\n",
}


def _hostile_run(tmp_path: Path, inputs: dict[str, str]) -> tuple[Path, ActionRun]:
    project = tmp_path / "project"
    for name, text in RECORDING.items():
        (project / name).parent.mkdir(parents=True, exist_ok=True)
        (project / name).write_text(text)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GITHUB_", "PYTEST_", "KIT_"))}
    env["PYTHONPATH"] = str(ROOT)
    run = run_action(
        ACTION,
        {"install": "false", "python": sys.executable, **inputs},
        cwd=project,
        env=env,
        github={"job": "unit", "run_id": "42", "repository": "me/proj"},
    )
    return project, run


def test_pytest_args_are_split_into_words_and_never_evaluated(tmp_path: Path) -> None:
    """`pytest-args: -k "${{ github.head_ref }}"` hands a branch name to the step: `x$(touch${IFS}PWNED)`
    is a valid ref. Command substitution, backticks, variables and globs reach pytest as text."""
    args = (
        "-p no:randomly -p no:cacheprovider --word=x$(touch${IFS}PWNED) "
        '--word "`touch PWNED2`" --word \'$HOME "quoted"\' --word * --word a\\ b -k passes tests'
    )
    project, run = _hostile_run(tmp_path, {"pytest-args": args})
    tests = run.step("Tests with the kit report")
    assert tests.returncode == 0 and "kit: the tests exited with 0" in tests.output, tests.output
    assert not (project / "PWNED").exists() and not (project / "PWNED2").exists(), "the input ran as shell"
    assert json.loads((project / "argv.json").read_text()) == [
        "-p",
        "no:randomly",
        "-p",
        "no:cacheprovider",
        "--word=x$(touch${IFS}PWNED)",
        "--word",
        "`touch PWNED2`",
        "--word",
        '$HOME "quoted"',
        "--word",
        "*",  # not the project's files
        "--word",
        "a b",
        "-k",
        "passes",
        "tests",
        "--kit-report=reports",
        "--junitxml=reports/junit.xml",
    ]
    assert run.returncode == 0 and run.outputs["exit-code"] == "0"


def test_an_unbalanced_quote_fails_the_step_with_one_line_and_runs_no_test(tmp_path: Path) -> None:
    """Evaluated, the words failed to parse, the selection was dropped and the whole suite ran (and
    could go green); now the step fails before pytest starts."""
    project, run = _hostile_run(tmp_path, {"pytest-args": "-k 'passes tests"})
    tests = run.step("Tests with the kit report")
    assert tests.returncode == 2, tests.output
    assert tests.output.splitlines() == [
        "kit: pytest-args: No closing quotation: not split into words, no test was run"
    ]
    assert not (project / "argv.json").exists() and not (project / "reports" / "junit.xml").exists()
    assert run.returncode != 0 and run.outputs["exit-code"] == "2"


def test_summary_also_publishes_only_files_of_the_report_folder(tmp_path: Path) -> None:
    """`summary-also: ../../x` put any file of the runner into the public job summary."""
    (tmp_path / "x").write_text("SECRET of the runner\n")
    _, run = _hostile_run(tmp_path, {"pytest-args": "-p no:randomly tests", "summary-also": "ok.md ../../x"})
    step = run.step("Job summary, memory chart and annotations")
    assert "SECRET" not in run.summary + run.log
    assert step.returncode == 2
    assert step.output.splitlines() == [
        "python -m megatron_testkit summary: error: --also reports/../../x is not a file of the report "
        "folder reports"
    ]
    assert run.returncode == 2


def test_summary_also_names_are_not_globbed(tmp_path: Path) -> None:
    """Split unquoted, `*` matched the project's files (here `tests`), each read as a summary file."""
    _, run = _hostile_run(tmp_path, {"pytest-args": "-p no:randomly tests", "summary-also": "*  *.md"})
    step = run.step("Job summary, memory chart and annotations")
    assert step.returncode == 0, step.output
    assert "No *: the job stopped" in run.summary and "No *.md: the job stopped" in run.summary
    assert "No tests:" not in run.summary


@pytest.mark.parametrize(
    "name", ["kit\nexit-code=0", "kit\rx", "a/b", "../x", "-rf", "--x", ".", "..", "..."], ids=repr
)
def test_an_artifact_name_with_a_control_character_or_a_path_is_refused(tmp_path: Path, name: str) -> None:
    """A new line in the name added lines to $GITHUB_OUTPUT; `-rf` broke the summary's command line
    (an empty job summary), `..` made the repro line download into the folder above the project."""
    project, run = _hostile_run(tmp_path, {"pytest-args": "-p no:randomly tests", "artifact-name": name})
    names = run.step("Name the artifact")
    assert names.returncode == 2 and names.written == ""
    assert len(names.output.splitlines()) == 1 and names.output.startswith("kit: artifact-name: ")
    assert not run.step("Tests with the kit report").ran and not (project / "argv.json").exists()
    assert run.returncode != 0


def test_the_default_runs_the_projects_tests_as_its_own_configuration_selects_them(tmp_path: Path) -> None:
    """The default was `-m L0`, this repository's tier policy: a project without that marker had
    every test deselected, pytest's exit 5, and a red job with no hint."""
    project, run = _hostile_run(tmp_path, {})
    tests = run.step("Tests with the kit report")
    assert tests.returncode == 0 and "kit: the tests exited with 0" in tests.output, tests.output
    assert json.loads((project / "argv.json").read_text()) == [
        "--kit-report=reports",
        "--junitxml=reports/junit.xml",
    ]
    report = json.loads((project / "reports" / "kit-report.json").read_text())
    assert [t["nodeid"] for t in report["tests"]] == ["tests/test_plain.py::test_passes"]
    assert run.returncode == 0 and run.outputs["exit-code"] == "0"


def test_a_selection_of_no_test_fails_with_one_line_naming_it_and_the_projects_markers(
    tmp_path: Path,
) -> None:
    """`-m L0` in a project that declares other markers: exit 5, and one line that says which
    expression selected nothing and which markers the project declares (the kit's own left out)."""
    (tmp_path / "project").mkdir()
    (tmp_path / "project" / "pytest.ini").write_text(
        "[pytest]\nmarkers =\n    slow: long tests\n    nightly\n"
    )
    _, run = _hostile_run(tmp_path, {"pytest-args": "-m L0 tests"})
    tests = run.step("Tests with the kit report")
    explained = [line for line in tests.output.splitlines() if line.startswith("kit: no test selected")]
    assert explained == [
        "kit: no test selected (pytest exit 5) by -m 'L0'; this project declares the markers: slow, nightly"
    ], tests.output
    assert any(line.startswith("::error title=kit: no test selected::") for line in tests.output.splitlines())
    assert run.returncode == 5 and run.outputs["exit-code"] == "5"
