"""`megatron_testkit.torchrun_merge` (`merge-reports`): per-rank torchrun reports merged into one, failures named by node and rank."""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from ci.jobs import ROOT
from megatron_testkit import torchrun_merge

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
    report = torchrun_merge.merge(torchrun_merge.find_reports([tmp_path / "reports"]))
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
    report = torchrun_merge.merge(torchrun_merge.find_reports([tmp_path / "reports"]))
    root = report["tests"][0]["failure"]
    assert (root["node"], root["rank"], root["process_rank"]) == (1, 3, 3)
    assert root["first_line"] == "node 1: rank 3 error: ValueError: planted"


def test_passing_rows_keep_every_rank_with_its_node_and_the_maximum_peak(tmp_path: Path) -> None:
    _job(tmp_path / "reports", planted=1)
    report = torchrun_merge.merge(torchrun_merge.find_reports([tmp_path / "reports"]))
    ok = next(row for row in report["tests"] if row["nodeid"] == "t.py::test_ok")
    assert [(r["node"], r["rank"]) for r in ok["ranks"]] == [(0, 0), (0, 1), (1, 2), (1, 3)]
    assert ok["peak_host_bytes"] == 103
    assert ok["outcome"] == "passed"
    assert report["session"]["outcome_counts"] == {"passed": 1, "failed": 1, "skipped": 0, "error": 0}


def test_a_rank_without_a_report_is_named_missing(tmp_path: Path) -> None:
    _job(tmp_path / "reports", planted=3, ranks=range(1, 4))
    report = torchrun_merge.merge(torchrun_merge.find_reports([tmp_path / "reports"]))
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


# ---- a report is untrusted input -----------------------------------------------------------------


def _merge_in(memory: int, out: Path, reports: Path) -> subprocess.CompletedProcess[str]:
    """`python -m ci merge-reports` under an address-space limit (a MemoryError past it)."""

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (memory, memory))

    return subprocess.run(
        [sys.executable, "-m", "ci", "merge-reports", str(out), str(reports)],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, preexec_fn=limit,
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("change", "says"),
    [
        # One world size of 10^7 made a 1.3 GB merge and a 238 MB file of "missing" ranks.
        ({"world_size": 10**7}, "tests[0].world_size is not an integer in [0, 65536]"),
        ({"world_size": "4"}, "tests[0].world_size is not an integer"),
        ({"ranks": [{"rank": 10**9}]}, "tests[0].ranks[0].rank is not an integer in [0, 65535]"),
        ({"duration_s": [1]}, "tests[0].duration_s is not a finite number"),
        ({"failure": {"rank": 0, "first_line": ["x"]}}, "tests[0].failure.first_line is not text"),
        ({"outcome": {"worst": True}}, "tests[0].outcome is not text"),
    ],
    ids=[
        "world_size 10^7",
        "world_size text",
        "rank 10^9",
        "duration list",
        "first line list",
        "outcome object",
    ],
)
def test_a_source_outside_the_schema_or_its_bounds_is_one_line_exit_2_in_bounded_memory(
    tmp_path: Path, change: dict[str, Any], says: str
) -> None:
    _job(tmp_path / "reports", planted=2)
    path = tmp_path / "reports" / "node1" / "rank3" / "kit-report.json"
    report = json.loads(path.read_text())
    report["tests"][0].update(change)
    path.write_text(json.dumps(report))
    result = _merge_in(1 << 30, tmp_path / "out", tmp_path / "reports")  # the interpreter needs ~100 MiB
    assert result.returncode == 2 and result.stdout == "", result.stderr[-2000:]
    assert result.stderr.count("\n") == 1 and says in result.stderr, result.stderr
    assert str(path) in result.stderr and not (tmp_path / "out").exists()


def test_text_from_the_reports_is_printed_and_written_escaped(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    hostile = "rank 0 oom: MemoryError: \x1b[2J\x1b]0;pwned\x07\n| `x` |"
    for rank in range(2):
        failure = {"rank": 0, "kind": "oom\x1b[8m", "first_line": hostile}
        _write(tmp_path / "reports", 0, rank, [_row("t.py::test_`bad`\x1b[1m", "failed", rank, failure)])
    assert torchrun_merge.main([str(tmp_path / "out"), str(tmp_path / "reports")]) == 0
    out = capsys.readouterr().out
    markdown = (tmp_path / "out" / "kit-report.md").read_text()
    failures = markdown[markdown.index("### Failures by node and rank") :]
    for text in (out, failures):
        assert all(ch.isprintable() for line in text.splitlines() for ch in line), text
        assert "\\x1b[2J" in text
    assert "- `t.py::test_'bad'\\x1b[1m`: root cause node 0" in failures


@pytest.mark.parametrize("linked", ["kit-report.json", "kit-report.md"])
def test_merging_onto_a_link_is_a_one_line_refusal_the_target_untouched_and_neither_file_written(
    linked: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A link at either name refuses the merge before anything is written: the markdown's link
    was refused only after the JSON had been written, leaving half a pair."""
    runs, out = tmp_path / "runs", tmp_path / "out"
    _write(runs, 0, 0, [_row("t.py::a", "passed", 0)])
    target = tmp_path / "mine"
    target.write_text("a user's file")
    out.mkdir()
    (out / linked).symlink_to(target)
    assert torchrun_merge.main([str(out), str(runs)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{linked} is a link" in err, err
    assert target.read_text() == "a user's file"
    assert sorted(p.name for p in out.iterdir()) == [linked], "half a pair was written"


def test_no_control_character_from_the_reports_reaches_any_line_of_the_markdown(tmp_path: Path) -> None:
    """The table, the session line and the failure lines alike (only the failures section was
    escaped: a node id's terminal escape reached the table, and through `summary`, the CI log)."""
    hostile = "t.py::x\x1b]0;pwn\x07"
    for rank in range(2):
        failure = {"rank": 0, "kind": "oom", "first_line": "rank 0 oom: \x1b[2J"}
        _write(tmp_path / "reports", 0, rank, [_row(hostile, "failed", rank, failure)])
    assert torchrun_merge.main([str(tmp_path / "out"), str(tmp_path / "reports")]) == 0
    markdown = (tmp_path / "out" / "kit-report.md").read_text()
    assert all(ch.isprintable() for line in markdown.splitlines() for ch in line), markdown
    assert "t.py::x\\x1b]0;pwn\\x07" in markdown


def _merge_steps(tests: int, processes: int = 2) -> int:
    """The Python lines `merge` runs in torchrun_merge.py itself for `processes` reports of `tests` tests."""
    sources = [
        torchrun_merge.Source(
            rank // 2,
            rank,
            Path(f"node{rank // 2}/rank{rank}/kit-report.json"),
            {
                "session": {"host": "h"},
                "tests": [_row(f"t.py::test_{i}", "passed", rank) for i in range(tests)],
            },
        )
        for rank in range(processes)
    ]
    steps = 0

    def trace(frame, event, arg):
        nonlocal steps
        if frame.f_code.co_filename != torchrun_merge.__file__:
            return None  # the schema's and the report's own work is not the merge's
        steps += event == "line"
        return trace

    sys.settrace(trace)
    try:
        report = torchrun_merge.merge(sources)
    finally:
        sys.settrace(None)
    assert len(report["tests"]) == tests and all(row["world_size"] == 4 for row in report["tests"])
    return steps


def test_the_merge_is_linear_in_tests_times_process_reports() -> None:
    # Counted in Python line events, not timed: twice the tests take twice the merge's own steps.
    # A merge that scanned every process' tests for each test took four times as many (2 x 100,000
    # tests did not finish in 9 minutes). python -m ci bench -k merge prints the times.
    small, large = _merge_steps(300), _merge_steps(600)
    assert large < 2.2 * small, (small, large)


def test_the_size_caps_are_checked_before_any_report_is_parsed(tmp_path: Path) -> None:
    """A set over the total cap was parsed report by report first (262 MB read for 145 s before the
    refusal). Sparse files give the sizes without writing them: no report is ever read here, so
    the first one's unreadable content must not be what is reported."""
    per_file = torchrun_merge.MAX_TOTAL_BYTES // 8 - 1  # nine of these pass the total cap
    for node in range(9):
        folder = tmp_path / "reports" / f"node{node}"
        folder.mkdir(parents=True)
        with open(folder / "kit-report.json", "wb") as f:
            f.truncate(per_file)  # zeros: no valid report, but never parsed
    with pytest.raises(ValueError, match=r"bytes under .*: not one job's reports"):
        torchrun_merge.find_reports([tmp_path / "reports"])
