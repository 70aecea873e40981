"""Merge the kit reports of a multi-node torchrun job into one, naming each failure by node and rank.

Under torchrun every rank is its own pytest process and writes its own report; launch them with
``--kit-report=DIR/node$GROUP_RANK/rank$RANK`` (torchrun sets both variables) so that the path
says which node and global rank a report came from. Then

    python -m megatron_testkit merge-reports OUT DIR [DIR ...]

finds every ``kit-report.json`` under the DIRs and writes ``OUT/kit-report.{json,md}``: one row per
test, its ranks labelled with their node, its failure the root cause across all processes (a
failure that is not a knock-on of a peer going away, the lowest global rank on ties), every
process' failure listed, and the ranks whose report is missing (a process killed before it wrote
one) named in the session header.
"""

from __future__ import annotations

import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megatron_testkit.diagnosis import RankRecord, classify
from megatron_testkit.report import build_report, format_markdown
from megatron_testkit.report_input import MAX_REPORT_BYTES, ReportError, code_span, load_report, printable
from megatron_testkit.safe_write import Folder, WriteRefused
from megatron_testkit.schema import MAX_GPUS, MAX_WORLD_SIZE

# Reports merged at once: one per process of the largest job the kit merges.
MAX_SOURCES = MAX_WORLD_SIZE
# Their summed size: each is read whole and merged in memory (parsed JSON is ~10x its text).
MAX_TOTAL_BYTES = 8 * MAX_REPORT_BYTES

_NODE = re.compile(r"^node[-_]?(\d{1,9})$")
_RANK = re.compile(r"^rank[-_]?(\d{1,9})$")
_FIRST_LINE = re.compile(r"^rank (\d+) (\w+): (?:([\w.]+): )?(.*)$")
_WORST = {"passed": 0, "skipped": 1, "failed": 2, "error": 3}


@dataclass(frozen=True)
class Source:
    """One process' report and where it came from."""

    node: int
    rank: int | None
    path: Path
    report: dict[str, Any]


def find_reports(dirs: list[Path], exclude: Path | None = None) -> list[Source]:
    """Every ``kit-report.json`` under ``dirs``; node and rank from ``node<N>``/``rank<R>`` in the path.

    A report outside any ``node<N>`` directory belongs to node ``i``, the position of its DIR.
    """
    found: list[tuple[int, Path]] = []
    total = 0
    for index, base in enumerate(dirs):
        if not base.is_dir():
            raise ValueError(f"merge-reports: {base} is not a directory")
        for path in sorted(base.rglob("kit-report.json")):
            if exclude is not None and exclude.resolve() in path.resolve().parents:
                continue
            total += path.stat().st_size
            # Checked before any report is parsed: 262 MB of reports were read for 145 s first.
            if len(found) >= MAX_SOURCES or total > MAX_TOTAL_BYTES:
                raise ValueError(
                    f"merge-reports: more than {MAX_SOURCES} reports or {MAX_TOTAL_BYTES} bytes under "
                    f"{printable(str(base))}: not one job's reports"
                )
            found.append((index, path))
    sources: list[Source] = []
    for index, path in found:
        parts = path.resolve().parts
        node = next((int(m[1]) for p in reversed(parts) if (m := _NODE.match(p))), index)
        rank = next((int(m[1]) for p in reversed(parts) if (m := _RANK.match(p))), None)
        try:
            report = load_report(path)  # bounded and checked field by field, as every reader does
        except ReportError as exc:
            raise ValueError(f"merge-reports: {printable(str(exc), 300)}") from None
        sources.append(Source(node, rank, path, report))
    if not sources:
        raise ValueError(f"merge-reports: no kit-report.json under {', '.join(map(str, dirs))}")
    return sources


def _process_rank(source: Source, row: dict[str, Any]) -> int | None:
    if source.rank is not None:
        return source.rank
    failure = row.get("failure") or {}
    if failure.get("rank") is not None:
        return failure["rank"]
    ranks = [r["rank"] for r in row.get("ranks", [])]
    return ranks[0] if len(ranks) == 1 else None


def _is_knock_on(failure: dict[str, Any]) -> bool:
    """Whether a failure only says that a peer went away (the kit's own knock-on rule)."""
    match = _FIRST_LINE.match(failure.get("first_line") or "")
    record = RankRecord(
        rank=failure.get("rank") or 0,
        status="failed",
        exc_type=(match[3] if match else None) or "Exception",
        exc_message=match[4] if match else failure.get("first_line") or "",
    )
    classify(record)
    return record.knock_on


def _fold(merged: dict[str, Any], row: dict[str, Any], source: Source, rank: int | None) -> None:
    """Fold one process' row of a test into the test's merged row."""
    merged["outcome"] = max(merged["outcome"], row["outcome"], key=lambda o: _WORST.get(o, 0))
    merged["duration_s"] = max(merged["duration_s"], row.get("duration_s") or 0.0)
    merged["world_size"] = max(merged["world_size"], row.get("world_size") or 0)
    merged["backend"] = merged["backend"] or row.get("backend")
    merged["seed"] = merged["seed"] if merged["seed"] is not None else row.get("seed")
    for key in ("budget_host_bytes", "budget_device_bytes"):
        merged[key] = merged[key] if merged[key] is not None else row.get(key)
    merged["leaked_processes"] += row.get("leaked_processes") or 0
    for r in row.get("ranks", []):
        merged["ranks"].append({**r, "node": source.node})
    for key in ("peak_host_bytes", "peak_device_bytes"):
        values = [v for v in (merged[key], row.get(key)) if v is not None]
        merged[key] = max(values) if values else None
    if row.get("failure"):
        merged["failures"].append(
            {**row["failure"], "node": source.node, "process_rank": rank, "report": str(source.path)}
        )


def _session(sources: list[Source], world: int, seen: set[tuple[int, int | None]]) -> dict[str, Any]:
    """The merged session header: where each report came from, the nodes, the ranks with no report."""
    expected = set(range(min(world, MAX_WORLD_SIZE)))
    ranks_seen = {rank for _node, rank in seen if rank is not None}
    first = sources[0].report["session"]
    return {
        "merged_from": [
            {
                "node": s.node,
                "rank": s.rank,
                "path": str(s.path),
                "host": s.report["session"].get("host"),
                "outcome_counts": s.report["session"].get("outcome_counts"),
            }
            for s in sources
        ],
        "nodes": sorted({s.node for s in sources}),
        "missing_ranks": sorted(expected - ranks_seen) if ranks_seen else [],
        "host": ", ".join(sorted({str(s.report["session"].get("host")) for s in sources})),
        "cpu_count": first.get("cpu_count"),
        "gpus": min(
            sum(s.report["session"].get("gpus") or 0 for s in sources if s.rank in (None, 0)), MAX_GPUS
        ),
        "torch": first.get("torch"),
        "duration_s": max(s.report["session"].get("duration_s") or 0 for s in sources),
        "markexpr": first.get("markexpr", ""),
    }


def merge(sources: list[Source]) -> dict[str, Any]:
    """The merged report, in the kit report's schema plus ``node`` on ranks and failures."""
    rows: dict[str, dict[str, Any]] = {}
    seen: set[tuple[int, int | None]] = set()
    # Per test, the processes (node, rank) that reported it: kept by test as the rows come, so the
    # merge stays linear in the rows (a scan of every seen test per test was quadratic).
    processes: dict[str, set[tuple[int, int | None]]] = {}
    world = 0
    for source in sources:
        for row in source.report["tests"]:
            rank = _process_rank(source, row)
            seen.add((source.node, rank))
            processes.setdefault(row["nodeid"], set()).add((source.node, rank))
            world = max(world, row.get("world_size") or 0)
            _fold(rows.setdefault(row["nodeid"], _empty_row(row["nodeid"])), row, source, rank)
    # Under torchrun every rank names the same root cause (the kit gathers each rank's outcome):
    # the root's node is the node of the process that holds that rank, not of the reporting one.
    rank_nodes = {rank: node for node, rank in seen if rank is not None}
    for nodeid, merged in rows.items():
        merged["ranks"].sort(key=lambda r: (r["rank"], r["node"]))
        # Under torchrun each process is one rank: a test whose ranks all failed before the kit
        # could record a launch still ran on as many ranks as processes reported it.
        merged["world_size"] = min(max(merged["world_size"], len(processes[nodeid])), MAX_WORLD_SIZE)
        merged["failure"] = _root(merged["failures"], rank_nodes)
    session = _session(sources, world, seen)
    return _with_node_fields(build_report(session, list(rows.values())), list(rows.values()))


def _with_node_fields(report: dict[str, Any], rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The schema-checked report with what only a merge knows put back on each row.

    `build_report` parses the rows through the typed schema (`megatron_testkit.schema`), which
    keeps exactly the kit report's fields; a merged report adds ``node`` to each rank and to the
    failure, and ``failures`` (every process' failure, with ``node``, ``process_rank`` and
    ``report``). Readers of the kit schema ignore those extra keys.
    """
    by_id = {row["nodeid"]: row for row in rows}
    for entry in report["tests"]:
        merged = by_id[entry["nodeid"]]
        entry["ranks"] = [
            {**checked, "node": source["node"]}
            for checked, source in zip(entry["ranks"], merged["ranks"], strict=True)
        ]
        if entry["failure"] is not None:
            root = merged["failure"]
            entry["failure"] = {
                **entry["failure"],
                **{k: root[k] for k in ("node", "process_rank", "report")},
            }
        entry["failures"] = merged["failures"]
    return report


def _empty_row(nodeid: str) -> dict[str, Any]:
    return {
        "nodeid": nodeid,
        "outcome": "passed",
        "duration_s": 0.0,
        "world_size": 0,
        "backend": None,
        "seed": None,
        "budget_host_bytes": None,
        "budget_device_bytes": None,
        "peak_host_bytes": None,
        "peak_device_bytes": None,
        "ranks": [],
        "failure": None,
        "failures": [],
        "pytest_rss_before_bytes": None,
        "pytest_rss_after_bytes": None,
        "leaked_processes": 0,
        "log_dir": None,
    }


def _root(failures: list[dict[str, Any]], rank_nodes: dict[int, int] | None = None) -> dict[str, Any] | None:
    """The failure to lead with: named by the launcher, not a knock-on, lowest global rank, as the
    failing rank's own process reported it where it did; its node is that rank's (`rank_nodes`)."""
    if not failures:
        return None
    named = [f for f in failures if f.get("kind") and f.get("rank") is not None]
    pool = [f for f in named if not _is_knock_on(f)] or named or failures
    root = min(
        pool,
        key=lambda f: (
            f.get("rank") if f.get("rank") is not None else 1 << 30,
            f.get("process_rank") != f.get("rank"),
            f["node"],
        ),
    )
    node = (rank_nodes or {}).get(root.get("rank"), root["node"])
    first = root.get("first_line") or ""
    return {**root, "node": node, "first_line": f"node {node}: {first}"}


def format_merged_markdown(report: dict[str, Any]) -> str:
    """The kit report's Markdown, then every process' failure by node and rank, then what is missing."""
    lines = [format_markdown(report).rstrip(), ""]
    session = report["session"]
    lines.append(
        f"Merged from {len(session['merged_from'])} reports on nodes {', '.join(map(str, session['nodes']))}."
    )
    if session["missing_ranks"]:
        lines.append(f"No report from rank(s) {', '.join(map(str, session['missing_ranks']))}.")
    failing = [row for row in report["tests"] if row["failures"]]
    if failing:
        lines += ["", "### Failures by node and rank", ""]
        for row in failing:
            root = row["failure"]
            lines.append(
                f"- {code_span(row['nodeid'], 300)}: root cause node {root['node']}, "
                f"rank {root.get('rank')}, "
                f"{printable(root.get('kind') or 'unnamed', 40)}"
            )
            for f in row["failures"]:
                lines.append(
                    f"  - node {f['node']}, process rank {f['process_rank']}: "
                    f"{printable(f.get('first_line') or '', 300).replace('|', '/')}"
                )
    return "\n".join(lines) + "\n"


def write(report: dict[str, Any], out: Path) -> tuple[Path, Path]:
    """Write ``OUT/kit-report.json`` and ``OUT/kit-report.md`` through the kit's writer (atomic,
    never through a link: `WriteRefused` in one line for ``OUT/kit-report.json`` that is one)."""
    folder = Folder(out, what="merge-reports OUT")
    for name in ("kit-report.json", "kit-report.md"):  # both refused before either is written:
        target = folder.path / name  # a refusal leaves no half of a pair
        if target.is_symlink() or (target.exists() and not target.is_file()):
            raise WriteRefused(
                f"{printable(str(target), 300)} is a link or not a file: the kit never writes through one"
            )
    json_path = folder.write_text(
        "kit-report.json", json.dumps(report, indent=2, default=str, allow_nan=False) + "\n"
    )
    md_path = folder.write_text("kit-report.md", format_merged_markdown(report))
    return json_path, md_path


MERGE_HELP = (
    "Merge the kit reports of a multi-node torchrun job (each node's --kit-report folder, DIR...) into one"
    " report folder OUT: kit-report.json and kit-report.md, one row per test with every node's ranks."
)


def main(argv: list[str], prog: str = "python -m megatron_testkit") -> int:
    """``merge-reports OUT DIR [DIR ...]``: 0 when merged, 2 on bad input (message on stderr)."""
    usage = f"usage: {prog} merge-reports OUT DIR [DIR ...]"
    if argv[:1] in (["-h"], ["--help"]):
        print(f"{usage}\n\n{MERGE_HELP}")
        return 0
    if len(argv) < 2:
        print(f"{prog}: error: merge-reports: expected OUT and at least one DIR ({usage})", file=sys.stderr)
        return 2
    out, dirs = Path(argv[0]), [Path(d) for d in argv[1:]]
    try:
        report = merge(find_reports(dirs, exclude=out))
    except ValueError as exc:
        print(str(exc), file=sys.stderr)
        return 2
    try:
        json_path, md_path = write(report, out)
    except WriteRefused as exc:
        print(f"merge-reports: {exc}", file=sys.stderr)
        return 2
    for row in report["tests"]:
        if row["failure"]:
            print(f"{printable(row['nodeid'])}: {printable(row['failure']['first_line'], 300)}")
    print(f"merged {len(report['session']['merged_from'])} reports into {json_path} and {md_path}")
    return 0
