"""A launch that runs past ten seconds prints one progress line per interval, under pytest's capture.

The inner session runs without ``-s``: its output is captured, yet the lines reach the terminal
(here, the inner process' stderr), because the kit writes them to the descriptor it saved before
pytest captured anything.
"""

from __future__ import annotations

import re
import textwrap
from pathlib import Path

import pytest

from fixtures.inner_session import WITHOUT_HYPOTHESIS, run_inner_session
from megatron_testkit import heartbeat

pytestmark = pytest.mark.L1

INNER = textwrap.dedent(
    """
    import time

    import torch
    import torch.distributed as dist

    from megatron_testkit.ranks import run_ranks


    def body(rank, world_size):
        t = torch.ones(1)
        dist.all_reduce(t)
        if rank == 0:
            time.sleep(12)  # rank 1 waits in the barrier meanwhile
        dist.barrier()
        return t.item()


    def test_beat():
        assert run_ranks(body, 2) == [2.0, 2.0]
    """
)


def test_a_long_launch_prints_one_progress_line_per_interval_past_ten_seconds(tmp_path: Path) -> None:
    out = run_inner_session(tmp_path, "test_inner.py", INNER, env={"KIT_HEARTBEAT": "2"})
    assert out["rc"] == 0, out["output"]
    lines = [line for line in out["output"].splitlines() if line.startswith("test_beat: 2 ranks, ")]
    assert lines, out["output"]
    # Counted from the launch's start; a launch queued for admission (the machine's ledger is shared
    # with other sessions) says how long it queued.
    when = r"test_beat: 2 ranks, (\d+) s(?: \(queued \d+ s(?:, running \d+ s)?\))?: "
    seconds = [int(re.match(when, line).group(1)) for line in lines]
    # The first past the ten seconds, then one per interval (2 s), never two for one interval:
    # the launch lasted at most the session's wall time, so at most one line per 2 s of it.
    assert seconds[0] >= heartbeat.AFTER_S
    assert seconds == sorted(seconds) and len(set(seconds)) == len(seconds)
    assert len(lines) <= out["wall_s"] / 2 + 1
    # While rank 0 sleeps, rank 1 waits in the barrier (the world's second collective).
    assert any(
        "rank 0 idle in user code, rank 1 in barrier #2 of group [0, 1] for " in line for line in lines
    ), lines


def test_kit_heartbeat_zero_prints_nothing(tmp_path: Path) -> None:
    out = run_inner_session(tmp_path, "test_inner.py", INNER, env={"KIT_HEARTBEAT": "0"})
    assert out["rc"] == 0, out["output"]
    assert "test_beat: 2 ranks" not in out["output"]


def test_a_progress_line_after_pytests_dots_starts_on_a_new_line(tmp_path: Path) -> None:
    """pytest's dots (stdout) and the progress lines (stderr) on one pipe, as on a terminal: a
    quick test leaves ``test_inner.py .`` unfinished when the long launch's first line comes."""
    import subprocess
    import sys

    from fixtures.inner_session import inner_env

    source = INNER.replace("def test_beat():", "def test_quick():\n    pass\n\n\ndef test_beat():")
    (tmp_path / "test_inner.py").write_text(source)
    env = {**inner_env(), "KIT_HEARTBEAT": "2"}
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *WITHOUT_HYPOTHESIS, "test_inner.py"],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stdout
    beats = [line for line in run.stdout.splitlines() if "test_beat: 2 ranks, " in line]
    assert beats, run.stdout
    assert all(line.startswith("test_beat: 2 ranks, ") for line in beats), beats
    assert "test_inner.py ." in run.stdout  # the dots were there, on their own line
