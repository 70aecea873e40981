"""Compare a pytest-benchmark run with the previous one, by ratios measured within each run.

Shared runners are noisy: an absolute time says more about the neighbours than about the code.
Each benchmark group of ``ci/benchmarks`` holds the kit's code (``extra_info["role"] ==
"subject"``) and what it is compared with in the same run (``"baseline"``: the syncing loop,
``torch.multiprocessing.spawn``, a step without the inspector). The figure compared run against
run is ``median(subject) / median(baseline)``; lower is better. A ratio that grew by more than
``--tolerance`` (default 25%) is a regression and the exit code is 1.

    python -m pytest ci/benchmarks --benchmark-only --benchmark-storage=reports/benchmarks --benchmark-autosave
    python -m ci.bench_compare reports/benchmarks          # newest run against the ones before
    python -m ci.bench_compare NEW.json OLD.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any


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
        base = baselines[0] if baselines else None
        if base is None:
            continue  # a partial run (-k, a failed baseline): nothing to divide by in this group
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


def _runs(directory: Path) -> list[Path]:
    """Every run under ``directory``, oldest first (by the run's own datetime field)."""
    runs = []
    for path in directory.rglob("*.json"):
        try:
            runs.append((load(path).get("datetime", ""), path))
        except (ValueError, json.JSONDecodeError):
            continue
    return [path for _when, path in sorted(runs)]


def main(argv: list[str] | None = None) -> int:
    """Print the ratio table; exit 1 when a ratio regressed, 2 on bad input."""
    parser = argparse.ArgumentParser(prog="python -m ci.bench_compare", description=__doc__.splitlines()[0])
    parser.add_argument("current", type=Path, help="a run's JSON, or a storage directory of runs")
    parser.add_argument("previous", type=Path, nargs="?", help="the run to compare with")
    parser.add_argument("--tolerance", type=float, default=0.25, help="relative growth of a ratio allowed")
    options = parser.parse_args(argv)
    try:
        if options.current.is_dir():
            runs = _runs(options.current)
            if not runs:
                raise ValueError(f"{options.current}: no pytest-benchmark JSON files under it")
            new, older = runs[-1], runs[:-1]
        else:
            new, older = options.current, [options.previous] if options.previous else []
        current = ratios(load(new))
        previous, old = previous_ratios(current, older)
    except (OSError, ValueError, json.JSONDecodeError) as exc:
        print(f"bench_compare: {exc}", file=sys.stderr)
        return 2
    print(f"ratios of medians, subject / baseline in the same run (lower is better); run {new}")
    print(
        f"previous run: {old} (and older ones for ratios it lacks)"
        if old
        else "no previous run to compare with"
    )
    width = max((len(k) for k in current), default=10)
    print(f"{'ratio':<{width}}  {'previous':>9}  {'current':>9}  verdict")
    rows = compare(current, previous, options.tolerance)
    for key, before, now, verdict in rows:
        shown = f"{before:9.3f}" if before is not None else f"{'-':>9}"
        print(f"{key:<{width}}  {shown}  {now:9.3f}  {verdict}")
    regressed = [row for row in rows if row[3] == "regressed"]
    if regressed:
        print(f"{len(regressed)} ratio(s) grew by more than {options.tolerance:.0%}")
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
