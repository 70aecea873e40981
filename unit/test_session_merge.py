"""A shared ``--kit-report`` folder never loses rows: sessions merge into one report under a lock.

Two real processes write sessions into one folder at the same time (as two jobs on one runner
do); every row of every session must be in the final report. The earlier behaviour (each write
replaced the file) kept the last session only.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from megatron_testkit.report import build_report, write_report

pytestmark = pytest.mark.L0

ROOT = Path(__file__).resolve().parent.parent


def _session(name: str, outcomes: list[str], exit_status: int = 0) -> dict:
    rows = [{"nodeid": f"t_{name}.py::test_{i}", "outcome": o} for i, o in enumerate(outcomes)]
    return build_report(
        {"started": name, "host": "h", "pytest_args": [name], "exit_status": exit_status}, rows
    )


def test_a_second_session_keeps_the_first_sessions_rows(tmp_path: Path) -> None:
    write_report(_session("a", ["passed", "failed"], exit_status=1), tmp_path)
    written = write_report(_session("b", ["passed"]), tmp_path)
    assert written.sessions == 2
    report = json.loads((tmp_path / "kit-report.json").read_text())
    assert [r["nodeid"] for r in report["tests"]] == ["t_a.py::test_0", "t_a.py::test_1", "t_b.py::test_0"]
    assert report["session"]["outcome_counts"] == {"passed": 2, "failed": 1, "skipped": 0, "error": 0}
    refs = report["session"]["sessions"]
    assert [(r["started"], r["first_test"], r["tests"]) for r in refs] == [("a", 0, 2), ("b", 2, 1)]
    assert report["session"]["started"] == "b"  # the newest session's header
    assert report["session"]["exit_status"] == 1  # the most telling of the sessions'
    assert "2 sessions that shared this report folder" in (tmp_path / "kit-report.md").read_text()
    # A third session keeps both, and the ranges still name each session's rows.
    write_report(_session("c", ["skipped"]), tmp_path)
    report = json.loads((tmp_path / "kit-report.json").read_text())
    assert [(r["started"], r["first_test"], r["tests"]) for r in report["session"]["sessions"]] == [
        ("a", 0, 2),
        ("b", 2, 1),
        ("c", 3, 1),
    ]


def test_the_same_test_in_two_sessions_keeps_a_row_from_each(tmp_path: Path) -> None:
    write_report(_session("a", ["failed"]), tmp_path)
    write_report(
        build_report({"started": "b"}, [{"nodeid": "t_a.py::test_0", "outcome": "passed"}]), tmp_path
    )
    report = json.loads((tmp_path / "kit-report.json").read_text())
    assert [(r["nodeid"], r["outcome"]) for r in report["tests"]] == [
        ("t_a.py::test_0", "failed"),
        ("t_a.py::test_0", "passed"),
    ]


def test_an_earlier_report_that_cannot_be_read_is_set_aside_not_overwritten(tmp_path: Path) -> None:
    (tmp_path / "kit-report.json").write_text('{"version": 2, "tests": [NaN]}')
    written = write_report(_session("b", ["passed"]), tmp_path)
    (aside,) = tmp_path.glob("kit-report.unreadable-*.json")
    assert aside.read_text() == '{"version": 2, "tests": [NaN]}'
    assert len(written.notes) == 1 and str(aside) in written.notes[0] and "NaN" in written.notes[0]
    assert [r["nodeid"] for r in json.loads((tmp_path / "kit-report.json").read_text())["tests"]] == [
        "t_b.py::test_0"
    ]


def test_a_report_file_that_is_a_link_is_refused_and_its_target_untouched(tmp_path: Path) -> None:
    from megatron_testkit.safe_write import WriteRefused

    target = tmp_path / "elsewhere.json"
    target.write_text("mine")
    (tmp_path / "reports").mkdir()
    (tmp_path / "reports" / "kit-report.json").symlink_to(target)
    with pytest.raises(WriteRefused, match=r"kit-report\.json is a link"):
        write_report(_session("a", ["passed"]), tmp_path / "reports")
    assert target.read_text() == "mine"


WRITER = textwrap.dedent(
    """
    import sys
    from megatron_testkit.report import build_report, write_report

    name, folder = sys.argv[1], sys.argv[2]
    for i in range(15):
        rows = [{"nodeid": f"{name}.py::test_{i}_{j}", "outcome": "passed"} for j in range(3)]
        write_report(build_report({"started": f"{name}{i}"}, rows), folder)
    """
)


def test_two_processes_writing_one_folder_at_once_keep_every_row(tmp_path: Path) -> None:
    procs = [
        subprocess.Popen([sys.executable, "-c", WRITER, name, str(tmp_path)], cwd=ROOT)
        for name in ("first", "second")
    ]
    assert [p.wait(timeout=300) for p in procs] == [0, 0]
    report = json.loads((tmp_path / "kit-report.json").read_text())
    ids = [r["nodeid"] for r in report["tests"]]
    want = {f"{name}.py::test_{i}_{j}" for name in ("first", "second") for i in range(15) for j in range(3)}
    assert len(ids) == 90 and set(ids) == want
    assert len(report["session"]["sessions"]) == 30
    assert not list(tmp_path.glob("*.tmp"))


def test_a_session_says_how_many_earlier_sessions_it_merged_in_the_singular(tmp_path: Path) -> None:
    """It said "with 1 earlier session(s) of the folder"; two real sessions into one folder."""
    from fixtures.inner_session import inner_env

    (tmp_path / "test_one.py").write_text("def test_one():\n    pass\n")
    command = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--kit-report=reports", "test_one.py"]  # fmt: skip
    outputs = []
    for _ in range(2):
        run = subprocess.run(
            command, cwd=tmp_path, env=inner_env(), capture_output=True, text=True, timeout=300
        )
        outputs.append(run.stdout)
    assert "earlier session" not in outputs[0], outputs[0][-2000:]
    assert " (with 1 earlier session of the folder, every row kept; " in outputs[1], outputs[1][-2000:]
