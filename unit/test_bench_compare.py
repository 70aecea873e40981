"""`ci.bench_compare` (what `python -m ci bench --compare` prints): run against run, by ratios measured within each run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ci import bench_compare

pytestmark = pytest.mark.L0


def _run(path: Path, when: str, medians: dict[tuple[str, str, str], float]) -> Path:
    benchmarks = [
        {"group": group, "name": name, "stats": {"median": median}, "extra_info": {"role": role}}
        for (group, name, role), median in medians.items()
    ]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"datetime": when, "benchmarks": benchmarks}))
    return path


def test_ratios_are_subject_over_baseline_within_a_group(tmp_path: Path) -> None:
    run = _run(
        tmp_path / "a.json",
        "2026-01-01",
        {
            ("g", "test_ours", "subject"): 2.0,
            ("g", "test_loop", "baseline"): 8.0,
            ("h", "test_x", "subject"): 1.0,
        },
    )
    # Group h has no baseline (a partial run): it gives no ratio rather than a wrong one.
    assert bench_compare.ratios(bench_compare.load(run)) == {"g: ours / loop": 0.25}


def test_a_machine_twice_as_slow_is_no_regression_but_a_relative_slowdown_is(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    store = tmp_path / "store"
    _run(store / "1.json", "2026-01-01", {("g", "ours", "subject"): 1.0, ("g", "loop", "baseline"): 4.0})
    # Everything twice as slow (a busier machine): the ratio is the same.
    _run(store / "2.json", "2026-01-02", {("g", "ours", "subject"): 2.0, ("g", "loop", "baseline"): 8.0})
    assert bench_compare.report(store / "2.json", store) == 0
    assert "same" in capsys.readouterr().out
    # Ours 50% slower against the same loop: regressed.
    _run(store / "3.json", "2026-01-03", {("g", "ours", "subject"): 3.0, ("g", "loop", "baseline"): 8.0})
    # Against the directory: each ratio from the newest other run that measured it (run 2's 0.25).
    assert bench_compare.report(store / "3.json", store) == 1
    out = capsys.readouterr().out
    assert "regressed" in out and "0.250" in out and "0.375" in out


def test_two_baselines_in_a_group_and_foreign_json_are_errors(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = _run(tmp_path / "b.json", "x", {("g", "a", "baseline"): 1.0, ("g", "b", "baseline"): 2.0})
    assert bench_compare.report(bad) == 2
    assert "2 baselines" in capsys.readouterr().err
    (tmp_path / "c.json").write_text("{}")
    assert bench_compare.report(tmp_path / "c.json") == 2
