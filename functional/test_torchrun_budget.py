"""Under ``torchrun -m pytest`` each rank is a pytest process, and the test's ``memory_budget`` holds
it as it holds a spawned rank: a rank over its budget fails the test as ``oom`` on every rank,
judged on the peak since the call (an earlier test's peak in the same process does not count).

A real torchrun job (``--standalone --nproc-per-node 2``) runs a small test file on both ranks,
each writing its own kit report.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from fixtures.inner_session import inner_env

pytestmark = pytest.mark.L1  # a torchrun job of two pytest sessions: ~35 s

# Sizes: a pytest process with torch imported resides in about 0.3-0.5 GiB here; 1.5 GiB of touched
# float32 pages on top is well over the 1 GiB budget, and 64 MiB on top is well under it.
RANK_TESTS = textwrap.dedent(
    """
    import pytest
    import torch
    import torch.distributed as dist

    from megatron_testkit.ranks import run_ranks


    def touch(rank, world_size, mib, on_ranks):
        held = 0.0
        if rank in on_ranks:
            x = torch.ones(mib * 2**20 // 4)  # touched pages: resident until freed below
            held = float(x.sum())
            del x
        dist.barrier()
        return held


    def test_a_big_peak_without_a_budget():
        # Both ranks' processes peak at 1.5 GiB more here, and free it again.
        assert run_ranks(touch, 2, args=(1536, (0, 1)))[0] > 0


    @pytest.mark.memory_budget(host="1GiB")
    def test_within_its_budget_since_the_call():
        run_ranks(touch, 2, args=(64, (0, 1)))


    @pytest.mark.memory_budget(host="1GiB")
    def test_rank_1_over_its_budget():
        run_ranks(touch, 2, args=(1536, (1,)))
    """
)


def test_under_torchrun_a_rank_over_its_memory_budget_fails_the_test_as_oom_on_every_rank(
    tmp_path: Path,
) -> None:
    (tmp_path / "test_ranks.py").write_text(RANK_TESTS)
    env = {**inner_env(), "OMP_NUM_THREADS": "1", "KIT_RANK_TIMEOUT": "120"}
    env.pop("PYTEST_XDIST_WORKER", None)
    job = subprocess.run(
        [
            sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
            "--max-restarts=0", "--no-python", "bash", "-c",
            'exec "$0" -m pytest -p no:cacheprovider -q test_ranks.py --kit-report="reports/rank$RANK"',
            sys.executable,
        ],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=280,
    )  # fmt: skip
    output = job.stdout[-4000:] + job.stderr[-4000:]
    assert job.returncode != 0, output  # the over-budget test failed on the ranks
    for rank in (0, 1):
        rows = {
            row["nodeid"].split("::")[-1]: row
            for row in json.loads((tmp_path / f"reports/rank{rank}/kit-report.json").read_text())["tests"]
        }
        assert rows["test_a_big_peak_without_a_budget"]["outcome"] == "passed", rows
        # The session's earlier 1.5 GiB peak is not this call's: within budget, it passes.
        within = rows["test_within_its_budget_since_the_call"]
        assert within["outcome"] == "passed", within["failure"]
        assert within["peak_host_bytes"] < 2**30
        over = rows["test_rank_1_over_its_budget"]
        assert over["outcome"] == "failed", over
        assert (over["failure"]["rank"], over["failure"]["kind"]) == (1, "oom"), over["failure"]
        assert "host memory budget exceeded" in over["failure"]["message"]
        if rank == 1:
            assert over["peak_host_bytes"] > 1536 * 2**20  # this rank's own peak, over the budget
