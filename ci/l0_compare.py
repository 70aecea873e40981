"""L0 of a previous commit against L0 of this tree, on this machine in one run, and where the time goes.

    python -m ci l0-bench --against [REF] [--workers N] [--reports DIR] [pytest args]

REF (default: ``origin/main``, or ``HEAD~`` where that is absent or is this commit) is checked out
with ``git worktree add`` into a temporary folder. Both trees' L0 runs as the CPU row runs it
(`ci.l0_run.run_l0`: the row's environment and arguments, on its xdist workers), the previous one
first, each with its own tree first on PYTHONPATH and the same pytest plugin
(`ci.l0_profile`, loaded as a module of its own) recording the child processes of every test.
Then, for each: wall and CPU time, and the test time split into rank launches (the report's
launches: their time, their ranks' start time ``setup_s``, warm or cold), nested pytest sessions,
this repository's CLI commands run as subprocesses, other subprocesses, and the rest; then the
wall ratio this / previous. Figures on a shared machine are load-dependent (the load average is
printed); each side's output is in its report directory's ``pytest.log``.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from accounting.json_input import JsonInputError, load_json, parse_json, read_regular_file
from ci import l0_profile
from ci.l0_run import ROOT, run_l0

# The order in which time in overlapping child processes is counted: a moment inside a nested
# session is the session's, whatever else ran beside it.
KINDS = ("nested", "cli", "other")
KIND_NAMES = {"nested": "nested pytest sessions", "cli": "CLI subprocesses", "other": "other subprocesses"}
PROFILE_MODULE = "kit_l0_profile"
PROFILE_LIMIT = 256 * 2**20
# Compiled before either run, so that neither pays for it inside its wall time.
PACKAGES = ("accounting", "megatron_testkit", "ci", "fixtures", "unit", "functional")


def _git(root: Path, *args: str) -> str:
    done = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, timeout=120)
    if done.returncode != 0:
        raise RuntimeError(f"git {' '.join(args)} in {root}: {done.stderr.strip() or done.returncode}")
    return done.stdout.strip()


def default_ref(root: Path = ROOT) -> str:
    """``origin/main``, unless it is absent or is this commit (a fresh clone of main): then ``HEAD~``."""
    try:
        origin = _git(root, "rev-parse", "--verify", "--quiet", "origin/main^{commit}")
    except RuntimeError:
        return "HEAD~"
    return "HEAD~" if origin == _git(root, "rev-parse", "HEAD") else "origin/main"


@contextlib.contextmanager
def previous_tree(ref: str, root: Path = ROOT) -> Iterator[tuple[Path, str]]:
    """REF checked out (detached) in a temporary worktree of ``root``: its path and commit; removed after."""
    commit = _git(root, "rev-parse", "--verify", f"{ref}^{{commit}}")
    folder = Path(tempfile.mkdtemp(prefix="kit-l0-previous-"))
    tree = folder / "tree"
    _git(root, "worktree", "add", "--detach", "--quiet", str(tree), commit)
    try:
        yield tree, commit
    finally:
        subprocess.run(["git", "-C", str(root), "worktree", "remove", "--force", str(tree)],
                       capture_output=True, timeout=120)  # fmt: skip
        shutil.rmtree(folder, ignore_errors=True)


def read_profile(folder: Path) -> list[dict[str, Any]]:
    """The child-process records `ci.l0_profile` wrote into ``folder`` (every process's file)."""
    records: list[dict[str, Any]] = []
    for path in sorted(folder.glob("*.jsonl")):
        text = read_regular_file(path, PROFILE_LIMIT, "l0 profile").decode("utf-8", "replace")
        for number, line in enumerate(text.splitlines(), 1):
            if line.strip():
                records.append(parse_json(line, where=f"{path}:{number}"))
    return records


def attribute(intervals: list[tuple[str, float, float]]) -> dict[str, float]:
    """Seconds per kind over one test's child processes, each moment counted once, for the first
    kind in `KINDS` that ran then (a CLI command beside a nested session is the session's)."""
    points = sorted({p for _, start, end in intervals for p in (start, end)})
    seconds = dict.fromkeys(KINDS, 0.0)
    for a, b in itertools.pairwise(points):
        running = {kind for kind, start, end in intervals if start <= a and end >= b}
        if running:
            seconds[min(running, key=KINDS.index)] += b - a
    return seconds


def breakdown(report: dict[str, Any], records: list[dict[str, Any]]) -> dict[str, Any]:
    """Where a session's test time went: launches from its kit report, child processes from its profile."""
    by_test: dict[str | None, list[tuple[str, float, float]]] = {}
    counts = dict.fromkeys(KINDS, 0)
    for record in records:
        kind = record.get("kind")
        if kind in KINDS:
            counts[kind] += 1
            by_test.setdefault(record.get("nodeid"), []).append((kind, record["start"], record["end"]))
    out: dict[str, Any] = {
        "tests": len(report["tests"]),
        "test_s": 0.0,
        "launches": 0,
        "start_modes": {},
        "launch_s": 0.0,
        "launch_setup_s": 0.0,
        **{f"{kind}_n": counts[kind] for kind in KINDS},
        **{f"{kind}_s": 0.0 for kind in KINDS},
        "rest_s": 0.0,
        "outside_tests_s": 0.0,
    }
    for row in report["tests"]:
        duration = row.get("duration_s") or 0.0
        launched = 0.0
        for launch in row.get("launches") or []:
            out["launches"] += 1
            mode = launch.get("start_mode") or "unrecorded"
            out["start_modes"][mode] = out["start_modes"].get(mode, 0) + 1
            launched += launch.get("duration_s") or 0.0
            out["launch_setup_s"] += launch.get("setup_s") or 0.0
        children = attribute(by_test.pop(row["nodeid"], []))
        out["test_s"] += duration
        out["launch_s"] += launched
        for kind in KINDS:
            out[f"{kind}_s"] += children[kind]
        out["rest_s"] += max(0.0, duration - launched - sum(children.values()))
    # Children started outside any test (collection, the session's start): their own line.
    out["outside_tests_s"] = sum(sum(attribute(rest).values()) for rest in by_test.values())
    return {key: round(value, 1) if isinstance(value, float) else value for key, value in out.items()}


def _modes(modes: dict[str, int]) -> str:
    return ", ".join(f"{count} {mode}" for mode, count in sorted(modes.items())) or "none"


def table(previous: dict[str, Any], this: dict[str, Any]) -> list[str]:
    """Both sides' figures for people, and the wall ratio this / previous."""
    rows: list[tuple[str, str, str]] = [("", f"previous {previous['commit'][:10]}", "this tree")]

    def add(name: str, key: str, count: str | None = None) -> None:
        cells = []
        for side in (previous, this):
            b = side["breakdown"]
            if key not in b:  # its report or profile could not be read: said below
                cells.append("-")
                continue
            share = f" ({b[key] / b['test_s']:.0%})" if b.get("test_s") else ""
            cells.append(f"{b[key]:.1f} s{share}" + (f", {b[count]}" if count else ""))
        rows.append((name, *cells))  # type: ignore[arg-type]

    rows.append(("wall", f"{previous['wall_s']:.1f} s", f"{this['wall_s']:.1f} s"))
    rows.append(("CPU (user + system)", f"{previous['cpu_s']:.1f} s", f"{this['cpu_s']:.1f} s"))
    rows.append(("outcomes", str(previous.get("outcome_counts")), str(this.get("outcome_counts"))))
    add("test time (all workers)", "test_s")
    add("  rank launches, n", "launch_s", "launches")
    rows.append(
        ("    start modes", *(_modes(s["breakdown"].get("start_modes", {})) for s in (previous, this)))
    )  # type: ignore[arg-type]
    add("    ranks' start (setup_s)", "launch_setup_s")
    for kind in KINDS:
        add(f"  {KIND_NAMES[kind]}, n", f"{kind}_s", f"{kind}_n")
    add("  the rest", "rest_s")
    add("children outside any test", "outside_tests_s")
    width = [max(len(row[i]) for row in rows) for i in range(3)]
    lines = [f"{a:{width[0]}s}  {b:>{width[1]}s}  {c:>{width[2]}s}" for a, b, c in rows]
    for side in (previous, this):
        if "error" in side["breakdown"]:
            lines.append(f"{side['ref']}: no breakdown: {side['breakdown']['error']}")
    ratio = this["wall_s"] / previous["wall_s"] if previous["wall_s"] else float("nan")
    lines.append(f"wall this / previous: {ratio:.2f} (goal: at most 0.5)")
    lines.append(f"load average (1, 5, 15 min) at the end: {os.getloadavg()}")
    return lines


def compile_tree(tree: Path) -> None:
    """Byte-compile a tree's packages (a fresh worktree has no .pyc files), outside the timed runs."""
    present = [str(tree / name) for name in PACKAGES if (tree / name).is_dir()]
    subprocess.run([sys.executable, "-m", "compileall", "-q", *present], capture_output=True, timeout=600)


def run_side(tree: Path, reports: Path, workers: int, extra: list[str]) -> dict[str, Any]:
    """One tree's L0 with the profile plugin: `run_l0`'s figures and the breakdown of its test time."""
    plugin_dir, profile_dir = reports / "profile-plugin", reports / "profile"
    for folder in (plugin_dir, profile_dir):
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)
    shutil.copyfile(Path(l0_profile.__file__), plugin_dir / f"{PROFILE_MODULE}.py")
    rest = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p != str(ROOT)]
    env = {
        "PYTHONPATH": os.pathsep.join([str(tree), str(plugin_dir), *rest]),
        l0_profile.DIR_ENV: str(profile_dir),
    }
    figures = run_l0(workers, reports, ["-p", PROFILE_MODULE, *extra], root=tree, more_env=env)
    try:
        report = load_json(reports / "kit-report.json", what="kit report")
        records = read_profile(profile_dir)
    except (OSError, JsonInputError) as exc:
        figures["breakdown"] = {"error": str(exc)}
        return figures
    figures["breakdown"] = breakdown(report, records)
    return figures


def run(ref: str, workers: int, reports: Path, extra: list[str]) -> int:
    """Both trees' L0, previous first; print the table, write ``l0-compare.json``; 1 if either failed."""
    this_commit = _git(ROOT, "rev-parse", "HEAD")
    try:
        _git(ROOT, "rev-parse", "--verify", "--quiet", f"{ref}^{{commit}}")
    except RuntimeError:
        print(f"python -m ci l0-bench: --against {ref!r} is not a commit of {ROOT}", file=sys.stderr)
        return 2
    with previous_tree(ref) as (tree, commit):
        compile_tree(tree)
        compile_tree(ROOT)
        previous = {**run_side(tree, reports / "previous", workers, extra), "commit": commit, "ref": ref}
    this = {**run_side(ROOT, reports / "this", workers, extra), "commit": this_commit, "ref": "this tree"}
    for line in table(previous, this):
        print(line)
    (reports / "l0-compare.json").write_text(
        json.dumps({"previous": previous, "this": this}, indent=2) + "\n"
    )
    return 0 if previous["returncode"] == this["returncode"] == 0 else 1
