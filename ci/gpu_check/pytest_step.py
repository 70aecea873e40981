"""Step ``pytest``: ``pytest -m "L0 and gpu"`` with ``KIT_REQUIRE_GPUS=1``; report and junit XML in OUTDIR/pytest/.

A GPU test that skips for want of a GPU fails here, and so does any skip the GPU rows do not
declare (``KIT_ALLOWED_SKIPS``: the GPU rows' CPU-path checks, and, on this one-GPU machine,
``gpus``: the tests that need two GPUs skip by design, as ``KIT_REQUIRE_GPUS=1`` says). At least one test
must have run: JUnit's ``tests`` counts skipped tests too, so the step counts the test cases that
were not skipped. The dry run collects the selection only.

pytest collects only the files that hold GPU tests (`gpu_test_files`), so the check's interpreter
needs only what those files import (not, say, the workflow tests' yaml); what it lacks of that is
named in one line before pytest runs (`missing_modules`), rather than a collection error.
"""

from __future__ import annotations

import ast
import importlib.util
import os
import shlex
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ci.gpu_check.summary import StepFailed, expect
from ci.jobs import ALLOWED_SKIPS_ENV, GPU_ALLOWED_SKIPS

if TYPE_CHECKING:
    from ci.gpu_check.summary import CheckState

ROOT = Path(__file__).resolve().parents[2]
# What this one-GPU check may skip: what the GPU rows may, plus the tests needing more GPUs than one.
ALLOWED_SKIPS = (*GPU_ALLOWED_SKIPS, "gpus")


# The folders whose test files pytest would collect, and this repository's own packages (never
# "missing": they are on the path from the repository root).
TEST_DIRS = ("unit", "functional")
LOCAL_PACKAGES = frozenset(
    {"unit", "functional", "fixtures", "megatron_testkit", "accounting", "ci", "conftest"}
)


def gpu_test_files(root: Path = ROOT) -> list[str]:
    """The test files that hold GPU tests (a ``gpu`` mark in their text), relative to ``root``."""
    return [
        str(path.relative_to(root))
        for folder in TEST_DIRS
        for path in sorted((root / folder).glob("test_*.py"))
        if "mark.gpu" in path.read_text()
    ]


def _top_level_imports(path: Path) -> set[str]:
    """The modules a file imports when it is imported (its module-level imports, not those inside
    a function or a ``try``, which are optional)."""
    names: set[str] = set()
    for node in ast.parse(path.read_text(), str(path)).body:
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def missing_modules(files: list[str], root: Path = ROOT) -> list[str]:
    """The modules that ``files``, ``conftest.py`` and the local modules they import (followed
    through) need at import and this interpreter cannot find, sorted."""
    todo = [root / "conftest.py", *(root / f for f in files)]
    seen: set[Path] = set()
    needed: set[str] = set()
    while todo:
        path = todo.pop()
        if path in seen or not path.is_file():
            continue
        seen.add(path)
        for name in _top_level_imports(path):
            if name in LOCAL_PACKAGES:
                continue
            needed.add(name)
        for node in ast.parse(path.read_text(), str(path)).body:
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                parts = node.module.split(".")
                if parts[0] in ("fixtures", "unit"):  # this repository's test support, followed
                    todo.append(root.joinpath(*parts).with_suffix(".py"))
                    todo.append(root.joinpath(*parts, "__init__.py"))
    return sorted(name for name in needed if name != "__future__" and importlib.util.find_spec(name) is None)


def pytest_command(out: Path) -> tuple[list[str], dict[str, str]]:
    """The pytest command and environment of the step, its report under `out`/pytest."""
    cmd = pytest_argv(["-m", "L0 and gpu", *gpu_test_files()], out / "pytest")
    env = {
        "KIT_REQUIRE_GPUS": "1",
        ALLOWED_SKIPS_ENV: ",".join(ALLOWED_SKIPS),
        "CI": "true",
        "HYPOTHESIS_PROFILE": "ci",
        "PYTHONUNBUFFERED": "1",
    }
    return cmd, env


def pytest_argv(selection: list[str], report: Path) -> list[str]:
    """pytest on ``selection`` (``-m EXPR`` or node ids), unshuffled, its kit report and JUnit XML in ``report``."""
    return [
        sys.executable,
        "-m",
        "pytest",
        *selection,
        "-p",
        "no:randomly",
        "-q",
        f"--kit-report={report}",
        f"--junitxml={report}/junit.xml",
    ]


def step(check: CheckState) -> dict[str, Any]:
    """Run the selection (collect it in a dry run); it must pass and run at least one test."""
    cmd, env = pytest_command(check.out)
    files = gpu_test_files()
    missing = missing_modules(files)
    expect(
        not missing,
        f"this interpreter lacks {', '.join(missing)}, which the GPU test files import: carry their wheels "
        f"in KIT_WHEELS (bash ci/gpu_check.sh installs them offline) or pip install them",
    )
    if check.dry:  # collect only: no report, no junit
        cmd = [*cmd[:3], "--collect-only", "-m", "L0 and gpu", *files, "-p", "no:randomly", "-q"]
    figures = run_pytest(cmd, env, check.out / "pytest.log", timeout=max(10.0, check.remaining() - 5))
    if check.dry:
        expect(figures["returncode"] == 0, f"collecting 'L0 and gpu' failed: {figures['last_line']}")
        figures["not_covered"] = "the tests needing two GPUs: known after the GPU run (skipped as 'gpus')"
        return figures
    figures.update(junit_counts(check.out / "pytest" / "junit.xml"))
    figures["not_covered"] = needing_more_gpus(check.out / "pytest" / "kit-report.json")
    expect(
        figures["returncode"] == 0,
        f"pytest -m 'L0 and gpu' exited {figures['returncode']}: {figures['last_line']}",
    )
    expect_some_ran(figures)
    return figures


def run_pytest(cmd: list[str], env: dict[str, str], log: Path, *, timeout: float) -> dict[str, Any]:
    """Run a pytest command from the repository root, its output in `log`: command, exit status, last line."""
    with log.open("w") as f:
        try:
            proc = subprocess.run(
                cmd, cwd=ROOT, env={**os.environ, **env}, stdout=f, stderr=subprocess.STDOUT, timeout=timeout
            )
        except subprocess.TimeoutExpired:
            raise StepFailed(f"pytest did not finish within {timeout:.0f} s (log: {log})") from None
    tail = log.read_text().strip().splitlines()[-1:] or [""]
    return {
        "command": shlex.join(cmd),
        "env": env,
        "returncode": proc.returncode,
        "last_line": tail[0],
        "log": str(log),
    }


def needing_more_gpus(report: Path) -> list[str]:
    """The tests of a kit report that skipped for want of GPUs (``gpus``): what one GPU did not cover."""
    from megatron_testkit.golden_tool import UsageError, load_report

    try:
        tests = load_report(str(report)).tests
    except UsageError:
        return []
    return [t.nodeid for t in tests if t.outcome == "skipped" and t.skip_capability == "gpus"]


def expect_some_ran(counts: dict[str, int]) -> None:
    """Fail the step unless at least one test ran (skipped ones do not count)."""
    expect(
        counts.get("ran", 0) > 0,
        f"no 'L0 and gpu' test ran ({counts.get('tests', 0)} collected, {counts.get('skipped', 0)} skipped)",
    )


def junit_counts(path: Path) -> dict[str, int]:
    """tests/failures/errors/skipped of a junit XML file, and `ran`: the test cases not skipped.

    {} when the file is missing or unreadable. The suite's `tests` includes skipped tests, so
    `ran` counts the `<testcase>` elements without a `<skipped>` child instead.
    """
    import xml.etree.ElementTree as ET

    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError):
        return {}
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    if suite is None:
        return {}
    counts = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    counts["ran"] = sum(1 for case in suite.iter("testcase") if case.find("skipped") is None)
    return counts
