"""Refresh golden files from a kit report, and compare two reports metric by metric.

``update REPORT``: for every test of the report that recorded metrics and passed (or failed only
on its golden values), write its golden file for the report's platform and print what changed.
A release-specific file (``.mcore0.16``) is written only where that release's values leave the
platform's file. ``diff A B``: every value that differs between two reports, with its relative
change and whether B's comparison accepts it. Shipped with the kit: ``python -m
megatron_testkit golden update|diff`` (this repository's ``python -m ci golden`` is the same).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from accounting.json_input import printable
from megatron_testkit import golden
from megatron_testkit.metrics import Comparison, Number, TestMetrics
from megatron_testkit.platforms import PlatformKeyError, check_platform
from megatron_testkit.safe_write import WriteRefused
from megatron_testkit.schema import Report, ReportError, TestEntry, read_report


class UsageError(ValueError):
    """Bad input on the command line: one line, exit status 2."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``update`` and ``diff`` subcommands."""
    sub = parser.add_subparsers(dest="golden_command", metavar="{update,diff}", required=True)
    update = sub.add_parser("update", help="write or refresh golden files from a passing run's kit report")
    update.add_argument("report", metavar="REPORT", help="a kit-report.json")
    update.add_argument(
        "--root", default=".", help="the directory the report's test ids are relative to (default: .)"
    )
    update.add_argument("--dry-run", action="store_true", help="print what would change, write nothing")
    diff = sub.add_parser("diff", help="compare two kit reports metric by metric")
    diff.add_argument("a", metavar="A.json")
    diff.add_argument("b", metavar="B.json")


def run(args: argparse.Namespace, prog: str = "golden") -> int:
    """Run the chosen subcommand; 2 with a one-line message on bad input."""
    try:
        if args.golden_command == "update":
            return update(load_report(args.report), Path(args.root), dry_run=args.dry_run)
        return diff(load_report(args.a), load_report(args.b))
    except (UsageError, golden.GoldenFileError, PlatformKeyError, WriteRefused) as exc:
        print(f"{prog}: error: {printable(str(exc), 600)}", file=sys.stderr)
        return 2


def load_report(path: str) -> Report:
    """A kit report from ``path`` through the kit's one bounded report reader (`schema.read_report`);
    `UsageError` in one line when it is missing, not a regular file, too large or not one."""
    try:
        return read_report(path)
    except ReportError as exc:
        if exc.strerror:
            raise UsageError(f"cannot read {printable(path, 300)}: {exc.strerror}") from None
        raise UsageError(str(exc)) from None


def _refreshable(entry: TestEntry) -> bool:
    kind = entry.failure.kind if entry.failure else None
    return entry.outcome == "passed" or (entry.outcome == "failed" and kind == "golden")


def update(report: Report, root: Path, *, dry_run: bool = False) -> int:
    """Write the golden file of every refreshable test with metrics; prints one block per test."""
    entries = [e for e in report.tests if e.metrics is not None and e.metrics.series]
    if not entries:
        raise UsageError("the report has no test with recorded metrics")
    for entry in entries:
        # Every test's target is checked before anything is written: a report is untrusted, and a
        # node id or platform that would put a file outside the test's golden/ folder refuses it.
        _check_target(entry)
    for entry in entries:
        if not _refreshable(entry):
            kind = entry.failure.kind if entry.failure else None
            print(f"{printable(entry.nodeid)}: not refreshed ({entry.outcome}{f', {kind}' if kind else ''})")
            continue
        torch_version = report.session.get("torch")
        print(_update_one(entry.nodeid, entry.metrics, root, torch_version, dry_run))
    return 0


def _check_target(entry: TestEntry) -> None:
    """`UsageError` naming the test when its node id or platform is not one a golden file takes."""
    assert entry.metrics is not None
    try:
        module, _ = golden.golden_stem(entry.nodeid)
        golden.check_test_module(module)
        check_platform(entry.metrics.platform, "metrics.platform")
    except ValueError as exc:
        raise UsageError(f"refused {printable(entry.nodeid, 200)!r}: {exc}") from None


def target_path(nodeid: str, metrics: TestMetrics, root: Path) -> tuple[Path | None, TestMetrics | None]:
    """Where ``metrics`` belong and what that file holds now; (None, file) when the platform's file
    already holds them for another megatron-core release (no release file needed)."""
    module, name = golden.golden_stem(nodeid)
    paths = golden.golden_paths(root / module, name, metrics.platform, metrics.megatron_core)
    specific, base = (paths[0], paths[-1]) if len(paths) == 2 else (None, paths[-1])
    if specific is not None and specific.is_file():
        return specific, golden.read_golden(specific)
    if not base.is_file():
        return base, None
    current = golden.read_golden(base)
    same_release = golden.mcore_minor(current.megatron_core) == golden.mcore_minor(metrics.megatron_core)
    if same_release or specific is None:
        return base, current
    if not golden.compare(current, metrics, platform=metrics.platform):
        return None, current
    return specific, None


def _update_one(
    nodeid: str, metrics: TestMetrics, root: Path, torch_version: str | None, dry_run: bool
) -> str:
    path, current = target_path(nodeid, metrics, root)
    shown = printable(nodeid)
    if path is None:
        core = printable(str(metrics.megatron_core), 40)
        return f"{shown}: unchanged (the platform's file holds for megatron-core {core})"
    changes = [printable(line) for line in _changes(current, metrics)]
    if current is not None and not changes:
        return f"{shown}: unchanged ({path})"
    if not dry_run:
        golden.write_golden(path, golden.golden_json(nodeid, metrics, torch_version))
    verb = "would write" if dry_run else "wrote"
    head = f"{shown}: {verb} {path}" + (" (new file)" if current is None else f" ({len(changes)} changed)")
    return "\n".join([head, *(f"  {line}" for line in changes)])


def _changes(old: TestMetrics | None, new: TestMetrics) -> list[str]:
    new = golden.compared(new)
    if old is None:
        return [
            f"{name}: {len(s.values)} value(s), {s.compare.kind}" for name, s in sorted(new.series.items())
        ]
    out = []
    for name in sorted(old.series.keys() | new.series.keys()):
        a, b = old.series.get(name), new.series.get(name)
        if a is None or b is None:
            out.append(f"{name}: {'added' if a is None else 'removed'}")
            continue
        if a.compare != b.compare:
            out.append(
                f"{name}: comparison {a.compare.kind} {a.compare.tolerance:g} -> {b.compare.kind} {b.compare.tolerance:g}"
            )
        for step in sorted(a.values.keys() | b.values.keys()):
            if a.values.get(step) != b.values.get(step):
                out.append(f"{name}[{step}]: {a.values.get(step)!r} -> {b.values.get(step)!r}")
    return out


_DIFF_COLUMNS = ("metric", "step", "A", "B", "rel change", "verdict (B's comparison)")


def diff_rows(a: Report, b: Report) -> dict[str, list[tuple[str, ...]]]:
    """By test: (metric, step, A, B, relative change, verdict) for every value that differs."""
    left = {e.nodeid: e.metrics for e in a.tests if e.metrics is not None}
    right = {e.nodeid: e.metrics for e in b.tests if e.metrics is not None}
    out: dict[str, list[tuple[str, ...]]] = {}
    for nodeid in sorted(left.keys() | right.keys()):
        if nodeid not in left or nodeid not in right:
            out[nodeid] = [("*", "*", _has(nodeid, left), _has(nodeid, right), "", "in one report only")]
            continue
        rows = _diff_test(left[nodeid], right[nodeid])
        if rows:
            out[nodeid] = rows
    return out


def _has(nodeid: str, side: dict) -> str:
    return "recorded" if nodeid in side else "-"


def _diff_test(a: TestMetrics, b: TestMetrics) -> list[tuple[str, ...]]:
    rows = []
    for name in sorted(a.series.keys() | b.series.keys()):
        sa, sb = a.series.get(name), b.series.get(name)
        steps = golden.sorted_steps((sa.values.keys() if sa else set()) | (sb.values.keys() if sb else set()))
        rule = (sb or sa).compare  # type: ignore[union-attr]
        for step in steps:
            va = sa.values.get(step) if sa else None
            vb = sb.values.get(step) if sb else None
            if va != vb:
                rel = f"{(vb - va) / abs(va):+.3g}" if va and vb is not None else ""
                rows.append((name, step, _cell(va), _cell(vb), rel, _verdict(rule, va, vb, b.platform)))
    return rows


def _verdict(rule: Comparison, a: Number | None, b: Number | None, platform: str) -> str:
    if a is None or b is None:
        return "on one side only"
    if not golden.applies(rule, platform):
        return f"not compared ({rule.kind} on {platform})"
    return ("within " if rule.accepts(a, b) else "outside ") + rule.kind


def _cell(value: object) -> str:
    return "-" if value is None else repr(value)


def diff(a: Report, b: Report) -> int:
    """Print the differing values of two reports, a table per test; 1 when any differ, else 0."""
    by_test = diff_rows(a, b)
    if not by_test:
        print("no differences in recorded metrics")
        return 0
    for nodeid, rows in by_test.items():
        print(f"{printable(nodeid)}\n{golden.format_table(rows, _DIFF_COLUMNS)}\n")
    outside = sum(r[-1].startswith("outside") for rows in by_test.values() for r in rows)
    total = sum(len(rows) for rows in by_test.values())
    print(f"{total} value(s) differ in {len(by_test)} test(s); {outside} outside their comparison")
    return 1


class _Parser(argparse.ArgumentParser):
    """argparse whose errors are one line (`UsageError`) instead of a usage block."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise UsageError(message)


def main(argv: list[str] | None = None, prog: str = "python -m megatron_testkit golden") -> int:
    """``update REPORT`` or ``diff A B``; a usage error is one line on stderr and exit status 2."""
    parser = _Parser(prog=prog, description=__doc__.splitlines()[0])
    add_arguments(parser)
    try:
        args = parser.parse_args(argv)
    except UsageError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2
    return run(args, prog)


if __name__ == "__main__":
    sys.exit(main())
