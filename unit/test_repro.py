"""`python -m ci repro` without running a test session: arguments, reports, verdicts, limits.

The end-to-end runs (a planted OOM, a rerun from a report) are in functional/test_repro.py.
"""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from ci import repro
from ci.jobs import JOBS, ROOT, pytest_args
from ci.limits import Kill, apply_memory_limit
from ci.verdicts import (
    ReportError,
    failed_tests,
    format_comparison,
    format_verdicts,
    junit_first_lines,
    junit_key,
    load_report,
    verdict,
)
from megatron_testkit import skips

pytestmark = pytest.mark.L0

MiB = 2**20


def entry(nodeid: str, outcome: str = "passed", **fields: Any) -> dict[str, Any]:
    """One test of a version-1 kit report, with the agreed field names."""
    base: dict[str, Any] = {
        "nodeid": nodeid,
        "outcome": outcome,
        "duration_s": 1.0,
        "world_size": 2,
        "backend": "gloo",
        "seed": 1234,
        "budget_host_bytes": None,
        "budget_device_bytes": None,
        "peak_host_bytes": 300 * MiB,
        "peak_device_bytes": None,
        "ranks": [],
        "failure": None,
        "log_dir": None,
    }
    base.update(fields)
    return base


def oom_entry(nodeid: str = "functional/test_x.py::test_big", seed: int = 77) -> dict[str, Any]:
    return entry(
        nodeid,
        "failed",
        seed=seed,
        budget_host_bytes=1536 * MiB,
        peak_host_bytes=1700 * MiB,
        ranks=[
            {
                "rank": 0,
                "peak_host_bytes": 400 * MiB,
                "peak_device_bytes": None,
                "exit_code": 0,
                "signal": None,
            },
            {
                "rank": 1,
                "peak_host_bytes": 1700 * MiB,
                "peak_device_bytes": None,
                "exit_code": 86,
                "signal": None,
            },
        ],
        failure={
            "rank": 1,
            "kind": "oom",
            "first_line": "rank 1 oom: fixtures.MemoryBudgetExceeded: host memory budget exceeded",
            "message": "rank 1 oom: fixtures.MemoryBudgetExceeded: host memory budget exceeded\n...",
        },
    )


PROJECT_FILES = {
    "unit/test_a.py": "def test_fine():\n    pass\n",
    "functional/test_b.py": (
        "import pytest\n\n\n"
        "@pytest.mark.parametrize(('n', 'backend'), [(2, 'gloo')])\n"
        "def test_big(n, backend):\n    pass\n\n\n"
        "def test_skipped():\n    pass\n"
    ),
    "unit/test_c.py": "def test_setup_error():\n    pass\n",
}


def make_project(root: Path, files: dict[str, str] = PROJECT_FILES) -> Path:
    """A small project holding the tests the reports below name (repro checks that they exist)."""
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    (root / "pytest.ini").write_text("[pytest]\naddopts = -p no:cacheprovider\n")
    return root


def write_report(path: Path, tests: list[dict[str, Any]], markexpr: str = "L0", gpus: int = 0) -> Path:
    session = {"markexpr": markexpr, "gpus": gpus, "pytest_args": ["-m", markexpr], "outcome_counts": {}}
    path.write_text(json.dumps({"version": 1, "session": session, "tests": tests}))
    return path


# ---- arguments ---------------------------------------------------------------------------------


BAD_ARGUMENTS = {
    "unknown tier": ["L7"],
    "unparsable host size": ["--host-memory", "lots"],
    "unknown device unit": ["--device-memory", "40 parsecs"],
    "negative gpus": ["--gpus", "-1"],
    "gpus not a number": ["--gpus", "two"],
    "unknown option": ["--bogus"],
    "missing report": ["--from-report", "{tmp}/absent.json"],
    "report not json": ["--from-report", "{tmp}/not.json"],
    "report of another version": ["--from-report", "{tmp}/v2.json"],
    "report without tests": ["--from-report", "{tmp}/notests.json"],
    "test without node id": ["--from-report", "{tmp}/nonodeid.json"],
    "unknown limit method": ["--limit-method", "ulimit"],
}


def _write_bad_reports(tmp: Path) -> None:
    (tmp / "not.json").write_text("{ this is not json")
    (tmp / "v2.json").write_text(json.dumps({"version": 99, "tests": []}))
    (tmp / "notests.json").write_text(json.dumps({"version": 1, "session": {}}))
    (tmp / "nonodeid.json").write_text(json.dumps({"version": 1, "tests": [{"outcome": "failed"}]}))


@pytest.mark.parametrize("case", sorted(BAD_ARGUMENTS))
def test_bad_arguments_are_one_line_errors_with_exit_code_2(
    case: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _write_bad_reports(tmp_path)
    argv = [arg.format(tmp=tmp_path) for arg in BAD_ARGUMENTS[case]]
    assert repro.main(argv) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.count("\n") == 1 and err.startswith("python -m ci repro: error: "), err


def test_the_module_entry_point_returns_2_on_a_bad_tier() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "ci", "repro", "L9"], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 2
    assert result.stderr == "python -m ci repro: error: unknown tier 'L9': expected one of L0, L1, L2\n"


# ---- what it would run ---------------------------------------------------------------------------


def dry_run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> list[str]:
    assert repro.main([*argv, "--dry-run"]) == 0
    return capsys.readouterr().out.splitlines()


def test_cpu_repro_uses_the_ci_rows_arguments_environment_and_runner_memory(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("KIT_HOST_MEMORY", raising=False)
    out = dry_run(["L0", "-k", "flops", "--reports", str(tmp_path)], capsys)
    assert out[0] == "ci repro: job L0-cpu (tier L0, runs-on ubuntu-latest)"
    env = next(line for line in out if line.startswith("ci repro: env "))
    assert (
        "KIT_HOST_MEMORY=7GB" in env and "CUDA_VISIBLE_DEVICES=''" in env and "HYPOTHESIS_PROFILE=ci" in env
    )
    command = shlex.split(out[-1].removeprefix("ci repro: "))
    assert command[1:] == [
        "-m", "pytest", "-m", "L0", f"--kit-report={tmp_path}", f"--junitxml={tmp_path}/junit.xml",
        "-p", "no:randomly", "--durations=20", "-k", "flops",
    ]  # fmt: skip


def test_gpu_repro_emulates_the_ci_card_and_gpu_count(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.delenv("KIT_DEVICE_MEMORY", raising=False)
    out = dry_run(["L1", "--gpus", "2", "--device-memory", "24GiB", "--reports", str(tmp_path)], capsys)
    assert out[0].startswith("ci repro: job L1-gpu (tier L1, runs-on self-hosted, linux, x64, gpu-x2)")
    env = next(line for line in out if line.startswith("ci repro: env "))
    assert "KIT_DEVICE_MEMORY=24GiB" in env and "CUDA_VISIBLE_DEVICES=0,1" in env
    assert f"TORCH_FR_DUMP_TEMP_FILE={tmp_path}/nccl/nccl_flight_recorder_rank_" in env
    assert "-m L1" in out[-1]


def test_from_report_selects_the_reports_tier_and_exactly_its_failed_tests(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    tests = [
        entry("unit/test_a.py::test_fine"),
        oom_entry("functional/test_b.py::test_big[2-gloo]"),
        entry("functional/test_b.py::test_skipped", "skipped"),
        entry("unit/test_c.py::test_setup_error", "error", failure=None, world_size=None),
    ]
    report = write_report(tmp_path / "kit-report.json", tests, markexpr="L1")
    project = make_project(tmp_path / "project")
    out = dry_run(
        ["--from-report", str(report), "--root", str(project), "--reports", str(tmp_path / "out")], capsys
    )
    assert out[0] == f"ci repro: job L1-cpu (tier L1, runs-on ubuntu-latest): 2 failed test(s) from {report}"
    command = shlex.split(out[-1].removeprefix("ci repro: "))
    assert command[-2:] == ["functional/test_b.py::test_big[2-gloo]", "unit/test_c.py::test_setup_error"]
    assert "unit/test_a.py::test_fine" not in out[-1] and "-m L1" in out[-1]


def test_a_report_directory_outside_the_project_keeps_the_projects_config(tmp_path: Path) -> None:
    """pytest reads a plugin option's separate value as a path when it picks the rootdir."""
    args = pytest_args(JOBS["L0-cpu"], tmp_path / "reports")
    result = subprocess.run(
        # --ignore (a core option) keeps collection empty, so this costs one pytest start-up.
        [sys.executable, "-m", "pytest", *args, "--collect-only", "--ignore=unit", "--ignore=functional"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert f"rootdir: {ROOT}" in result.stdout and "configfile: pyproject.toml" in result.stdout, (
        result.stdout
    )


def test_a_report_without_failures_reruns_nothing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    report = write_report(tmp_path / "r.json", [entry("a.py::test_x")])
    assert repro.main(["--from-report", str(report)]) == 0
    assert "no failed tests" in capsys.readouterr().out


# ---- reading reports and stating verdicts ------------------------------------------------------


def test_the_verdict_names_the_rank_kind_first_line_and_peak_against_budget() -> None:
    v = verdict(oom_entry())
    assert (v.rank, v.kind, v.cause) == (1, "oom", "rank 1 oom")
    assert v.first_line == "fixtures.MemoryBudgetExceeded: host memory budget exceeded"
    assert v.memory() == "host 1.66 GiB / 1.50 GiB"
    text = format_verdicts([v]).splitlines()
    assert text[0] == "FAILED functional/test_x.py::test_big: rank 1 oom"
    assert text[1].strip() == "fixtures.MemoryBudgetExceeded: host memory budget exceeded"
    assert "host 1.66 GiB / 1.50 GiB" in text[2] and "seed 77" in text[2]


def test_the_verdict_uses_the_failing_ranks_peak_not_the_tests_max() -> None:
    test = oom_entry()
    test["failure"]["rank"] = 0
    test["failure"]["kind"] = "error"
    assert verdict(test).peak_host == 400 * MiB


def test_a_failure_in_the_pytest_process_is_an_error_without_a_rank() -> None:
    v = verdict(
        entry("unit/test_a.py::test_assert", "failed", world_size=None, peak_host_bytes=None, seed=None)
    )
    assert (v.rank, v.cause, v.first_line) == (None, "error", "")
    assert format_verdicts([v]).splitlines() == [
        "FAILED unit/test_a.py::test_assert: error",
        "    in the pytest process (the test launched no ranks)",
    ]


def test_a_crash_without_first_line_falls_back_to_the_message() -> None:
    failure = {"rank": 3, "kind": "crash", "first_line": "", "message": "\nrank 3 died of SIGKILL\nmore"}
    v = verdict(entry("t.py::test_k", "failed", failure=failure))
    assert (v.cause, v.first_line) == ("rank 3 crash", "rank 3 died of SIGKILL")


def test_in_process_failures_take_their_first_line_from_junit(tmp_path: Path) -> None:
    assert junit_key("unit/test_a.py::TestX::test_y[1-a]") == ("unit.test_a.TestX", "test_y[1-a]")
    (tmp_path / "junit.xml").write_text(
        '<testsuites><testsuite name="pytest">'
        '<testcase classname="unit.test_a" name="test_assert"><failure message="assert 1 == 2&#10;+  where 1 = f()">'
        "long text</failure></testcase>"
        '<testcase classname="unit.test_a.TestX" name="test_y[1-a]"><error message="">'
        "\nfixture 'db' not found\nmore</error></testcase>"
        '<testcase classname="unit.test_a" name="test_ok"/>'
        "</testsuite></testsuites>"
    )
    junit = junit_first_lines(tmp_path / "junit.xml")
    assert junit == {
        ("unit.test_a", "test_assert"): "assert 1 == 2",
        ("unit.test_a.TestX", "test_y[1-a]"): "fixture 'db' not found",
    }
    v = verdict(entry("unit/test_a.py::test_assert", "failed", world_size=None), junit)
    assert v.first_line == "assert 1 == 2"
    assert verdict(oom_entry(), junit).first_line.startswith("fixtures.MemoryBudgetExceeded")
    assert junit_first_lines(tmp_path / "absent.xml") == {}


def test_failed_tests_keeps_report_order_and_each_id_once(tmp_path: Path) -> None:
    report = load_report(
        write_report(
            tmp_path / "r.json",
            [entry("a::x", "failed"), entry("a::y"), entry("a::x", "error"), entry("a::z", "error")],
        )
    )
    assert [t["nodeid"] for t in failed_tests(report)] == ["a::x", "a::z"]


def test_the_comparison_puts_ci_next_to_local_and_flags_what_differs() -> None:
    ci = [verdict(oom_entry(seed=77)), verdict(entry("t::gone", "failed"))]
    local = {"functional/test_x.py::test_big": verdict(entry("functional/test_x.py::test_big", seed=78))}
    lines = format_comparison(ci, local).splitlines()
    assert lines[0] == "functional/test_x.py::test_big"
    assert lines[1].split()[:4] == ["CI:", "failed", "rank", "1"]
    assert lines[2].split()[:3] == ["local:", "passed", "passed"]
    assert "seed differs: CI 77, local 78" in lines[4]
    assert lines[5:7] == ["t::gone", "    CI:    failed  error"]
    assert lines[7].startswith("    local: not run")


def test_load_report_accepts_what_the_plugin_writes(tmp_path: Path) -> None:
    path = write_report(tmp_path / "r.json", [oom_entry()])
    assert load_report(path)["tests"][0]["failure"]["kind"] == "oom"
    (tmp_path / "list.json").write_text("[]")
    with pytest.raises(ReportError, match="is not a version-2 kit report"):
        load_report(tmp_path / "list.json")


# ---- the runner's memory limit -------------------------------------------------------------------


def test_no_limit_and_env_limit_do_not_wrap_the_command() -> None:
    assert apply_memory_limit(None).wrap(["true"]) == ["true"]
    env = apply_memory_limit(2**30, "env")
    # env has no kernel limit (nothing wraps the command); the watcher enforces the ranks' summed RSS.
    assert env.wrap(["true"]) == ["true"] and "no kernel limit" in env.describe()
    assert "summed RSS" in env.describe()
    with pytest.raises(ValueError, match="unknown limit method 'ulimit'"):
        apply_memory_limit(2**30, "ulimit")


def test_the_whole_run_limit_kills_a_run_that_exceeds_it() -> None:
    limit = apply_memory_limit(200 * MiB)
    if limit.cgroup is None:
        limit.close()
        skips.skip("cgroup", f"no writable cgroup on this machine: {limit.describe()}")
    hog = [sys.executable, "-c", "b = bytearray(600 * 2**20); b[::4096] = b'x' * len(b[::4096])"]
    try:
        small = subprocess.run(
            limit.wrap([sys.executable, "-c", "print('ok')"]), capture_output=True, timeout=60
        )
        big = subprocess.run(limit.wrap(hog), capture_output=True, timeout=60)
        assert small.returncode == 0 and small.stdout == b"ok\n"
        assert big.returncode == -9, big
        assert (limit.oom_kills() or 0) >= 1
        assert limit.peak_bytes() is not None and limit.peak_bytes() <= 200 * MiB
    finally:
        limit.close()
    assert not limit.cgroup.exists()


# ---- stale ids, rank-less tests, rows ------------------------------------------------------------


def test_a_stale_id_is_reported_and_skipped_and_the_rest_rerun(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    tests = [
        oom_entry("functional/test_b.py::test_big[2-gloo]"),
        entry("functional/test_b.py::test_renamed", "failed"),  # in a file that still exists
        entry("unit/test_gone.py::test_x", "failed"),  # in a file that does not
    ]
    report = write_report(tmp_path / "kit-report.json", tests)
    project = make_project(tmp_path / "project")
    out = dry_run(["--from-report", str(report), "--root", str(project)], capsys)
    assert out[0] == (
        "ci repro: 2 failed test(s) of the report do not exist here (renamed or removed since the CI run?), "
        "skipped: functional/test_b.py::test_renamed, unit/test_gone.py::test_x"
    )
    command = shlex.split(out[-1].removeprefix("ci repro: "))
    assert command[-1] == "functional/test_b.py::test_big[2-gloo]"
    assert "test_renamed" not in out[-1] and "test_gone" not in out[-1]


def test_a_report_whose_failed_tests_all_vanished_reruns_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    report = write_report(tmp_path / "kit-report.json", [entry("unit/test_a.py::test_was_here", "failed")])
    project = make_project(tmp_path / "project")
    assert repro.main(["--from-report", str(report), "--root", str(project), "--dry-run"]) == 1
    out = capsys.readouterr().out
    assert "none of the report's failed tests exists here: nothing to rerun" in out
    assert "-m pytest" not in out


def test_collected_ids_lists_what_exists_without_running_it(tmp_path: Path) -> None:
    project = make_project(tmp_path / "project")
    ids = ["functional/test_b.py::test_big[2-gloo]", "functional/test_b.py::test_big[4-gloo]", "nope.py::t"]
    present = repro.collected_ids(project, ids, {})
    assert present == {
        "functional/test_b.py::test_big[2-gloo]",
        "functional/test_b.py::test_skipped",
    }


def test_the_comparison_names_stale_ids_and_rank_less_tests_in_words() -> None:
    rankless = entry(
        "unit/test_c.py::test_assert", "failed", world_size=None, peak_host_bytes=None, seed=None
    )
    ci = [verdict(rankless), verdict(entry("t::gone", "failed")), verdict(oom_entry(seed=5))]
    local = {
        "unit/test_c.py::test_assert": verdict(rankless),
        "functional/test_x.py::test_big": verdict(oom_entry(seed=5)),
    }
    lines = repro.format_comparison(ci, local, stale=["t::gone"]).splitlines()
    assert lines[:4] == [
        "unit/test_c.py::test_assert",
        "    CI:    failed  error",
        "    local: failed  error",
        "    in the pytest process (the test launched no ranks): no seed, world size or rank memory",
    ]
    assert "same seed (None)" not in "\n".join(lines)
    assert lines[4:7] == [
        "t::gone",
        "    CI:    failed  error",
        "    local: skipped: no such test here (renamed or removed since the CI run)",
    ]
    assert lines[-1] == "    same seed (5) and world size (2)"


def test_job_picks_a_row_by_name_and_the_report_names_its_row(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = dry_run(["--job", "L1-cpu-mcore-0.16.1", "--reports", str(tmp_path)], capsys)
    assert out[0] == "ci repro: job L1-cpu-mcore-0.16.1 (tier L1, runs-on ubuntu-latest)"
    env = next(line for line in out if line.startswith("ci repro: env "))
    assert "KIT_MEGATRON_CORE=0.16.1" in env and "KIT_CI_JOB=L1-cpu-mcore-0.16.1" in env
    # A report from that row (the plugin records KIT_CI_JOB as session.ci_job) reruns on that row.
    project = make_project(tmp_path / "project")
    report = write_report(
        tmp_path / "kit-report.json", [oom_entry("functional/test_b.py::test_big[2-gloo]")], "L1"
    )
    data = json.loads(report.read_text())
    data["session"]["ci_job"] = "L1-cpu-mcore-0.16.1"
    report.write_text(json.dumps(data))
    out = dry_run(["--from-report", str(report), "--root", str(project)], capsys)
    assert out[0].startswith("ci repro: job L1-cpu-mcore-0.16.1 (tier L1")
    # The GPU rows' mark expression still names the tier.
    gpu_report = write_report(
        tmp_path / "gpu.json", [oom_entry("functional/test_b.py::test_big[2-gloo]")], "L0 and gpu", 2
    )
    out = dry_run(["--from-report", str(gpu_report), "--root", str(project)], capsys)
    assert out[0].startswith("ci repro: job L0-gpu (tier L0")
    assert "-m 'L0 and gpu'" in out[-1]


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["--job", "L9-cpu"], "--job: unknown job 'L9-cpu'"),
        (["L0", "--job", "L1-cpu"], "--job L1-cpu runs tier L1, not L0"),
    ],
)
def test_bad_job_choices_are_usage_errors(
    argv: list[str], words: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert repro.main([*argv, "--dry-run"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and words in err and err.count("\n") == 1


# ---- the runner's memory limit: on the ranks, not on pytest --------------------------------------


def test_a_rank_killed_by_the_limit_becomes_the_root_cause_as_oom() -> None:
    crash = entry(
        "t::grows",
        "failed",
        failure={"rank": 1, "kind": "crash", "first_line": "rank 1 crash: killed by SIGKILL"},
    )
    kill = Kill("t::grows", 1, 2, 4242, "killed by the kernel OOM killer in the ranks' capped cgroup (...)")
    v = repro.with_kills(verdict(crash), [kill])
    assert (v.rank, v.kind, v.cause) == (1, "oom", "rank 1 oom")
    assert v.first_line.startswith("killed by the kernel OOM killer")
    passed = verdict(entry("t::grows"))
    assert repro.with_kills(passed, [kill]) == passed, "a passing test is not rewritten"
    assert repro.with_kills(verdict(crash), []) == verdict(crash)


def test_the_printed_report_path_exists_even_when_pytest_wrote_none(tmp_path: Path) -> None:
    md = tmp_path / "reports" / "kit-report.md"
    limit = apply_memory_limit(700 * MiB, "env")
    kill = Kill("t::grows", 1, 2, 4242, "the ranks' summed RSS 701 MiB exceeded ...")
    repro._note_in_markdown(md, -9, limit, [kill], "runner memory (env, on the ranks): ...")
    text = md.read_text()
    assert "pytest exited with -9 and wrote no report" in text
    assert "### Runner memory limit (env)" in text and "`t::grows`: rank 1 oom: the ranks' summed RSS" in text


RANK = (
    # A stand-in for a launcher's rank: same command-line name, grows 8 MiB every 20 ms up to `mib`.
    "import sys, time\n"
    "blocks = []\n"
    "for _ in range(int(sys.argv[1]) // 8):\n"
    "    blocks.append(bytearray(8 * 2**20)); time.sleep(0.02)\n"
    "time.sleep(30)\n"
)
PARENT = (
    # A stand-in for pytest: starts two ranks the way the launcher does and waits for them.
    "import os, subprocess, sys\n"
    "os.environ['PYTEST_CURRENT_TEST'] = 'test_fake.py::test_grows (call)'\n"
    "small = subprocess.Popen([sys.executable, '-c', sys.argv[1], '16', 'kit-rank-0-of-2'])\n"
    "big = subprocess.Popen([sys.executable, '-c', sys.argv[1], sys.argv[2], 'kit-rank-1-of-2'])\n"
    "print(big.wait(), flush=True); small.kill(); small.wait()\n"
)


def _run_parent(limit: Any, grow_mib: int) -> tuple[subprocess.CompletedProcess[str], list[Kill], list[int]]:
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT, RANK, str(grow_mib)], stdout=subprocess.PIPE, text=True
    )
    watcher = limit.watch(parent.pid)
    out, _ = parent.communicate(timeout=120)
    kills = watcher.stop()
    adopted = sorted(r.rank for r in watcher.ranks.values())
    assert not watcher.errors, watcher.errors
    return subprocess.CompletedProcess(parent.args, parent.returncode, out, ""), kills, adopted


def test_env_limit_kills_the_rank_that_pushed_the_sum_over_and_names_it() -> None:
    limit = apply_memory_limit(300 * MiB, "env")
    result, kills, adopted = _run_parent(limit, 600)
    limit.close()
    assert adopted == [0, 1]
    assert result.returncode == 0 and result.stdout.strip() == "-9", "the growing rank was killed"
    assert [(k.nodeid, k.rank, k.world_size) for k in kills] == [("test_fake.py::test_grows", 1, 2)]
    assert "exceeded the runner's 300.00 MiB (env method)" in kills[0].reason


def test_cgroup_limit_caps_only_the_ranks_names_the_oom_kill_and_leaves_nothing() -> None:
    limit = apply_memory_limit(300 * MiB)
    if limit.cgroup is None:
        limit.close()
        skips.skip("cgroup", f"no writable cgroup on this machine (the env variant runs): {limit.describe()}")
    group = limit.cgroup
    try:
        result, kills, adopted = _run_parent(limit, 600)
        assert adopted == [0, 1]
        # The parent (pytest's stand-in) was never in the group: it survived and printed.
        assert result.returncode == 0 and result.stdout.strip() == "-9"
        assert (limit.oom_kills() or 0) >= 1
        assert [(k.nodeid, k.rank) for k in kills] == [("test_fake.py::test_grows", 1)]
        assert "killed by the kernel OOM killer in the ranks' capped cgroup" in kills[0].reason
        assert "oom_kill 0 -> 1" in kills[0].reason
    finally:
        limit.close()
    assert not group.exists() and limit.leftovers == 0


def test_closing_the_limit_kills_a_rank_that_outlived_the_run_then_removes_the_group() -> None:
    limit = apply_memory_limit(300 * MiB)
    if limit.cgroup is None:
        limit.close()
        skips.skip("cgroup", f"no writable cgroup on this machine: {limit.describe()}")
    group = limit.cgroup
    straggler = subprocess.Popen(limit.wrap([sys.executable, "-c", "import time; time.sleep(60)"]))
    deadline = time.monotonic() + 10
    while straggler.pid not in limit.pids() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert straggler.pid in limit.pids()
    limit.close(wait_s=0.5)
    assert straggler.wait(timeout=10) == -9
    assert limit.leftovers == 1 and not group.exists()
