"""The memory chart: each rank test's peak against its per-rank budget, as Mermaid and as a PNG.

Expected values are written out by hand from the report below (MiB = bytes / 2**20).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from ci.charts import bars, memory_charts_markdown, mermaid, write_png
from ci.jobs import ROOT
from megatron_testkit import skips

pytestmark = pytest.mark.L0

MiB = 2**20


def row(nodeid: str, world: int | None, host: int | None, budget: int | None, **more: Any) -> dict[str, Any]:
    base = {
        "nodeid": nodeid,
        "world_size": world,
        "outcome": "passed",
        "peak_host_bytes": host,
        "budget_host_bytes": budget,
        "peak_device_bytes": None,
        "budget_device_bytes": None,
    }
    base.update(more)
    return base


REPORT = {
    "version": 1,
    "session": {},
    "tests": [
        row("functional/test_cp.py::test_pretrain[gloo-cpu]", 2, 1200 * MiB, 1536 * MiB),
        row('functional/test_pp.py::test_max["quoted"]', 4, 800 * MiB + MiB // 2, 768 * MiB),
        row("functional/test_l.py::test_no_budget", 2, 300 * MiB, None),
        row("unit/test_flops.py::test_pure", None, None, None),
        row(
            "functional/test_gpu.py::test_nccl",
            2,
            2048 * MiB,
            8192 * MiB,
            peak_device_bytes=3 * 1024 * MiB,
            budget_device_bytes=4 * 1024 * MiB,
        ),
    ],
}


def test_bars_chart_rank_tests_with_a_budget_and_count_the_rest() -> None:
    host, unbudgeted = bars(REPORT, "host")
    assert [(b.label, b.peak // MiB, b.budget // MiB) for b in host] == [
        ("test_pretrain[gloo-cpu]", 1200, 1536),
        ("test_max['quoted']", 800, 768),
        ("test_nccl", 2048, 8192),
    ]
    assert unbudgeted == 1  # test_no_budget; the rank-less unit test is not a rank test
    device, unbudgeted = bars(REPORT, "device")
    assert [(b.label, b.peak // MiB, b.budget // MiB) for b in device] == [("test_nccl", 3072, 4096)]
    assert unbudgeted == 0


def test_mermaid_block_is_an_xychart_with_peaks_as_bars_and_budgets_as_a_line() -> None:
    lines = mermaid(REPORT, "host").splitlines()
    assert lines[:2] == ["```mermaid", "xychart-beta"]
    assert lines[2] == '    title "Peak host RSS per rank (bars) against the budget (line), MiB"'
    assert lines[3] == '    x-axis ["test_pretrain[gloo-cpu]", "test_max[\'quoted\']", "test_nccl"]'
    # Top: 1.1 x the largest value (8192 MiB budget) = 9011.2 MiB, floored to whole bytes first.
    assert lines[4] == '    y-axis "MiB" 0 --> 9011.2'
    assert lines[5] == "    bar [1200, 800.5, 2048]"
    assert lines[6] == "    line [1536, 768, 8192]"
    assert lines[7] == "```"
    assert lines[-1] == "1 rank test(s) declare no host budget: their peaks are in the table."
    assert mermaid({"tests": [row("a::b", 2, 10, None)]}, "host") is None


def test_the_summary_section_names_what_went_over_budget(tmp_path: Path) -> None:
    path = tmp_path / "kit-report.json"
    path.write_text(json.dumps(REPORT))
    text = memory_charts_markdown(path)
    assert text.startswith("### Peak memory per rank against its budget\n\n```mermaid\n")
    assert text.count("xychart-beta") == 2  # host and device
    assert text.rstrip().endswith('Over budget: `functional/test_pp.py::test_max["quoted"]` (host)')
    assert memory_charts_markdown(tmp_path / "absent.json") == ""


def test_the_png_is_drawn_with_matplotlib(tmp_path: Path) -> None:
    skips.importorskip("matplotlib", "matplotlib", "the `charts` extra is not installed")
    path = tmp_path / "kit-report.json"
    path.write_text(json.dumps(REPORT))
    png = tmp_path / "kit-memory.png"
    assert write_png(path, png) == f"memory chart: {png}"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_without_matplotlib_the_png_is_skipped_with_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "kit-report.json"
    path.write_text(json.dumps(REPORT))
    png = tmp_path / "kit-memory.png"
    # Without matplotlib (an optional dependency): one line, no file, no exception.
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    line = write_png(path, png)
    assert line.startswith("memory chart: matplotlib is not installed, PNG skipped") and "\n" not in line
    assert not png.exists()


def test_python_m_ci_chart_prints_the_chart(tmp_path: Path) -> None:
    path = tmp_path / "kit-report.json"
    path.write_text(json.dumps(REPORT))
    result = subprocess.run(
        [sys.executable, "-m", "ci", "chart", str(path)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert "xychart-beta" in result.stdout and result.stdout.rstrip().splitlines()[-1].startswith(
        "memory chart:"
    )
    missing = subprocess.run(
        [sys.executable, "-m", "ci", "chart", str(tmp_path / "nope.json")],
        capture_output=True, text=True, cwd=ROOT, timeout=120,
    )  # fmt: skip
    assert missing.returncode == 2 and "no report at" in missing.stderr and missing.stdout == ""
