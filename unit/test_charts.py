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

from ci.jobs import ROOT
from megatron_testkit import skips
from megatron_testkit.charts import bars, memory_charts_markdown, mermaid, write_png

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


# ---- a report is untrusted input -----------------------------------------------------------------

BREAKOUT = 'functional/test_x.py::test_a"]\n```\n<img src=x onerror=alert(1)>\n`x`\x1b[2J\n```mermaid'


def test_a_node_id_cannot_leave_the_mermaid_block_or_its_code_span(tmp_path: Path) -> None:
    report = {"version": 1, "session": {}, "tests": [row(BREAKOUT, 2, 900 * MiB, 768 * MiB)]}
    path = tmp_path / "kit-report.json"
    path.write_text(json.dumps(report))
    text = memory_charts_markdown(path)
    lines = text.splitlines()
    # Exactly one fenced block, opened and closed by the chart itself.
    assert [line for line in lines if line.startswith("```")] == ["```mermaid", "```"]
    axis = next(line for line in lines if line.startswith("    x-axis"))
    assert axis.count('"') == 2, axis  # the label's own quotes only
    over = next(line for line in lines if line.startswith("Over budget: "))
    assert over.count("`") == 2 and "\\n" in over and "\\x1b" in over, over
    assert all(ch.isprintable() for line in lines for ch in line)
    assert "\n<img" not in text


MALFORMED = {
    "not JSON": "{ nope",
    "a list": "[1, 2]",
    "tests of another type": '{"version": 1, "session": {}, "tests": {"a": 1}}',
    "a row that is a number": '{"version": 1, "session": {}, "tests": [1]}',
    "a peak as text": '{"version": 1, "tests": [{"nodeid": "t.py::a", "outcome": "passed", "world_size": 2, "peak_host_bytes": "9"}]}',
    "world size as text": '{"version": 1, "tests": [{"nodeid": "t.py::a", "outcome": "passed", "world_size": "2"}]}',
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_a_malformed_report_is_one_line_exit_2_never_a_traceback(
    case: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from megatron_testkit.charts import main

    path = tmp_path / "kit-report.json"
    path.write_text(MALFORMED[case])
    assert main([str(path)], prog="python -m ci") == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and err.startswith("python -m ci: error: chart: "), err
    assert main([str(path)]) == 2  # as shipped: the kit's command line names itself
    assert capsys.readouterr().err.startswith("python -m megatron_testkit: error: chart: ")
    # The job summary's reader says so in one line too, and the PNG writer does not raise.
    assert memory_charts_markdown(path).startswith("Memory chart: none, the report is unusable (")
    assert write_png(path, tmp_path / "kit-memory.png").startswith("memory chart: the report is unusable")
    # Through `python -m ci chart`: the same one line, exit 2.
    result = subprocess.run(
        [sys.executable, "-m", "ci", "chart", str(path)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert "Traceback" not in result.stderr, result.stderr
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr


# ---- each rank, over time, and metric series against golden values ------------------------------


def ranked(
    nodeid: str, peaks: list[int], budget: int | None, memory: list[dict] | None = None
) -> dict[str, Any]:
    """A version-4 row: per-rank peaks, and one launch with each rank's memory over time."""
    return row(
        nodeid,
        len(peaks),
        max(peaks),
        budget,
        ranks=[{"rank": r, "peak_host_bytes": p} for r, p in enumerate(peaks)],
        launches=[{"world_size": len(peaks), "backend": "gloo", "seed": 1, "memory": memory}],
    )


def test_the_rank_chart_has_a_bar_per_rank_for_tests_with_and_without_a_budget() -> None:
    from megatron_testkit.charts import mermaid_ranks

    report = {
        "tests": [
            ranked("t.py::test_a", [100 * MiB, 300 * MiB], 512 * MiB),
            ranked("t.py::test_b", [50 * MiB, 60 * MiB], None),
        ]
    }
    lines = mermaid_ranks(report, "host").splitlines()
    assert lines[2] == '    title "Peak host RSS of each rank, MiB"'
    assert lines[3] == '    x-axis ["test_a r0", "test_a r1", "test_b r0", "test_b r1"]'
    assert lines[5] == "    bar [100, 300, 50, 60]"
    assert not any(line.strip().startswith("line") for line in lines)  # no budget line to leave gaps in
    assert mermaid_ranks(report, "device") is None  # nothing measured on the device


def test_a_summary_of_a_hundred_tests_stays_readable(tmp_path: Path) -> None:
    # 100 two-rank tests with budgets: test_i peaks at i MiB per rank against a 200 MiB budget.
    tests = [ranked(f"t.py::test_{i}", [i * MiB, i * MiB], 200 * MiB) for i in range(1, 101)]
    path = tmp_path / "kit-report.json"
    path.write_text(json.dumps({"version": 4, "session": {}, "tests": tests}))
    text = memory_charts_markdown(path)
    axes = [line for line in text.splitlines() if line.startswith("    x-axis [")]
    assert [axis.count('", "') + 1 for axis in axes] == [30, 40]  # the budget chart, the ranks' chart
    # The budget chart keeps the 30 closest to their budget (test_71 .. test_100), in order.
    assert axes[0].startswith('    x-axis ["test_71", "test_72"') and axes[0].endswith('"test_100"]')
    assert "70 more rank test(s) with a host budget, further under it: in the table." in text
    assert axes[1].startswith('    x-axis ["test_81 r0", "test_81 r1"')  # the 20 largest tests, 2 ranks each
    assert "80 more rank test(s) with smaller peaks" in text


def test_memory_over_time_draws_a_line_per_rank_and_a_budget_only_where_one_is_declared() -> None:
    from megatron_testkit.charts import mermaid_over_time, on_grid

    memory = [
        {"rank": 0, "t_s": [0.0, 1.0, 2.0, 3.0], "rss_bytes": [100 * MiB, 200 * MiB, 200 * MiB, 100 * MiB]},
        {"rank": 1, "t_s": [0.0, 1.0, 2.0, 3.0], "rss_bytes": [100 * MiB, 400 * MiB, 100 * MiB, 100 * MiB]},
    ]
    without = mermaid_over_time({"tests": [ranked("t.py::test_a", [200 * MiB, 400 * MiB], None, memory)]})
    assert [
        line.split(" [")[0].strip() for line in without.splitlines() if line.strip().startswith("line")
    ] == [
        "line",
        "line",
    ]  # rank 0, rank 1: no budget line
    assert 'x-axis "seconds from spawn" 0 --> 3.0' in without
    budgeted = mermaid_over_time(
        {"tests": [ranked("t.py::test_a", [200 * MiB, 400 * MiB], 512 * MiB, memory)]}
    )
    lines = [line for line in budgeted.splitlines() if line.strip().startswith("line")]
    assert len(lines) == 3 and lines[-1] == "    line [" + ", ".join(["512"] * 40) + "]"
    assert "the budget: the flat line at 512" in budgeted
    # On the grid: each step's largest sample, carried over empty steps (by hand: 4 steps over 3 s).
    assert on_grid([(0.0, 1), (1.0, 4), (2.0, 1), (3.0, 1)], 3.0, 4) == [1, 4, 1, 1]
    assert on_grid([(0.0, 5), (2.9, 7)], 3.0, 6) == [5, 5, 5, 5, 5, 7]


def test_the_png_draws_a_bar_per_rank_a_budget_only_where_declared_and_series_against_golden(
    tmp_path: Path,
) -> None:
    skips.importorskip("matplotlib", "matplotlib", "the `charts` extra is not installed")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from megatron_testkit.charts import _rank_bars_panel, metric_series, rank_bars

    report = {
        "tests": [
            ranked("tests/test_m.py::test_a", [100 * MiB, 300 * MiB], 512 * MiB),
            ranked("tests/test_m.py::test_b", [50 * MiB, 60 * MiB, 70 * MiB], None),
        ]
    }
    fig, ax = plt.subplots()
    _rank_bars_panel(ax, "host RSS", rank_bars(report, "host"))
    assert len(ax.patches) == 5  # a bar per rank
    assert len(ax.collections) == 1  # one budget segment: test_b declares none
    plt.close(fig)
    # A recorded loss beside the golden file the project committed for it.
    golden_dir = tmp_path / "tests" / "golden" / "test_m"
    golden_dir.mkdir(parents=True)
    (golden_dir / "test_a.cpu-gloo.json").write_text(
        json.dumps({"test": "tests/test_m.py::test_a", "platform": "cpu-gloo", "made_with": {},
                    "series": {"loss": {"compare": {"kind": "relative", "tolerance": 0.01, "why": "x"},
                                        "values": {"1": 2.5, "2": 2.0}}}})
    )  # fmt: skip
    metrics = {"platform": "cpu-gloo", "series": {"loss": {"compare": {"kind": "relative", "tolerance": 0.01, "why": "x"},
                                                           "values": {"1": 2.5, "2": 2.25}}}}  # fmt: skip
    report["tests"][0]["metrics"] = metrics
    (chart,) = metric_series(report, tmp_path)
    assert (chart.name, chart.recorded, chart.golden) == (
        "loss",
        [(1.0, 2.5), (2.0, 2.25)],
        [(1.0, 2.5), (2.0, 2.0)],
    )
    path = tmp_path / "kit-report.json"
    path.write_text(json.dumps({"version": 4, "session": {}, "tests": report["tests"]}))
    png = tmp_path / "kit-memory.png"
    assert write_png(path, png, root=tmp_path) == f"memory chart: {png}"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
