"""`repro --from-report` runs only test files git tracks, and its `--dry-run` says so beforehand.

The printed repro line downloads a CI artifact into the project's root, and a fork's pull request
controls what its tests write there (a `test_*.py`, a `conftest.py`). The real run refused such
files while `--dry-run`, which starts no process, listed them as runnable; now both read git's
index (`megatron_testkit.git_index`) and refuse the same ids. Real git repositories, real runs.
"""

from __future__ import annotations

import json
import shlex
import subprocess
from pathlib import Path

import pytest

from megatron_testkit import repro
from megatron_testkit.git_index import IndexUnknown, tracked_files
from megatron_testkit.nodeids import NOT_TRACKED
from megatron_testkit.report_dir import MARKER
from unit.test_repro import _processes_started

pytestmark = pytest.mark.L0

GIT = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-c", "init.defaultBranch=main"]


def _git(root: Path, *args: str) -> str:
    done = subprocess.run([*GIT, "-C", str(root), *args], capture_output=True, text=True, check=True)
    return done.stdout


def _ls_files(root: Path) -> set[str]:
    out = subprocess.run(
        ["git", "-c", "core.quotePath=false", "ls-files", "-z", "--cached"],
        cwd=root,
        capture_output=True,
        check=True,
    ).stdout
    return {name for name in out.decode("utf-8", "surrogateescape").split("\0") if name}


def _repository(root: Path, *init: str) -> Path:
    root.mkdir(parents=True)
    _git(root, "init", "-q", *init)
    for i in range(30):
        (root / "tests" / "deep" / f"folder_{i % 3}").mkdir(parents=True, exist_ok=True)
        (root / "tests" / "deep" / f"folder_{i % 3}" / f"test_{'long_' * i}{i}.py").write_text(f"# {i}\n")
    (root / "tests" / "ünïcödé and space.py").write_text("# a name git quotes by default\n")
    _git(root, "add", "-A")
    _git(root, "commit", "-qm", "tests")
    return root


INDEX_KINDS = {
    "version 2": ((), ()),
    "version 3: intent-to-add and skip-worktree entries (extended flags)": (
        (),
        (
            ("update-index", "--index-version", "3"),
            ("add", "-N", "tests/new.py"),
            ("update-index", "--skip-worktree", "tests/deep/folder_0/test_0.py"),
        ),
    ),
    "version 4: prefix-compressed names": ((), (("update-index", "--index-version", "4"),)),
    "SHA-256 object names": (("--object-format=sha256",), ()),
    "SHA-256, version 4": (("--object-format=sha256",), (("update-index", "--index-version", "4"),)),
    "no checksum (index.skipHash)": ((), (("config", "index.skipHash", "true"), ("add", "tests/new.py"))),
}


@pytest.mark.parametrize("kind", sorted(INDEX_KINDS))
def test_the_index_reader_lists_what_git_ls_files_lists(tmp_path: Path, kind: str) -> None:
    init, then = INDEX_KINDS[kind]
    root = _repository(tmp_path / "repo", *init)
    (root / "tests" / "new.py").write_text("# added after the commit\n")
    (root / "untracked.py").write_text("# never added\n")
    for args in then:
        _git(root, *args)
    expected = _ls_files(root)
    assert "untracked.py" not in expected and len(expected) >= 31
    assert tracked_files(root) == expected
    sub = root / "tests" / "deep"
    assert tracked_files(sub) == _ls_files(sub) and "folder_1/test_long_1.py" in _ls_files(sub)


def test_a_linked_work_tree_and_a_folder_outside_any_repository(tmp_path: Path) -> None:
    root = _repository(tmp_path / "repo")
    _git(root, "worktree", "add", "-q", str(tmp_path / "linked"))
    assert (tmp_path / "linked" / ".git").is_file()
    assert tracked_files(tmp_path / "linked") == _ls_files(tmp_path / "linked") == _ls_files(root)
    (tmp_path / "plain").mkdir()
    assert tracked_files(tmp_path / "plain") is None


@pytest.mark.parametrize(
    "commands",
    [
        (("update-index", "--split-index"), ("add", "tests/new.py")),
        (("sparse-checkout", "set", "--cone", "--sparse-index", "tests/deep/folder_1"),),
    ],
    ids=["split index", "sparse index"],
)
def test_an_index_only_git_can_read_is_said_so(tmp_path: Path, commands: tuple[tuple[str, ...], ...]) -> None:
    root = _repository(tmp_path / "repo")
    (root / "tests" / "new.py").write_text("# new\n")
    for args in commands:
        _git(root, *args)
    with pytest.raises(IndexUnknown):
        tracked_files(root)


def test_a_cut_index_is_unknown_never_a_short_list(tmp_path: Path) -> None:
    root = _repository(tmp_path / "repo")
    index = root / ".git" / "index"
    index.write_bytes(index.read_bytes()[: index.stat().st_size // 2])
    with pytest.raises(IndexUnknown, match="cut short or malformed"):
        tracked_files(root)


# ---- repro --from-report ------------------------------------------------------------------------

FAILING = "import pytest\n\n\n@pytest.mark.L0\ndef test_x():\n    open({marker!r}, 'a').write(__file__ + '\\n')\n    assert False\n"


def _project(tmp_path: Path) -> tuple[Path, Path, list[str]]:
    """A git project with a tracked failing test, an untracked one, and a downloaded artifact
    holding a report, a `test_*.py` and a `conftest.py`; the report's failed ids name them all."""
    ran = tmp_path / "ran.txt"  # each test file that ran appends its path
    root = tmp_path / "project"
    (root / "tests").mkdir(parents=True)
    (root / "pytest.ini").write_text("[pytest]\naddopts = -p no:cacheprovider -p no:randomly\n")
    (root / "tests" / "test_tracked.py").write_text(FAILING.format(marker=str(ran)))
    _git(root, "init", "-q")
    _git(root, "add", "-A")
    _git(root, "commit", "-qm", "a project")
    (root / "tests" / "test_new.py").write_text(FAILING.format(marker=str(ran)))  # not added yet
    artifact = root / "kit-reports-L0-cpu"  # where the printed repro line downloads to
    artifact.mkdir()
    (artifact / "test_evil.py").write_text(FAILING.format(marker=str(ran)))
    (artifact / "conftest.py").write_text(f"open({str(ran)!r}, 'a').write(__file__ + '\\n')\n")
    sessions = root / "old-run" / "logs" / "session-1"  # a report folder without its report
    sessions.mkdir(parents=True)
    (sessions / MARKER).write_text("rank logs\n")
    (root / "old-run" / "test_left.py").write_text(FAILING.format(marker=str(ran)))
    ids = [
        "tests/test_tracked.py::test_x",
        "tests/test_new.py::test_x",
        "kit-reports-L0-cpu/test_evil.py::test_x",
        "kit-reports-L0-cpu/conftest.py",
        "old-run/test_left.py::test_x",
    ]
    report = artifact / "kit-report.json"
    tests = [{"nodeid": nodeid, "outcome": "failed"} for nodeid in ids]
    report.write_text(json.dumps({"version": 1, "session": {"markexpr": "L0"}, "tests": tests}))
    return root, report, ids


REPORT_FOLDER = "in a report folder: never run from a report"
ARTIFACT = (
    "in a folder that holds a kit report or session logs (a downloaded artifact?): never run from a report"
)


def _refused(lines: list[str]) -> str:
    return next(line for line in lines if " refused, not run" in line)


def _selected(lines: list[str]) -> list[str]:
    command = shlex.split(next(line for line in reversed(lines) if " -m pytest " in line).split(": ", 1)[1])
    return command[command.index("--") + 1 :]


@pytest.mark.parametrize("include", [False, True], ids=["tracked only", "--include-untracked"])
def test_the_dry_run_refuses_what_the_real_run_refuses_and_an_artifacts_files_never_run(
    tmp_path: Path, capfd: pytest.CaptureFixture[str], include: bool
) -> None:
    root, report, ids = _project(tmp_path)
    argv = ["--from-report", str(report), "--root", str(root), "--reports", str(tmp_path / "out")]
    argv += ["--limit-method", "env", *(["--include-untracked"] if include else [])]
    with _processes_started() as started:
        assert repro.main([*argv, "--dry-run"]) == 0
    assert started == [], "the dry run reads git's index itself"
    dry = capfd.readouterr().out.splitlines()
    new = "" if include else f"{ids[1]} ({NOT_TRACKED}); "
    assert _refused(dry) == (
        f"kit repro: {4 if not include else 3} id(s) of the report refused, not run (not a test of this "
        f"project): {new}{ids[2]} ({REPORT_FOLDER if include else NOT_TRACKED}); "
        f"{ids[3]} (not a test file (test_*.py)); {ids[4]} ({ARTIFACT if include else NOT_TRACKED})"
    )
    runnable = [ids[0], ids[1]] if include else [ids[0]]
    assert _selected(dry) == runnable
    if not include:
        return  # the real run of this case is the one below, less the untracked test (seconds each)

    assert repro.main(argv) == 1  # the runnable tests fail, as planted
    real = capfd.readouterr().out.splitlines()
    assert _refused(real) == _refused(dry), "the real run refuses exactly what the dry run said"
    ran = sorted(Path(line).name for line in (tmp_path / "ran.txt").read_text().splitlines())
    assert ran == sorted(nodeid.split("::")[0].rsplit("/", 1)[1] for nodeid in runnable)


def test_include_untracked_goes_with_a_report(capsys: pytest.CaptureFixture[str]) -> None:
    assert repro.main(["L0", "--include-untracked", "--dry-run"]) == 2
    assert (
        capsys.readouterr().err
        == "python -m megatron_testkit repro: error: --include-untracked goes with --from-report\n"
    )


def test_outside_git_an_artifacts_test_file_is_refused_too(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """No index to say what is the project's: a folder holding a kit report is a run's output."""
    root, report, ids = _project(tmp_path)
    subprocess.run(["rm", "-rf", str(root / ".git")], check=True)
    argv = ["--from-report", str(report), "--root", str(root), "--dry-run"]
    assert repro.main(argv) == 0
    out = capsys.readouterr().out.splitlines()
    assert _refused(out) == (
        f"kit repro: 3 id(s) of the report refused, not run (not a test of this project): "
        f"{ids[2]} ({REPORT_FOLDER}); {ids[3]} (not a test file (test_*.py)); {ids[4]} ({ARTIFACT})"
    )
    assert _selected(out) == [ids[0], ids[1]]


def test_with_a_split_index_the_real_run_asks_git_and_the_dry_run_says_it_did_not_check(
    tmp_path: Path,
) -> None:
    from megatron_testkit.nodeids import check

    root = _repository(tmp_path / "repo")
    _git(root, "update-index", "--split-index")
    (root / "tests" / "test_untracked.py").write_text("def test_x():\n    pass\n")
    (root / "tests" / "test_added.py").write_text("def test_x():\n    pass\n")
    _git(root, "add", "tests/test_added.py")
    ids = ["tests/test_added.py::test_x", "tests/test_untracked.py::test_x"]
    real = check(root, ids)
    assert real.accepted == [ids[0]] and real.refused == [(ids[1], NOT_TRACKED)] and real.unchecked is None
    dry = check(root, ids, start_processes=False)
    assert dry.unchecked == "a split index" and dry.accepted == ids


PLANT = "open({marker!r}, 'a').write(__file__ + '\\n')\n"


@pytest.mark.parametrize("planted", ["conftest.py", "__init__.py"])
@pytest.mark.parametrize("include", [False, True], ids=["tracked only", "--include-untracked"])
def test_an_untracked_file_pytest_loads_beside_a_tracked_test_blocks_the_run(
    tmp_path: Path, capfd: pytest.CaptureFixture[str], planted: str, include: bool
) -> None:
    """An artifact named `tests`, downloaded into the root, puts its report and a conftest.py beside
    a tracked test: running that test would import the conftest. Neither run nor dry run starts it."""
    ran = tmp_path / "ran.txt"
    root = tmp_path / "project"
    (root / "tests").mkdir(parents=True)
    (root / "pytest.ini").write_text("[pytest]\naddopts = -p no:cacheprovider -p no:randomly\n")
    (root / "tests" / "test_t.py").write_text(FAILING.format(marker=str(ran)))
    _git(root, "init", "-q")
    _git(root, "add", "-A")
    _git(root, "commit", "-qm", "a project")
    (root / "tests" / planted).write_text(PLANT.format(marker=str(ran)))
    report = root / "tests" / "kit-report.json"
    tests = [{"nodeid": "tests/test_t.py::test_x", "outcome": "failed"}]
    report.write_text(json.dumps({"version": 1, "session": {"markexpr": "L0"}, "tests": tests}))
    argv = ["--from-report", str(report), "--root", str(root), "--reports", str(tmp_path / "out")]
    argv += ["--limit-method", "env", *(["--include-untracked"] if include else [])]
    why = REPORT_FOLDER if include else NOT_TRACKED  # tests/ holds the report
    expected = (
        f"python -m megatron_testkit repro: error: tests/{planted}, which pytest loads with "
        f"tests/test_t.py, is {why}: nothing run\n"
    )
    with _processes_started() as started:
        assert repro.main([*argv, "--dry-run"]) == 2
    assert started == []
    assert capfd.readouterr().err == expected
    assert repro.main(argv) == 2
    assert capfd.readouterr().err == expected
    assert not ran.exists(), "neither the test nor the planted file ran"

    _git(root, "add", f"tests/{planted}")  # the project's own file: the test runs, and loads it
    report.rename(tmp_path / "kit-report.json")
    argv[1] = str(tmp_path / "kit-report.json")
    assert repro.main(argv) == 1
    # (the kit's collection of the test's file loads the planted file too: a set, not a count)
    assert {Path(line).name for line in ran.read_text().splitlines()} == {planted, "test_t.py"}
