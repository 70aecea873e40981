"""`ci.merge_reports`: per-rank torchrun reports merged into one, failures named by node and rank."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from ci import merge_reports

pytestmark = pytest.mark.L0

KNOCK_ON = "RuntimeError: [pair.cc:553] Connection closed by peer [127.0.0.1]:5311"


def _row(nodeid: str, outcome: str, rank: int, failure: dict[str, Any] | None = None) -> dict[str, Any]:
    ranks = [] if failure else [{"rank": rank, "peak_host_bytes": 100 + rank, "peak_device_bytes": None}]
    return {
        "nodeid": nodeid,
        "outcome": outcome,
        "duration_s": 1.0 + rank,
        "world_size": 0 if failure else 4,
        "backend": None if failure else "gloo (torchrun)",
        "seed": 7,
        "budget_host_bytes": None,
        "budget_device_bytes": None,
        "peak_host_bytes": None if failure else 100 + rank,
        "peak_device_bytes": None,
        "ranks": ranks,
        "failure": failure,
        "pytest_rss_before_bytes": 1,
        "pytest_rss_after_bytes": 1,
        "leaked_processes": 0,
        "log_dir": None,
    }


def _write(base: Path, node: int, rank: int, rows: list[dict[str, Any]]) -> None:
    out = base / f"node{node}" / f"rank{rank}"
    out.mkdir(parents=True)
    report = {"version": 1, "session": {"host": "h", "duration_s": 2.0, "outcome_counts": {}}, "tests": rows}
    (out / "kit-report.json").write_text(json.dumps(report))


def _job(base: Path, planted: int, ranks: range = range(4)) -> None:
    for rank in ranks:
        node = rank // 2
        if rank == planted:
            failure = {"rank": rank, "kind": "oom", "first_line": f"rank {rank} oom: MemoryError: boom"}
        elif rank < planted:
            # A peer that noticed first (lower rank) but only reports the connection going away.
            failure = {"rank": rank, "kind": "error", "first_line": f"rank {rank} error: {KNOCK_ON}"}
        else:
            failure = {"rank": None, "kind": None, "first_line": KNOCK_ON}
        _write(
            base,
            node,
            rank,
            [_row("t.py::test_ok", "passed", rank), _row("t.py::test_bad", "failed", rank, failure)],
        )


def test_the_planted_failure_is_the_root_cause_not_a_lower_rank_knock_on(tmp_path: Path) -> None:
    _job(tmp_path / "reports", planted=3)
    report = merge_reports.merge(merge_reports.find_reports([tmp_path / "reports"]))
    rows = {row["nodeid"]: row for row in report["tests"]}
    root = rows["t.py::test_bad"]["failure"]
    assert (root["node"], root["rank"], root["kind"]) == (1, 3, "oom")
    assert root["first_line"] == "node 1: rank 3 oom: MemoryError: boom"
    assert [(f["node"], f["process_rank"]) for f in rows["t.py::test_bad"]["failures"]] == [
        (0, 0),
        (0, 1),
        (1, 2),
        (1, 3),
    ]
    assert rows["t.py::test_bad"]["world_size"] == 4


def test_every_process_naming_the_same_rank_gives_that_ranks_node_and_its_own_report(tmp_path: Path) -> None:
    # The kit gathers each rank's outcome under torchrun: all four processes name rank 3 (node 1).
    for rank in range(4):
        words = "ValueError: planted" if rank == 3 else "ValueError: planted (as rank 3 reported it)"
        failure = {"rank": 3, "kind": "error", "first_line": f"rank 3 error: {words}"}
        _write(tmp_path / "reports", rank // 2, rank, [_row("t.py::test_bad", "failed", rank, failure)])
    report = merge_reports.merge(merge_reports.find_reports([tmp_path / "reports"]))
    root = report["tests"][0]["failure"]
    assert (root["node"], root["rank"], root["process_rank"]) == (1, 3, 3)
    assert root["first_line"] == "node 1: rank 3 error: ValueError: planted"


def test_passing_rows_keep_every_rank_with_its_node_and_the_maximum_peak(tmp_path: Path) -> None:
    _job(tmp_path / "reports", planted=1)
    report = merge_reports.merge(merge_reports.find_reports([tmp_path / "reports"]))
    ok = next(row for row in report["tests"] if row["nodeid"] == "t.py::test_ok")
    assert [(r["node"], r["rank"]) for r in ok["ranks"]] == [(0, 0), (0, 1), (1, 2), (1, 3)]
    assert ok["peak_host_bytes"] == 103
    assert ok["outcome"] == "passed"
    assert report["session"]["outcome_counts"] == {"passed": 1, "failed": 1, "skipped": 0, "error": 0}


def test_a_rank_without_a_report_is_named_missing(tmp_path: Path) -> None:
    _job(tmp_path / "reports", planted=3, ranks=range(1, 4))
    report = merge_reports.merge(merge_reports.find_reports([tmp_path / "reports"]))
    assert report["session"]["missing_ranks"] == [0]
    assert report["session"]["nodes"] == [0, 1]


def test_cli_writes_json_and_markdown_and_rejects_bad_input(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from ci.__main__ import main

    _job(tmp_path / "reports", planted=2)
    assert main(["merge-reports", str(tmp_path / "out"), str(tmp_path / "reports")]) == 0
    markdown = (tmp_path / "out" / "kit-report.md").read_text()
    assert "root cause node 1, rank 2, oom" in markdown
    assert json.loads((tmp_path / "out" / "kit-report.json").read_text())["tests"]
    assert "node 1: rank 2 oom" in capsys.readouterr().out
    assert main(["merge-reports", str(tmp_path / "out2"), str(tmp_path / "nowhere")]) == 2
    assert "is not a directory" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert main(["merge-reports", str(tmp_path / "out3"), str(tmp_path / "empty")]) == 2
    assert "no kit-report.json" in capsys.readouterr().err
