"""Compare a pytest-benchmark run with a baseline run, by ratios measured within each run.

Shared runners are noisy: an absolute time says more about the neighbours than about the code.
Each benchmark of ``ci/benchmarks`` times the kit's code and what it is compared with (the syncing
loop, ``torch.multiprocessing.spawn``, a step without the inspector) round by round in one test,
and records the ratio of their medians itself: ``extra_info["ratios"] = {"subject / baseline":
value}``. A group of separate tests marked ``extra_info["role"]`` (``"subject"``, ``"baseline"``)
gives ``median(subject) / median(baseline)`` instead, which drifts with the machine's speed
between the tests. Lower is better. A ratio that grew by more than the tolerance (default 25%) is
a regression. `python -m ci bench --compare BASELINE` uses this.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

# How much a ratio may grow before it counts as a regression: shared runners move a ratio of two
# medians by ~10% run to run, so 25% flags a real slowdown without flagging noise.
DEFAULT_TOLERANCE = 0.25
# How many runs a history directory keeps (`prune`): a month of nights, a few MB of JSON.
HISTORY_KEEP = 30
PROG = "python -m ci bench"  # the command that prints the table, named in its error messages
# One line of the table: the ratio's name, its earlier value (None: new), its value now, the verdict.
Row = tuple[str, float | None, float, str]


def load(path: Path) -> dict[str, Any]:
    """A pytest-benchmark JSON file (``--benchmark-json`` or ``--benchmark-autosave``)."""
    data = json.loads(path.read_text())
    if "benchmarks" not in data:
        raise ValueError(f"{path}: not a pytest-benchmark JSON file (no 'benchmarks' list)")
    return data


def ratios(data: dict[str, Any]) -> dict[str, float]:
    """``{"group: subject / baseline": ratio}``: every subject of every group, every recorded ratio."""
    groups: dict[str, dict[str, list[dict[str, Any]]]] = {}
    out = {}
    for bench in data["benchmarks"]:
        extra = bench.get("extra_info") or {}
        out.update(_recorded(bench, extra.get("ratios")))
        if extra.get("role") in ("subject", "baseline"):
            groups.setdefault(bench.get("group") or bench["name"], {}).setdefault(extra["role"], []).append(
                bench
            )
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


def _recorded(bench: dict[str, Any], recorded: Any) -> dict[str, float]:
    """The ratios a benchmark measured itself (``extra_info["ratios"]``), keyed by its group."""
    if recorded is None:
        return {}
    where = f"benchmark {bench.get('name')!r}: extra_info['ratios']"
    if not isinstance(recorded, dict):
        raise ValueError(f"{where} must map 'subject / baseline' to a ratio, got {type(recorded).__name__}")
    out = {}
    for name, value in recorded.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise ValueError(f"{where}[{name!r}] = {value!r}: a ratio is a number > 0")
        out[f"{bench.get('group') or bench['name']}: {name}"] = float(value)
    return out


def _short(name: str) -> str:
    return name.removeprefix("test_")


def compare(current: dict[str, float], previous: dict[str, float] | None, tolerance: float) -> list[Row]:
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


def baseline_runs(baseline: Path | None, run: Path, *, history: bool = False) -> list[Path]:
    """The runs to compare `run` with, oldest first: a JSON file, or every run in a directory but `run`.

    A `history` directory may hold no other run (the first night): then there is nothing to compare.
    """
    if baseline is None:
        return []
    if not baseline.is_dir():
        return [baseline]
    older = [path for path in runs(baseline) if path.resolve() != run.resolve()]
    if not older and not history:
        raise ValueError(f"{baseline}: no pytest-benchmark JSON files under it besides {run.name}")
    return older


def prune(directory: Path, keep: int = HISTORY_KEEP) -> list[Path]:
    """Delete all but the newest `keep` runs under `directory`; returns what was deleted."""
    older = runs(directory)[:-keep] if keep > 0 else runs(directory)
    for path in older:
        path.unlink()
    return older


def report(
    run: Path,
    baseline: Path | None = None,
    tolerance: float = DEFAULT_TOLERANCE,
    *,
    history: bool = False,
    markdown: Path | None = None,
) -> int:
    """Print `run`'s ratio table against `baseline`; 1 when a ratio regressed, 2 on bad input.

    `history`: `baseline` is the directory of earlier nights, possibly none yet. `markdown`: the
    same table written there as Markdown (for a CI job's summary).
    """
    try:
        current = ratios(load(run))
        previous, old = previous_ratios(current, baseline_runs(baseline, run, history=history))
    except (OSError, ValueError, json.JSONDecodeError) as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    rows = compare(current, previous, tolerance)
    regressed = [row for row in rows if row[3] == "regressed"]
    against = (
        f"baseline: {old} (and older runs for ratios it lacks)" if old else "no baseline run to compare with"
    )
    verdict = f"{len(regressed)} ratio(s) grew by more than {tolerance:.0%}" if regressed else ""
    print(f"ratios of medians, subject / baseline in the same run (lower is better); run {run}")
    print(against)
    print("\n".join(table_lines(rows)))
    if verdict:
        print(verdict)
    if markdown is not None:
        markdown.parent.mkdir(parents=True, exist_ok=True)
        markdown.write_text(markdown_table(rows, against, verdict or "no ratio regressed", tolerance))
    return 1 if regressed else 0


def table_lines(rows: list[Row]) -> list[str]:
    """The ratio table as text: ratio, baseline, current, verdict."""
    width = max((len(row[0]) for row in rows), default=10)
    lines = [f"{'ratio':<{width}}  {'baseline':>9}  {'current':>9}  verdict"]
    for key, before, now, verdict in rows:
        shown = f"{before:9.3f}" if before is not None else f"{'-':>9}"
        lines.append(f"{key:<{width}}  {shown}  {now:9.3f}  {verdict}")
    return lines


def markdown_table(rows: list[Row], against: str, verdict: str, tolerance: float) -> str:
    """The ratio table as Markdown, with what it was compared with and the verdict."""
    lines = [
        "## Benchmarks",
        "",
        "Ratios of medians, subject / baseline measured in the same run (lower is better); a ratio "
        f"that grew by more than {tolerance:.0%} against the earlier run fails the job. {against}.",
        "",
        "| ratio | earlier | now | change | verdict |",
        "|---|---:|---:|---:|---|",
    ]
    for key, before, now, row_verdict in rows:
        earlier = f"{before:.3f}" if before is not None else "-"
        change = f"{now / before - 1:+.0%}" if before else "-"
        lines.append(f"| {key} | {earlier} | {now:.3f} | {change} | {row_verdict} |")
    return "\n".join([*lines, "", f"**{verdict}**", ""])


def figures(data: dict[str, Any]) -> list[str]:
    """One line per benchmark that recorded figures in ``extra_info`` (beyond its role and ratios): what a person reads."""
    lines = []
    for bench in data["benchmarks"]:
        extra = {k: v for k, v in (bench.get("extra_info") or {}).items() if k not in ("role", "ratios")}
        if extra:
            shown = ", ".join(f"{k}={_figure(v)}" for k, v in extra.items())
            lines.append(f"{_short(bench['name'])}: {shown}")
    return lines


def _figure(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)
