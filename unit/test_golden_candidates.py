"""The first run on a platform says which golden files are missing and the command that makes them.

A real inner session on CI (``CI=true``) fails a test that records metrics without a golden file;
its report then lists that test as a candidate, with the file it belongs in, in the job summary.
The printed command is run as printed and writes the file; after it nothing is missing.
"""

from __future__ import annotations

import shlex
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from ci.jobs import JOBS, summary_markdown
from fixtures.inner_session import inner_env, run_inner_session
from megatron_testkit.golden_candidates import UPDATE_COMMAND, missing_golden_files, missing_golden_markdown

pytestmark = pytest.mark.L0

INNER = textwrap.dedent(
    """
    import pytest
    from megatron_testkit import metrics

    @pytest.mark.L0
    def test_records(kit_metrics):
        kit_metrics.record_steps("loss", [2.5, 2.25], metrics.relative(1e-4, "test tolerance"))

    @pytest.mark.L0
    def test_records_and_fails_otherwise(kit_metrics):
        kit_metrics.record_steps("tokens", [64])
        assert False, "another failure: golden update leaves this test out"

    @pytest.mark.L0
    def test_records_nothing():
        pass
    """
)


def test_a_ci_run_without_golden_files_lists_the_candidates_and_the_command_that_makes_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CI", "true")
    monkeypatch.setenv("KIT_GOLDEN_PLATFORM", "h200-nccl")  # as the first GPU job names its platform
    result = run_inner_session(tmp_path, "test_inner.py", INNER)
    assert result["rc"] == 1 and result["rows"]["test_records"]["failure"]["kind"] == "golden"
    reports = result["dir"]
    found = missing_golden_files(reports, tmp_path)
    assert [(c.nodeid, c.platform, str(c.path)) for c in found] == [
        ("test_inner.py::test_records", "h200-nccl", "golden/test_inner/test_records.h200-nccl.json")
    ]
    text = missing_golden_markdown(reports, tmp_path, artifact="kit-reports-L0-gpu")
    assert text.startswith("## Golden files to make")
    assert "test_inner.py::test_records\n  -> golden/test_inner/test_records.h200-nccl.json" in text
    assert "download the `kit-reports-L0-gpu` artifact" in text
    command = f"{UPDATE_COMMAND} kit-report.json"
    assert f"`{command}`" in text
    # The command as printed (with the report's path), in the project root, writes the file.
    argv = [sys.executable if word == "python" else word for word in shlex.split(command)]
    argv[-1] = str(reports / "kit-report.json")
    env = {k: v for k, v in inner_env().items() if k != "KIT_GOLDEN_PLATFORM"}
    done = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert (tmp_path / "golden/test_inner/test_records.h200-nccl.json").is_file()
    assert missing_golden_files(reports, tmp_path) == [] and missing_golden_markdown(reports, tmp_path) == ""


def test_the_job_summary_carries_the_section_and_a_run_with_nothing_missing_has_none(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CI", "true")
    monkeypatch.setenv("KIT_GOLDEN_PLATFORM", "h200-nccl")
    reports = run_inner_session(tmp_path, "test_inner.py", INNER)["dir"]
    # The repository's job summary looks for the files under the repository root.
    assert "## Golden files to make" in summary_markdown(JOBS["L0-gpu"], reports)
    empty = tmp_path / "empty"
    empty.mkdir()
    assert missing_golden_markdown(empty) == ""  # no report: nothing to say
    (empty / "kit-report.json").write_text("{not json")
    assert missing_golden_markdown(empty) == ""  # an unreadable report says nothing, never raises
