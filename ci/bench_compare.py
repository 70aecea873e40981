"""Compare a pytest-benchmark run with a baseline run, by ratios measured within each run.

Shared runners are noisy: an absolute time says more about the neighbours than about the code.
Each benchmark group of ``ci/benchmarks`` holds the kit's code (``extra_info["role"] ==
"subject"``) and what it is compared with in the same run (``"baseline"``: the syncing loop,
``torch.multiprocessing.spawn``, a step without the inspector). The figure compared run against
run is ``median(subject) / median(baseline)``; lower is better. A ratio that grew by more than
the tolerance (default 25%) is a regression. `python -m ci bench --compare BASELINE` uses this.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

# How much a ratio may grow before it counts as a regression: shared runners move a ratio of two
# medians by ~10% run to run, so 25% flags a real slowdown without flagging noise.
DEFAULT_TOLERANCE = 0.25
PROG = "python -m ci bench"  # the command that prints the table, named in its error messages


def load(path: Path) -> dict[str, Any]:
    """A pytest-benchmark JSON file (``--benchmark-json`` or ``--benchmark-autosave``)."""
    data = json.loads(path.read_text())
    if "benchmarks" not in data:
        raise ValueError(f"{path}: not a pytest-benchmark JSON file (no 'benchmarks' list)")
    return data


def ratios(data: dict[str, Any]) -> dict[str, float]:
    """``{"group: subject / baseline": median ratio}`` for every subject of every group."""
    groups: dict[str, dict[str, list[dict[str, Any]]]] = {}
    for bench in data["benchmarks"]:
        role = (bench.get("extra_info") or {}).get("role")
        if role in ("subject", "baseline"):
            groups.setdefault(bench.get("group") or bench["name"], {}).setdefault(role, []).append(bench)
    out = {}
    for group, roles in sorted(groups.items()):
        baselines = roles.get("baseline", [])
        if len(baselines) > 1:
            raise ValueError(
                f"benchmark group {group!r} has {len(baselines)} baselines; one is needed "
                f"(extra_info['role'] = 'baseline')"
            )
        if not baselines:
            continue  # a partial run (-k, a failed baseline): nothing to divide by in this group
        base = baselines[0]
        for subject in roles.get("subject", []):
            key = f"{group}: {_short(subject['name'])} / {_short(base['name'])}"
            out[key] = subject["stats"]["median"] / base["stats"]["median"]
    return out


def _short(name: str) -> str:
    return name.removeprefix("test_")


def compare(
    current: dict[str, float], previous: dict[str, float] | None, tolerance: float
) -> list[tuple[str, float | None, float, str]]:
    """Rows ``(key, previous ratio, current ratio, verdict)``; verdict ``regressed`` past tolerance."""
    rows = []
    for key, now in current.items():
        before = previous.get(key) if previous else None
        if before is None:
            verdict = "new"
        elif now > before * (1 + tolerance):
            verdict = "regressed"
        elif now < before / (1 + tolerance):
            verdict = "improved"
        else:
            verdict = "same"
        rows.append((key, before, now, verdict))
    return rows


def previous_ratios(
    current: dict[str, float], older: list[Path]
) -> tuple[dict[str, float] | None, Path | None]:
    """Each current ratio from the newest earlier run that measured it (runs may cover subsets).

    Returns the ratios and the newest run that had any of them (None, None when none had).
    """
    found: dict[str, float] = {}
    newest = None
    for path in reversed(older):
        for key, value in ratios(load(path)).items():
            if key in current and key not in found:
                found[key] = value
                newest = newest or path
    return (found, newest) if found else (None, None)


def runs(directory: Path) -> list[Path]:
    """Every run under ``directory``, oldest first (by the run's own datetime field)."""
    found = []
    for path in directory.rglob("*.json"):
        try:
            found.append((load(path).get("datetime", ""), path))
        except (ValueError, json.JSONDecodeError):
            continue
    return [path for _when, path in sorted(found)]


def baseline_runs(baseline: Path | None, run: Path) -> list[Path]:
    """The runs to compare `run` with, oldest first: a JSON file, or every run in a directory but `run`."""
    if baseline is None:
        return []
    if not baseline.is_dir():
        return [baseline]
    older = [path for path in runs(baseline) if path.resolve() != run.resolve()]
    if not older:
        raise ValueError(f"{baseline}: no pytest-benchmark JSON files under it besides {run.name}")
    return older


def report(run: Path, baseline: Path | None = None, tolerance: float = DEFAULT_TOLERANCE) -> int:
    """Print `run`'s ratio table against `baseline`; 1 when a ratio regressed, 2 on bad input."""
    try:
        current = ratios(load(run))
        previous, old = previous_ratios(current, baseline_runs(baseline, run))
    except (OSError, ValueError, json.JSONDecodeError) as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    print(f"ratios of medians, subject / baseline in the same run (lower is better); run {run}")
    print(
        f"baseline: {old} (and older runs for ratios it lacks)" if old else "no baseline run to compare with"
    )
    width = max((len(k) for k in current), default=10)
    print(f"{'ratio':<{width}}  {'baseline':>9}  {'current':>9}  verdict")
    rows = compare(current, previous, tolerance)
    for key, before, now, verdict in rows:
        shown = f"{before:9.3f}" if before is not None else f"{'-':>9}"
        print(f"{key:<{width}}  {shown}  {now:9.3f}  {verdict}")
    regressed = [row for row in rows if row[3] == "regressed"]
    if regressed:
        print(f"{len(regressed)} ratio(s) grew by more than {tolerance:.0%}")
        return 1
    return 0


def figures(data: dict[str, Any]) -> list[str]:
    """One line per benchmark that recorded figures in ``extra_info`` (beyond its role): what a person reads."""
    lines = []
    for bench in data["benchmarks"]:
        extra = {k: v for k, v in (bench.get("extra_info") or {}).items() if k != "role"}
        if extra:
            shown = ", ".join(f"{k}={_figure(v)}" for k, v in extra.items())
            lines.append(f"{_short(bench['name'])}: {shown}")
    return lines


def _figure(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)
