"""docs/megatron-on-cpu.md's PP=2 example runs as written: the page's `tests/test_pp2.py` block,
as a project's own test file, in a pytest session of its own (two gloo ranks, megatron-core's 1F1B
schedule, the loss falling after one step, and the in-place division the page warns about)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from fixtures.inner_session import WITHOUT_HYPOTHESIS, inner_env

pytestmark = pytest.mark.L1  # two megatron-core ranks through a pipeline schedule: about a minute

REPO = Path(__file__).resolve().parent.parent


def _python_block(path: Path, after: str) -> str:
    """The first ```python block of `path` that follows the line containing `after`."""
    text = path.read_text()
    start = text.index("```python\n", text.index(after)) + len("```python\n")
    return text[start : text.index("\n```", start)] + "\n"


def test_the_pipeline_parallel_example_of_the_docs_runs_and_passes(tmp_path: Path) -> None:
    source = _python_block(REPO / "docs" / "megatron-on-cpu.md", "`tests/test_pp2.py`:")
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_pp2.py").write_text(source)
    (tmp_path / "pyproject.toml").write_text('[tool.pytest.ini_options]\ntestpaths = ["tests"]\n')
    env = inner_env()
    env.pop("PYTEST_XDIST_WORKER", None)
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *WITHOUT_HYPOTHESIS, "--kit-report=reports"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    assert "1 passed" in result.stdout
    # The example's own assertions ran (not a collection of nothing): its row in the kit report.
    assert "tests/test_pp2.py::test_pp2_gpt_trains_one_step_on_cpu  2      gloo" in result.stdout
