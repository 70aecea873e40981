"""`python -m ci repro` without running a test session: arguments, reports, verdicts, limits.

The end-to-end runs (a planted OOM, a rerun from a report) are in functional/test_repro.py.
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import shlex
import shutil
import subprocess
import sys
import time
import tracemalloc
from pathlib import Path
from typing import Any

import pytest

from ci import repro
from ci.jobs import JOBS, ROOT, pytest_args
from megatron_testkit import skips
from megatron_testkit.report_input import MAX_REPORT_BYTES
from megatron_testkit.repro_limit import Kill, apply_memory_limit
from megatron_testkit.verdicts import (
    ReportError,
    failed_tests,
    format_comparison,
    format_verdicts,
    junit_first_lines,
    junit_key,
    load_report,
    verdict,
)

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


def _junit(path: Path, size: int, last: str) -> Path:
    """A JUnit file of about `size` bytes of small failed test cases, the one named `last` at its end."""
    head = '<?xml version="1.0"?><testsuites><testsuite name="pytest">'
    block = "".join(
        f'<testcase classname="tests.test_many" name="test_{i}"><failure message="m{i}"/></testcase>'
        for i in range(10_000)
    )
    tail = (
        f'<testcase classname="tests.test_x" name="{last}"><failure message="">\n\n  boom at the end  \n'
        "more</failure></testcase></testsuite></testsuites>"
    )
    with open(path, "w") as f:
        f.write(head)
        for _ in range((size - len(head) - len(tail)) // len(block)):
            f.write(block)
        f.write(tail)
    return path


def test_a_junit_file_is_streamed_in_memory_that_does_not_grow_with_it(tmp_path: Path) -> None:
    """Parsed into one tree, a 64 MiB junit.xml beside a report took `repro --dry-run` to 0.7 GB
    (2.7 GB for another file): memory grew with the file. Streamed, it stays flat."""
    from megatron_testkit.verdicts import _JUNIT_CHUNK

    junit = _junit(tmp_path / "junit.xml", 8 * MiB, "test_last")
    key = ("tests.test_x", "test_last")
    tracemalloc.start()
    try:
        lines = junit_first_lines(junit, {key})
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert lines == {key: "boom at the end"}, "read to its end"
    # The chunk read, expat's copy of its unparsed tail (at most a chunk), one message's text
    # (MAX_MESSAGE_CHARS, 64 Ki characters) and a chunk of slack: 4 chunks (4 MiB), whatever
    # the file's size; the tree of these 8 MiB is over 80 MiB.
    assert peak < 4 * _JUNIT_CHUNK, f"{peak / MiB:.1f} MiB"


def test_junit_past_its_cap_keeps_the_lines_before_and_reads_no_doctype(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from megatron_testkit import verdicts

    junit = _junit(tmp_path / "junit.xml", 3 * MiB, "test_last")
    monkeypatch.setattr(verdicts, "MAX_JUNIT_BYTES", MiB)
    lines = junit_first_lines(junit)
    # Whole test cases of the first MiB were read (each about 90 bytes), nothing after it.
    assert lines[("tests.test_many", "test_0")] == "m0" and ("tests.test_x", "test_last") not in lines
    assert len(lines) == 10_000, "the names repeat every 10,000 cases: all seen in the first MiB"
    # Entities live in a DOCTYPE, which pytest never writes: a file with one gives no line.
    entities = tmp_path / "entities.xml"
    entities.write_text(
        '<?xml version="1.0"?><!DOCTYPE t [<!ENTITY a "boom">]>'
        '<testsuite><testcase classname="c" name="n"><failure message="&a;"/></testcase></testsuite>'
    )
    assert junit_first_lines(entities) == {}


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
    with pytest.raises(ReportError, match="is not a version-5 kit report"):
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
        (["--job", "bench-cpu"], "--job bench-cpu runs the benchmarks, not tests: python -m ci bench"),
        (["--hypothesis-seed", "many"], "argument --hypothesis-seed: invalid int value: 'many'"),
    ],
)
def test_bad_job_choices_are_usage_errors(
    argv: list[str], words: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert repro.main([*argv, "--dry-run"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and words in err and err.count("\n") == 1


# ---- the nightly exploring row: its hypothesis seed -----------------------------------------------


def _explore_report(path: Path, pytest_args: list[str]) -> Path:
    """A report of the exploring row with one failed property, its recorded pytest arguments given."""
    report = write_report(
        path, [entry("unit/test_a.py::test_fine", "failed", world_size=None)], "L0 and hypothesis"
    )
    data = json.loads(report.read_text())
    data["session"].update(ci_job="explore-cpu", pytest_args=pytest_args)
    report.write_text(json.dumps(data))
    return report


def test_a_nightly_failure_reruns_with_the_seed_its_report_recorded(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    project = make_project(tmp_path / "project")
    recorded = ["-m", "L0", "--kit-report=reports", "-m", "L0 and hypothesis", "--hypothesis-seed=3141592653"]
    report = _explore_report(tmp_path / "kit-report.json", recorded)
    out = dry_run(["--from-report", str(report), "--root", str(project)], capsys)
    assert out[0].startswith("ci repro: job explore-cpu (tier L0")
    env = next(line for line in out if line.startswith("ci repro: env "))
    assert "HYPOTHESIS_PROFILE=explore" in env
    command = shlex.split(out[-1].removeprefix("ci repro: "))
    assert "--hypothesis-seed=3141592653" in command and command[-1] == "unit/test_a.py::test_fine"
    assert command[command.index("L0 and hypothesis") - 1] == "-m", "the row's selection: its properties"
    # Given on the command line, the seed wins over the report's; the separate-word form is read too.
    out = dry_run(["--from-report", str(report), "--root", str(project), "--hypothesis-seed", "7"], capsys)
    assert "--hypothesis-seed=7" in out[-1] and "3141592653" not in out[-1]
    spaced = _explore_report(tmp_path / "spaced.json", ["--hypothesis-seed", "42"])
    assert (
        "--hypothesis-seed=42" in dry_run(["--from-report", str(spaced), "--root", str(project)], capsys)[-1]
    )


def test_a_report_without_a_seed_adds_none(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The PR rows run derandomised: their reports record no seed, and the rerun passes none."""
    project = make_project(tmp_path / "project")
    report = write_report(tmp_path / "kit-report.json", [oom_entry("functional/test_b.py::test_big[2-gloo]")])
    out = dry_run(["--from-report", str(report), "--root", str(project)], capsys)
    assert "--hypothesis-seed" not in out[-1]
    assert repro.recorded_seed({"pytest_args": ["--hypothesis-seed=x", "-k", "seed"]}) is None
    assert repro.recorded_seed({}) is None


@pytest.mark.parametrize(
    ("recorded", "says"),
    [
        (["--hypothesis-seed=" + "7" * 4400], "has 4400 digits, more than a seed may have (1000)"),
        (["--hypothesis-seed", "-" + "9" * 1001], "has 1001 digits, more than a seed may have (1000)"),
    ],
    ids=["4,400 digits", "1,001 digits, negative, separate word"],
)
def test_a_recorded_seed_too_long_for_an_int_is_one_line_and_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], recorded: list[str], says: str
) -> None:
    """int() of more than 4,300 digits raised a traceback out of repro."""
    project = make_project(tmp_path / "project")
    report = _explore_report(tmp_path / "kit-report.json", recorded)
    assert repro.main(["--from-report", str(report), "--root", str(project), "--dry-run"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err == (
        f"python -m ci repro: error: the report's recorded --hypothesis-seed {says}: give one with "
        "--hypothesis-seed N\n"
    )
    # Given on the command line, the seed wins and the recorded one is not read.
    assert repro.main(["--from-report", str(report), "--root", str(project), "--hypothesis-seed", "5",
                       "--dry-run"]) == 0  # fmt: skip
    assert "--hypothesis-seed=5" in capsys.readouterr().out
    # Digits that are not ASCII ("\u00b2".isdigit() is true, int() refuses it) are no seed.
    assert repro.recorded_seed({"pytest_args": ["--hypothesis-seed=\u00b2"]}) is None
    assert repro.recorded_seed({"pytest_args": ["--hypothesis-seed=" + "1" * 1000]}) == int("1" * 1000)


SEED_PROJECT_TEST = """
import os

from hypothesis import given, strategies as st


@given(st.integers(0, 2**40))
def test_draws(x):
    with open(os.environ["DRAWS"], "a") as f:
        f.write(f"{x}\\n")
"""


def _draws(project: Path, profile: str, *seed: str) -> list[str]:
    """The examples `test_draws` saw in one pytest run under this repository's conftest.py."""
    draws = project / f"draws-{profile}-{'-'.join(seed) or 'none'}-{time.monotonic_ns()}.txt"
    env = {
        **os.environ,
        "HYPOTHESIS_PROFILE": profile,
        "KIT_HYPOTHESIS_MAX_EXAMPLES": "25",
        "DRAWS": str(draws),
    }
    env.pop("KIT_ALLOWED_SKIPS", None)
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:randomly", *seed, "test_seed.py"],
        cwd=project,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    return draws.read_text().splitlines()


def test_the_explore_profile_draws_what_its_seed_says_and_the_ci_profile_ignores_seeds(
    tmp_path: Path,
) -> None:
    """Real hypothesis runs under the repository's conftest.py (its profiles), in a tiny project."""
    project = make_project(tmp_path / "project", {"test_seed.py": SEED_PROJECT_TEST})
    shutil.copy(ROOT / "conftest.py", project / "conftest.py")
    first = _draws(project, "explore", "--hypothesis-seed=11")
    assert len(first) == 25, "KIT_HYPOTHESIS_MAX_EXAMPLES sets the explore profile's count"
    assert _draws(project, "explore", "--hypothesis-seed=11") == first, "a seed replays its examples"
    assert _draws(project, "explore", "--hypothesis-seed=12") != first, "another seed explores others"
    # The PR rows' profile: derandomised, the same examples whatever the seed, 60 of them.
    ci = _draws(project, "ci", "--hypothesis-seed=11")
    assert ci == _draws(project, "ci", "--hypothesis-seed=12") and len(ci) == 60


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


# ---- a report is untrusted input -----------------------------------------------------------------
# A report comes from a CI artifact that a fork's pull request controls: nothing in it may reach
# pytest's command line as an option or a file outside the project's tests, and no size in it may
# make repro build something huge.

GOOD_ID = "functional/test_b.py::test_big[2-gloo]"

REFUSED_IDS = {
    "option --basetemp": "--basetemp=.git",
    "option -p": "-p",
    "option -p joined": "-pevil_plugin",
    "option --rootdir": "--rootdir=/",
    "option -c": "-c",
    "option --confcutdir": "--confcutdir=/",
    "option --junitxml": "--junitxml=pwned.xml",
    "option after the file": "unit/test_a.py::--x",
    "non-test file": "README.md",
    "conftest": "conftest.py",
    "config file": "pytest.ini",
    "absolute path outside": "/tmp/outside/test_evil.py::test_x",
    "absolute path to a test of the project": "{project}/unit/test_a.py::test_fine",
    "traversal": "../outside/test_evil.py::test_x",
    "traversal inside the path": "unit/../../outside/test_evil.py",
    "hidden folder": ".venv/lib/test_x.py",
    "installed package": "venv/lib/python3.12/site-packages/pkg/test_x.py",
    "escape sequence": "unit/test_a.py::test_fine\x1b[2K\r",
    "newline": "unit/test_a.py::test_fine\nsafe",
    "bidi override": "unit/test_a.py::test_\u202eenif",
    "NUL": "unit/test_a.py\x00::test_fine",
    "windows path": "unit\\test_a.py::test_fine",
}


@pytest.mark.parametrize("case", sorted(REFUSED_IDS))
def test_an_id_that_is_not_a_test_of_the_project_is_refused_named_and_never_passed_on(
    case: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    project = make_project(tmp_path / "project")
    bad = REFUSED_IDS[case].format(project=project)
    report = write_report(tmp_path / "r.json", [entry(bad, "failed"), oom_entry(GOOD_ID)])
    out = dry_run(["--from-report", str(report), "--root", str(project)], capsys)
    command = shlex.split(out[-1].removeprefix("ci repro: "))
    # Ids come after "--", so even an accepted one is never read as an option; only the good one is there.
    assert command[command.index("--") :] == ["--", GOOD_ID]
    refused = next(line for line in out if " refused, not run" in line)
    assert refused.startswith("ci repro: 1 id(s) of the report refused") and "(" in refused
    # Printed escaped: no control or format character reaches the terminal.
    assert all(ch.isprintable() for line in out for ch in line), out


def test_a_dry_run_imports_no_test_file_and_starts_no_process(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Collection imports a test file; --dry-run ran one to find stale ids, named files outside included."""
    marker = tmp_path / "imported"
    code = f"open({str(marker)!r}, 'a').write(__file__ + '\\n')\n\ndef test_x():\n    pass\n"
    project = make_project(tmp_path / "project", {**PROJECT_FILES, "unit/test_marker.py": code})
    (tmp_path / "outside").mkdir()
    (tmp_path / "outside" / "test_evil.py").write_text(code)
    ids = [
        "unit/test_marker.py::test_x",
        "unit/test_marker.py::test_renamed",
        f"{tmp_path}/outside/test_evil.py::test_x",
        "../outside/test_evil.py::test_x",
    ]
    report = write_report(tmp_path / "r.json", [entry(i, "failed") for i in ids])
    with _processes_started() as started:
        out = dry_run(["--from-report", str(report), "--root", str(project)], capsys)
    assert not marker.exists(), marker.read_text()
    assert started == []
    command = shlex.split(out[-1].removeprefix("ci repro: "))
    assert command[command.index("--") :] == ["--", "unit/test_marker.py::test_x"]
    assert any("skipped: unit/test_marker.py::test_renamed" in line for line in out), out


_STARTED: list[list[str]] | None = None


def _audit(event: str, args: tuple[Any, ...]) -> None:
    if _STARTED is not None and event in ("subprocess.Popen", "os.posix_spawn", "os.fork", "os.exec"):
        _STARTED.append([event, *map(str, args[:2])])


class _processes_started:
    """Records every process this interpreter starts meanwhile (CPython's audit events)."""

    installed = False

    def __enter__(self) -> list[list[str]]:
        global _STARTED
        if not _processes_started.installed:
            sys.addaudithook(_audit)  # cannot be removed; records only inside this context
            _processes_started.installed = True
        _STARTED = []
        return _STARTED

    def __exit__(self, *exc: object) -> None:
        global _STARTED
        _STARTED = None


def _ci(argv: list[str], memory: int = 1 << 30, **kwargs: Any) -> subprocess.CompletedProcess[str]:
    """`python -m ci ARGV` under an address-space limit of `memory` bytes (a MemoryError past it)."""

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (memory, memory))

    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-m", "ci", *argv],
        cwd=ROOT, env=env, preexec_fn=limit, capture_output=True, text=True, timeout=120, **kwargs,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("session", "tests", "says"),
    [
        # Each of these took repro (or a reader) far past 1 GiB or into a traceback before.
        ({"gpus": 10**7}, [oom_entry(GOOD_ID)], "session.gpus is not an integer in [0, 4096]"),
        ({"gpus": 2**70}, [oom_entry(GOOD_ID)], "session.gpus is not an integer"),
        ({}, [entry(GOOD_ID, "failed", world_size=10**7)], "tests[0].world_size is not an integer"),
        ({}, [entry(GOOD_ID, "failed")] * 100_001, "tests has more than 100000 entries"),
        (
            {},
            [entry(GOOD_ID, "failed", log_dir="x" * (2**20 + 1))],
            "tests[0].log_dir is not text of at most",
        ),
        ({}, [entry("t" * 5000, "failed")], "tests[0].nodeid is not text of at most 4096 characters"),
    ],
    ids=["gpus 10^7", "gpus 2^70", "world_size 10^7", "100001 tests", "1 MiB string", "5000-char id"],
)
def test_huge_counts_and_strings_are_refused_in_bounded_memory(
    session: dict[str, Any], tests: list[dict[str, Any]], says: str, tmp_path: Path
) -> None:
    path = tmp_path / "r.json"
    with path.open("w") as f:  # entry by entry: one 30 MB string would stay in this process' heap
        f.write(json.dumps({"version": 1, "session": {"markexpr": "L0", **session}})[:-1] + ', "tests": [')
        for i, test in enumerate(tests):
            f.write(("," if i else "") + json.dumps(test))
        f.write("]}")
    # 1 GiB of address space: the interpreter and repro need ~100 MiB; the old code needed 800 MB+
    # for CUDA_VISIBLE_DEVICES from gpus = 10^7 alone.
    result = _ci(["repro", "--from-report", str(path), "--root", str(tmp_path), "--dry-run"])
    assert result.returncode == 2, result.stderr[-2000:]
    assert result.stderr.count("\n") == 1 and says in result.stderr, result.stderr


WRONG_TYPES = {
    "gpus as text": ({"gpus": "2"}, {}, "session.gpus is not an integer"),
    "gpus as a list": ({"gpus": [0, 1]}, {}, "session.gpus is not an integer"),
    "markexpr as a list": ({"markexpr": ["L0"]}, {}, "session.markexpr is not text"),
    "ci_job as a number": ({"ci_job": 5}, {}, "session.ci_job is not text"),
    "world size as text": ({}, {"world_size": "4"}, "tests[0].world_size is not an integer"),
    "world size as a float": ({}, {"world_size": 2.0}, "tests[0].world_size is not an integer"),
    "seed as an object": ({}, {"seed": {"a": 1}}, "tests[0].seed is not an integer"),
    "negative peak": ({}, {"peak_host_bytes": -5}, "tests[0].peak_host_bytes is not an integer in [0"),
    "bool as a count": ({}, {"leaked_processes": True}, "tests[0].leaked_processes is not an integer"),
    "failure as text": ({}, {"failure": "boom"}, "tests[0].failure is not an object"),
    "failure rank as text": ({}, {"failure": {"rank": "1"}}, "tests[0].failure.rank is not an integer"),
    "first line as an object": (
        {},
        {"failure": {"first_line": {}}},
        "tests[0].failure.first_line is not text",
    ),
    "ranks as an object": ({}, {"ranks": {"0": {}}}, "tests[0].ranks is not a list"),
    "rank peak as text": ({}, {"ranks": [{"rank": 0, "peak_host_bytes": "1"}]}, "ranks[0].peak_host_bytes"),
    "unknown outcome": ({}, {"outcome": "exploded"}, "tests[0].outcome is not one of passed"),
    "duration as text": ({}, {"duration_s": "1"}, "tests[0].duration_s is not a finite number"),
}


@pytest.mark.parametrize("case", sorted(WRONG_TYPES))
def test_a_field_of_the_wrong_type_is_a_one_line_error_naming_it(
    case: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    session, fields, says = WRONG_TYPES[case]
    test = {**oom_entry(GOOD_ID), **fields}
    path = tmp_path / "r.json"
    path.write_text(json.dumps({"version": 1, "session": {"markexpr": "L0", **session}, "tests": [test]}))
    assert (
        repro.main(["--from-report", str(path), "--root", str(make_project(tmp_path / "p")), "--dry-run"])
        == 2
    )
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and says in err, err


MALFORMED_FILES = {
    "truncated": (b'{"version": 1, "session": {}, "tests": [{"nodeid": "a', "is not JSON"),
    "not an object": (b"[1, 2, 3]", "is not a version-5 kit report"),
    "NaN": (b'{"version": 1, "session": {"duration_s": NaN}, "tests": []}', "NaN is not a JSON number"),
    "deep nesting": (
        b'{"version": 1, "tests": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
        "not JSON the kit",
    ),
    "a 5000-digit number": (b'{"version": 1, "tests": [], "x": 1' + b"0" * 5000 + b"}", "not JSON the kit"),
    "not UTF-8": (b'{"version": 1, "tests": ["\xff\xfe"]}', "is not UTF-8 text"),
}


@pytest.mark.parametrize("case", sorted(MALFORMED_FILES))
def test_a_malformed_report_file_is_a_one_line_error(
    case: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data, says = MALFORMED_FILES[case]
    (tmp_path / "r.json").write_bytes(data)
    assert repro.main(["--from-report", str(tmp_path / "r.json"), "--dry-run"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and says in err, err


def test_a_huge_or_endless_report_is_refused_before_it_is_read(tmp_path: Path) -> None:
    """A sparse file past the bound, and a FIFO nobody writes (the old reader waited on it forever)."""
    huge = tmp_path / "huge.json"
    with open(huge, "wb") as f:
        f.truncate(64 * MAX_REPORT_BYTES)  # 2 GiB, sparse: no disk used
    fifo = tmp_path / "fifo.json"
    os.mkfifo(fifo)
    for path, says in ((huge, f"is larger than {MAX_REPORT_BYTES} bytes"), (fifo, "is not a regular file")):
        # 512 MiB of address space: reading the whole file would not fit.
        result = _ci(["repro", "--from-report", str(path), "--dry-run"], memory=512 << 20)
        assert result.returncode == 2 and says in result.stderr and result.stderr.count("\n") == 1, (
            result.stderr
        )


def test_report_text_is_printed_escaped() -> None:
    hostile = oom_entry("functional/test_x.py::test_big\x1b]0;title\x07")
    hostile["failure"] = {
        **hostile["failure"],
        "kind": "oom\x1b[8m",
        "first_line": "boom\x1b[2J\rhidden\u202e",
    }
    for text in (format_verdicts([verdict(hostile)]), format_comparison([verdict(hostile)], {})):
        assert all(ch.isprintable() for line in text.splitlines() for ch in line), text
        assert "\\x1b[2J" in text and "\\u202e" in text


# ---- stop requests reach the child ---------------------------------------------------------------

SLEEPER = """
import os, signal, sys, time
out = sys.argv[1]

def stop(signum, frame):
    with open(out, "a") as f:
        f.write(f"got {signum}\\n")
    time.sleep(0.5)  # a shutdown that takes a while: writing the report, tearing down ranks
    with open(out, "a") as f:
        f.write("done\\n")
    sys.exit(3)

signal.signal(signal.SIGTERM, stop)
signal.signal(signal.SIGINT, stop)
with open(out, "a") as f:
    f.write(f"started {os.getpid()}\\n")
time.sleep(120)
"""

RUN_JOB = """
import sys
from pathlib import Path
import ci.jobs as jobs
jobs.ROOT = Path(sys.argv[1])  # a project whose ci/test.sh is the sleeper, not the test suite
sys.exit(jobs.run_job("L0-cpu"))
"""


def _wait_for(path: Path, text: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not (path.exists() and text in path.read_text()):
        assert time.monotonic() < deadline, f"no {text!r} in {path}"
        time.sleep(0.05)


@pytest.mark.parametrize("signum", [15, 2], ids=["SIGTERM", "SIGINT"])
def test_ci_job_forwards_a_stop_signal_to_the_tests_it_runs_and_waits_for_them(
    signum: int, tmp_path: Path
) -> None:
    """A real signal to a real `run_job`, whose child is a shell script running a real Python
    process (as ci/test.sh runs pytest): the signal reaches that process, and run_job waits for its
    shutdown, then goes on (the memory-chart line is printed after the child)."""
    (tmp_path / "ci").mkdir()
    (tmp_path / "sleeper.py").write_text(SLEEPER)
    log = tmp_path / "sleeper.log"
    (tmp_path / "ci" / "test.sh").write_text(f'"{sys.executable}" sleeper.py "{log}"\nexit $?\n')
    env = {k: v for k, v in os.environ.items() if k != "GITHUB_STEP_SUMMARY"}
    env["PYTHONPATH"] = str(ROOT)
    job = subprocess.Popen(
        [sys.executable, "-c", RUN_JOB, str(tmp_path)],
        cwd=ROOT, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        _wait_for(log, "started")
        job.send_signal(signum)  # to run_job's process alone, as a runner signals the step's process
        out, _ = job.communicate(timeout=60)
        lines = log.read_text().splitlines()
        assert lines[1:] == [f"got {signum}", "done"], lines
        assert "memory chart:" in out.splitlines()[-1], out
        # The shell's exit code: killed by the SIGTERM (128 + 15), or the child's 3 (bash waits out
        # a child's SIGINT and goes on); never 0, never run_job's own death.
        assert job.returncode in (3, 128 + 15), job.returncode
    finally:
        job.kill()
        pid = int(log.read_text().split()[1]) if log.exists() else None
        if pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, 9)


def test_the_child_helper_passes_a_signal_on_when_the_child_shares_the_terminals_group(
    tmp_path: Path,
) -> None:
    """With a terminal, the child stays in the parent's process group: a signal sent to the parent
    alone is passed to the child itself (pytest directly, as repro runs it)."""
    code = (
        "import subprocess, sys\n"
        "from megatron_testkit.child import exit_code, wait_forwarding\n"
        "proc = subprocess.Popen([sys.executable, sys.argv[1], sys.argv[2]])\n"
        "sys.exit(exit_code(wait_forwarding(proc)))\n"
    )
    (tmp_path / "sleeper.py").write_text(SLEEPER)
    log = tmp_path / "sleeper.log"
    parent = subprocess.Popen(
        [sys.executable, "-c", code, str(tmp_path / "sleeper.py"), str(log)],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    try:
        _wait_for(log, "started")
        parent.send_signal(15)
        assert parent.wait(timeout=60) == 3  # the child's own exit code, after its shutdown
        assert log.read_text().splitlines()[1:] == ["got 15", "done"]
    finally:
        parent.kill()


def test_an_interrupted_test_is_rerun_and_said_so() -> None:
    # A CI cancel records the running test as `interrupted`: it never passed, so repro reruns it.
    from megatron_testkit.verdicts import failed_tests, verdict

    report = {
        "tests": [
            {"nodeid": "unit/test_a.py::test_done", "outcome": "passed"},
            {"nodeid": "unit/test_a.py::test_cut_short", "outcome": "interrupted"},
        ]
    }
    rerun = failed_tests(report)
    assert [t["nodeid"] for t in rerun] == ["unit/test_a.py::test_cut_short"]
    assert verdict(rerun[0]).cause == "interrupted"


def test_the_stale_line_names_the_first_ids_and_counts_the_rest(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Every id on one line: 2.9 MB of output for a report of 100,000 failed tests."""
    gone = [entry(f"unit/test_gone.py::test_{i}", "failed") for i in range(1000)]
    gone += [entry(f"-x{i}", "failed") for i in range(25)]  # refused: an option, not a test
    report = write_report(
        tmp_path / "kit-report.json", [oom_entry("functional/test_b.py::test_big[2-gloo]"), *gone]
    )
    project = make_project(tmp_path / "project")
    out = dry_run(["--from-report", str(report), "--root", str(project)], capsys)
    first = ", ".join(f"unit/test_gone.py::test_{i}" for i in range(20))
    assert out[1] == (
        "ci repro: 1000 failed test(s) of the report do not exist here (renamed or removed since the CI run?), "
        f"skipped: {first} and 980 more"
    )
    refused = "; ".join(f"-x{i} (starts with '-' (an option, not a test))" for i in range(20))
    assert out[0] == (
        "ci repro: 25 id(s) of the report refused, not run (not a test of this project): "
        f"{refused} and 5 more"
    )
