"""The launcher's verdicts, proven the way pytest tests itself: run a pytest session on a file.

One inner session (under ``pytest -n 2``) runs every scenario once, with ``--kit-report``; each
outer test asserts one verdict from its output and its report, so the ranks are spawned once per
scenario, not once per assertion. The inner session runs as a subprocess: its ranks, signals and
leak guard must not touch the outer session.
"""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Any

import psutil
import pytest

from fixtures.inner_session import run_inner_session
from megatron_testkit.schema import REPORT_VERSION

pytestmark = pytest.mark.L0

SCENARIOS = textwrap.dedent(
    """
    import os
    import signal
    import time

    import pytest
    import torch
    import torch.distributed as dist

    from megatron_testkit.ranks import run_ranks


    def oom(rank, world_size):
        if rank == 1:
            # A real allocation failure, not a raised exception: 1 PiB is beyond any machine and
            # Linux's overcommit heuristic refuses it, so torch's CPU allocator fails.
            torch.empty(2**50, dtype=torch.uint8)
        t = torch.ones(1)
        dist.all_reduce(t)  # rank 0 waits here for the rank that died


    def crash(rank, world_size):
        if rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)  # a real SIGKILL, as the OOM killer sends
        dist.barrier()


    def hang(rank, world_size):
        time.sleep(600)


    def exit0(rank, world_size):
        if rank == 1:
            os._exit(0)  # status 0, but the function never returned: no result, no record
        return rank  # rank 0 has no collective: it returns at once


    def desync(rank, world_size):
        if rank == 0:
            dist.all_reduce(torch.ones(1))  # times out: rank 1 never joins
        time.sleep(600)


    def error(rank, world_size):
        if rank == 0:
            raise ValueError("bad shard on rank 0")
        dist.barrier()


    def hog(rank, world_size, mib):
        if rank == 1:
            x = torch.ones(mib * 2**20 // 4)  # touched pages: resident, not just reserved
            return float(x[0])
        return 0.0


    def leave_helpers(rank, world_size):
        import multiprocessing
        import subprocess
        import sys

        # As dist_checkpointing's async writer does: a spawn Manager (and its resource_tracker),
        # never shut down because the rank exits without running atexit. A Manager may exit with
        # its parent, so a plain long-lived child is left too: that one certainly outlives the rank.
        manager = multiprocessing.get_context("spawn").Manager()
        sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
        return manager._process.pid, sleeper.pid


    def total(rank, world_size):
        t = torch.tensor([float(rank + 1)])
        dist.all_reduce(t)
        return t.item(), torch.get_num_threads(), os.environ["CUDA_DEVICE_MAX_CONNECTIONS"]


    def hang_once_marked(rank, world_size, marker_dir):
        open(os.path.join(marker_dir, f"rank{rank}"), "w").close()
        time.sleep(600)


    # pytest-timeout's own SIGALRM timer and handler, but brought forward to fire half a second
    # after both ranks are in the function: how long the ranks take to start (over 12 s on a loaded
    # 2-core runner, where a fixed 12 s timer caught them still in set-up) must not decide where
    # their stacks are. The 120 s it is set to is the bound if they never get there.
    @pytest.mark.timeout(120, method="signal")
    def test_interrupted_by_pytest_timeout(tmp_path):
        import threading

        def bring_the_timer_forward():
            while len(list(tmp_path.glob("rank*"))) < 2:
                time.sleep(0.05)
            signal.setitimer(signal.ITIMER_REAL, 0.5)

        threading.Thread(target=bring_the_timer_forward, daemon=True).start()
        run_ranks(hang_once_marked, 2, timeout=300, args=(str(tmp_path),))


    def test_oom():
        run_ranks(oom, 2, timeout=120)


    def test_crash():
        run_ranks(crash, 2, timeout=120)


    def test_hang():
        run_ranks(hang, 2, timeout=20)


    def test_exit0():
        run_ranks(exit0, 2, timeout=120)


    def test_desync():
        # The process group times out (after 10 s) before the launch does (20 s).
        run_ranks(desync, 2, timeout=20)


    def test_error():
        run_ranks(error, 2, timeout=120)


    @pytest.mark.memory_budget(host="600MiB")
    def test_budget_overrun():
        run_ranks(hog, 2, timeout=120, args=(900,))


    @pytest.mark.memory_budget(host="2GiB")
    def test_good_pair():
        results = run_ranks(total, 2, timeout=120)
        assert [r[0] for r in results] == [3.0, 3.0]
        assert all(r[2] == "1" for r in results)


    def test_helpers_are_killed():
        import psutil

        ((manager, sleeper),) = run_ranks(leave_helpers, 1, timeout=120)
        for pid in (manager, sleeper):
            try:
                alive = psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
            except psutil.NoSuchProcess:
                alive = False
            assert not alive, pid


    def test_without_ranks():
        assert 1 + 1 == 2


    def noop(rank, world_size):
        return rank


    def test_budget_below_the_startup_footprint(monkeypatch):
        import megatron_testkit.ranks as ranks
        from megatron_testkit.budgets import MemoryBudget

        monkeypatch.setattr(ranks.IDLE_FOOTPRINT, "bytes", None)  # as in a fresh worker: nothing known yet
        run_ranks(noop, 2, timeout=120, budget=MemoryBudget.parse(host="48MiB"))


    def test_budget_below_a_known_footprint_is_refused_at_launch():
        from megatron_testkit.budgets import MemoryBudget

        run_ranks(noop, 2, timeout=120)  # an idle rank's footprint is now known
        run_ranks(noop, 2, timeout=120, budget=MemoryBudget.parse(host="48MiB"))
    """
)


@pytest.fixture(scope="module")
def scenarios(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Run the scenario file once; give back its output, its report and its report dir.

    `pytester` is function-scoped, so this module-scoped run does what its
    ``runpytest_subprocess`` does by hand.
    """
    root = tmp_path_factory.mktemp("scenarios")
    return run_inner_session(
        root, "test_scenarios.py", SCENARIOS, "-n", "2", f"--junitxml={root / 'reports' / 'junit.xml'}"
    )


def _after_setup_s(row: dict[str, Any]) -> float:
    """A test's time less its launches' wait for admission and their ranks' set-up (both recorded)."""
    assert row["setup_s"] is not None and row["queued_s"] is not None, row
    return row["duration_s"] - row["queued_s"] - row["setup_s"]


def _failure(scenarios: dict[str, Any], name: str) -> dict[str, Any]:
    row = scenarios["rows"][name]
    assert row["outcome"] == "failed", (name, row, scenarios["output"][-3000:])
    assert row["failure"] is not None
    return row["failure"]


def test_oom_on_rank_1_is_named_as_the_root_cause_within_seconds(scenarios: dict[str, Any]) -> None:
    failure = _failure(scenarios, "test_oom")
    assert (failure["rank"], failure["kind"]) == (1, "oom")
    assert failure["first_line"].startswith("rank 1 oom: RuntimeError")
    assert "can't allocate memory" in failure["first_line"]
    # Rank 0's "Connection closed by peer" is shown, but as a knock-on, never as the cause.
    assert "rank 0: error (knock-on" in failure["message"]
    assert "last collective entered: all_reduce #1" in failure["message"]
    # "In seconds": against a 120 s timeout, counted once the ranks are up. The wait for admission
    # and the set-up (what the tests admitted beside it slow down) are the machine's, not the verdict's.
    assert _after_setup_s(scenarios["rows"]["test_oom"]) < 30


def test_sigkilled_rank_is_a_crash_not_its_peers_connection_error(scenarios: dict[str, Any]) -> None:
    failure = _failure(scenarios, "test_crash")
    assert (failure["rank"], failure["kind"]) == (1, "crash")
    assert "killed by SIGKILL" in failure["first_line"]
    row = scenarios["rows"]["test_crash"]
    assert row["ranks"][1]["signal"] == "SIGKILL"
    assert _after_setup_s(row) < 30


def test_a_rank_exiting_0_before_returning_is_a_crash_not_a_finished_rank(scenarios: dict[str, Any]) -> None:
    # Not a FileNotFoundError on rank1.result, not "finished": rank 1 is named, with its status.
    failure = _failure(scenarios, "test_exit0")
    assert (failure["rank"], failure["kind"]) == (1, "crash"), failure["message"][-3000:]
    assert failure["first_line"].startswith("rank 1 crash: exited with code 0 before returning")
    assert "FileNotFoundError" not in failure["message"]
    row = scenarios["rows"]["test_exit0"]
    assert row["ranks"][1]["exit_code"] == 0 and row["ranks"][1]["signal"] is None
    # The failed launch keeps its rank logs (named in the report), without the result files.
    log_dir = Path(row["log_dir"])
    assert (log_dir / "rank1.log").exists()
    assert list(log_dir.glob("rank*.result")) == []


def test_sleeping_pair_is_a_hang_with_both_stacks(scenarios: dict[str, Any]) -> None:
    failure = _failure(scenarios, "test_hang")
    assert failure["kind"] == "hang"
    # 20 s from the ranks' set-up, however long the loaded machine took to start them; two
    # sleeping ranks are outside any collective, so the stall rule never judged them earlier.
    assert failure["first_line"].startswith("rank 0 hang: no rank finished within 20 s of its set-up")
    assert "deadlock" not in failure["first_line"]
    row = scenarios["rows"]["test_hang"]
    assert _after_setup_s(row) >= 20
    message = failure["message"]
    # Both ranks' faulthandler stacks, each ending in the sleeping function.
    assert message.count('test_scenarios.py", line') >= 2
    assert message.count(" in hang") >= 2


def test_collective_timeout_blames_the_rank_that_never_joined(scenarios: dict[str, Any]) -> None:
    failure = _failure(scenarios, "test_desync")
    assert (failure["rank"], failure["kind"]) == (1, "hang")
    assert failure["first_line"].startswith(
        "rank 1 hang: a collective timed out on rank 0; rank 1 entered the fewest collectives (0, none yet)"
    )
    # The timed-out rank's error and the culprit's stack (asleep, never in a collective).
    assert "Timed out" in failure["message"] or "timed out" in failure["message"]
    assert " in desync" in failure["message"]


def test_an_outer_pytest_timeout_still_shows_the_rank_stacks(scenarios: dict[str, Any]) -> None:
    failure = _failure(scenarios, "test_interrupted_by_pytest_timeout")
    assert failure["kind"] is None  # pytest-timeout's verdict, not the launcher's
    assert "Timeout (>120.0s) from pytest-timeout" in failure["message"]
    assert "run_ranks was interrupted" in failure["message"]
    assert failure["message"].count(" in hang") >= 2


def test_exception_is_an_error_with_its_traceback(scenarios: dict[str, Any]) -> None:
    failure = _failure(scenarios, "test_error")
    assert (failure["rank"], failure["kind"]) == (0, "error")
    assert failure["first_line"] == "rank 0 error: ValueError: bad shard on rank 0"
    assert 'raise ValueError("bad shard on rank 0")' in failure["message"]
    assert "Traceback (most recent call last)" in failure["message"]


def test_budget_overrun_fails_with_its_figure(scenarios: dict[str, Any]) -> None:
    failure = _failure(scenarios, "test_budget_overrun")
    assert (failure["rank"], failure["kind"]) == (1, "oom")
    assert "host memory budget exceeded" in failure["first_line"]
    assert "> budget 600.00 MiB" in failure["first_line"]
    row = scenarios["rows"]["test_budget_overrun"]
    assert row["budget_host_bytes"] == 600 * 2**20
    assert row["ranks"][1]["peak_host_bytes"] > 600 * 2**20


def test_good_pair_passes_and_its_peaks_are_reported(scenarios: dict[str, Any]) -> None:
    row = scenarios["rows"]["test_good_pair"]
    assert row["outcome"] == "passed", scenarios["output"][-3000:]
    assert (row["world_size"], row["backend"]) == (2, "gloo")
    assert row["budget_host_bytes"] == 2 * 2**30
    assert [r["rank"] for r in row["ranks"]] == [0, 1]
    assert all(r["exit_code"] == 0 and r["signal"] is None for r in row["ranks"])
    # A rank that imported torch and built a gloo group is resident well above 50 MiB.
    assert all(r["peak_host_bytes"] > 50 * 2**20 for r in row["ranks"])
    assert row["peak_host_bytes"] == max(r["peak_host_bytes"] for r in row["ranks"])
    assert row["peak_device_bytes"] is None
    assert row["leaked_processes"] == 0


def test_report_files_hold_every_test_of_the_session(scenarios: dict[str, Any]) -> None:
    report, rows = scenarios["report"], scenarios["rows"]
    assert report["version"] == REPORT_VERSION == 5
    assert set(rows) == {
        "test_oom",
        "test_crash",
        "test_hang",
        "test_exit0",
        "test_error",
        "test_desync",
        "test_interrupted_by_pytest_timeout",
        "test_budget_overrun",
        "test_good_pair",
        "test_helpers_are_killed",
        "test_without_ranks",
        "test_budget_below_the_startup_footprint",
        "test_budget_below_a_known_footprint_is_refused_at_launch",
    }
    assert report["session"]["outcome_counts"] == {"passed": 3, "failed": 10, "skipped": 0, "error": 0}
    assert "-n" in report["session"]["pytest_args"]
    assert rows["test_without_ranks"]["world_size"] == 0
    assert rows["test_without_ranks"]["ranks"] == []
    # Same test id, same seed: the seed is derived from the node id, not drawn.
    from megatron_testkit.attribution import seed_for

    assert rows["test_good_pair"]["seed"] == seed_for(rows["test_good_pair"]["nodeid"])
    markdown = (scenarios["dir"] / "kit-report.md").read_text()
    assert "| test_scenarios.py::test_good_pair | 2 | gloo |" in markdown
    assert "rank 1 oom" in markdown
    for name in ("test_oom", "test_good_pair"):
        log_dir = Path(rows[name]["log_dir"])
        # In this session's own folder under logs/, which the kit marked as its own.
        assert log_dir.parent.parent == scenarios["dir"] / "logs"
        assert (log_dir.parent / ".megatron-testkit-session").is_file()
        assert (log_dir / "rank0.log").exists() and (log_dir / "rank1.log").exists()
    # Every launch went through the session's admission ledger (this outer session's, when there is
    # one: the inner session joins it).
    session = report["session"]
    assert 0 < session["admission_peak_bytes"] <= session["admission_limit_bytes"]
    for row in rows.values():
        if row["world_size"]:
            assert row["admitted_bytes"] > 0
            assert row["queued_s"] is not None
    assert "admission: peak " in scenarios["output"]
    assert "kit report: ranks, peaks, budgets" in scenarios["output"]
    assert "pytest RSS grew" in scenarios["output"]


def test_a_budget_below_the_rank_startup_footprint_is_the_budget_not_a_rank_oom(
    scenarios: dict[str, Any],
) -> None:
    failure = _failure(scenarios, "test_budget_below_the_startup_footprint")
    assert failure["rank"] is None and failure["kind"] is None  # no rank is blamed
    assert failure["first_line"].startswith(
        "megatron_testkit.ranks.BudgetBelowFootprint: host memory budget 48.00 MiB"
    )
    assert "below a rank's startup footprint" in failure["first_line"]


def test_a_budget_below_a_known_idle_footprint_is_refused_before_spawning(scenarios: dict[str, Any]) -> None:
    row = scenarios["rows"]["test_budget_below_a_known_footprint_is_refused_at_launch"]
    failure = _failure(scenarios, "test_budget_below_a_known_footprint_is_refused_at_launch")
    assert "below an idle rank's footprint" in failure["first_line"]
    # The first launch ran (and passed); the refused one spawned nothing (version 3: launch records).
    assert len(row["launches"]) == 1 and row["launches"][0]["kind"] is None


def test_a_rank_failure_shows_the_kit_message_not_the_launcher_source(scenarios: dict[str, Any]) -> None:
    out = scenarios["output"]
    section = out[out.index("_ test_error _") :]
    # Up to the next test's header or, when it is the last failure shown (xdist's order varies),
    # to the next session section (warnings, short summary, the kit's table).
    ends = [i for i in (section.find("\n____"), section.find("\n====")) if i != -1]
    section = section[: min(ends) if ends else None]
    assert "RankFailure: rank 0 error: ValueError: bad shard on rank 0" in section
    assert 'raise ValueError("bad shard on rank 0")' in section  # the rank's own traceback
    for launcher_source in ("def run_ranks(", "__tracebackhide__", "launch.supervise()", "raise failure"):
        assert launcher_source not in section
    assert len(section.splitlines()) < 120


def test_junit_failure_message_leads_with_rank_and_kind(scenarios: dict[str, Any]) -> None:
    junit = (scenarios["dir"] / "junit.xml").read_text()
    assert 'message="megatron_testkit.diagnosis.RankFailure: rank 1 oom: RuntimeError' in junit
    assert 'message="megatron_testkit.diagnosis.RankFailure: rank 1 crash: killed by SIGKILL' in junit


def test_failing_rank_output_is_shown_prefixed_by_rank(scenarios: dict[str, Any]) -> None:
    assert "[rank1] RuntimeError: [enforce fail" in scenarios["output"]
    assert "[rank0] ValueError: bad shard on rank 0" in scenarios["output"]


def test_nothing_is_left_running_after_the_session(scenarios: dict[str, Any]) -> None:
    marker = str(scenarios["dir"].parent)
    stray = []
    for proc in psutil.process_iter(["cmdline", "environ"]):
        try:
            env = proc.info["environ"] or {}
        except psutil.Error:
            continue
        if marker in env.get("KIT_RANK_SPEC", ""):
            stray.append(proc.pid)
    assert stray == []
    assert scenarios["rows"]["test_good_pair"]["leaked_processes"] == 0


def test_helper_processes_a_rank_leaves_are_killed_and_counted(scenarios: dict[str, Any]) -> None:
    row = scenarios["rows"]["test_helpers_are_killed"]
    assert row["outcome"] == "passed", scenarios["output"][-3000:]
    assert row["leaked_processes"] >= 1  # at least the sleeper the rank left
