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
    assert span_growth(session["tests"]) == 2 * MiB  # gw1 after its first rank test: 940 -> 942
    assert summary(session).startswith(
        "4 tests in 2 pytest processes, 4 with ranks; pytest RSS 50 -> 60 MiB; first rank test +80.0 MiB, "
        "the others +3.0 MiB in total"
    )


def test_growth_within_one_worker_is_still_caught() -> None:
    session = report(row("a", "gw0", 500, 540), row("b", "gw1", 900, 901), row("c", "gw0", 540, 640))
    problems = check_report(session)
    assert any("grew 100.0 MiB over 1 rank test after each process' first" in p for p in problems), problems
    assert any("grew 100.0 MiB from the first rank test to the end" in p for p in problems), problems


def test_the_summary_shows_admission_and_the_default_share() -> None:
    session = report(
        {**row("a", None, 500, 501), "queued_s": 2.5, "admitted_bytes": 2 << 30, "budget_host_bytes": None},
        admission_limit_bytes=7 * 10**9,
        admission_peak_bytes=4 << 30,
        admission_source="KIT_HOST_MEMORY=7GB",
        admission_default_rank_bytes=1 << 30,
    )
    assert summary(session).splitlines()[1] == (
        "admission: peak 4.00 GiB of 6.52 GiB admitted (KIT_HOST_MEMORY=7GB); 1 test queued 2.5 s in all; "
        "1.00 GiB a rank for the 1 rank test without a memory_budget"
    )


def test_each_session_of_a_shared_report_folder_is_its_own_processes() -> None:
    # Two sessions wrote one --kit-report folder (megatron_testkit.session_merge): gw0 of the second
    # is a new process, whose first rank test pays the imports again.
    first = [row("f.py::a", "gw0", 500, 540), row("f.py::b", "gw0", 540, 541)]
    second = [row("f.py::a", "gw0", 300, 380), row("f.py::b", "gw0", 380, 381)]
    merged = report(*first, *second, sessions=[{"first_test": 0, "tests": 2}, {"first_test": 2, "tests": 2}])
    assert check_report(merged) == []
    assert span_growth(merged["tests"], merged["session"]["sessions"]) == 1 * MiB
    # Read as one session, the second's imports would be growth of the first's process.
    assert check_report({**merged, "session": {**merged["session"], "sessions": None}}) != []


def test_a_file_without_ranks_after_the_first_rank_test_pays_its_imports_outside_the_span() -> None:
    # A worker ran a rank file (its first rank test importing megatron-core, +200 MiB once), then a
    # unit file that imported datasets (+90 MiB, once), then a rank file whose non-rank test kept
    # 100 MiB alive: only the latter is the span's.
    session = report(
        row("functional/f.py::ranks", "gw0", 300, 500),
        row("unit/u.py::imports_datasets", "gw0", 500, 590, world_size=0),
        row("functional/g.py::ranks", "gw0", 590, 591),
        row("functional/g.py::hoards", "gw0", 591, 691, world_size=0),
    )
    assert span_growth(session["tests"]) == 101 * MiB
    assert any("grew 101.0 MiB from the first rank test" in p for p in check_report(session))


_RETAINED = """
import psutil
from megatron_testkit.attribution_plugin import rss

first = bytearray(16 << 20)  # mmapped: freeing it raises glibc's mmap threshold to its size
del first
keep = []
for _ in range(3):
    chunks = [bytearray(3 << 20) for _ in range(10)]  # 30 MiB of temporaries, now from the heap
    keep.append(bytearray(64 << 10))  # a live object above them: the heap's top is not free
    del chunks
print(psutil.Process().memory_info().rss, rss())
"""


def test_the_pytest_rss_a_test_reports_leaves_out_the_free_pages_malloc_keeps() -> None:
    # Freed temporaries under a live object stay resident in malloc's heap (30 MiB here): the
    # kit's reading hands them back first, so a test's growth counts memory still held. The
    # retention itself depends on the order allocations came in, which is why it must not count.
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-c", _RETAINED], capture_output=True, text=True, timeout=120, check=True
    )
    raw, reported = (int(x) for x in out.stdout.split())
    assert raw - reported > 20 * 2**20, (raw, reported)
