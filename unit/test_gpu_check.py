"""`python -m ci gpu-check`: its arguments, the commands it would run on the GPU, its dry run on this CPU.

The GPU steps themselves need a GPU; here the dry run runs their CPU side for real (imports, a
real flight-recorder dump of a gloo desync parsed and diagnosed, the accounting calls, the
benchmark's code, the harness on CPU, the pytest selection collected).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ci import gpu_check
from ci.cli import main
from ci.gpu_check import pytest_step
from ci.gpu_check.summary import StepFailed
from fixtures.suite_collection import whole_suite

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.L0
def test_unknown_steps_and_missing_outdir_are_refused_with_exit_code_2(tmp_path, capsys):
    assert main(["gpu-check", str(tmp_path), "--only", "memory,warp"]) == 2
    err = capsys.readouterr().err
    assert "unknown step(s) ['warp']" in err and err.count("\n") == 1
    assert main(["gpu-check"]) == 2
    assert "OUTDIR" in capsys.readouterr().err


@pytest.mark.L0
def test_the_pytest_step_selects_l0_gpu_tests_and_requires_the_gpu(tmp_path):
    check = gpu_check.Check(tmp_path, dry_run=True, budget_s=60)
    cmd, env = check.pytest_command()
    assert cmd[1:3] == ["-m", "pytest"]
    assert cmd[cmd.index("-m", 2) + 1] == "L0 and gpu"
    assert f"--kit-report={tmp_path / 'pytest'}" in cmd
    assert env["KIT_REQUIRE_GPUS"] == "1"  # a skipped GPU test is a failure here
    # The GPU rows' declared skips, and the two-GPU tests this one GPU cannot run.
    assert env["KIT_ALLOWED_SKIPS"] == "no-cuda,gpus"


# Two tests of a tiny project, as a one-GPU machine sees two-GPU tests: both skip, or one runs.
SKIPPING_TESTS = """
import os

import pytest


def test_pair_a():
    pytest.skip("needs gpus: needs 2 GPUs (marked gpu, world_size(2)); 1 visible")


def test_pair_b():
    if os.environ.get("ONE_RUNS") != "1":
        pytest.skip("needs gpus: needs 2 GPUs (marked gpu, world_size(2)); 1 visible")
"""


def _junit(tmp_path: Path, one_runs: bool, *extra: str) -> Path:
    """A real junit XML file written by pytest for SKIPPING_TESTS (``extra``: more pytest arguments)."""
    (tmp_path / "test_pairs.py").write_text(SKIPPING_TESTS)
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    junit = tmp_path / f"junit-{one_runs}.xml"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            f"--junitxml={junit}",
            *extra,
            "test_pairs.py",
        ],
        cwd=tmp_path,
        env={**os.environ, "ONE_RUNS": "1" if one_runs else "0"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return junit


@pytest.mark.L0
def test_a_run_whose_every_test_skipped_ran_nothing_and_fails_the_step(tmp_path):
    counts = pytest_step.junit_counts(_junit(tmp_path, one_runs=False))
    # JUnit's `tests` counts the skipped tests: read alone it says two tests ran.
    assert (counts["tests"], counts["skipped"], counts["ran"]) == (2, 2, 0)
    with pytest.raises(StepFailed, match=r"no 'L0 and gpu' test ran \(2 collected, 2 skipped\)"):
        pytest_step.expect_some_ran(counts)
    # Control: one of the two runs, and the step accepts it.
    counts = pytest_step.junit_counts(_junit(tmp_path, one_runs=True))
    assert (counts["tests"], counts["skipped"], counts["ran"]) == (2, 1, 1)
    pytest_step.expect_some_ran(counts)
    assert pytest_step.junit_counts(tmp_path / "absent.xml") == {}


@pytest.mark.L0
def test_a_step_out_of_time_is_skipped_and_the_check_fails(tmp_path):
    check = gpu_check.Check(tmp_path, dry_run=True, budget_s=0)
    assert check.run(["environment"]) == 1
    (line,) = (tmp_path / "summary.json").read_text().splitlines()
    result = json.loads(line)
    assert (result["step"], result["status"]) == ("environment", "skipped")
    assert "out of time" in result["detail"]


@pytest.mark.L0
def test_a_rerun_into_the_same_outdir_never_takes_the_previous_runs_dump_for_its_own(tmp_path):
    import torch

    from ci.gpu_check import hang
    from megatron_testkit import flight_recorder as fr

    parent = tmp_path / "flight_recorder"
    first = hang.fresh_run_dir(parent)
    # The first run's rank 0 dumped (a real, readable flight-recorder dump of this process).
    fr.dump_path(first / fr.DUMP_STEM, 0).write_bytes(torch._C._distributed_c10d._dump_fr_trace())
    assert fr.wait_for_dumps(first / fr.DUMP_STEM, [0], timeout_s=0.1)  # it reads as "dumped"
    second = hang.fresh_run_dir(parent)
    assert second != first and second.parent == parent and list(second.iterdir()) == []
    # Where the second run waits for its dump, the first run's is not there to be taken for it.
    assert fr.wait_for_dumps(second / fr.DUMP_STEM, [0], timeout_s=0.1) == {}


@pytest.mark.L0
def test_the_te_training_step_needs_transformer_engine_on_the_gpu_and_says_so(tmp_path):
    from ci.gpu_check import te_train
    from ci.gpu_check.summary import CheckState

    # On this CPU machine TE cannot be used: the GPU path refuses before launching anything.
    with pytest.raises(StepFailed, match=r"^needs te: no CUDA device: .*run the others with --only"):
        te_train.step(CheckState(tmp_path, dry_run=False, budget_s=60))
    assert te_train.loss_spread([2.0, 4.0], [2.0, 4.0]) == 0.0
    assert te_train.loss_spread([2.0, 4.0], [2.02, 3.9]) == pytest.approx(0.025)  # 0.1 / 4.0
    with pytest.raises(StepFailed, match="logged 2 and 1 losses"):
        te_train.loss_spread([2.0, 4.0], [2.0])


@pytest.mark.L0
def test_the_check_says_which_tests_one_gpu_did_not_cover(tmp_path):
    from ci.gpu_check.summary import StepResult

    reports = tmp_path / "reports"
    _junit(tmp_path, True, f"--kit-report={reports}")
    skipped = pytest_step.needing_more_gpus(reports / "kit-report.json")
    assert skipped == ["test_pairs.py::test_pair_a"]  # test_pair_b ran
    check = gpu_check.Check(tmp_path, dry_run=False, budget_s=60)
    check.results = [
        StepResult("pytest", "ok", figures={"not_covered": skipped}),
        StepResult("te_inspect", "failed", detail="needs te: not installed"),
    ]
    lines = check.not_covered()
    assert lines[0].startswith("the tests that need two GPUs")
    assert "skipped here for want of GPUs (1): test_pairs.py::test_pair_a" in lines
    assert "step te_inspect failed: needs te: not installed" in lines


@pytest.mark.L1
def test_the_dry_run_passes_and_writes_one_summary_line_per_step(tmp_path):
    steps = ["environment", "memory", "hang", "sync", "bench", "te_train", "te_inspect"]
    run = subprocess.run(
        [sys.executable, "-m", "ci", "gpu-check", str(tmp_path), "--dry-run", "--only", ",".join(steps)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    lines = [json.loads(line) for line in (tmp_path / "summary.json").read_text().splitlines()]
    assert [line["step"] for line in lines] == steps
    assert {line["status"] for line in lines} == {"dry-ok"}
    by_step = {line["step"]: line["figures"] for line in lines}
    # The flight-recorder dump of the gloo desync is real and read back: rank 1 never entered #2.
    assert any("rank 1 at #1 never entered it" in d for d in by_step["hang"]["diagnosis"])
    assert by_step["hang"]["nccl_env"]["TORCH_NCCL_DEBUG_INFO_PIPE_FILE"].startswith(str(tmp_path))
    # The accounting on the dry run's device equals the CPU reference accumulator.
    assert by_step["sync"]["flops"] == by_step["sync"]["cpu_flops"] > 0
    assert set(by_step["bench"]["us_per_microbatch"]) == {"8", "512", "8192"}
    assert json.loads((tmp_path / "bench.json").read_text())["device"] == "cpu"
    # The TE steps' CPU side: the harness calls, two runs bit-identical in fp32, the test's CPU twin.
    te = by_step["te_train"]
    assert te["bf16_loss_spread"] == 0.0 and te["use_te"] is False and te["platform"] == "cpu-gloo"
    assert te["loss_after_load"] == te["loss_before_save"] and "GPU" in te["te"]
    assert by_step["te_inspect"]["ran"] == 1 and "default-precision-1rank" in by_step["te_inspect"]["command"]
    for step in steps:
        assert f"[gpu-check] {step}" in run.stdout
    assert "[gpu-check] not covered: the tests that need two GPUs" in run.stdout


@pytest.mark.L0
def test_the_pytest_step_collects_only_the_files_holding_gpu_tests(tmp_path):
    files = pytest_step.gpu_test_files()
    assert {
        "unit/test_memory.py",
        "functional/test_cp_pretrain_sft.py",
        "functional/test_tensor_inspect.py",
    } <= set(files)
    # The workflow and action checks import yaml, which a GPU container need not have.
    assert "unit/test_workflows.py" not in files and "unit/test_action.py" not in files
    cmd, _ = gpu_check.Check(tmp_path, dry_run=True, budget_s=60).pytest_command()
    assert cmd[cmd.index("L0 and gpu") + 1 : cmd.index("L0 and gpu") + 1 + len(files)] == files


@pytest.mark.L0
def test_a_module_the_gpu_test_files_import_and_the_interpreter_lacks_is_named(tmp_path):
    (tmp_path / "conftest.py").write_text("import kit_absent_for_conftest\nimport os\n")
    (tmp_path / "fixtures").mkdir()
    (tmp_path / "fixtures" / "support.py").write_text("from kit_absent_for_fixtures.sub import x\n")
    (tmp_path / "test_gpu.py").write_text(
        "import pytest\n"
        "from fixtures.support import x\n"
        "try:\n    import kit_absent_optional\nexcept ImportError:\n    pass\n"
        "def test_a():\n    import kit_absent_in_a_function\n"
    )
    # Module-level imports only, followed through the repository's fixtures; optional ones are not needed.
    assert pytest_step.missing_modules(["test_gpu.py"], root=tmp_path) == [
        "kit_absent_for_conftest",
        "kit_absent_for_fixtures",
    ]
    assert pytest_step.missing_modules(pytest_step.gpu_test_files()) == []  # this environment has them


@pytest.mark.L0
def test_a_missing_module_fails_the_pytest_step_in_one_line_before_pytest(tmp_path, monkeypatch):
    # This interpreter has hypothesis: its absence (real in a GPU container without it) stands in here.
    monkeypatch.setattr(pytest_step, "missing_modules", lambda files: ["hypothesis"])
    check = gpu_check.Check(tmp_path, dry_run=True, budget_s=60)
    with pytest.raises(
        StepFailed, match=r"^this interpreter lacks hypothesis, which the GPU test files import: carry"
    ):
        pytest_step.step(check)
    assert not (tmp_path / "pytest.log").exists()  # pytest never ran


@pytest.mark.L1
def test_the_gpu_test_files_hold_every_l0_gpu_test_of_the_tree(tmp_path_factory):
    def collected(*paths: str) -> set[str]:
        run = subprocess.run(
            [
                sys.executable,
                "-m",
                "pytest",
                "--collect-only",
                "-q",
                "-m",
                "L0 and gpu",
                "-p",
                "no:randomly",
                *paths,
            ],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
        return {line for line in run.stdout.splitlines() if "::" in line}

    # The whole tree's `-m "L0 and gpu"`, from the session's one collection of the suite (the
    # tier and CI-row checks read the same); the GPU step's own files are collected as it does.
    everything = set(whole_suite(tmp_path_factory).select("L0 and gpu"))
    assert everything and collected(*pytest_step.gpu_test_files()) == everything
