"""The report's memory as charts people read at a glance: each rank's peak, each rank's memory over
time, the budgets where tests declare them, and recorded metric series against their golden values.

Two renderings from `kit-report.json`: Mermaid `xychart-beta` blocks, which GitHub renders in the
job summary, and a PNG in `reports/` through matplotlib, an optional dependency (without it, one
line says the PNG was skipped). In Mermaid, where a line needs a value for every bar, the budget
chart has one bar per rank test (its largest per-rank peak) against its budget and leaves out tests
without one (counted under it); the chart of each rank has a bar per rank and no budget line; memory
over time is drawn for the launch with the largest peak, a line per rank. Each Mermaid chart holds
a bounded number of bars (the tests closest to their budget, the largest peaks) so that a job of a
hundred tests stays readable; the PNG draws the budget only over the tests that declare one, and
the metric series of each test beside its golden values per step. Stdlib only (matplotlib is
imported when asked for: the `charts` extra). The report is read through
`megatron_testkit.report_input` (bounded, checked); text from it reaches the summary only escaped:
a label keeps a small set of characters, so a node id cannot end Mermaid's string or the fenced block.
"""

from __future__ import annotations

import io
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megatron_testkit.report_input import ReportError, code_span, load_report, printable
from megatron_testkit.safe_write import Folder, WriteRefused

MIB = 2**20
SIDES = (("host", "host RSS"), ("device", "CUDA device memory"))
_LABEL_CHARS = 40
CHART_HELP = (
    "The memory of each rank test from a kit report (REPORT: kit-report.json or its folder, default"
    " reports/kit-report.json): its peak against its per-rank budget, each rank's peak and each rank's"
    " memory over time as Mermaid charts on stdout; with matplotlib (the charts extra) installed, the same"
    " and each test's metric series against its golden values per step in kit-memory.png beside the report."
)
# A Mermaid chart in a job summary: at most this many bars (a hundred tests' bars are unreadable).
SUMMARY_BARS = 30
RANK_BARS = 40
# Memory over time in Mermaid: points on the time axis, and ranks drawn.
TIME_POINTS = 40
TIME_RANKS = 8
# The PNG: tests in the per-rank bars, launches drawn over time, metric series drawn.
PNG_TESTS = 40
PNG_LAUNCHES = 4
PNG_SERIES = 6


@dataclass(frozen=True)
class Bar:
    """One rank test on one side: its largest per-rank peak and its per-rank budget, in bytes."""

    label: str
    peak: int
    budget: int


# What a label may hold: anything else (quotes that end Mermaid's string, backticks that end the
# fence, newlines, markup) becomes "?".
_UNSAFE_LABEL = re.compile(r"[^A-Za-z0-9 _\-\[\].,:=+/()'@%*!~^|]")


def _label(nodeid: str) -> str:
    """The test's name without its file (`test_x[param]`), clipped, in characters safe in Mermaid."""
    name = _UNSAFE_LABEL.sub("?", nodeid.rsplit("::", 1)[-1].replace('"', "'"))
    return name if len(name) <= _LABEL_CHARS else name[: _LABEL_CHARS - 3] + "..."


def bars(report: dict[str, Any], side: str) -> tuple[list[Bar], int]:
    """The charted tests of `side` (launched ranks, measured a peak, declared a budget) and how many were not.

    The count left out is of rank tests with a measured peak but no budget on that side.
    """
    out: list[Bar] = []
    unbudgeted = 0
    for row in report.get("tests", []):
        if not row.get("world_size"):
            continue
        peak, budget = row.get(f"peak_{side}_bytes"), row.get(f"budget_{side}_bytes")
        if not isinstance(peak, int) or isinstance(peak, bool):
            continue
        if not isinstance(budget, int) or isinstance(budget, bool):
            unbudgeted += 1
            continue
        out.append(Bar(_label(row["nodeid"]), peak, budget))
    return out, unbudgeted


def _mib(n: int) -> str:
    return f"{n / MIB:.1f}".rstrip("0").rstrip(".")


def closest_to_budget(charted: list[Bar], limit: int) -> list[Bar]:
    """The `limit` bars with the largest peak against their budget, in the report's order."""
    if len(charted) <= limit:
        return charted
    kept = sorted(range(len(charted)), key=lambda i: -charted[i].peak / max(charted[i].budget, 1))[:limit]
    return [charted[i] for i in sorted(kept)]


def mermaid(report: dict[str, Any], side: str, limit: int | None = None) -> str | None:
    """A fenced `mermaid` xychart-beta block for `side`, or None when no rank test has a budget there;
    with `limit`, only that many bars: the tests closest to (or over) their budget."""
    charted, unbudgeted = bars(report, side)
    if not charted:
        return None
    left = 0
    if limit is not None and len(charted) > limit:
        left = len(charted) - limit
        charted = closest_to_budget(charted, limit)
    title = dict(SIDES)[side]
    top = max(max(b.peak, b.budget) for b in charted) * 1.1
    labels = ", ".join(f'"{b.label}"' for b in charted)
    lines = [
        "```mermaid",
        "xychart-beta",
        f'    title "Peak {title} per rank (bars) against the budget (line), MiB"',
        f"    x-axis [{labels}]",
        f'    y-axis "MiB" 0 --> {_mib(int(top))}',
        f"    bar [{', '.join(_mib(b.peak) for b in charted)}]",
        f"    line [{', '.join(_mib(b.budget) for b in charted)}]",
        "```",
    ]
    if left:
        lines.append(f"\n{left} more rank test(s) with a {side} budget, further under it: in the table.")
    if unbudgeted:
        lines.append(f"\n{unbudgeted} rank test(s) declare no {side} budget: their peaks are in the table.")
    return "\n".join(lines) + "\n"


@dataclass(frozen=True)
class RankBar:
    """One rank of one rank test on one side: its peak, and the test's per-rank budget (or None)."""

    test: str
    rank: int | None  # None: an older report's row without per-rank peaks (its largest rank)
    peak: int
    budget: int | None


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def rank_bars(report: dict[str, Any], side: str) -> list[list[RankBar]]:
    """Per rank test with a measured peak on `side`: one bar per rank, budget or not."""
    out = []
    for row in report.get("tests", []):
        if not row.get("world_size"):
            continue
        label, budget = _label(row["nodeid"]), _int(row.get(f"budget_{side}_bytes"))
        ranks = [
            RankBar(label, r["rank"], peak, budget)
            for r in row.get("ranks") or []
            if isinstance(r, dict) and (peak := _int(r.get(f"peak_{side}_bytes"))) is not None
        ]
        peak = _int(row.get(f"peak_{side}_bytes"))
        if not ranks and peak is not None:
            ranks = [RankBar(label, None, peak, budget)]
        if ranks:
            out.append(ranks)
    return out


def largest(groups: list[list[RankBar]], bars_at_most: int) -> list[list[RankBar]]:
    """The tests with the largest peaks, as many as fit in `bars_at_most` bars, in the report's order."""
    order = sorted(range(len(groups)), key=lambda i: -max(b.peak for b in groups[i]))
    kept, used = [], 0
    for i in order:
        if used + len(groups[i]) > bars_at_most and kept:
            break
        kept.append(i)
        used += len(groups[i])
    return [groups[i] for i in sorted(kept)]


def _rank_label(bar: RankBar) -> str:
    return bar.test if bar.rank is None else f"{bar.test} r{bar.rank}"


def mermaid_ranks(report: dict[str, Any], side: str, bars_at_most: int = RANK_BARS) -> str | None:
    """A fenced xychart-beta block with one bar per rank (the tests with the largest peaks, at most
    `bars_at_most` bars), budget or not; None when no rank test measured `side`."""
    groups = rank_bars(report, side)
    if not groups or not any(g[0].rank is not None for g in groups):
        return None  # an older report without per-rank peaks: the budget chart says it all
    shown = largest(groups, bars_at_most)
    charted = [bar for group in shown for bar in group]
    top = max(b.peak for b in charted) * 1.1
    lines = [
        "```mermaid",
        "xychart-beta",
        f'    title "Peak {dict(SIDES)[side]} of each rank, MiB"',
        f"    x-axis [{', '.join(f'{chr(34)}{_rank_label(b)}{chr(34)}' for b in charted)}]",
        f'    y-axis "MiB" 0 --> {_mib(int(top))}',
        f"    bar [{', '.join(_mib(b.peak) for b in charted)}]",
        "```",
    ]
    if len(shown) < len(groups):
        lines.append(
            f"\n{len(groups) - len(shown)} more rank test(s) with smaller peaks: each rank's in kit-report.json."
        )
    return "\n".join(lines) + "\n"


@dataclass(frozen=True)
class Timeline:
    """One launch's memory over time: its test, each rank's (seconds, bytes) samples, its budget."""

    test: str
    ranks: dict[int, list[tuple[float, int]]]
    budget: int | None

    @property
    def peak(self) -> int:
        """The largest sample of any rank."""
        return max(b for samples in self.ranks.values() for _, b in samples)

    @property
    def end(self) -> float:
        """The last sample's time."""
        return max(t for samples in self.ranks.values() for t, _ in samples)


def timelines(report: dict[str, Any]) -> list[Timeline]:
    """Every launch that recorded memory over time (a report of version 4 or later)."""
    out = []
    for row in report.get("tests", []):
        budget = _int(row.get("budget_host_bytes"))
        for launch in row.get("launches") or []:
            memory = launch.get("memory") if isinstance(launch, dict) else None
            ranks: dict[int, list[tuple[float, int]]] = {}
            for series in memory or []:
                if isinstance(series, dict) and _int(series.get("rank")) is not None:
                    pairs = zip(series.get("t_s") or [], series.get("rss_bytes") or [], strict=False)
                    ranks[series["rank"]] = [(float(t), int(b)) for t, b in pairs]
            ranks = {r: samples for r, samples in ranks.items() if samples}
            if ranks:
                out.append(Timeline(_label(row["nodeid"]), ranks, budget))
    return out


def on_grid(samples: list[tuple[float, int]], end: float, points: int) -> list[int]:
    """The samples on `points` even steps from 0 to `end`: each step the largest sample within it,
    else the last one before it (0 before the first)."""
    width = end / points if end > 0 else 1.0
    out: list[int] = []
    last, i = 0, 0
    for k in range(points):
        upper = (k + 1) * width
        inside = []
        while i < len(samples) and (samples[i][0] < upper or k == points - 1):
            inside.append(samples[i][1])
            i += 1
        last = max(inside) if inside else last
        out.append(last)
    return out


def mermaid_over_time(report: dict[str, Any]) -> str | None:
    """A fenced xychart-beta block of host RSS over time, a line per rank, for the launch with the
    largest peak (its budget as a line when the test has one); None without such a launch."""
    found = timelines(report)
    if not found:
        return None
    launch = max(found, key=lambda t: t.peak)
    ranks = sorted(launch.ranks, key=lambda r: -max(b for _, b in launch.ranks[r]))[:TIME_RANKS]
    lines_of = {r: on_grid(launch.ranks[r], launch.end, TIME_POINTS) for r in sorted(ranks)}
    top = max(launch.peak, launch.budget or 0) * 1.1
    end = max(launch.end, 0.1)
    budget = f"; the budget: the flat line at {_mib(launch.budget)}" if launch.budget else ""
    lines = [
        "```mermaid",
        "xychart-beta",
        f'    title "Host RSS over time, {launch.test}: a line per rank ({", ".join(f"r{r}" for r in sorted(ranks))}), MiB"',
        f'    x-axis "seconds from spawn" 0 --> {end:.1f}',
        f'    y-axis "MiB" 0 --> {_mib(int(top))}',
        *(f"    line [{', '.join(_mib(v) for v in values)}]" for values in lines_of.values()),
    ]
    if launch.budget:
        lines.append(f"    line [{', '.join([_mib(launch.budget)] * TIME_POINTS)}]")
    lines.append("```")
    more = len(launch.ranks) - len(ranks)
    notes = [f"The launch with the largest peak of {plural_tests(len(found))}{budget}."]
    if more:
        notes.append(f"{more} more rank(s) with smaller peaks are in kit-report.json.")
    return "\n".join(lines) + "\n\n" + " ".join(notes) + "\n"


def plural_tests(n: int) -> str:
    """``1 launch`` / ``3 launches`` that recorded memory over time."""
    return f"{n} launch{'es' if n != 1 else ''} that recorded memory over time"


def _load(path: Path) -> dict[str, Any] | str:
    """The checked report, or one line saying why there is none."""
    try:
        return load_report(path)
    except ReportError as exc:
        return printable(str(exc), 300)


def memory_charts_markdown(report_path: Path) -> str:
    """The summary's chart section: '' when the report is missing or nothing has a budget, one
    line when the report is unusable."""
    if not Path(report_path).exists():
        return ""
    report = _load(report_path)
    if isinstance(report, str):
        return f"Memory chart: none, the report is unusable ({report}).\n"
    blocks = [block for side, _ in SIDES if (block := mermaid(report, side, SUMMARY_BARS))]
    more = [block for side, _ in SIDES if (block := mermaid_ranks(report, side))]
    over_time = mermaid_over_time(report)
    if over_time:
        more.append(over_time)
    if not blocks:
        return "### Memory of each rank\n\n" + "\n".join(more) if more else ""
    over = [
        f"{code_span(row['nodeid'])} ({side})"
        for row in report.get("tests", [])
        for side, _ in SIDES
        if isinstance(row.get(f"peak_{side}_bytes"), int)
        and isinstance(row.get(f"budget_{side}_bytes"), int)
        and row[f"peak_{side}_bytes"] > row[f"budget_{side}_bytes"]
    ]
    text = "### Peak memory per rank against its budget\n\n" + "\n".join(blocks)
    if over:
        text += "\nOver budget: " + ", ".join(over) + "\n"
    if more:
        text += "\n### Memory of each rank\n\n" + "\n".join(more)
    return text


@dataclass(frozen=True)
class SeriesChart:
    """One recorded metric series of a test beside its golden values, per step."""

    test: str
    name: str
    recorded: list[tuple[float, float]]
    golden: list[tuple[float, float]]


def _step(step: str) -> float | None:
    try:
        return float(step)
    except ValueError:
        return None  # a label (rank0, ...): not a step on an axis


def metric_series(report: dict[str, Any], root: Path) -> list[SeriesChart]:
    """Each recorded series with numeric steps, beside the golden values of the test's golden file
    under `root` (the project's root, where the node ids are relative to); none where it has none."""
    from megatron_testkit import golden
    from megatron_testkit.metrics import TestMetrics

    out = []
    for row in report.get("tests", []):
        metrics = row.get("metrics")
        if not isinstance(metrics, dict):
            continue
        try:
            found = TestMetrics.from_json(metrics)
            module, name = golden.golden_stem(row["nodeid"])
            path = golden.find_golden(
                golden.golden_paths(root / module, name, found.platform, found.megatron_core)
            )
            want = golden.read_golden(path) if path is not None else None
        except (ValueError, OSError):
            continue  # a node id or golden file the kit refuses: the series alone is not worth a guess
        for series_name, series in sorted(found.series.items()):
            recorded = sorted((x, float(v)) for k, v in series.values.items() if (x := _step(k)) is not None)
            if len(recorded) < 2:
                continue  # a single value (or labels) is a table's, not a chart's
            other = want.series.get(series_name) if want is not None else None
            golden_values = (
                sorted((x, float(v)) for k, v in other.values.items() if (x := _step(k)) is not None)
                if other is not None
                else []
            )
            out.append(SeriesChart(_label(row["nodeid"]), series_name, recorded, golden_values))
    return out


def write_png(report_path: Path, png_path: Path, root: Path | None = None) -> str:
    """Draw the charts into `png_path` with matplotlib: each rank's peak per side (the budget over
    the tests that declare one), memory over time per rank for the launches with the largest peaks,
    and each metric series against its golden values (golden files under `root`, default the
    working directory); one line saying what happened (never raises on absence)."""
    if not Path(report_path).exists():
        return f"memory chart: no report at {printable(str(report_path))}, no PNG"
    report = _load(report_path)
    if isinstance(report, str):
        return f"memory chart: the report is unusable, no PNG ({report})"
    sides = [
        (title, largest(groups, 10**9)[:PNG_TESTS])
        for side, title in SIDES
        if (groups := rank_bars(report, side))
    ]
    over_time = sorted(timelines(report), key=lambda t: -t.peak)[:PNG_LAUNCHES]
    series = metric_series(report, Path.cwd() if root is None else root)[:PNG_SERIES]
    if not (sides or over_time or series):
        return "memory chart: no rank test measured memory and no test recorded a series, no PNG"
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "memory chart: matplotlib is not installed, PNG skipped (the Mermaid chart is in the summary)"
    panels = len(sides) + len(over_time) + len(series)
    fig, axes = plt.subplots(panels, 1, figsize=(11, 3.6 * panels), squeeze=False)
    ax_iter = iter(axes[:, 0])
    for title, groups in sides:
        _rank_bars_panel(next(ax_iter), title, groups)
    for timeline in over_time:
        _over_time_panel(next(ax_iter), timeline)
    for chart in series:
        _series_panel(next(ax_iter), chart)
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=100)
    plt.close(fig)
    try:  # the kit's writer: atomic, never through a link in the report folder
        Folder(png_path.parent, what="chart folder").write_bytes(png_path.name, buffer.getvalue())
    except WriteRefused as exc:
        return f"memory chart: the PNG was not written ({exc})"
    return f"memory chart: {png_path}"


def _outside_legend(ax: Any) -> None:
    """The legend beside the plot, never over a bar or the budget."""
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0), borderaxespad=0.0)


def _rank_bars_panel(ax: Any, title: str, groups: list[list[RankBar]]) -> None:
    """One bar per rank, grouped by test; the budget as a segment over the tests that declare one."""
    x, ticks, labels = 0.0, [], []
    budget_drawn = False
    for group in groups:
        xs = [x + i for i in range(len(group))]
        ax.bar(
            xs, [b.peak / MIB for b in group], color="tab:blue", label="peak of a rank" if not ticks else None
        )
        if group[0].budget is not None:
            ax.hlines(
                group[0].budget / MIB, xs[0] - 0.45, xs[-1] + 0.45, colors="tab:red", linewidth=2,
                label="per-rank budget" if not budget_drawn else None,
            )  # fmt: skip
            budget_drawn = True
        ticks += xs
        labels += [f"r{b.rank}" if b.rank is not None else "max" for b in group]
        ax.text((xs[0] + xs[-1]) / 2, 0, group[0].test, rotation=90, ha="center", va="bottom", fontsize=6)
        x = xs[-1] + 2
    ax.set_xticks(ticks, labels, fontsize=6)
    ax.set_ylabel("MiB")
    ax.set_title(f"Peak {title} of each rank (grouped by test; a budget only where the test declares one)")
    _outside_legend(ax)


def _over_time_panel(ax: Any, timeline: Timeline) -> None:
    """A line per rank over the launch; the budget only when the test declares one."""
    for rank in sorted(timeline.ranks):
        samples = timeline.ranks[rank]
        ax.plot([t for t, _ in samples], [b / MIB for _, b in samples], label=f"rank {rank}")
    if timeline.budget is not None:
        ax.axhline(timeline.budget / MIB, color="tab:red", linestyle="--", label="per-rank budget")
    ax.set_xlabel("seconds from spawn")
    ax.set_ylabel("MiB")
    ax.set_title(f"Host RSS over time: {timeline.test}")
    _outside_legend(ax)


def _series_panel(ax: Any, chart: SeriesChart) -> None:
    """A recorded series per step, and its golden values where the test has a golden file."""
    ax.plot([s for s, _ in chart.recorded], [v for _, v in chart.recorded], "o-", label="this run")
    if chart.golden:
        ax.plot([s for s, _ in chart.golden], [v for _, v in chart.golden], "x--", label="golden")
    ax.set_xlabel("step")
    ax.set_title(f"{chart.name}: {chart.test}" + ("" if chart.golden else " (no golden file found)"))
    _outside_legend(ax)


def main(args: list[str], prog: str = "python -m megatron_testkit") -> int:
    """``chart [REPORT]``: the Mermaid charts, then the PNG beside the report (`prog` names the
    command line in errors).

    A missing or unusable report is one line on stderr and exit code 2, never a traceback.
    """
    if args[:1] in (["-h"], ["--help"]):
        print(f"usage: {prog} chart [REPORT]\n\n{CHART_HELP}")
        return 0
    if len(args) > 1 or any(arg.startswith("-") for arg in args):
        print(
            f"{prog}: error: chart: expected at most one report path, got {printable(str(args))}",
            file=sys.stderr,
        )
        return 2
    report = Path(args[0]) if args else Path("reports/kit-report.json")
    if report.is_dir():
        report = report / "kit-report.json"  # the report folder (--kit-report DIR)
    loaded = _load(report) if report.is_file() else f"no report at {printable(str(report))}"
    if isinstance(loaded, str):
        print(f"{prog}: error: chart: {loaded}", file=sys.stderr)
        return 2
    print(memory_charts_markdown(report) or "no rank test measured memory: no chart")
    print(write_png(report, report.with_name("kit-memory.png")))
    return 0
