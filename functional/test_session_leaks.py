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

`check_report(report)` is the same check for any session report; run it on a whole-L0 report with
``python -m functional.test_session_leaks reports/kit-report.json`` (exit status 1 on violation).
"""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path
from typing import Any

import psutil
import pytest

from fixtures.inner_session import run_inner_session

MiB = 2**20
# Per-session bound on the pytest process' growth over rank tests, excluding the first rank test
# (which imports torch.distributed pickling paths and tensorboard readers once).
RANK_TEST_GROWTH_BOUND = 48 * MiB
# From the first rank test to the end of the session (rank tests and everything between them).
SPAN_BOUND = 64 * MiB
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


    def test_leaves_a_child_behind():
        subprocess.Popen(["sleep", "300"])


    def test_hoards_memory():
        KEPT.append(torch.ones({HOARD_MIB} * 2**20 // 4))
    """
)


def rank_test_growth(rows: list[dict[str, Any]]) -> list[tuple[str, int]]:
    """(nodeid, pytest RSS after - before) of every test that launched ranks, in session order."""
    out = []
    for row in rows:
        before, after = row.get("pytest_rss_before_bytes"), row.get("pytest_rss_after_bytes")
        if row.get("world_size") and before is not None and after is not None:
            out.append((row["nodeid"], after - before))
    return out


def span_growth(rows: list[dict[str, Any]]) -> int:
    """pytest RSS from before the first rank test to after the last test (0 without rank tests).

    Covers whatever runs in between (tests without ranks, fixtures, report hooks) as well."""
    starts = [r for r in rows if r.get("world_size") and r.get("pytest_rss_before_bytes") is not None]
    ends = [r for r in rows if r.get("pytest_rss_after_bytes") is not None]
    if not starts or not ends:
        return 0
    return ends[-1]["pytest_rss_after_bytes"] - starts[0]["pytest_rss_before_bytes"]


def check_report(
    report: dict[str, Any], bound: int = RANK_TEST_GROWTH_BOUND, span_bound: int = SPAN_BOUND
) -> list[str]:
    """Violations of the shared-session contract in a kit report (empty when it holds)."""
    problems = []
    span = span_growth(report["tests"])
    if span > span_bound:
        problems.append(
            f"pytest RSS grew {span / MiB:.1f} MiB from the first rank test to the end of the session "
            f"(bound {span_bound / MiB:.0f} MiB)"
        )
    growth = rank_test_growth(report["tests"])
    steady = sum(delta for _, delta in growth[1:])
    if steady > bound:
        worst = sorted(growth[1:], key=lambda g: -g[1])[:3]
        problems.append(
            f"pytest RSS grew {steady / MiB:.1f} MiB over {len(growth) - 1} rank tests after the first "
            f"(bound {bound / MiB:.0f} MiB); largest: "
            + ", ".join(f"{n} +{d / MiB:.1f} MiB" for n, d in worst)
        )
    for row in report["tests"]:
        if row.get("leaked_processes"):
            problems.append(f"{row['nodeid']} left {row['leaked_processes']} process(es) behind")
    return problems


def summary(report: dict[str, Any]) -> str:
    """One line of figures for the session: growth, per-test maximum, leaks, RSS start/end."""
    growth = rank_test_growth(report["tests"])
    session = report["session"]
    first = growth[0][1] if growth else 0
    steady = sum(d for _, d in growth[1:])
    worst = max((d for _, d in growth), default=0)
    leaks = sum(row.get("leaked_processes") or 0 for row in report["tests"])
    return (
        f"{len(report['tests'])} tests, {len(growth)} with ranks; pytest RSS "
        f"{session['pytest_rss_start_bytes'] / MiB:.0f} -> {session['pytest_rss_end_bytes'] / MiB:.0f} MiB; "
        f"first rank test +{first / MiB:.1f} MiB, the others +{steady / MiB:.1f} MiB in total "
        f"(largest single test +{worst / MiB:.1f} MiB); from the first rank test to the end "
        f"+{span_growth(report['tests']) / MiB:.1f} MiB; leaked processes {leaks}"
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


def main(argv: list[str]) -> int:
    """``python -m functional.test_session_leaks REPORT [BOUND_MIB [SPAN_BOUND_MIB]]``: check a report."""
    report = json.loads(Path(argv[0]).read_text())
    bound = int(argv[1]) * MiB if len(argv) > 1 else RANK_TEST_GROWTH_BOUND
    span_bound = int(argv[2]) * MiB if len(argv) > 2 else SPAN_BOUND
    print(summary(report))
    problems = check_report(report, bound, span_bound)
    for p in problems:
        print("VIOLATION:", p)
    return 1 if problems else 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
