"""`python -m ci l0-bench --against`: its arguments, its table of where the time goes, its profile plugin.

The two L0 runs themselves take minutes (the nightly and a person run them); here the parts around
them run for real: the breakdown of a recorded report (rows of a real full run's kit report,
trimmed to the fields read) with child-process records whose figures are chosen so that every sum
below is worked out by hand, the previous commit's worktree in a real git repository, and the
plugin in a real pytest session.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from ci import l0_compare, l0_profile
from ci.l0_bench import main

pytestmark = pytest.mark.L0
pytest_plugins = ["pytester"]

DATA = Path(__file__).parent / "data" / "l0_bench"


def test_a_ref_that_is_no_commit_is_one_line_and_exit_2_before_anything_runs(capsys, tmp_path):
    assert main(["--against", "no-such-ref-for-l0-bench", "--reports", str(tmp_path)]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1
    assert "--against 'no-such-ref-for-l0-bench' is not a commit" in err
    assert list(tmp_path.iterdir()) == []


def test_the_breakdown_of_a_recorded_report_splits_the_test_time_by_what_it_went_to():
    report = json.loads((DATA / "kit-report.json").read_text())
    records = l0_compare.read_profile(DATA)
    b = l0_compare.breakdown(report, records)
    # Test time: 26.8319 + 1.2591 + 18.5223 + 8.9675 (the four rows' duration_s).
    assert b["tests"] == 4 and b["test_s"] == 55.6
    # pp2 launched 21.559 + 5.084 s, dp2xpp2 9.523 + 8.975 s; their ranks started in 6.324 + 0.58
    # + 1.004 + 1.136 s; one launch went cold (the warm parent was still starting).
    assert (b["launches"], b["launch_s"], b["launch_setup_s"]) == (4, 45.1, 9.0)
    assert b["start_modes"] == {"cold": 1, "warm": 3}
    # Two nested sessions of 3 s; the `python -c` inside the second one is the session's time.
    assert (b["nested_n"], b["nested_s"]) == (2, 6.0)
    # Two CLI runs of 0.4 s; the `sh` beside them counts only where no CLI ran (200.4-200.5).
    assert (b["cli_n"], b["cli_s"], b["other_n"], b["other_s"]) == (2, 0.8, 3, 0.1)
    # The rest: 0.1889 (pp2) + 0.0243 (dp2xpp2) + 8.9675 - 6 + 1.2591 - 0.9.
    assert b["rest_s"] == 3.5
    assert b["outside_tests_s"] == 2.0  # the git run at collection, in no test


def test_the_table_sets_both_sides_side_by_side_with_the_wall_ratio():
    b = l0_compare.breakdown(
        json.loads((DATA / "kit-report.json").read_text()), l0_compare.read_profile(DATA)
    )
    side = {"cpu_s": 900.0, "outcome_counts": {"passed": 4}, "breakdown": b, "returncode": 0}
    previous = {**side, "wall_s": 600.0, "commit": "52ef968" + "0" * 33, "ref": "HEAD~"}
    this = {**side, "wall_s": 300.0, "commit": "1" * 40, "ref": "this tree"}
    lines = l0_compare.table(previous, this)
    assert lines[0].split() == ["previous", "52ef968000", "this", "tree"]
    assert lines[1].split() == ["wall", "600.0", "s", "300.0", "s"]
    nested = next(line for line in lines if line.strip().startswith("nested pytest sessions"))
    assert nested.split("n")[-1].split() == ["6.0", "s", "(11%),", "2", "6.0", "s", "(11%),", "2"]  # 6 / 55.6
    modes = next(line for line in lines if "start modes" in line)
    assert modes.count("1 cold, 3 warm") == 2
    assert "wall this / previous: 0.50 (goal: at most 0.5)" in lines
    # A side whose report could not be read shows dashes and says why.
    broken = {**previous, "breakdown": {"error": "kit report reports/kit-report.json: missing"}}
    lines = l0_compare.table(broken, this)
    assert next(line for line in lines if "the rest" in line).split()[2] == "-"
    assert "HEAD~: no breakdown: kit report reports/kit-report.json: missing" in lines


@pytest.mark.parametrize(
    ("argv", "kind"),
    [
        ([sys.executable, "-m", "pytest", "-q", "test_inner.py"], "nested"),
        ([sys.executable, "-mpytest", "--basetemp=x"], "nested"),  # pytester's runpytest_subprocess
        (["bash", "ci/test.sh", "L0"], "nested"),
        ([sys.executable, "-m", "accounting", "flops"], "cli"),
        ([sys.executable, "-m", "ci.gpu_check", "out"], "cli"),
        ([sys.executable, "-m", "megatron_testkit", "--help"], "cli"),
        ([sys.executable, "-c", "import torch"], "other"),
        (["git", "status"], "other"),
        ([sys.executable, "-c", "boot", "kit-rank-1-of-2"], None),  # a cold rank: in the report
        ([sys.executable, "-c", "serve", "{}", "kit-warm-parent"], None),
        (
            [sys.executable, "-u", "-c", "import sys;exec(eval(sys.stdin.readline()))"],
            None,
        ),  # an xdist worker
    ],
)
def test_child_processes_are_told_apart_by_their_command(argv, kind):
    assert l0_profile.classify(argv) == kind


def _git(repo: Path, *args: str) -> str:
    env = {**os.environ, "GIT_AUTHOR_NAME": "k", "GIT_AUTHOR_EMAIL": "k@x", "GIT_COMMITTER_NAME": "k",
           "GIT_COMMITTER_EMAIL": "k@x"}  # fmt: skip
    done = subprocess.run(
        ["git", "-C", str(repo), *args], env=env, capture_output=True, text=True, check=True
    )
    return done.stdout.strip()


def test_the_default_ref_is_origin_main_unless_that_is_this_commit_and_the_tree_is_removed_after(tmp_path):
    repo = tmp_path / "repo"
    repo.mkdir()
    _git(repo, "init", "-q")
    for text in ("first", "second"):
        (repo / "file.txt").write_text(text)
        _git(repo, "add", "file.txt")
        _git(repo, "commit", "-q", "-m", text)
    assert l0_compare.default_ref(repo) == "HEAD~"  # no origin/main
    _git(repo, "update-ref", "refs/remotes/origin/main", "HEAD~")
    assert l0_compare.default_ref(repo) == "origin/main"
    _git(repo, "update-ref", "refs/remotes/origin/main", "HEAD")  # a fresh clone of main
    assert l0_compare.default_ref(repo) == "HEAD~"
    with l0_compare.previous_tree("HEAD~", root=repo) as (tree, commit):
        assert (tree / "file.txt").read_text() == "first"
        assert commit == _git(repo, "rev-parse", "HEAD~")
    assert not tree.exists() and str(tree) not in _git(repo, "worktree", "list")
    assert (repo / "file.txt").read_text() == "second"


INNER = """
import subprocess, sys


def test_children():
    subprocess.run([sys.executable, "-m", "accounting", "--help"], capture_output=True, check=True)
    subprocess.run([sys.executable, "-c", "pass"], check=True)
    with subprocess.Popen([sys.executable, "-c", "pass", "kit-rank-0-of-1"]) as rank:
        rank.wait()
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.3)"])
    while proc.poll() is None:
        pass


def test_nothing():
    pass
"""


def test_the_plugin_records_each_tests_child_processes_but_not_the_kits_ranks(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
):
    shutil.copyfile(l0_profile.__file__, pytester.path / "kit_l0_profile.py")
    pytester.makepyfile(test_inner=INNER)
    profile = pytester.path / "profile"
    monkeypatch.setenv(l0_profile.DIR_ENV, str(profile))
    result = pytester.runpytest_subprocess("-p", "kit_l0_profile", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=2)
    # What the session ran outside any test (its plugins' probes at start) has no test: left out here.
    records = [r for r in l0_compare.read_profile(profile) if r["nodeid"] is not None]
    assert [(r["nodeid"], r["kind"], r["argv"][1:3]) for r in records] == [
        ("test_inner.py::test_children", "cli", ["-m", "accounting"]),
        ("test_inner.py::test_children", "other", ["-c", "pass"]),
        ("test_inner.py::test_children", "other", ["-c", "import time; time.sleep(0.3)"]),
    ]
    assert all(r["end"] >= r["start"] for r in records)
    assert records[2]["end"] - records[2]["start"] >= 0.3  # seen ended by poll(), not by wait()
