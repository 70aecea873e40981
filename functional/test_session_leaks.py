"""A leak-free shared session: the pytest process does not grow, and no process outlives its test.

Upstream's L0 failure came from many functional tests sharing one process and its memory. Here
the rank code runs in spawned processes, so the pytest process itself should stay flat; this
module proves, from the kit plugin's own session report (`--kit-report`), that

- across several rank tests in one session the pytest process' RSS grows by less than
  `RANK_TEST_GROWTH_BOUND` in total (`pytest_rss_after_bytes - pytest_rss_before_bytes`, summed
  over the rank tests after the first, which pays the one-time imports), and
- from the first rank test to the end of the session it grows by less than `SPAN_BOUND`, and
- every rank test ends with `leaked_processes == 0`, and no process of the session survives it.

Two negative controls in the same inner session keep the check honest: a test that leaves a
child process behind must be reported with `leaked_processes == 1` (and fail in teardown), and a
test that keeps 96 MiB alive in a module global must show up as growth above the span bound.

The check itself ships with the kit (`megatron_testkit.session_check`, which CI runs on a whole
tier's report); this module proves it on an inner session.
"""

from __future__ import annotations

import textwrap
from typing import Any

import psutil
import pytest

from fixtures.inner_session import run_inner_session
from megatron_testkit.session_check import MiB, check_report, span_growth, summary

HOARD_MIB = 96

INNER = textwrap.dedent(
    f"""
    import subprocess

    import pytest
    import torch
    import torch.distributed as dist

    from megatron_testkit.ranks import run_ranks

    KEPT = []


    def exchange(rank, world_size, mib):
        # A real collective plus a result of `mib` MiB sent back to the pytest process.
        t = torch.full((mib * 2**20 // 4,), float(rank + 1))
        dist.all_reduce(t)
        return t[:4].tolist(), t.numpy().tobytes()


    @pytest.mark.world_size(2)
    @pytest.mark.parametrize("i", range(3))
    def test_rank_exchange(i):
        results = run_ranks(exchange, 2, timeout=120, args=(8,))
        assert [r[0] for r in results] == [[3.0] * 4, [3.0] * 4]
        assert all(len(r[1]) == 8 * 2**20 for r in results)


    @pytest.mark.leak_guard  # no ranks: guarded because it opts in (a project's default is rank tests only)
    def test_leaves_a_child_behind():
        subprocess.Popen(["sleep", "300"])


    def test_hoards_memory():
        KEPT.append(torch.ones({HOARD_MIB} * 2**20 // 4))
    """
)


@pytest.fixture(scope="module")
def inner(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Run the inner session once (a subprocess: its leaks must not touch this session)."""
    return run_inner_session(tmp_path_factory.mktemp("session"), "test_inner.py", INNER)


@pytest.mark.L0
@pytest.mark.world_size(2)
def test_rank_tests_keep_the_pytest_process_flat_and_leave_nothing_behind(inner: dict[str, Any]) -> None:
    rows = [r for name, r in inner["rows"].items() if name.startswith("test_rank_exchange")]
    assert len(rows) == 3 and all(r["outcome"] == "passed" for r in rows), inner["output"][-3000:]
    assert all(r["leaked_processes"] == 0 for r in rows)
    clean = {"session": inner["report"]["session"], "tests": rows}
    assert check_report(clean) == [], summary(clean)
    print(f"[session_leaks] inner session ({inner['wall_s']:.1f} s): {summary(clean)}")


@pytest.mark.L0
def test_a_leaked_child_process_is_caught_and_killed(inner: dict[str, Any]) -> None:
    row = inner["rows"]["test_leaves_a_child_behind"]
    assert row["leaked_processes"] == 1 and row["outcome"] in ("failed", "error")
    assert "kit leak guard" in inner["output"] and "sleep 300" in inner["output"]
    assert any("left 1 process" in p for p in check_report(inner["report"]))
    survivors = []
    for proc in psutil.process_iter(["cmdline", "cwd"]):
        try:
            if proc.info["cmdline"] == ["sleep", "300"] and proc.info["cwd"] == str(inner["root"]):
                survivors.append(proc.pid)
        except psutil.Error:
            continue
    assert survivors == []


@pytest.mark.L0
def test_memory_kept_by_a_test_shows_as_growth_above_the_bound(inner: dict[str, Any]) -> None:
    row = inner["rows"]["test_hoards_memory"]
    assert row["pytest_rss_after_bytes"] - row["pytest_rss_before_bytes"] >= HOARD_MIB * MiB * 0.9
    assert span_growth(inner["report"]["tests"]) >= HOARD_MIB * MiB * 0.9
    assert any("from the first rank test to the end" in p for p in check_report(inner["report"]))
