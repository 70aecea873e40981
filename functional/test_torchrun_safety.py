"""Under ``torchrun -m pytest`` a deadlock is named by the stall rule and a stop signal ends every
rank's session with its report, also on a rank blocked in a gloo collective.

A real torchrun job (``--standalone --nproc-per-node 2``, gloo on CPU) runs a small test file on
both ranks, each writing its own kit report. Before, the deadlock below sat in the end-of-test
gather for good (nothing printed, no report), and SIGTERM failed the running test on the rank that
took it (its session went on to the next test) while the blocked rank was SIGKILLed with no report.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import psutil
import pytest

from fixtures.inner_session import inner_env
from megatron_testkit import skips

pytestmark = pytest.mark.L1  # a torchrun job of two pytest sessions each: ~20-40 s

DEADLOCK_TESTS = textwrap.dedent(
    """
    import pytest
    import torch
    import torch.distributed as dist

    from megatron_testkit.ranks import run_ranks


    def fail_on_rank_1(rank, world_size):
        if rank == 1:
            raise ValueError("rank 1 fails before the all_reduce")
        dist.all_reduce(torch.ones(1))  # rank 0 waits here for a rank that never comes


    @pytest.mark.stall_window(3)
    def test_rank_1_fails_and_rank_0_waits_for_it():
        run_ranks(fail_on_rank_1, 2)


    def test_after_the_deadlock():
        run_ranks(lambda rank, world_size: rank, 2)
    """
)

SIGNAL_TESTS = textwrap.dedent(
    """
    import atexit
    import os
    import time
    from pathlib import Path

    import pytest
    import torch.distributed as dist

    from megatron_testkit.ranks import run_ranks


    def sleep_or_wait(rank, world_size):
        here = Path(os.environ["SIGNAL_TEST_DIR"])
        if rank == 0:
            # Rank 0 runs Python (it takes SIGTERM) and stays alive a while after its session
            # ended: rank 1 stays blocked in the barrier until then, past the signal watch's grace.
            atexit.register(time.sleep, 8)
            (here / "rank0-sleeping").touch()
            time.sleep(600)
        (here / "rank1-waiting").touch()
        dist.barrier()  # rank 1: blocked in gloo, its main thread never runs the Python handler


    @pytest.mark.stall_window(None)
    def test_stopped_by_the_agent():
        run_ranks(sleep_or_wait, 2)


    def test_never_runs():
        pass
    """
)

WRITER_TESTS = textwrap.dedent(
    """
    import multiprocessing
    import os
    from pathlib import Path

    from megatron_testkit.ranks import run_ranks


    def save(rank, world_size, name):
        import torch
        from megatron.core import dist_checkpointing
        from megatron.core.dist_checkpointing import ShardedTensor

        from megatron_testkit.megatron_cpu import cpu_shim

        path = Path(os.environ["SIGNAL_TEST_DIR"], name)
        path.mkdir(exist_ok=True)
        tensor = torch.arange(4, dtype=torch.float32) + 4 * rank
        with cpu_shim():
            dist_checkpointing.save({"w": ShardedTensor.from_rank_offsets("w", tensor, (0, rank, world_size))}, path)
        return [p.pid for p in multiprocessing.active_children()]


    def test_first_save():
        print("HELPERS", run_ranks(save, 2, args=("first",)))


    def test_second_save_uses_the_same_writer():
        print("HELPERS", run_ranks(save, 2, args=("second",)))
    """
)


def _torchrun(tmp_path: Path) -> list[str]:
    return [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
        "--max-restarts=0", "--no-python", "bash", "-c",
        'exec "$0" -m pytest -p no:cacheprovider -q test_ranks.py --kit-report="reports/rank$RANK"',
        sys.executable,
    ]  # fmt: skip


def _env(tmp_path: Path) -> dict[str, str]:
    env = {**inner_env(), "OMP_NUM_THREADS": "1", "KIT_RANK_TIMEOUT": "900", "SIGNAL_TEST_DIR": str(tmp_path)}
    env.pop("PYTEST_XDIST_WORKER", None)
    return env


def _start(tmp_path: Path, stderr: int) -> subprocess.Popen[str]:
    """The job in a session of its own, so that `_end` reaches its ranks too."""
    return subprocess.Popen(
        _torchrun(tmp_path),
        cwd=tmp_path,
        env=_env(tmp_path),
        stdout=subprocess.PIPE,
        stderr=stderr,
        text=True,
        start_new_session=True,
    )


def _end(job: subprocess.Popen[str]) -> None:
    """Nothing of the job is left running (a job that outlived its test's wait): the agent starts each
    rank in a session of its own, so its ranks are found as its children."""
    with contextlib.suppress(psutil.Error):
        for proc in [*psutil.Process(job.pid).children(recursive=True), psutil.Process(job.pid)]:
            with contextlib.suppress(psutil.Error):
                proc.kill()
    job.wait()


def _rows(tmp_path: Path, rank: int) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    report = json.loads((tmp_path / f"reports/rank{rank}/kit-report.json").read_text())
    return report, {row["nodeid"].split("::")[-1]: row for row in report["tests"]}


def test_under_torchrun_a_deadlock_is_named_by_the_stall_rule_on_every_rank(tmp_path: Path) -> None:
    (tmp_path / "test_ranks.py").write_text(DEADLOCK_TESTS)
    job = _start(tmp_path, stderr=subprocess.PIPE)
    try:
        stdout, stderr = job.communicate(timeout=240)
    finally:
        _end(job)
    job = subprocess.CompletedProcess(job.args, job.returncode, stdout, stderr)
    output = job.stdout[-6000:] + job.stderr[-6000:]
    assert job.returncode != 0, output
    for rank in (0, 1):
        _, rows = _rows(tmp_path, rank)
        row = rows["test_rank_1_fails_and_rank_0_waits_for_it"]
        assert row["outcome"] == "failed", (rank, row, output)
        failure = row["failure"]
        # The failed rank's own error leads, on both ranks, and the wait-for graph says who waits.
        assert (failure["rank"], failure["kind"]) == (1, "error"), (rank, failure)
        assert failure["first_line"] == "rank 1 error: ValueError: rank 1 fails before the all_reduce"
        assert "rank 0 waits in all_reduce #1 of group [0, 1] for rank 1 (exited)" in failure["message"]
        assert re.search(r"rank 1 exited while rank 0 waits for it: rank 0 -> rank 1", failure["message"])
        assert "raise ValueError" in failure["message"]  # rank 1's own traceback
    _, rows0 = _rows(tmp_path, 0)
    # Rank 0 was blocked in the all_reduce: its watch wrote its report and ended it, with its stack.
    assert (
        "dist.all_reduce(torch.ones(1))"
        in rows0["test_rank_1_fails_and_rank_0_waits_for_it"]["failure"]["message"]
    )
    assert "test_after_the_deadlock" not in rows0
    assert "kit: rank 0 blocked in a deadlock the stall rule named; ending it" in job.stdout + job.stderr


def test_under_torchrun_sigterm_ends_every_ranks_session_with_its_report(tmp_path: Path) -> None:
    (tmp_path / "test_ranks.py").write_text(SIGNAL_TESTS)
    job = _start(tmp_path, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 180
        while not all((tmp_path / name).exists() for name in ("rank0-sleeping", "rank1-waiting")):
            assert time.monotonic() < deadline and job.poll() is None, job.communicate()[0][-6000:]
            time.sleep(0.2)
        time.sleep(1.0)  # rank 1 inside the barrier
        job.send_signal(signal.SIGTERM)  # to the agent, as a CI cancel stops the job
        output = job.communicate(timeout=120)[0]
    finally:
        _end(job)
    output = output[-8000:]
    for rank in (0, 1):
        report, rows = _rows(tmp_path, rank)
        stopped = rows["test_stopped_by_the_agent"]
        assert stopped["outcome"] == "interrupted", (rank, stopped, output)
        assert "test_never_runs" not in rows, (rank, rows, output)  # the session ended there
        assert report["session"]["exit_status"] == 2, (rank, report["session"])
    # Rank 1 never left the gloo barrier: its signal watch wrote the report.
    _, rows1 = _rows(tmp_path, 1)
    assert (
        "the kit's signal watch wrote this rank's report"
        in rows1["test_stopped_by_the_agent"]["failure"]["message"]
    )


def test_under_torchrun_megatrons_checkpoint_writer_lives_with_the_rank_not_as_a_leak(tmp_path: Path) -> None:
    if importlib.util.find_spec("megatron") is None:
        skips.skip("megatron", "megatron-core is not installed")
    (tmp_path / "test_ranks.py").write_text(WRITER_TESTS)
    job = _start(tmp_path, stderr=subprocess.STDOUT)
    try:
        output = job.communicate(timeout=400)[0]
    finally:
        _end(job)
    assert job.returncode == 0, output[-6000:]
    for rank in (0, 1):
        _, rows = _rows(tmp_path, rank)
        for name in ("test_first_save", "test_second_save_uses_the_same_writer"):
            # The leak guard left megatron's Manager to the rank: the second save reuses it.
            assert rows[name]["outcome"] == "passed", (rank, name, rows[name], output[-6000:])
            assert rows[name]["leaked_processes"] == 0, (rank, name, rows[name])
    assert "LibraryHelperWarning" in output
