"""Per-test ranks (``--kit-ranks-per-test``) on a torchrun-style suite of our own, unchanged.

`fixtures/torchrun_suite` is written the way projects that adopt the kit already have theirs: a
`Utils`-like init that asks for NCCL and calls ``set_device(rank % device_count())``, groups made per
test, a test that fails on one rank, one that deadlocks, one that needs eight ranks. Each test here
copies it into a temporary project whose ini turns the mode and the CPU layer on (two lines, no
conftest edit) and runs pytest on it in a child process, then reads the kit report.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from fixtures.inner_session import REPO_ROOT, WITHOUT_HYPOTHESIS, inner_env, run_inner_session

SUITE = REPO_ROOT / "fixtures" / "torchrun_suite"
TESTS = "torchrun_suite/test_suite_groups.py"
INI = "[pytest]\nkit_ranks_per_test = 2\nkit_cpu_shim = true\n"


def _run(tmp_path: Path, *args: str, env: dict[str, str] | None = None) -> dict[str, Any]:
    """The suite in a project of its own under ``tmp_path``, run by pytest with the kit report on."""
    project = tmp_path / "project"
    if not project.exists():
        shutil.copytree(SUITE, project / "torchrun_suite", ignore=shutil.ignore_patterns("__pycache__"))
        (project / "pytest.ini").write_text(INI)
    reports = tmp_path / "reports"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-p",
            "no:cacheprovider",
            *WITHOUT_HYPOTHESIS,
            f"--kit-report={reports}",
            *args,
        ],
        cwd=project,
        env={**inner_env(), "SUITE_FIXTURE_LOG": str(tmp_path / "fixtures.log"), **(env or {})},
        capture_output=True,
        text=True,
        timeout=900,
    )
    report = json.loads((reports / "kit-report.json").read_text())
    return {
        "output": proc.stdout + proc.stderr,
        "rc": proc.returncode,
        "report": report,
        "rows": {row["nodeid"].split("::")[-1]: row for row in report["tests"]},
        "fixture_log": (tmp_path / "fixtures.log").read_text().splitlines()
        if (tmp_path / "fixtures.log").exists()
        else [],
    }


@pytest.mark.L0
def test_a_torchrun_style_test_runs_on_fresh_ranks_with_its_own_nccl_init(tmp_path: Path) -> None:
    run = _run(tmp_path, f"{TESTS}::test_groups_made_per_test_reduce_over_nccl_asked_for")
    assert run["rc"] == 0, run["output"][-4000:]
    # One row, this session's: the ranks' own sessions write none.
    (row,) = run["report"]["tests"]
    assert row["outcome"] == "passed" and row["world_size"] == 2
    (launch,) = row["launches"]
    assert launch["backend"] == "gloo"
    # The suite's session fixture ran in each rank (RANK 0 and 1), never in this pytest process.
    assert sorted(line.split()[1] for line in run["fixture_log"]) == ["0", "1"]
    # Each rank's NCCL init and group got gloo, its set_device(rank % device_count()) ran: listed
    # once in the session's header, counted over both ranks.
    listed = {s["call"]: s["count"] for s in run["report"]["session"]["cpu_substitutions"]}
    assert listed["torch.distributed.init_process_group(backend='nccl') -> gloo"] == 2
    assert listed["torch.distributed.new_group(backend='nccl') -> gloo"] == 2
    assert listed["torch.cuda.set_device"] == 2
    assert listed["torch.cuda.Stream() -> CPU stream"] == 2


@pytest.mark.L1
def test_a_rank_that_fails_and_a_deadlock_are_named_with_their_own_evidence(tmp_path: Path) -> None:
    run = _run(
        tmp_path,
        f"{TESTS}::test_fails_on_rank_one_only",
        f"{TESTS}::test_each_rank_waits_in_a_group_the_other_never_enters",
        f"{TESTS}::test_groups_made_per_test_reduce_over_nccl_asked_for",
    )
    assert run["rc"] == 1, run["output"][-4000:]
    rows = run["rows"]
    assert len(run["report"]["tests"]) == 3
    failed = rows["test_fails_on_rank_one_only"]
    assert failed["outcome"] == "failed"
    assert (failed["failure"]["rank"], failed["failure"]["kind"]) == (1, "error")
    message = failed["failure"]["message"]
    # The test's own failure in rank 1's session: its assertion, its source line, its file.
    assert "AssertionError: rank 1 counted 42 ranks" in failed["failure"]["first_line"]
    assert "assert seen == Utils.world_size" in message
    assert "torchrun_suite/test_suite_groups.py" in message
    hung = rows["test_each_rank_waits_in_a_group_the_other_never_enters"]
    assert hung["failure"]["kind"] == "hang"
    text = hung["failure"]["message"]
    assert "rank 0 -> rank 1 -> rank 0" in text.splitlines()[0]
    assert "rank 0 waits in all_reduce #1 of group [0, 1]" in text
    assert "rank 1 waits in all_reduce #1 of group [0, 1]" in text
    # Named by the stall rule (stall_window(5) on the test), not by the launch timeout.
    assert hung["launches"][0]["duration_s"] < 120
    assert rows["test_groups_made_per_test_reduce_over_nccl_asked_for"]["outcome"] == "passed"
    # Session fixtures run once per test, in each of its ranks: three tests on two ranks.
    assert len(run["fixture_log"]) == 6


@pytest.mark.L1
def test_an_eight_rank_test_goes_through_admission_and_passes(tmp_path: Path) -> None:
    # A rank of a test without a memory_budget is admitted with KIT_DEFAULT_RANK_MEMORY.
    share = 256 * 2**20
    run = _run(
        tmp_path,
        f"{TESTS}::test_eight_ranks_reduce_once",
        env={"KIT_DEFAULT_RANK_MEMORY": str(share)},
    )
    assert run["rc"] == 0, run["output"][-4000:]
    row = run["rows"]["test_eight_ranks_reduce_once"]
    assert row["outcome"] == "passed" and row["world_size"] == 8  # its ranks_per_test(8) marker
    assert row["admitted_bytes"] == 8 * share
    # All eight at once. The session's peak may hold more than this launch: a warm parent's memory
    # stands in the ledger, and under this repository's CI the ledger is the enclosing session's.
    assert run["report"]["session"]["admission_peak_bytes"] >= 8 * share
    assert sorted(line.split()[1] for line in run["fixture_log"]) == [str(r) for r in range(8)]


# Two tests that skip inside their ranks: one declares its capability through the kit, one does not.
SKIPPING = """
import pytest

from megatron_testkit import skips


def test_declared():
    skips.skip("cuda", "no CUDA device here")


def test_free_text():
    pytest.skip("just because")
"""


@pytest.mark.L0
def test_a_skip_inside_the_ranks_keeps_the_capability_it_declares(tmp_path: Path) -> None:
    # The rank's reason reaches the launching session as the test wrote it (not "Skipped: needs
    # cuda: ..."), so the skip policy reads its capability: allowed here, while the free-text skip
    # is still refused as undeclared (by the rank's own session, which applies the same policy).
    run = run_inner_session(
        tmp_path,
        "test_skipping.py",
        SKIPPING,
        "-o",
        "kit_ranks_per_test=2",
        "-rs",
        env={"KIT_ALLOWED_SKIPS": "cuda"},
    )
    declared, free = run["rows"]["test_declared"], run["rows"]["test_free_text"]
    assert (declared["outcome"], declared["skip_capability"]) == ("skipped", "cuda"), run["output"][-3000:]
    # The skip is placed at the test (its def line, as for a skip mark); before, -rs named a line of
    # pytest's own runner.py, the place the launcher's skip was raised from.
    skip_lines = [line for line in run["output"].splitlines() if line.startswith("SKIPPED")]
    assert skip_lines == ["SKIPPED [1] test_skipping.py:7: needs cuda: no CUDA device here"], skip_lines
    assert free["outcome"] == "failed", run["output"][-3000:]
    assert "a skip must declare the capability it needs" in run["output"]
