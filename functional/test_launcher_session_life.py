"""The kit in a whole pytest session's real life: signals, shared report folders, bad environment.

Each test runs a small pytest session as a subprocess (its signals, ranks and report must not
touch this session) and does to it what CI and people do: cancel it with SIGTERM or Ctrl-C, point
``--kit-report`` at a folder that holds other things or that another session is writing, start it
with a malformed ``KIT_*`` variable, or cap its ranks with ``python -m ci repro``'s watcher.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

import psutil
import pytest

from fixtures.inner_session import WITHOUT_HYPOTHESIS, inner_env
from fixtures.stop_signals import as_a_background_job, ignored_signals, with_default_stop_signals

# Ranks that start a helper (as dist_checkpointing's writers do), say so, and wait to be stopped.
WAITING = textwrap.dedent(
    """
    import os, subprocess, sys, time

    from megatron_testkit.ranks import run_ranks


    def wait_with_a_helper(rank, world_size, ready):
        helper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
        with open(f"{ready}.{rank}.tmp", "w") as f:
            f.write(str(helper.pid))
        os.replace(f"{ready}.{rank}.tmp", f"{ready}.{rank}")
        time.sleep(300)


    def test_stopped_while_its_ranks_run():
        run_ranks(wait_with_a_helper, 2, timeout=250, args=(os.environ["READY"],))


    def test_never_started():
        pass
    """
)


def _start(
    root: Path, source: str, *args: str, env: dict[str, str] | None = None, name: str = "test_inner.py"
) -> subprocess.Popen:
    (root / name).write_text(source)
    # Its stop signals at their defaults: the tests below signal it as a terminal or CI would,
    # even when this suite runs as a background job (which ignores SIGINT and SIGQUIT).
    return subprocess.Popen(
        with_default_stop_signals(
            [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *WITHOUT_HYPOTHESIS, *args, name]
        ),
        cwd=root,
        env=inner_env(env),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _wait_for(paths: list[Path], proc: subprocess.Popen, limit_s: float = 120) -> None:
    deadline = time.monotonic() + limit_s
    while not all(p.exists() for p in paths):
        assert proc.poll() is None, proc.communicate()[0][-3000:]
        assert time.monotonic() < deadline, f"never appeared: {paths}"
        time.sleep(0.05)


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _interrupted_report(proc: subprocess.Popen, output: str, root: Path) -> dict[str, Any]:
    """The report of an inner session that was stopped while `test_stopped_while_it_sleeps` ran."""
    assert proc.returncode == 2, output[-3000:]  # pytest's "interrupted"
    report = json.loads((root / "reports" / "kit-report.json").read_text())
    outcomes = [(row["nodeid"].split("::")[-1], row["outcome"]) for row in report["tests"]]
    assert outcomes == [("test_stopped_while_it_sleeps", "interrupted")], output[-3000:]
    return report


def _launched_under(root: Path) -> list[int]:
    """Processes that carry the marker of a launch made under ``root`` (ranks, helpers, daemons)."""
    found = []
    for proc in psutil.process_iter(["environ"]):
        try:
            env = proc.info["environ"] or {}
        except psutil.Error:
            continue
        if env.get("KIT_RANK_SPEC", "").startswith(str(root)) and _alive(proc.pid):
            found.append(proc.pid)
    return found


@pytest.mark.L0
@pytest.mark.parametrize(
    "signum",
    [signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT],
    ids=["sigterm", "ctrl-c", "sighup", "sigquit"],
)
def test_a_cancelled_session_records_the_test_as_interrupted_and_leaves_nothing(
    signum: int, tmp_path: Path
) -> None:
    ready = tmp_path / "ready"
    env = {**os.environ, "READY": str(ready)}
    proc = _start(tmp_path, WAITING, "--kit-report=reports", "--junitxml=reports/junit.xml", env=env)
    helpers: list[int] = []
    try:
        _wait_for([ready.with_name("ready.0"), ready.with_name("ready.1")], proc)
        helpers = [int(ready.with_name(f"ready.{r}").read_text()) for r in (0, 1)]
        proc.send_signal(signum)  # how a CI runner cancels a job (SIGTERM), or a person (Ctrl-C)
        output = proc.communicate(timeout=120)[0]
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 2, output[-3000:]  # pytest's "interrupted"
    report = json.loads((tmp_path / "reports" / "kit-report.json").read_text())
    rows = {row["nodeid"].split("::")[-1]: row for row in report["tests"]}
    assert rows["test_stopped_while_its_ranks_run"]["outcome"] == "interrupted", output[-3000:]
    assert "test_never_started" not in rows
    assert report["session"]["exit_status"] == 2
    assert report["session"]["outcome_counts"]["interrupted"] == 1
    assert ET.parse(tmp_path / "reports" / "junit.xml").getroot() is not None
    time.sleep(1.0)  # the kernel reaps what the launcher killed
    assert [pid for pid in helpers if _alive(pid)] == []
    assert _launched_under(tmp_path) == []
    if signum == signal.SIGQUIT:  # the stacks first: where the session was when it was asked
        assert "the stack of every thread" in output, output[-3000:]
        assert 'File "' in output and "in supervise" in output, output[-3000:]


# A test that says which stop signals its session ignores, then waits to be stopped.
SLEEPING = textwrap.dedent(
    """
    import os, signal, time


    def test_stopped_while_it_sleeps():
        ignored = [s.name for s in (signal.SIGINT, signal.SIGQUIT) if signal.getsignal(s) is signal.SIG_IGN]
        with open(os.environ["READY"] + ".tmp", "w") as f:
            f.write(" ".join(ignored) or "none ignored")
        os.replace(os.environ["READY"] + ".tmp", os.environ["READY"])
        time.sleep(300)
    """
)


@pytest.mark.L0
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGQUIT], ids=["ctrl-c", "sigquit"])
def test_a_session_started_from_a_background_job_is_still_stopped_by_ctrl_c_and_sigquit(
    signum: int, tmp_path: Path
) -> None:
    """A suite run as a background job (`bash ci/test.sh L0 &` in a script) has SIGINT and SIGQUIT
    ignored, and so had every session it started: the Ctrl-C and SIGQUIT cases above waited 120 s
    for a session that ignored them. A session a test stops starts with its stop signals at their
    defaults (`fixtures.stop_signals`)."""
    # The premise, from a real shell: a background job starts with SIGINT and SIGQUIT ignored.
    job = subprocess.run(
        ["sh", "-c", "cat /proc/self/status & wait"], capture_output=True, text=True, check=True
    )
    assert {signal.SIGINT, signal.SIGQUIT} <= ignored_signals(job.stdout), job.stdout
    ready = tmp_path / "ready"
    with as_a_background_job():  # this process as such a job's shell leaves it
        proc = _start(tmp_path, SLEEPING, "--kit-report=reports", env={**os.environ, "READY": str(ready)})
    try:
        _wait_for([ready], proc)
        assert ready.read_text() == "none ignored"  # before: "SIGINT SIGQUIT"
        proc.send_signal(signum)
        output = proc.communicate(timeout=120)[0]
    finally:
        if proc.poll() is None:
            proc.kill()
    _interrupted_report(proc, output, tmp_path)


# A test whose fixture takes a while to tear down (a checkpoint written, a process group torn
# down): the session's end tears it down after the stop, and a second stop signal comes meanwhile.
SLOW_CLEANUP = textwrap.dedent(
    """
    import os, time
    import pytest


    @pytest.fixture
    def slow_cleanup():
        yield
        ready = os.environ["READY"]
        open(ready + ".cleaning", "w").close()
        while not os.path.exists(ready + ".second-sent"):
            time.sleep(0.05)


    def test_stopped_while_it_sleeps(slow_cleanup):
        open(os.environ["READY"], "w").close()
        time.sleep(300)
    """
)


@pytest.mark.L0
@pytest.mark.parametrize(
    ("first", "second"),
    [(signal.SIGINT, signal.SIGTERM), (signal.SIGTERM, signal.SIGINT)],
    ids=["ctrl-c-then-sigterm", "sigterm-then-ctrl-c"],
)
def test_a_second_stop_signal_during_the_cleanup_is_ignored_and_the_report_says_interrupted(
    first: int, second: int, tmp_path: Path
) -> None:
    """A CI cancel sends SIGINT, then SIGTERM a few seconds later (GitHub Actions: 7.5 s). Before,
    a SIGTERM that came while the session cleaned up after Ctrl-C raised a second KeyboardInterrupt
    there and pytest died of it (exit -2); landing in pytest's own interrupt handling, it also left
    a report that called the stopped test passed, exit status 0 (seen in a stress loop)."""
    ready = tmp_path / "ready"
    proc = _start(tmp_path, SLOW_CLEANUP, "--kit-report=reports", "--junitxml=reports/junit.xml",
                  env={**os.environ, "READY": str(ready)})  # fmt: skip
    try:
        _wait_for([ready], proc)
        proc.send_signal(first)
        _wait_for([ready.with_name("ready.cleaning")], proc)
        proc.send_signal(second)  # delivered before the fixture can see the file below
        ready.with_name("ready.second-sent").touch()
        output = proc.communicate(timeout=120)[0]
    finally:
        if proc.poll() is None:
            proc.kill()
    report = _interrupted_report(proc, output, tmp_path)
    assert report["session"]["exit_status"] == 2, output[-3000:]
    assert ET.parse(tmp_path / "reports" / "junit.xml").getroot() is not None


# A module-scoped fixture that launches ranks which wait: the session is stopped while the first
# test's setup is still in the fixture, before any phase of it reported.
IN_FIXTURE = textwrap.dedent(
    """
    import os, time
    import pytest

    from megatron_testkit.ranks import run_ranks


    def wait(rank, world_size, ready):
        with open(f"{ready}.{rank}", "w"):
            pass
        time.sleep(300)


    @pytest.fixture(scope="module")
    def trained():
        return run_ranks(wait, 2, timeout=250, args=(os.environ["READY"],))


    def test_uses_the_fixture(trained):
        pass


    def test_after_it(trained):
        pass
    """
)


@pytest.mark.L0
def test_a_session_stopped_while_a_fixture_launches_ranks_records_the_test_as_interrupted(
    tmp_path: Path,
) -> None:
    ready = tmp_path / "ready"
    env = {**os.environ, "READY": str(ready)}
    proc = _start(tmp_path, IN_FIXTURE, "--kit-report=reports", env=env)
    try:
        _wait_for([ready.with_name("ready.0"), ready.with_name("ready.1")], proc)
        proc.send_signal(signal.SIGTERM)
        output = proc.communicate(timeout=120)[0]
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 2, output[-3000:]
    report = json.loads((tmp_path / "reports" / "kit-report.json").read_text())
    rows = {row["nodeid"].split("::")[-1]: row for row in report["tests"]}
    # Before: `tests: []`, and repro called the test "not run".
    assert list(rows) == ["test_uses_the_fixture"], report["tests"]
    assert rows["test_uses_the_fixture"]["outcome"] == "interrupted"
    assert "SIGTERM" in rows["test_uses_the_fixture"]["failure"]["first_line"]
    assert _launched_under(tmp_path) == []


@pytest.mark.L0
def test_a_malformed_kit_variable_is_a_usage_error_naming_it(tmp_path: Path) -> None:
    cases = {
        "KIT_RANK_TIMEOUT": "nan",  # would disable hang detection
        "KIT_HOST_MEMORY": "lots",  # was blamed on the first launch's test
        "KIT_SEED": "seven",  # was blamed on the first launch's test
        "KIT_RANK_LOG_BYTES": "1KiB",  # could not hold one traceback
        "KIT_GOLDEN_PLATFORM": "../../x",  # wrote a candidate outside the test's folder
        "KIT_STALL_WINDOW": "soon",  # would be blamed on the first launch's test
        "KIT_DEFAULT_RANK_MEMORY": "lots",  # admission's share of a rank without a budget
    }
    for name, value in cases.items():
        proc = _start(tmp_path, "def test_nothing():\n    pass\n", env={**os.environ, name: value})
        output = proc.communicate(timeout=120)[0]
        assert proc.returncode == pytest.ExitCode.USAGE_ERROR, (name, output[-2000:])
        errors = [line for line in output.splitlines() if line.startswith("ERROR:")]
        assert len(errors) == 1 and name in errors[0] and repr(value) in errors[0], (name, output[-2000:])
        assert "Traceback" not in output


@pytest.mark.L0
def test_a_full_disk_at_the_sessions_start_is_a_usage_error_not_an_internal_error(tmp_path: Path) -> None:
    """The admission ledger is the first file a session writes; it was an INTERNALERROR (exit 3).

    The full disk is caused for real, without root: RLIMIT_FSIZE in the session's process makes
    every write past 16 bytes fail with EFBIG, as ENOSPC would (SIGXFSZ ignored, as a shell that
    set ``ulimit -f`` leaves it)."""
    import resource

    def small_files() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (16, 16))

    (tmp_path / "test_inner.py").write_text("def test_nothing():\n    pass\n")
    (tmp_path / "tmp").mkdir()
    env = inner_env({**os.environ, "TMPDIR": str(tmp_path / "tmp"), "PYTHONDONTWRITEBYTECODE": "1"})
    env.pop("KIT_ADMISSION_DIR", None)  # a session of its own: it creates its ledger, then joins it
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *WITHOUT_HYPOTHESIS, "test_inner.py"],
        cwd=tmp_path, env=env, preexec_fn=small_files, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    output = done.stdout + done.stderr
    assert done.returncode == pytest.ExitCode.USAGE_ERROR, output[-2000:]
    assert "INTERNALERROR" not in output and "Traceback" not in output, output[-2000:]
    errors = [line for line in output.splitlines() if line.startswith("ERROR:")]
    assert len(errors) == 1 and "kit admission ledger: cannot write" in errors[0], output[-2000:]
    assert list((tmp_path / "tmp").iterdir()) == [], "the refused session left its ledger folder"


@pytest.mark.L0
def test_a_report_folder_that_is_a_file_or_has_a_linked_logs_folder_is_a_usage_error(tmp_path: Path) -> None:
    (tmp_path / "afile").write_text("mine")
    (tmp_path / "reports").mkdir()
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "reports" / "logs").symlink_to(tmp_path / "elsewhere")
    for folder, says in (("afile", "cannot use it as a folder"), ("reports", "is a link")):
        proc = _start(tmp_path, "def test_nothing():\n    pass\n", f"--kit-report={folder}")
        output = proc.communicate(timeout=120)[0]
        assert proc.returncode == pytest.ExitCode.USAGE_ERROR, output[-2000:]
        errors = [line for line in output.splitlines() if line.startswith("ERROR:")]
        assert len(errors) == 1 and f"--kit-report={folder}" in errors[0] and says in errors[0], output[
            -2000:
        ]
        assert "Traceback" not in output and "INTERNALERROR" not in output
    assert (tmp_path / "afile").read_text() == "mine"
    assert list((tmp_path / "elsewhere").iterdir()) == []


TWO_RANKS = textwrap.dedent(
    """
    import os, time

    import torch.distributed as dist
    from megatron_testkit.ranks import run_ranks


    def wait_for_go(rank, world_size, ready, go):
        open(f"{ready}.{rank}", "w").close()
        while not os.path.exists(go):
            time.sleep(0.05)
        dist.barrier()
        return rank


    def test_ranks():
        assert run_ranks(wait_for_go, 2, timeout=250, args=(os.environ["READY"], os.environ["GO"])) == [0, 1]
    """
)


@pytest.mark.L0
def test_a_users_logs_folder_in_the_report_dir_is_left_alone(tmp_path: Path) -> None:
    mine = tmp_path / "logs" / "training.log"
    mine.parent.mkdir()
    mine.write_text("a user's own log\n")
    (tmp_path / "go").touch()
    env = {**os.environ, "READY": str(tmp_path / "ready"), "GO": str(tmp_path / "go")}
    proc = _start(tmp_path, TWO_RANKS, "--kit-report=.", env=env)
    output = proc.communicate(timeout=300)[0]
    assert proc.returncode == 0, output[-3000:]
    assert mine.read_text() == "a user's own log\n"
    log_dir = Path(json.loads((tmp_path / "kit-report.json").read_text())["tests"][0]["log_dir"])
    assert log_dir.is_relative_to(tmp_path / "logs") and (log_dir / "rank0.log").exists()


@pytest.mark.L1
def test_two_sessions_sharing_a_report_dir_keep_each_others_launches(tmp_path: Path) -> None:
    first, second = tmp_path / "first", tmp_path / "second"
    first.mkdir()
    second.mkdir()
    reports = tmp_path / "reports"
    env = {**os.environ, "READY": str(first / "ready"), "GO": str(first / "go")}
    proc = _start(first, TWO_RANKS, f"--kit-report={reports}", env=env)
    try:
        _wait_for([first / "ready.0", first / "ready.1"], proc)
        # A second session (another test file, as another CI step would run) starts on the same
        # report folder while the first one's ranks run.
        (second / "go").touch()
        env2 = {**os.environ, "READY": str(second / "ready"), "GO": str(second / "go")}
        other = _start(second, TWO_RANKS, f"--kit-report={reports}", env=env2, name="test_other.py")
        other_output = other.communicate(timeout=300)[0]
        assert other.returncode == 0, other_output[-3000:]
        (first / "go").touch()
        output = proc.communicate(timeout=300)[0]
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, output[-3000:]
    # Both sessions' rows, merged under the folder's lock (the second finished first): before,
    # the last session to finish overwrote the other's kit-report.json.
    report = json.loads((reports / "kit-report.json").read_text())
    assert [row["nodeid"] for row in report["tests"]] == [
        "test_other.py::test_ranks",
        "test_inner.py::test_ranks",
    ]
    assert [ref["first_test"] for ref in report["session"]["sessions"]] == [0, 1]
    first_logs = Path(report["tests"][1]["log_dir"])
    assert (first_logs / "rank0.log").exists() and (first_logs / "rank1.log").exists()


GROWING = textwrap.dedent(
    """
    import time

    import torch
    import torch.distributed as dist
    from megatron_testkit.ranks import run_ranks


    def grow(rank, world_size):
        if rank == 1:
            chunks = []
            for _ in range(60):  # up to 3.75 GiB, 64 MiB of touched pages at a time
                chunks.append(torch.ones(16 * 2**20))
                time.sleep(0.02)
        dist.barrier()


    def test_grows():
        run_ranks(grow, 2, timeout=250)
    """
)


@pytest.mark.L1
def test_a_rank_killed_by_the_repro_watcher_is_oom_in_the_report(tmp_path: Path) -> None:
    # `python -m ci repro --host-memory 1200MiB --limit-method env`, without its KIT_HOST_MEMORY
    # (so only the watcher enforces it): two idle ranks hold ~600 MiB, rank 1 then grows past it.
    from megatron_testkit.repro_limit import apply_memory_limit

    env = {k: v for k, v in os.environ.items() if k not in ("KIT_HOST_MEMORY", "KIT_RANK_CGROUP")}
    limit = apply_memory_limit(1200 * 2**20, "env", owner="python -m ci repro")
    proc = _start(tmp_path, GROWING, "--kit-report=reports", env=env)
    watcher = limit.watch(proc.pid)
    try:
        output = proc.communicate(timeout=300)[0]
    finally:
        kills = watcher.stop()
        if proc.poll() is None:
            proc.kill()
    assert [(k.rank, k.nodeid) for k in kills] == [(1, "test_inner.py::test_grows")], output[-3000:]
    failure: dict[str, Any] = json.loads((tmp_path / "reports" / "kit-report.json").read_text())["tests"][0][
        "failure"
    ]
    assert (failure["rank"], failure["kind"]) == (1, "oom"), failure["first_line"]
    assert "killed by python -m ci repro" in failure["first_line"]
    assert "rank 1 oom: " in output


FAILING_RANK = textwrap.dedent(
    """
    from megatron_testkit.ranks import run_ranks


    def fail_on_one(rank, world_size):
        if rank == 1:
            raise ValueError("rank one gives up")
        return rank


    def test_fails():
        run_ranks(fail_on_one, 2, timeout=120)
    """
)


@pytest.mark.L0
def test_a_report_folder_moved_elsewhere_still_resolves_its_rank_logs_and_records_no_kit_internals(
    tmp_path: Path,
) -> None:
    # As CI runs it: the report folder is uploaded, and a person opens the downloaded copy on
    # another machine. Every path the report, its Markdown and the failure's "Rank logs:" line
    # give must resolve from that copy, and the session's settings are the user's only.
    proc = _start(tmp_path, FAILING_RANK, "--kit-report=reports")
    output = proc.communicate(timeout=300)[0]
    assert proc.returncode == 1, output[-3000:]
    downloaded = tmp_path / "elsewhere" / "artifact"
    downloaded.parent.mkdir()
    (tmp_path / "reports").rename(downloaded)
    report = json.loads((downloaded / "kit-report.json").read_text())
    (row,) = report["tests"]
    assert row["rank_logs"].startswith("logs/session-"), row["rank_logs"]
    assert "rank one gives up" in (downloaded / row["rank_logs"] / "rank1.log").read_text()
    shown = [line for line in row["failure"]["message"].splitlines() if line.startswith("Rank logs: ")]
    assert shown == [f"Rank logs: {row['rank_logs']} (in the --kit-report folder)"], shown
    assert f"  rank logs: `{row['rank_logs']}`" in (downloaded / "kit-report.md").read_text()
    # The terminal says the same (a person reads it there first).
    assert f"Rank logs: {row['rank_logs']} (in the --kit-report folder)" in output
    names = [setting["name"] for setting in report["session"]["settings"]]
    assert "KIT_ADMISSION_DIR" not in names, names
    # Each rank's memory over the launch, as the launcher sampled it: both ranks, times from spawn.
    (launch,) = row["launches"]
    assert sorted(series["rank"] for series in launch["memory"]) == [0, 1]
    for series in launch["memory"]:
        assert len(series["t_s"]) == len(series["rss_bytes"]) >= 1 and series["t_s"] == sorted(series["t_s"])
        assert all(0 < b < 2**40 for b in series["rss_bytes"])
