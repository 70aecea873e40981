"""Each rank test's peak memory against its per-rank budget, as a chart people read at a glance.

Two renderings of the same numbers from `kit-report.json`: a Mermaid `xychart-beta` block per
memory side (host RSS, CUDA device), which GitHub renders in the job summary, and a PNG in
`reports/` through matplotlib, an optional dependency (without it, one line says the PNG was
skipped). Bars are each test's largest per-rank peak, the line is its budget; tests that declare
no budget on a side are left out of that side's chart and counted under it, since a line needs a
value for every bar. Stdlib only (matplotlib is imported when asked for: the `charts` extra).
The report is read through `megatron_testkit.report_input` (bounded, checked); text from it reaches the summary only escaped: a label keeps a small set of characters,
so a node id cannot end Mermaid's string or the fenced block.
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
    "Each rank test's peak memory against its per-rank budget, from a kit report (REPORT: kit-report.json"
    " or its folder, default reports/kit-report.json): Mermaid charts on stdout, and kit-memory.png beside"
    " the report when matplotlib (the charts extra) is installed."
)


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


def mermaid(report: dict[str, Any], side: str) -> str | None:
    """A fenced `mermaid` xychart-beta block for `side`, or None when no rank test has a budget there."""
    charted, unbudgeted = bars(report, side)
    if not charted:
        return None
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
    if unbudgeted:
        lines.append(f"\n{unbudgeted} rank test(s) declare no {side} budget: their peaks are in the table.")
    return "\n".join(lines) + "\n"


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
    blocks = [block for side, _ in SIDES if (block := mermaid(report, side))]
    if not blocks:
        return ""
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
    return text


def write_png(report_path: Path, png_path: Path) -> str:
    """Draw the charts into `png_path` with matplotlib; one line saying what happened (never raises on absence)."""
    if not Path(report_path).exists():
        return f"memory chart: no report at {printable(str(report_path))}, no PNG"
    report = _load(report_path)
    if isinstance(report, str):
        return f"memory chart: the report is unusable, no PNG ({report})"
    sides = [(side, title, bars(report, side)[0]) for side, title in SIDES]
    sides = [entry for entry in sides if entry[2]]
    if not sides:
        return "memory chart: no rank test declares a budget, no PNG"
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "memory chart: matplotlib is not installed, PNG skipped (the Mermaid chart is in the summary)"
    fig, axes = plt.subplots(len(sides), 1, figsize=(10, 3.5 * len(sides)), squeeze=False)
    for ax, (_, title, charted) in zip(axes[:, 0], sides, strict=True):
        xs = range(len(charted))
        ax.bar(xs, [b.peak / MIB for b in charted], label="peak per rank")
        ax.plot(xs, [b.budget / MIB for b in charted], "r_", markersize=30, mew=2, label="budget")
        ax.set_xticks(list(xs), [b.label for b in charted], rotation=30, ha="right", fontsize=7)
        ax.set_ylabel("MiB")
        ax.set_title(f"Peak {title} per rank against the budget")
        ax.legend(fontsize=7)
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=100)
    plt.close(fig)
    try:  # the kit's writer: atomic, never through a link in the report folder
        Folder(png_path.parent, what="chart folder").write_bytes(png_path.name, buffer.getvalue())
    except WriteRefused as exc:
        return f"memory chart: the PNG was not written ({exc})"
    return f"memory chart: {png_path}"


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
    print(memory_charts_markdown(report) or "no rank test declares a memory budget: no chart")
    print(write_png(report, report.with_name("kit-memory.png")))
    return 0
