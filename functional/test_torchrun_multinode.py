"""L1: kit tests as a two-node torchrun job on loopback, one report per rank, merged into one.

Two torchrun agents (``--nnodes 2 --nproc-per-node 2``) meet through a c10d rendezvous on a port
picked at run time, as two GPU nodes would. Each of the four ranks runs pytest on the same test
file; `run_ranks` sees torchrun and runs in that process on that rank. Every rank writes its
report to ``node$GROUP_RANK/rank$RANK``; ``python -m ci merge-reports`` merges them, and a failure
planted on node 1 must come out named by node, global rank and kind.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path
from typing import Any

import psutil
import pytest

from megatron_testkit import proctree

pytestmark = pytest.mark.L1

NODES, PER_NODE = 2, 2
# Node 1's second rank: global rank GROUP_RANK * PER_NODE + LOCAL_RANK = 3.
PLANTED_RANK = 1 * PER_NODE + 1

NODE_TESTS = textwrap.dedent(
    """
    import os

    import torch
    import torch.distributed as dist

    # The installed kit, as on a real cluster (this repository's `fixtures` is not shipped). No
    # setup of its own: run_ranks makes a group per call under a store prefix of its own (an
    # unprefixed second group can read stale gloo addresses from the agent's store), and the
    # plugin turns the agent's SIGTERM into an interrupt so that every rank writes its report.
    from megatron_testkit.ranks import run_ranks


    def total(rank, world_size):
        t = torch.tensor([float(rank + 1)])
        dist.all_reduce(t)
        return t.item(), os.environ["GROUP_RANK"]


    def planted(rank, world_size):
        t = torch.ones(1)
        dist.all_reduce(t)
        if os.environ["GROUP_RANK"] == "1" and os.environ["LOCAL_RANK"] == "1":
            raise ValueError(f"planted on node 1, global rank {rank}")
        return rank


    def test_sum_over_both_nodes():
        results = run_ranks(total, 4)
        assert [r[0] for r in results] == [10.0] * 4
        assert sorted(r[1] for r in results) == ["0", "0", "1", "1"]


    def test_planted_failure_on_node_1():
        run_ranks(planted, 4)


    def test_the_next_test_runs_on_every_rank():
        # Reached by all four only if the planted failure ended that test on every rank.
        assert [r[0] for r in run_ranks(total, 4)] == [10.0] * 4
    """
)

# Every rank's pytest writes its own report; the path says which node and rank it is.
RANK_COMMAND = (
    'exec "$0" -m pytest -p no:cacheprovider -q test_nodes.py --kit-report="$1/node$GROUP_RANK/rank$RANK"'
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _agent(root: Path, reports: Path, port: int, run_id: str, node: int) -> subprocess.Popen:
    log = open(root / f"agent{node}.log", "wb")  # noqa: SIM115 (closed when the agent is reaped)
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1", "KIT_RANK_TIMEOUT": "120"}
    env.pop("PYTEST_XDIST_WORKER", None)
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            f"--nnodes={NODES}",
            f"--nproc-per-node={PER_NODE}",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint=127.0.0.1:{port}",
            f"--rdzv-id={run_id}",
            "--max-restarts=0",
            "--no-python",
            "bash",
            "-c",
            RANK_COMMAND,
            sys.executable,
            str(reports),
        ],
        cwd=root,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Run the two-node job once, merge its reports; give back the merged report and logs."""
    root = tmp_path_factory.mktemp("torchrun")
    (root / "test_nodes.py").write_text(NODE_TESTS)
    reports = root / "reports"
    port, run_id = _free_port(), uuid.uuid4().hex[:12]
    agents = [_agent(root, reports, port, run_id, node) for node in range(NODES)]
    codes = []
    try:
        for agent in agents:
            codes.append(agent.wait(timeout=400))
    finally:
        # The agents start their ranks in sessions of their own: kill those by pid, then the agents.
        ranks = [p for agent in agents for p in proctree.descendants(agent.pid)]
        for agent in agents:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(agent.pid, signal.SIGKILL)
        for proc in ranks:
            with contextlib.suppress(psutil.Error):
                proc.kill()
        for agent in agents:
            agent.wait()
        psutil.wait_procs(ranks, timeout=10)
    logs = "\n".join((root / f"agent{n}.log").read_text(errors="replace")[-3000:] for n in range(NODES))
    merged_dir = root / "merged"
    merge = subprocess.run(
        [sys.executable, "-m", "ci", "merge-reports", str(merged_dir), str(reports)],
        capture_output=True,
        text=True,
        cwd=Path(__file__).resolve().parent.parent,
        timeout=120,
    )
    assert merge.returncode == 0, merge.stderr + logs
    report = json.loads((merged_dir / "kit-report.json").read_text())
    return {
        "codes": codes,
        "logs": logs,
        "reports": reports,
        "merge": merge,
        "report": report,
        "markdown": (merged_dir / "kit-report.md").read_text(),
        "rows": {row["nodeid"].split("::")[-1]: row for row in report["tests"]},
    }


def test_every_rank_of_both_nodes_wrote_its_report(job: dict[str, Any]) -> None:
    written = sorted(
        str(p.parent.relative_to(job["reports"])) for p in job["reports"].rglob("kit-report.json")
    )
    assert written == ["node0/rank0", "node0/rank1", "node1/rank2", "node1/rank3"], job["logs"]
    assert job["report"]["session"]["nodes"] == [0, 1]
    assert job["report"]["session"]["missing_ranks"] == []


def test_a_passing_test_has_all_four_ranks_labelled_by_node(job: dict[str, Any]) -> None:
    row = job["rows"]["test_sum_over_both_nodes"]
    assert row["outcome"] == "passed", job["logs"]
    assert [(r["node"], r["rank"]) for r in row["ranks"]] == [(0, 0), (0, 1), (1, 2), (1, 3)]
    assert row["world_size"] == 4


def test_the_failure_planted_on_node_1_is_named_by_node_rank_and_kind(job: dict[str, Any]) -> None:
    row = job["rows"]["test_planted_failure_on_node_1"]
    assert row["outcome"] == "failed"
    failure = row["failure"]
    assert (failure["node"], failure["rank"], failure["kind"]) == (1, PLANTED_RANK, "error"), row
    assert failure["first_line"].startswith(
        f"node 1: rank {PLANTED_RANK} error: ValueError: planted on node 1"
    )
    assert f"root cause node 1, rank {PLANTED_RANK}, error" in job["markdown"]
    assert f"node 1: rank {PLANTED_RANK} error" in job["merge"].stdout
    # The job as a whole failed, as a torchrun job with a failing rank must.
    assert any(code != 0 for code in job["codes"])


def test_every_rank_names_the_planted_rank_and_the_session_goes_on(job: dict[str, Any]) -> None:
    # Each rank's outcome is gathered: all four processes end the failing test with the same root
    # cause (no peer waits for a result until the agent tears the job down), then run the next one.
    planted = job["rows"]["test_planted_failure_on_node_1"]
    reporters = sorted((f["node"], f["process_rank"]) for f in planted["failures"])
    assert reporters == [(0, 0), (0, 1), (1, 2), (1, 3)], job["logs"]
    assert {(f["rank"], f["kind"]) for f in planted["failures"]} == {(PLANTED_RANK, "error")}
    after = job["rows"]["test_the_next_test_runs_on_every_rank"]
    assert after["outcome"] == "passed", job["logs"]
    assert [(r["node"], r["rank"]) for r in after["ranks"]] == [(0, 0), (0, 1), (1, 2), (1, 3)]
