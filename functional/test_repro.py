"""`python -m ci repro` end to end, on a small generated project that uses the kit's plugin.

The project plants one failure of each origin: a rank that exceeds its host budget (an OOM the
launcher must name), a plain assertion in the pytest process, a passing test, and an L1 test the
L0 selection must leave out. The first run plays the CI job (it is the same command and writes
the same report); the second reruns from that report, and must run only the failed tests, with
the same seeds and world sizes, printing the CI verdict next to the local one.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest

from ci.jobs import ROOT

# Each test carries its tier: the runner-limit runs are L1, the rest L0.

PLANTED = textwrap.dedent(
    """
    import time

    import pytest

    from megatron_testkit.ranks import run_ranks


    def grow_on_rank_1(rank, world_size):
        if rank == 1:
            blocks = []
            for _ in range(64):  # up to 1 GiB, 16 MiB at a time, slowly enough for the watchdog
                blocks.append(bytearray(16 * 2**20))
                time.sleep(0.01)
        return rank


    @pytest.mark.L0
    @pytest.mark.world_size(2)
    @pytest.mark.memory_budget(host="400MiB")
    def test_planted_oom():
        run_ranks(grow_on_rank_1, 2, timeout=120)


    @pytest.mark.L0
    def test_planted_assertion():
        assert 1 + 1 == 3, "planted assertion"


    @pytest.mark.L0
    def test_passes():
        pass


    @pytest.mark.L1
    def test_only_in_l1():
        pass
    """
)


def repro(*args: str) -> subprocess.CompletedProcess[str]:
    """`python -m ci repro ...` as a person runs it, from this repository's root."""
    return subprocess.run(
        [sys.executable, "-m", "ci", "repro", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )


@pytest.fixture(scope="module")
def project(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("planted")
    (root / "pytest.ini").write_text("[pytest]\naddopts = -p no:cacheprovider\n")
    (root / "conftest.py").write_text('"""The kit plugin comes through its pytest11 entry point."""\n')
    (root / "test_planted.py").write_text(PLANTED)
    return root


@pytest.fixture(scope="module")
def ci_run(project: Path) -> tuple[subprocess.CompletedProcess[str], dict[str, Any]]:
    """The L0 job on the planted project: its output and the report CI would upload."""
    result = repro("L0", "--root", str(project), "--reports", str(project / "ci-reports"))
    report_path = project / "ci-reports" / "kit-report.json"
    assert report_path.exists(), result.stdout[-3000:] + result.stderr[-3000:]
    return result, json.loads(report_path.read_text())


@pytest.mark.L0
def test_a_planted_oom_on_one_rank_is_reported_as_such(ci_run: tuple[Any, dict[str, Any]]) -> None:
    result, report = ci_run
    assert result.returncode == 1, result.stderr
    out = result.stdout
    # pytest's own progress came through first, then the verdicts.
    assert "2 failed, 1 passed, 1 deselected" in out
    verdicts = out[out.index("ci repro: " + "=" * 30 + " verdicts") :]
    lines = verdicts.splitlines()
    oom = lines.index("FAILED test_planted.py::test_planted_oom: rank 1 oom")
    assert "host memory budget exceeded" in lines[oom + 1]
    assert lines[oom + 2].strip().startswith("peak/budget: host ")
    assert "/ 400.00 MiB; world size 2" in lines[oom + 2]
    assertion = lines.index("FAILED test_planted.py::test_planted_assertion: error")
    assert oom < assertion
    assert lines[assertion + 1].strip().startswith("AssertionError: planted assertion")  # from junit.xml
    assert "test_passes" not in verdicts and "test_only_in_l1" not in verdicts
    method = next(line for line in lines if line.startswith("ci repro: runner memory ("))
    assert any(name in method for name in ("cgroup2", "cgroup1", "systemd-run", "env"))
    # The report CI would upload says the same.
    by_id = {test["nodeid"]: test for test in report["tests"]}
    failure = by_id["test_planted.py::test_planted_oom"]["failure"]
    assert (failure["rank"], failure["kind"]) == (1, "oom")
    assert by_id["test_planted.py::test_planted_oom"]["peak_host_bytes"] > 400 * 2**20
    assert report["session"]["markexpr"] == "L0"


@pytest.mark.L0
def test_a_rerun_from_the_report_reruns_only_the_failed_tests(
    project: Path, ci_run: tuple[Any, dict[str, Any]], tmp_path: Path
) -> None:
    _, ci_report = ci_run
    artifact = tmp_path / "kit-report.json"  # as downloaded from the CI job
    shutil.copy(project / "ci-reports" / "kit-report.json", artifact)
    shutil.copy(project / "ci-reports" / "junit.xml", tmp_path / "junit.xml")
    result = repro(
        "--from-report", str(artifact), "--root", str(project), "--reports", str(tmp_path / "local")
    )
    assert result.returncode == 1, result.stderr
    local = json.loads((tmp_path / "local" / "kit-report.json").read_text())
    ran = sorted(test["nodeid"] for test in local["tests"])
    assert ran == ["test_planted.py::test_planted_assertion", "test_planted.py::test_planted_oom"]
    ci_seed = next(t["seed"] for t in ci_report["tests"] if t["nodeid"].endswith("test_planted_oom"))
    local_oom = next(t for t in local["tests"] if t["nodeid"].endswith("test_planted_oom"))
    assert (local_oom["seed"], local_oom["world_size"]) == (ci_seed, 2)
    out = result.stdout
    assert out.startswith(
        f"ci repro: job L0-cpu (tier L0, runs-on ubuntu-latest): 2 failed test(s) from {artifact}"
    )
    lines = out[out.index("=" * 30 + " verdicts") :].splitlines()
    at = lines.index("test_planted.py::test_planted_oom")
    assert lines[at + 1].split()[:4] == ["CI:", "failed", "rank", "1"]
    assert lines[at + 2].split()[:5] == ["local:", "failed", "rank", "1", "oom"]
    assert lines[at + 4].strip() == f"same seed ({ci_seed}) and world size (2)"
    at = lines.index("test_planted.py::test_planted_assertion")
    assert lines[at + 1].split()[:4] == ["CI:", "failed", "error", "AssertionError:"]
    assert lines[at + 2].split()[:4] == ["local:", "failed", "error", "AssertionError:"]


@pytest.mark.L0
def test_a_stale_id_in_the_report_is_named_and_the_other_failures_rerun(
    project: Path, ci_run: tuple[Any, dict[str, Any]], tmp_path: Path
) -> None:
    """A test renamed since the CI run: pytest alone would exit 4 and rerun nothing."""
    report = json.loads((project / "ci-reports" / "kit-report.json").read_text())
    renamed = dict(next(t for t in report["tests"] if t["nodeid"].endswith("test_planted_assertion")))
    renamed["nodeid"] = "test_planted.py::test_planted_assertion_before_the_rename"
    report["tests"].append(renamed)
    artifact = tmp_path / "kit-report.json"
    artifact.write_text(json.dumps(report))
    result = repro(
        "--from-report", str(artifact), "--root", str(project), "--reports", str(tmp_path / "local"),
        "-k", "not oom",
    )  # fmt: skip
    assert result.returncode == 1, result.stderr
    out = result.stdout
    assert out.startswith(
        "ci repro: 1 failed test(s) of the report do not exist here (renamed or removed since the CI run?), "
        "skipped: test_planted.py::test_planted_assertion_before_the_rename\n"
    )
    local = json.loads((tmp_path / "local" / "kit-report.json").read_text())
    assert [t["nodeid"] for t in local["tests"]] == ["test_planted.py::test_planted_assertion"]
    lines = out[out.index("=" * 30 + " verdicts") :].splitlines()
    at = lines.index("test_planted.py::test_planted_assertion_before_the_rename")
    assert lines[at + 2] == "    local: skipped: no such test here (renamed or removed since the CI run)"
    at = lines.index("test_planted.py::test_planted_assertion")
    assert lines[at + 2].split()[:3] == ["local:", "failed", "error"]
    assert lines[at + 3] == (
        "    in the pytest process (the test launched no ranks): no seed, world size or rank memory"
    )


GROWS = textwrap.dedent(
    """
    import time

    import pytest

    from megatron_testkit.ranks import run_ranks


    def grow_on_rank_1(rank, world_size):
        if rank == 1:
            blocks = []
            for _ in range(80):  # up to 1.25 GiB, 16 MiB at a time: past the runner's 700 MiB
                blocks.append(bytearray(16 * 2**20))
                time.sleep(0.02)
        return rank


    @pytest.mark.L0
    @pytest.mark.world_size(2)
    def test_grows():
        run_ranks(grow_on_rank_1, 2, timeout=120)


    @pytest.mark.L0
    def test_after():
        pass
    """
)


def _kit_ranks_alive() -> list[int]:
    alive = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                if (
                    b"kit-rank-" in (proc / "cmdline").read_bytes()
                    and b"test_grows" in (proc / "environ").read_bytes()
                ):
                    alive.append(int(proc.name))
            except OSError:
                continue
    return alive


@pytest.mark.L1
@pytest.mark.parametrize("method", ["env", "auto"])
def test_a_rank_past_the_runners_memory_is_named_oom_and_pytest_survives(tmp_path: Path, method: str) -> None:
    """`--host-memory 700MiB` with a rank growing to 1.25 GiB: `env`, and the machine's own method."""
    root = tmp_path / "grows"
    root.mkdir()
    (root / "pytest.ini").write_text("[pytest]\naddopts = -p no:cacheprovider\n")
    (root / "test_grows.py").write_text(GROWS)
    reports = tmp_path / "reports"
    result = repro(
        "L0", "--root", str(root), "--reports", str(reports), "--host-memory", "700MiB", "--limit-method", method
    )  # fmt: skip
    out = result.stdout
    assert result.returncode == 1, out[-3000:] + result.stderr[-3000:]
    assert "1 failed, 1 passed" in out, "pytest survived and ran the next test"
    verdicts = out[out.index("=" * 30 + " verdicts") :].splitlines()
    at = verdicts.index("FAILED test_grows.py::test_grows: rank 1 oom")
    used = next(line for line in verdicts if line.startswith("ci repro: runner memory ("))
    if used.startswith("ci repro: runner memory (env,"):
        # Two enforcers of one limit: the repro's watcher (all launches, every 20 ms) and the
        # launcher (KIT_HOST_MEMORY, its own ranks, every 50 ms); whichever samples first kills.
        assert (
            "exceeded the runner's 700.00 MiB (env method); rank 1 grew most" in verdicts[at + 1]
            or "> 700.00 MiB (KIT_HOST_MEMORY, the runner's memory); rank 1 grew most" in verdicts[at + 1]
        ), verdicts[at + 1]
    else:
        assert "killed by the kernel OOM killer in the ranks' capped cgroup" in verdicts[at + 1]
        assert "kernel OOM kills 1" in used
        group = next(line for line in out.splitlines() if line.startswith("ci repro: runner memory limit: "))
        path = Path(group.split("(", 1)[1].split(")", 1)[0])
        assert path.name.startswith("kit-repro-") and not path.exists(), "the group is removed"
    md = reports / "kit-report.md"
    assert f"ci repro: report {md}," in out and md.exists()
    assert "test_grows.py::test_grows`: rank 1 oom" in md.read_text()
    assert not _kit_ranks_alive(), "no rank outlived the run"


# ---- a hostile report, a stop request ------------------------------------------------------------


@pytest.mark.L0
def test_a_hostile_report_cannot_make_repro_delete_the_clones_git_folder(tmp_path: Path) -> None:
    """The attack as found: `README.md` made the stale-id collection fail, which then filtered
    nothing, and `--basetemp=.git` reached pytest, which emptied `.git` at session start."""
    clone = tmp_path / "clone"
    clone.mkdir()
    (clone / "pytest.ini").write_text("[pytest]\naddopts = -p no:cacheprovider\n")
    (clone / "README.md").write_text("# a project\n")
    (clone / "test_tmp.py").write_text(
        "import pytest\n\n\n@pytest.mark.L0\ndef test_uses_tmp_path(tmp_path):\n    assert False, 'planted'\n"
    )
    git = ["git", "-C", str(clone), "-c", "user.name=t", "-c", "user.email=t@t"]
    for args in (["init", "-q"], ["add", "-A"], ["commit", "-qm", "a project"]):
        subprocess.run([*git, *args], check=True, capture_output=True)
    ids = ["README.md", "--basetemp=.git", "test_tmp.py::test_uses_tmp_path", "-p", "--rootdir=/"]
    report = tmp_path / "artifact" / "kit-report.json"
    report.parent.mkdir()
    report.write_text(
        json.dumps(
            {
                "version": 1,
                "session": {"markexpr": "L0"},
                "tests": [{"nodeid": i, "outcome": "failed"} for i in ids],
            }
        )
    )
    result = repro("--from-report", str(report), "--root", str(clone), "--reports", str(tmp_path / "out"))
    status = subprocess.run([*git, "status", "--porcelain"], capture_output=True, text=True)
    assert status.returncode == 0 and (clone / ".git" / "HEAD").is_file(), status.stderr
    assert result.stdout.startswith("ci repro: 4 id(s) of the report refused, not run"), result.stdout[:2000]
    # The one real test ran (and failed as planted); nothing else reached pytest's command line.
    local = json.loads((tmp_path / "out" / "kit-report.json").read_text())
    assert [(t["nodeid"], t["outcome"]) for t in local["tests"]] == [
        ("test_tmp.py::test_uses_tmp_path", "failed")
    ]


SLOW = textwrap.dedent(
    """
    import os
    import time

    import pytest


    @pytest.mark.L0
    def test_slow():
        with open(os.environ["SLOW_PID_FILE"], "w") as f:
            f.write(str(os.getpid()))
        time.sleep(120)
    """
)


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.mark.L0
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_stop_signal_to_repro_stops_its_pytest_and_repro_reports_after_it(
    tmp_path: Path, signum: signal.Signals
) -> None:
    """A CI cancel signals `python -m ci repro` alone: before, repro died and its pytest slept on."""
    from fixtures.stop_signals import with_default_stop_signals

    root = tmp_path / "slow"
    root.mkdir()
    (root / "pytest.ini").write_text("[pytest]\naddopts = -p no:cacheprovider\n")
    (root / "test_slow.py").write_text(SLOW)
    pid_file = tmp_path / "pytest.pid"
    # SIGINT at its default even when this suite runs as a background job (which ignores it).
    command = with_default_stop_signals(
        [sys.executable, "-m", "ci", "repro", "L0", "--root", str(root), "--reports", str(tmp_path / "out"),
         "--limit-method", "env"]
    )  # fmt: skip
    proc = subprocess.Popen(
        command,
        cwd=ROOT, env={**os.environ, "SLOW_PID_FILE": str(pid_file)},
        stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    pid = None
    try:
        deadline = time.monotonic() + 300
        while not (pid_file.exists() and pid_file.read_text()):
            assert time.monotonic() < deadline and proc.poll() is None, "the test never started"
            time.sleep(0.1)
        pid = int(pid_file.read_text())
        proc.send_signal(signum)
        out, _ = proc.communicate(timeout=120)
        assert not _alive(pid), "pytest outlived repro"
        assert "=" * 30 + " verdicts " in out, out[-3000:]  # repro went on after its pytest ended
        assert proc.returncode != 0
    finally:
        proc.kill()
        if pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
