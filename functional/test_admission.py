"""Memory admission under ``pytest -n 4``: rank tests whose budgets add up to more than the runner.

Four tests, one rank each with a 600 MiB host budget, under a 1.25 GiB runner (KIT_HOST_MEMORY):
admission lets two run at once (1200 MiB <= 1280 MiB), queues the others, and the ranks' summed
resident memory, sampled from outside, never crosses the limit. The control runs the same
session with admission off (KIT_ADMISSION=0): the four ranks overlap and the sum crosses it.
Each rank touches 300 MiB on top of its idle footprint (Python and torch, about 200-300 MiB),
holds it until three ranks have stamped (or 6 s), then returns: without admission at least three
overlap, 3 x 500 MiB > 1280 MiB; with it at most two, 2 x 600 MiB budgets <= 1280 MiB.
"""

from __future__ import annotations

import textwrap
import threading
from pathlib import Path
from typing import Any

import psutil
import pytest

from fixtures.inner_session import run_inner_session

pytestmark = pytest.mark.L1

MiB = 2**20
LIMIT = 1280 * MiB
BUDGET = 600 * MiB

SESSION = textwrap.dedent(
    """
    import os
    import time
    from pathlib import Path

    import pytest

    from megatron_testkit.ranks import run_ranks


    def hold(rank, world_size, stamps):
        import torch

        x = torch.ones(300 * 2**20 // 4)  # touched: resident
        Path(stamps, str(os.getpid())).touch()
        end = time.monotonic() + 6
        while len(os.listdir(stamps)) < 3 and time.monotonic() < end:
            time.sleep(0.05)
        return float(x[0])


    @pytest.mark.memory_budget(host="600MiB")
    @pytest.mark.parametrize("i", range(4))
    def test_hold(i):
        assert run_ranks(hold, 1, args=(os.environ["STAMPS"],), timeout=120) == [1.0]
    """
)


class RankMemory:
    """Samples the summed RSS of the ranks launched under ``root`` (by their launch spec's path)."""

    def __init__(self, root: Path) -> None:
        self.root, self.peak, self.stop = str(root), 0, threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)

    def run(self) -> None:
        ranks: dict[int, psutil.Process] = {}
        while not self.stop.is_set():
            for proc in psutil.process_iter(["cmdline"]):
                if proc.pid in ranks or not any(
                    a.startswith("kit-rank-") for a in proc.info["cmdline"] or []
                ):
                    continue
                try:
                    if proc.environ().get("KIT_RANK_SPEC", "").startswith(self.root):
                        ranks[proc.pid] = proc
                except psutil.Error:
                    continue
            total = 0
            for proc in list(ranks.values()):
                try:
                    total += proc.memory_info().rss
                except psutil.Error:
                    ranks.pop(proc.pid, None)
            self.peak = max(self.peak, total)
            self.stop.wait(0.05)

    def __enter__(self) -> RankMemory:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join()


def _session(root: Path, admission: bool) -> tuple[dict[str, Any], int]:
    stamps = root / "stamps"
    stamps.mkdir(parents=True)
    env = {
        "KIT_HOST_MEMORY": f"{LIMIT}",
        "STAMPS": str(stamps),
        "KIT_ADMISSION_DIR": None,  # its own ledger, with its own runner limit, not this session's
        "KIT_ADMISSION": "1" if admission else "0",
        # Cold launches: the arithmetic above (exactly two 600 MiB budgets fit) leaves no room for
        # a warm parent, whose resident memory (Python and torch, not a fixed figure) the ledger
        # counts too once it is up (docs/testkit.md, warm starts).
        "KIT_WARM_START": "0",
    }
    with RankMemory(root) as sampled:
        result = run_inner_session(root, "test_hold.py", SESSION, "-n", "4", "-p", "no:randomly", env=env)
    return result, sampled.peak


@pytest.fixture(scope="module")
def sessions(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[dict[str, Any], int]]:
    return {
        "admitted": _session(tmp_path_factory.mktemp("admitted"), admission=True),
        "control": _session(tmp_path_factory.mktemp("control"), admission=False),
    }


def test_budgets_over_the_runner_under_n4_finish_without_crossing_it(sessions) -> None:
    result, peak = sessions["admitted"]
    assert result["rc"] == 0, result["output"][-3000:]
    rows = result["rows"].values()
    assert [r["outcome"] for r in rows] == ["passed"] * 4
    assert {r["worker"] for r in rows} != {None}  # it did run under xdist
    assert 4 * BUDGET > LIMIT  # the budgets add up to more than the runner
    assert 0 < peak <= LIMIT, f"ranks' summed RSS peaked at {peak / MiB:.0f} MiB"


def test_the_queueing_and_the_peak_of_admitted_memory_are_in_the_report(sessions) -> None:
    result, _ = sessions["admitted"]
    session = result["report"]["session"]
    assert session["admission_limit_bytes"] == LIMIT
    assert session["admission_source"] == f"KIT_HOST_MEMORY={LIMIT}"
    # At most two 600 MiB ranks fit at once, and two did run at once.
    assert session["admission_peak_bytes"] == 2 * BUDGET
    rows = list(result["rows"].values())
    assert all(r["admitted_bytes"] == BUDGET for r in rows)
    queued = [r for r in rows if r["queued_s"] and r["queued_s"] > 0.5]
    assert len(queued) >= 2, [(r["nodeid"], r["queued_s"]) for r in rows]  # two waited for the first two
    assert "admission: peak 1.17 GiB of 1.25 GiB admitted" in result["output"]


def test_the_same_session_without_admission_crosses_the_limit(sessions) -> None:
    result, peak = sessions["control"]
    assert result["rc"] == 0, result["output"][-3000:]
    assert result["report"]["session"]["admission_limit_bytes"] is None
    assert all(r["queued_s"] is None for r in result["rows"].values())
    assert peak > LIMIT, f"ranks' summed RSS peaked at {peak / MiB:.0f} MiB only"
