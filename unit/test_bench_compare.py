"""`ci.bench_compare` (what `python -m ci bench --compare` prints): run against run, by ratios measured within each run."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from ci import bench, bench_compare
from ci.cli import main

ROOT = Path(__file__).resolve().parent.parent


def _run(path: Path, when: str, medians: dict[tuple[str, str, str], float]) -> Path:
    benchmarks = [
        {"group": group, "name": name, "stats": {"median": median}, "extra_info": {"role": role}}
        for (group, name, role), median in medians.items()
    ]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"datetime": when, "benchmarks": benchmarks}))
    return path


@pytest.mark.L0
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


def _recorded_run(path: Path, when: str, recorded: object, group: str = "acc") -> Path:
    """A run of one benchmark that timed its variants round by round and recorded their ratios."""
    bench = {
        "group": group,
        "name": "test_step[8]",
        "stats": {"median": 1.0},
        "extra_info": {"ratios": recorded},
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"datetime": when, "benchmarks": [bench]}))
    return path


@pytest.mark.L0
def test_ratios_a_benchmark_recorded_are_compared_like_group_ratios(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    store = tmp_path / "store"
    first = _recorded_run(store / "1.json", "2026-01-01", {"host / loop": 1.3, "loader / loop": 0.8})
    assert bench_compare.ratios(bench_compare.load(first)) == {
        "acc: host / loop": 1.3,
        "acc: loader / loop": 0.8,
    }
    # Within the tolerance: same; the host ratio 40% up: regressed, named by group and ratio.
    _recorded_run(store / "2.json", "2026-01-02", {"host / loop": 1.4, "loader / loop": 0.8})
    assert bench_compare.report(store / "2.json", store) == 0
    capsys.readouterr()
    _recorded_run(store / "3.json", "2026-01-03", {"host / loop": 1.96, "loader / loop": 0.8})
    assert bench_compare.report(store / "3.json", store) == 1
    out = capsys.readouterr().out
    assert "acc: host / loop" in out and "1.400      1.960  regressed" in out
    # What a person reads leaves the ratios to the table.
    assert bench_compare.figures(bench_compare.load(first)) == []


@pytest.mark.L0
@pytest.mark.parametrize(
    "recorded",
    [[1.3], {"host / loop": "fast"}, {"host / loop": 0}, {"host / loop": -1.0}, {"host / loop": True}],
)
def test_a_recorded_ratio_that_is_not_a_positive_number_is_an_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], recorded: object
) -> None:
    bad = _recorded_run(tmp_path / "bad.json", "2026-01-01", recorded)
    assert bench_compare.report(bad) == 2
    assert "test_step[8]" in capsys.readouterr().err


@pytest.mark.L0
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


@pytest.mark.L0
def test_two_baselines_in_a_group_and_foreign_json_are_errors(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = _run(tmp_path / "b.json", "x", {("g", "a", "baseline"): 1.0, ("g", "b", "baseline"): 2.0})
    assert bench_compare.report(bad) == 2
    assert "2 baselines" in capsys.readouterr().err
    (tmp_path / "c.json").write_text("{}")
    assert bench_compare.report(tmp_path / "c.json") == 2


@pytest.mark.L0
def test_a_directory_with_only_the_run_itself_is_no_baseline(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    only = _run(
        tmp_path / "store" / "1.json",
        "2026-01-01",
        {("g", "ours", "subject"): 1.0, ("g", "loop", "baseline"): 4.0},
    )
    assert bench_compare.report(only, only.parent) == 2
    assert "no pytest-benchmark JSON files under it besides 1.json" in capsys.readouterr().err
    # Without a baseline the run's own ratios are printed, every one of them new.
    assert bench_compare.report(only) == 0
    out = capsys.readouterr().out
    assert "no baseline run to compare with" in out and "g: ours / loop" in out and "0.250  new" in out


@pytest.mark.L0
def test_bench_refuses_a_missing_baseline_before_running_anything(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    saved = tmp_path / "run.json"
    assert main(["bench", "--compare", str(tmp_path / "nope.json"), "--json", str(saved)]) == 2
    out, err = capsys.readouterr()
    assert err == f"python -m ci bench: error: no baseline at {tmp_path / 'nope.json'}\n" and out == ""
    assert not saved.exists()


@pytest.mark.L0
def test_bench_run_prints_a_saved_runs_figures_and_compares_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    store = tmp_path / "store"
    _run(store / "1.json", "2026-01-01", {("g", "ours", "subject"): 1.0, ("g", "loop", "baseline"): 4.0})
    new = _run(
        store / "2.json", "2026-01-02", {("g", "ours", "subject"): 3.0, ("g", "loop", "baseline"): 4.0}
    )
    data = json.loads(new.read_text())
    data["benchmarks"][0]["extra_info"]["startup_median_s"] = 1.23456
    new.write_text(json.dumps(data))
    assert main(["bench", "--run", str(new), "--compare", str(store), "--tolerance", "2.5"]) == 0
    out = capsys.readouterr().out
    assert "  ours: startup_median_s=1.235" in out and "same" in out  # 0.75 vs 0.25: within 250%
    assert main(["bench", "--run", str(new), "--compare", str(store)]) == 1
    assert "regressed" in capsys.readouterr().out
    assert main(["bench", "--run", str(new), "-k", "inspect"]) == 2
    assert "--run compares a saved run" in capsys.readouterr().err
    assert main(["bench", "--run", str(tmp_path / "nope.json")]) == 2
    assert capsys.readouterr().err == f"python -m ci bench: error: no saved run at {tmp_path / 'nope.json'}\n"


@pytest.mark.L0
def test_bench_passes_what_it_does_not_know_to_pytest_on_every_benchmark(tmp_path: Path) -> None:
    command = bench.pytest_command(tmp_path / "run.json", ["-k", "inspect", "--benchmark-min-rounds=10"])
    assert command[1:4] == ["-m", "pytest", "ci/benchmarks"]
    assert f"--benchmark-json={tmp_path / 'run.json'}" in command
    assert command[-3:] == ["-k", "inspect", "--benchmark-min-rounds=10"]


@pytest.mark.L1
def test_python_m_ci_bench_runs_saves_prints_figures_and_fails_on_a_regression(tmp_path: Path) -> None:
    """The launcher's no-op pair, one round, against a baseline whose ratio no run can match."""
    group = "launch-noop-2ranks"
    baseline = _recorded_run(
        tmp_path / "baseline.json", "2026-01-01", {"run_ranks / torch_spawn": 1e-6}, group
    )
    saved = tmp_path / "run.json"
    result = subprocess.run(
        [sys.executable, "-m", "ci", "bench", "--compare", str(baseline), "--json", str(saved), "-k", "noop"],
        cwd=ROOT,
        env={**os.environ, "KIT_BENCH_LAUNCH_ROUNDS": "1"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 1, result.stdout[-3000:] + result.stderr[-3000:]
    run = bench_compare.load(saved)
    assert [b["name"] for b in run["benchmarks"]] == ["test_noop"]
    key = f"{group}: run_ranks / torch_spawn"
    assert key in bench_compare.ratios(run)
    assert f"{key}      0.000" in result.stdout and "regressed" in result.stdout
    figures = [line for line in result.stdout.splitlines() if line.startswith("  noop: ")]
    assert len(figures) == 1 and "startup_median_s=" in figures[0], result.stdout  # what a person reads


@pytest.mark.L0
def test_history_the_first_night_compares_nothing_and_a_later_regression_fails_with_a_table(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The nightly row's mode: each run lands in the history and is compared with the nights before it."""
    history, md = tmp_path / "history", tmp_path / "bench-report.md"
    first = _run(
        history / "1.json", "2026-01-01", {("g", "ours", "subject"): 1.0, ("g", "loop", "baseline"): 4.0}
    )
    # The first night: nothing earlier, so nothing to compare (where --compare would be an error).
    assert main(["bench", "--run", str(first), "--history", str(history), "--markdown", str(md)]) == 0
    assert "no baseline run to compare with" in capsys.readouterr().out
    assert "| g: ours / loop | - | 0.250 | - | new |" in md.read_text()
    # Everything 1.2x slower on a busier runner, ours 1.4x: the ratio grew 17%, within the 25% threshold.
    same = _run(
        history / "2.json", "2026-01-02", {("g", "ours", "subject"): 1.4, ("g", "loop", "baseline"): 4.8}
    )
    assert main(["bench", "--run", str(same), "--history", str(history), "--markdown", str(md)]) == 0
    # A 3x slowdown of ours against the same loop: fails, the table says by how much.
    slow = _run(
        history / "3.json", "2026-01-03", {("g", "ours", "subject"): 4.5, ("g", "loop", "baseline"): 4.8}
    )
    assert main(["bench", "--run", str(slow), "--history", str(history), "--markdown", str(md)]) == 1
    out = capsys.readouterr().out
    assert "regressed" in out and "1 ratio(s) grew by more than 25%" in out
    table = md.read_text()
    assert "| g: ours / loop | 0.292 | 0.938 | +221% | regressed |" in table
    assert "**1 ratio(s) grew by more than 25%**" in table and f"baseline: {same}" in table


@pytest.mark.L0
def test_history_keeps_the_newest_runs_and_refuses_a_second_baseline(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    history = tmp_path / "history"
    paths = [
        _run(
            history / f"{day:02d}.json",
            f"2026-01-{day:02d}",
            {("g", "a", "subject"): 1.0, ("g", "b", "baseline"): 2.0},
        )
        for day in range(1, bench_compare.HISTORY_KEEP + 3)
    ]
    assert main(["bench", "--run", str(paths[-1]), "--history", str(history)]) == 0
    kept = sorted(p.name for p in history.iterdir())
    assert kept == [p.name for p in paths[-bench_compare.HISTORY_KEEP :]], "the two oldest nights are gone"
    capsys.readouterr()
    assert (
        main(["bench", "--run", str(paths[-1]), "--history", str(history), "--compare", str(paths[-2])]) == 2
    )
    assert "--compare and --history both name the baseline" in capsys.readouterr().err
    (tmp_path / "file").write_text("")
    assert main(["bench", "--run", str(paths[-1]), "--history", str(tmp_path / "file")]) == 2
    assert "is not a directory" in capsys.readouterr().err


@pytest.mark.L1
def test_the_nightly_rows_command_saves_into_the_history_and_fails_on_a_regression(tmp_path: Path) -> None:
    """`ci/test.sh bench ...` as the bench-cpu row runs it, against a planted previous night."""
    from ci.jobs import JOBS

    project = tmp_path / "project"
    (project / "ci").mkdir(parents=True)
    shutil.copy(ROOT / "ci" / "test.sh", project / "ci" / "test.sh")
    # Installing is not what is tested here: the setup step prints the interpreter to use.
    (project / "ci" / "setup.sh").write_text(f"#!/usr/bin/env bash\necho {sys.executable}\n")
    history, md = tmp_path / "history", tmp_path / "bench-report.md"
    group = "launch-noop-2ranks"
    planted = _recorded_run(
        history / "last-night.json", "2000-01-01", {"run_ranks / torch_spawn": 1e-6}, group
    )
    command = JOBS["bench-cpu"].command()
    command[command.index("--history") + 1] = str(history)
    command[command.index("--markdown") + 1] = str(md)
    result = subprocess.run(
        [*command, "-k", "noop"],
        cwd=project,
        env={**os.environ, "KIT_BENCH_LAUNCH_ROUNDS": "1", "PYTHONPATH": str(ROOT), "KIT_ALLOWED_SKIPS": ""},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 1, result.stdout[-3000:] + result.stderr[-3000:]
    tonight = [path for path in history.iterdir() if path != planted]
    assert len(tonight) == 1 and bench_compare.load(tonight[0])["benchmarks"], "the run lands in the history"
    table = md.read_text()
    assert f"| {group}: run_ranks / torch_spawn | 0.000 |" in table and "| regressed |" in table
    assert f"baseline: {planted}" in table
