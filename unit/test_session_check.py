"""megatron_testkit.session_check over an xdist session: each worker is its own pytest process."""

from __future__ import annotations

from typing import Any

import pytest

from megatron_testkit.session_check import MiB, check_report, span_growth, summary

pytestmark = pytest.mark.L0


def row(nodeid: str, worker: str | None, before: int, after: int, world_size: int = 2) -> dict[str, Any]:
    return {
        "nodeid": nodeid,
        "worker": worker,
        "world_size": world_size,
        "pytest_rss_before_bytes": before * MiB,
        "pytest_rss_after_bytes": after * MiB,
        "leaked_processes": 0,
        "queued_s": None,
    }


def report(*rows: dict[str, Any], **session: Any) -> dict[str, Any]:
    return {
        "session": {"pytest_rss_start_bytes": 50 * MiB, "pytest_rss_end_bytes": 60 * MiB, **session},
        "tests": list(rows),
    }


def test_two_workers_are_two_processes_each_paying_its_first_rank_test_once() -> None:
    # gw0 and gw1 each import torch's pickling paths in their first rank test (+40 MiB), and gw1
    # is a larger process: neither is growth of a shared session. Interleaved as xdist reports.
    session = report(
        row("a", "gw0", 500, 540),
        row("b", "gw1", 900, 940),
        row("c", "gw0", 540, 541),
        row("d", "gw1", 940, 942),
    )
    assert check_report(session) == []
    assert span_growth(session["tests"]) == 42 * MiB  # gw1: 900 -> 942
    assert summary(session).startswith(
        "4 tests in 2 workers, 4 with ranks; pytest RSS 50 -> 60 MiB; first rank test +80.0 MiB, "
        "the others +3.0 MiB in total"
    )


def test_growth_within_one_worker_is_still_caught() -> None:
    session = report(row("a", "gw0", 500, 540), row("b", "gw1", 900, 901), row("c", "gw0", 540, 640))
    problems = check_report(session)
    assert any("grew 100.0 MiB over 1 rank tests after each worker's first" in p for p in problems), problems
    assert any("grew 140.0 MiB from the first rank test to the end" in p for p in problems), problems


def test_the_summary_shows_admission_and_the_default_share() -> None:
    session = report(
        {**row("a", None, 500, 501), "queued_s": 2.5, "admitted_bytes": 2 << 30, "budget_host_bytes": None},
        admission_limit_bytes=7 * 10**9,
        admission_peak_bytes=4 << 30,
        admission_source="KIT_HOST_MEMORY=7GB",
        admission_default_rank_bytes=1 << 30,
    )
    assert summary(session).splitlines()[1] == (
        "admission: peak 4.00 GiB of 6.52 GiB admitted (KIT_HOST_MEMORY=7GB); 1 tests queued 2.5 s in all; "
        "1.00 GiB a rank for the 1 rank tests without a memory_budget"
    )
