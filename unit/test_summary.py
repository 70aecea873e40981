"""`python -m megatron_testkit summary`: what a CI job's summary and annotations take from its report folder.

The action's own steps run this command in `unit/test_action.py`; here its limits, in process.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megatron_testkit import cli
from unit.test_repro import entry

pytestmark = pytest.mark.L0


def _report(folder: Path, failed: int) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    tests = [entry(f"tests/test_x.py::test_{i}", "failed") for i in range(failed)]
    tests.append(entry("tests/test_x.py::test_fine"))
    session = {"markexpr": "L0", "pytest_args": ["-m", "L0"], "outcome_counts": {}}
    (folder / "kit-report.json").write_text(json.dumps({"version": 1, "session": session, "tests": tests}))
    return folder


@pytest.mark.parametrize(("failed", "shown"), [(50, 50), (51, 50), (1234, 50)])
def test_annotations_stop_at_50_then_one_line_counts_the_rest(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], failed: int, shown: int
) -> None:
    """100,000 failures printed 100,000 `::error` lines (12 MB); GitHub shows 10 a step, 50 a job."""
    assert cli.main(["summary", str(_report(tmp_path / "reports", failed)), "--annotations"]) == 0
    lines = capsys.readouterr().out.splitlines()
    errors = [line for line in lines if line.startswith("::error ")]
    assert len(errors) == shown
    assert errors[0].startswith("::error file=tests/test_x.py,title=tests/test_x.py%3A%3Atest_0%3A error::")
    assert errors[-1].startswith(
        f"::error file=tests/test_x.py,title=tests/test_x.py%3A%3Atest_{shown - 1}%3A"
    )
    rest = lines[len(errors) :]
    if failed == shown:
        assert rest == []
    else:
        assert rest == [f"and {failed - shown} more failed test(s), not annotated: see the job's kit report"]


def test_a_summary_file_linked_out_of_the_report_folder_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A job's tests write the report folder: a link in it to a file of the runner is not published."""
    reports = _report(tmp_path / "reports", 1)
    (tmp_path / "secret.md").write_text("SECRET\n")
    (reports / "bench-report.md").symlink_to(tmp_path / "secret.md")
    (reports / "own.md").write_text("own table\n")
    assert cli.main(["summary", str(reports), "--also", str(reports / "own.md")]) == 0
    assert "own table" in capsys.readouterr().out
    for also in (reports / "bench-report.md", reports / ".." / "secret.md", tmp_path / "secret.md"):
        assert cli.main(["summary", str(reports), "--also", str(also)]) == 2
        out, err = capsys.readouterr()
        assert out == "" and err == (
            f"python -m megatron_testkit summary: error: --also {also} is not a file of the report folder "
            f"{reports}\n"
        )
