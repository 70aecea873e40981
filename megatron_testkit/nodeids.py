"""Which node ids from a report may reach pytest: ids of test files tracked in the project, and no other.

A report's node ids are untrusted text (a fork's pull request controls the CI artifact), and
pytest reads its command line as options and paths to import. An id is accepted only when it
reads as a node id (no leading ``-``, no absolute path, no ``..``, no control characters, a file
part named ``test_*.py``) and its file is a test file of the project: tracked by git when the
project is a git work tree (read from git's index, `megatron_testkit.git_index`, so a dry run
that starts no process refuses what the real run refuses), else a regular file under the root
outside hidden folders. The repro line downloads the artifact into the project, and a fork's
tests write what it holds: a file not tracked by git is accepted only when asked
(``include_untracked``), and never one in a report folder or a folder that holds a kit report or
a session's logs. The same holds for the files pytest loads for a test file before its tests
run (`LOADED_WITH_A_TEST`: a `conftest.py`, a package's `__init__.py`, an ini file, in its folder
and each folder above it up to the root): one that git does not track blocks the run (`Checked.blocked`),
since a planted `conftest.py` beside a tracked test runs as surely as a planted test. Nothing here imports or runs a test file: whether a test still exists is read
from the file's syntax tree.
"""

from __future__ import annotations

import ast
import re
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

from megatron_testkit.git_index import IndexUnknown
from megatron_testkit.git_index import tracked_files as index_files
from megatron_testkit.report_dir import MARKER
from megatron_testkit.schema import MAX_NODEID_CHARS

_TEST_FILE = re.compile(r"test_[A-Za-z0-9_]*\.py")
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
# Folders of installed code, which a project may hold (a virtual environment in the checkout).
_INSTALLED = ("site-packages", "dist-packages", "node_modules")
NOT_TRACKED = "not tracked by git: commit or `git add` it"
# What the kit writes into a report folder: a folder holding one is a run's output (an artifact).
_KIT_OUTPUT = ("kit-report.json", "kit-report.md", MARKER)
# Files pytest imports or reads for a test file given on its command line, from the file's folder
# up to the root: conftests and packages are imported, an ini file can add options and plugins.
LOADED_WITH_A_TEST = (
    "conftest.py",
    "__init__.py",
    "pytest.ini",
    ".pytest.ini",
    "tox.ini",
    "setup.cfg",
    "pyproject.toml",
)


@dataclass
class Checked:
    """The ids split three ways: safe to pass on, refused (with the reason), stale (gone since)."""

    accepted: list[str] = field(default_factory=list)
    refused: list[tuple[str, str]] = field(default_factory=list)
    stale: list[str] = field(default_factory=list)
    unchecked: str | None = None  # why tracking was left to the real run (an index only git reads)
    blocked: str | None = None  # a file pytest would load with an accepted test and must not: why


def form_problem(nodeid: str) -> str | None:
    """Why `nodeid` does not read as a node id of a test file (None when it does)."""
    if not nodeid or len(nodeid) > MAX_NODEID_CHARS:
        return f"not 1 to {MAX_NODEID_CHARS} characters"
    if not nodeid.isprintable():
        return "holds control characters"
    if nodeid.startswith("-"):
        return "starts with '-' (an option, not a test)"
    path, *names = nodeid.split("::")
    if path.startswith("/") or "\\" in path or re.match(r"[A-Za-z]:", path):
        return "not a path relative to the project"
    parts = PurePosixPath(path).parts
    if any(part in ("..", ".") or part.startswith(".") for part in parts):
        return "a path through '..' or a hidden folder"
    if any(part in _INSTALLED for part in parts):
        return "a path into installed packages"
    if not parts or not _TEST_FILE.fullmatch(parts[-1]):
        return "not a test file (test_*.py)"
    for name in names:
        if not _NAME.fullmatch(name.split("[", 1)[0]) or ("[" in name and not name.endswith("]")):
            return f"{name[:40]!r} is not a test name"
    return None


def git_ls_files(root: Path) -> set[str] | None:
    """The files git tracks under `root`, as ``git ls-files`` lists them; None when git fails."""
    try:
        out = subprocess.run(
            ["git", "-c", "core.quotePath=false", "ls-files", "-z", "--cached"],
            cwd=root,
            capture_output=True,
            timeout=60,
            check=False,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    if out.returncode != 0:
        return None
    return {name for name in out.stdout.decode("utf-8", "surrogateescape").split("\0") if name}


def _holds_kit_output(folder: Path) -> bool:
    if any((folder / name).exists() for name in _KIT_OUTPUT):
        return True
    logs = folder / "logs"
    return logs.is_dir() and any(logs.glob(f"*/{MARKER}"))


def kit_output_problem(
    root: Path, full: Path, report_folders: Sequence[Path], include_root: bool
) -> str | None:
    """Why the file `full` is a run's output rather than a test of the project at `root`: it is
    in one of `report_folders`, or a folder between it and the root (the root too when
    `include_root`) holds a kit report or a session's logs. None when it is neither."""
    top = root.resolve()
    resolved = full.resolve()
    for folder in report_folders:
        folder = folder.resolve()
        inside = top in folder.parents or (include_root and folder == top)
        if inside and folder in resolved.parents:
            return "in a report folder: never run from a report"
    for folder in resolved.parents:
        if folder == top and not include_root:
            break
        if _holds_kit_output(folder):
            return "in a folder that holds a kit report or session logs (a downloaded artifact?): never run from a report"
        if folder == top:
            break
    return None


def file_problem(
    root: Path,
    path: str,
    tracked: set[str] | None,
    *,
    include_untracked: bool = False,
    report_folders: Sequence[Path] = (),
) -> str | None:
    """Why `path` is not a test file of the project at `root`; "missing" when it does not exist.
    `tracked`: the files git tracks (None: not a git work tree)."""
    full = root / path
    untracked = tracked is not None and path not in tracked
    if untracked:
        if not full.exists() and not full.is_symlink():
            return "missing"
        if not include_untracked:
            return NOT_TRACKED
    if full.is_symlink():
        return "a symbolic link"
    if not full.exists():
        return "missing"
    if not full.is_file():
        return "not a regular file"
    if root.resolve() not in full.resolve().parents:
        return "outside the project"
    if tracked is None or untracked:  # only committed files are trusted inside a run's output
        return kit_output_problem(root, full, report_folders, include_root=untracked)
    return None


def loaded_file_problem(
    root: Path,
    path: str,
    tracked: set[str] | None,
    *,
    include_untracked: bool = False,
    report_folders: Sequence[Path] = (),
) -> str | None:
    """Why a file pytest loads with the test file `path` (`LOADED_WITH_A_TEST`, in its folder or one
    above it up to `root`) must not run: untracked by git (unless `include_untracked`), or, when
    untracked or outside git, a run's output (`kit_output_problem`). None when every one may load."""
    folder = (root / path).parent
    while True:
        for name in LOADED_WITH_A_TEST:
            loaded = folder / name
            if not loaded.exists() and not loaded.is_symlink():
                continue
            shown = loaded.relative_to(root).as_posix()
            untracked = tracked is not None and shown not in tracked
            if untracked and not include_untracked:
                return f"{shown}, which pytest loads with {path}, is {NOT_TRACKED}"
            if tracked is None or untracked:
                why = kit_output_problem(root, loaded, report_folders, include_root=untracked)
                if why is not None:
                    return f"{shown}, which pytest loads with {path}, is {why}"
        if folder == root:
            return None
        folder = folder.parent


def defined_names(source: str) -> dict[str, set[str] | None]:
    """Top-level names of a test module -> the names defined in them (for classes without bases;
    None where any name may exist: functions, assignments, imports, classes that inherit)."""
    names: dict[str, set[str] | None] = {}
    for node in ast.parse(source).body:
        if isinstance(node, ast.ClassDef):
            inherited = bool(node.bases) or bool(node.decorator_list)
            members = {
                n.name
                for n in node.body
                if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
            }
            members |= {
                t.id
                for n in node.body
                if isinstance(n, ast.Assign)
                for t in n.targets
                if isinstance(t, ast.Name)
            }
            names[node.name] = None if inherited else members
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            names[node.name] = None
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update({t.id: None for t in targets if isinstance(t, ast.Name)})
        elif isinstance(node, ast.ImportFrom | ast.Import):
            names.update({(a.asname or a.name).split(".")[0]: None for a in node.names})
    return names


def exists_in_source(source: str, names: list[str]) -> bool:
    """Whether the test `names` (``Class``, ``test[param]``...) can exist in a module of `source`."""
    if not names:
        return True
    try:
        defined = defined_names(source)
    except (SyntaxError, ValueError, RecursionError):
        return True  # pytest will say what is wrong with the file
    top = names[0].split("[", 1)[0]
    if top not in defined:
        return False
    members = defined[top]
    return members is None or len(names) < 2 or names[1].split("[", 1)[0] in members


def check(
    root: Path,
    nodeids: list[str],
    *,
    start_processes: bool = True,
    include_untracked: bool = False,
    report_folders: Sequence[Path] = (),
) -> Checked:
    """Split `nodeids` into accepted, refused and stale, reading files but running nothing.

    Tracked files come from git's index, read here; an index only git reads is asked of ``git
    ls-files`` when `start_processes`, else left to the real run (`Checked.unchecked` says why)."""
    out = Checked()
    try:
        tracked = index_files(root)
    except IndexUnknown as exc:
        if start_processes:
            # A work tree whose tracked files git cannot list either: nothing is trusted.
            tracked = git_ls_files(root) or set()
        else:
            tracked, out.unchecked = None, str(exc)
    sources: dict[str, str] = {}
    for nodeid in nodeids:
        problem = form_problem(nodeid)
        path, *names = nodeid.split("::")
        if problem is None:
            problem = file_problem(
                root, path, tracked, include_untracked=include_untracked, report_folders=report_folders
            )
        if problem == "missing":
            out.stale.append(nodeid)
            continue
        if problem is not None:
            out.refused.append((nodeid, problem))
            continue
        if path not in sources:
            sources[path] = (root / path).read_text(encoding="utf-8", errors="replace")
        (out.accepted if exists_in_source(sources[path], names) else out.stale).append(nodeid)
    for path in dict.fromkeys(nodeid.split("::")[0] for nodeid in out.accepted):
        out.blocked = loaded_file_problem(
            root, path, tracked, include_untracked=include_untracked, report_folders=report_folders
        )
        if out.blocked is not None:
            break
    return out
