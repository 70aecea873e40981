"""Golden values: committed files of a test's metric series per platform, compared with a run's.

Layout, next to the tests: ``<test dir>/golden/<test module>/<test name>.<platform>.json``, where
the platform is ``cpu-gloo`` or ``<gpu model>-nccl`` (``h100-nccl``), and a file for one
megatron-core minor adds it (``cpu-gloo.mcore0.16``) where that release's values differ; the
lookup takes the release's file first, then the platform's. Pure functions over paths and JSON:
the plugin (`megatron_testkit.golden_plugin`) and ``python -m megatron_testkit golden`` both use them.
"""

from __future__ import annotations

import json
import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

from accounting.json_input import JsonInputError, load_json, printable
from megatron_testkit.metrics import Comparison, MetricError, MetricSeries, Number, TestMetrics
from megatron_testkit.platforms import check_platform, is_gpu_platform
from megatron_testkit.safe_write import Folder

# The command that writes a report's golden files (`megatron_testkit.golden_tool`), run in the
# project root the report's test ids are relative to: it exists wherever the kit is installed.
UPDATE_COMMAND = "python -m megatron_testkit golden update"

GOLDEN_DIR = "golden"
_COLUMNS = ("metric", "step", "golden", "got", "allowed")
_INTEGER = re.compile(r"-?[0-9]+")
# A golden file holds a few series of a few hundred steps: kilobytes; this is far past any.
MAX_GOLDEN_BYTES = 16 * 2**20


class GoldenFileError(ValueError):
    """A golden file or node id the kit refuses; one line naming the file or field (a platform key:
    `megatron_testkit.platforms.PlatformKeyError`)."""


def mcore_minor(version: str | None) -> str | None:
    """``0.16.1`` -> ``mcore0.16`` (None when megatron-core is not installed)."""
    match = re.match(r"(\d+)\.(\d+)", version or "")
    return f"mcore{match.group(1)}.{match.group(2)}" if match else None


def check_test_module(module: str) -> str:
    """A node id's test file as a path relative to the project root that stays inside it: no
    absolute path, no ``..`` or empty component, a ``.py`` file; `GoldenFileError` otherwise."""
    shown = printable(module, 200)
    path = PurePosixPath(module)
    if not module or "\0" in module or "\\" in module or path.is_absolute() or module.startswith("/"):
        raise GoldenFileError(f"test file {shown!r} is not a path relative to the project root")
    if any(part in ("", ".", "..") for part in module.split("/")) or path.suffix != ".py":
        raise GoldenFileError(f"test file {shown!r} is not a .py file inside the project root")
    return module


def golden_stem(nodeid: str) -> tuple[str, str]:
    """``dir/test_mod.py::Class::test[p]`` -> (``dir/test_mod.py``, ``Class.test[p]``)."""
    module, _, name = nodeid.partition("::")
    if not name:
        raise ValueError(f"{nodeid!r} is not a test node id (path::name)")
    return module, name.replace("::", ".")


def golden_paths(test_file: Path, test_name: str, platform: str, megatron_core: str | None) -> list[Path]:
    """Where a test's golden file may be, most specific first (the release's, then the platform's)."""
    check_platform(platform)
    directory = test_file.parent / GOLDEN_DIR / test_file.stem
    name = re.sub(r"[^A-Za-z0-9._\[\]-]+", "_", test_name)
    minor = mcore_minor(megatron_core)
    specific = [directory / f"{name}.{platform}.{minor}.json"] if minor else []
    return [*specific, directory / f"{name}.{platform}.json"]


def find_golden(paths: list[Path]) -> Path | None:
    """The first of ``paths`` that exists."""
    return next((p for p in paths if p.is_file()), None)


def candidate_path(path: Path) -> Path:
    """Where a local run writes the file it would have compared with: ``<name>.candidate.json``."""
    return path.with_suffix(".candidate.json")


def applies(rule: Comparison, platform: str) -> bool:
    """Whether ``rule`` compares anything on ``platform`` (throughput bounds: GPU platforms only)."""
    return rule.kind != "none" and (rule.kind != "at_least" or is_gpu_platform(platform))


def compared(metrics: TestMetrics) -> TestMetrics:
    """``metrics`` less the series its platform does not compare (what a golden file holds)."""
    kept = {n: s for n, s in metrics.series.items() if applies(s.compare, metrics.platform)}
    return TestMetrics(metrics.platform, metrics.megatron_core, kept)


def golden_json(nodeid: str, metrics: TestMetrics, torch_version: str | None = None) -> dict[str, Any]:
    """A golden file's content: the test, what made it, and the compared series (rule beside values)."""
    made_with = {"megatron_core": metrics.megatron_core, "torch": torch_version}
    series = {name: s.to_json() for name, s in sorted(compared(metrics).series.items())}
    return {"test": nodeid, "platform": metrics.platform, "made_with": made_with, "series": series}


def write_golden(path: Path, content: dict[str, Any]) -> Path:
    """Write one golden file (sorted series, 2-space JSON, a final newline) through the kit's
    writer: contained in the test's folder, as ``golden/<module>/<file>`` (the layout
    `golden_paths` makes), no link followed from ``golden`` down (a ``golden`` that is itself a
    link, committed by a pull request, points wherever its author chose), atomic. `WriteRefused`
    in one line otherwise."""
    folder = Folder(path.parent.parent.parent, what="test folder")
    return folder.write_text(
        f"{GOLDEN_DIR}/{path.parent.name}/{path.name}", json.dumps(content, indent=2, allow_nan=False) + "\n"
    )


def linked_part(path: Path) -> Path | None:
    """The first of ``golden``, ``golden/<module>`` and the file itself that is a symbolic link
    (None when none is): golden files are read only from the test's own ``golden/`` folder."""
    for part in (path.parent.parent, path.parent, path):
        try:
            if stat.S_ISLNK(os.lstat(part).st_mode):
                return part
        except OSError:
            return None
    return None


def read_golden(path: Path) -> TestMetrics:
    """A golden file's series, read by the bounded reader and checked field by field (finite
    values, plain names, ASCII steps); `GoldenFileError` naming the file and the field otherwise.
    A link on the way (``golden``, its module folder, the file) is refused, as the writer refuses it."""
    link = linked_part(path)
    if link is not None:
        raise GoldenFileError(
            f"{printable(str(path), 300)}: not read: {printable(str(link), 300)} is a symbolic link "
            "(golden files are read only from the test's own golden/ folder)"
        )
    try:
        data = load_json(path, limit=MAX_GOLDEN_BYTES, what="golden file")
    except JsonInputError as exc:
        raise GoldenFileError(str(exc)) from None
    shown = printable(str(path), 300)
    try:
        if not isinstance(data, dict):
            raise MetricError("not an object with 'series'")
        made_with = data.get("made_with") or {}
        if not isinstance(made_with, dict):
            raise MetricError("made_with is not an object")
        core = made_with.get("megatron_core")
        return TestMetrics.from_json(
            {"platform": data.get("platform"), "megatron_core": core, "series": data.get("series")}, "golden"
        )
    except (MetricError, TypeError) as exc:
        raise GoldenFileError(f"{shown}: not a golden file ({printable(str(exc), 300)})") from None


@dataclass(frozen=True)
class Mismatch:
    """One row of the mismatch table."""

    metric: str
    step: str
    golden: Number | None
    got: Number | None
    allowed: str

    def cells(self) -> tuple[str, ...]:
        """The row's printed cells (``-`` for a missing value)."""
        return (self.metric, self.step, _cell(self.golden), _cell(self.got), self.allowed)


def _cell(value: Number | None) -> str:
    return "-" if value is None else repr(value)


def compare(golden: TestMetrics, got: TestMetrics, *, platform: str) -> list[Mismatch]:
    """Every value of ``got`` outside its comparison against ``golden``, and every golden value
    ``got`` lacks. The comparison is ``got``'s (the test states it); series ``platform`` does not
    compare (``none``; ``at_least`` off GPU platforms) are left out, as golden files leave them out."""
    out = []
    got = compared(TestMetrics(platform, got.megatron_core, got.series))
    golden = compared(TestMetrics(platform, golden.megatron_core, golden.series))
    for name in sorted(golden.series.keys() | got.series.keys()):
        want, have = golden.series.get(name), got.series.get(name)
        if have is None:
            out.append(Mismatch(name, "*", None, None, "the test no longer records this series"))
            continue
        if want is None:
            out.append(Mismatch(name, "*", None, None, "not in the golden file"))
            continue
        out += _compare_series(name, want, have, platform)
    return out


def _compare_series(name: str, want: MetricSeries, have: MetricSeries, platform: str) -> list[Mismatch]:
    rule = have.compare
    out = []
    for step in sorted_steps(want.values.keys() | have.values.keys()):
        g, v = want.values.get(step), have.values.get(step)
        if g is None or v is None:
            out.append(Mismatch(name, step, g, v, "a step present on one side only"))
        elif not rule.accepts(g, v):
            out.append(Mismatch(name, step, g, v, rule.allowed(g)))
    return out


def sorted_steps(steps: Any) -> list[str]:
    """Steps in numeric order, then labels (``rank0``...) in text order (ASCII digits only count
    as numbers: ``"²"`` is a digit to `str.isdigit` and not to `int`)."""
    return sorted(steps, key=lambda s: (0, int(s), "") if _INTEGER.fullmatch(s) else (1, 0, s))


def format_table(rows: list[tuple[str, ...]], columns: tuple[str, ...] = _COLUMNS) -> str:
    """A plain-text table with a header line; every cell escaped (`printable`): names and steps come
    from reports and golden files, which may hold escape sequences."""
    rows = [tuple(printable(cell) for cell in row) for row in rows]
    widths = [max(len(c), *(len(r[i]) for r in rows)) if rows else len(c) for i, c in enumerate(columns)]
    lines = [columns, tuple("-" * w for w in widths), *rows]
    return "\n".join(
        "  ".join(c.ljust(w) for c, w in zip(line, widths, strict=True)).rstrip() for line in lines
    )


def refresh_command(report_dir: str | None) -> str:
    """The command that refreshes golden files from this session's report, as a person types it in
    the directory pytest ran from: with ``--kit-report DIR``, ``... update DIR/kit-report.json``;
    without one, the run that makes the report first."""
    if report_dir:
        import shlex

        return f"{UPDATE_COMMAND} {shlex.quote(os.path.join(report_dir, 'kit-report.json'))}"
    return f"rerun pytest with --kit-report=reports, then {UPDATE_COMMAND} reports/kit-report.json"


def mismatch_message(
    nodeid: str, path: Path, rows: list[Mismatch], note: str = "", report_dir: str | None = None
) -> str:
    """The failure text: what differs, the table, and how to refresh after an intended change
    (`refresh_command` of the session's ``--kit-report`` folder)."""
    head = f"golden values: {len(rows)} value(s) of {nodeid} differ from {path}"
    tail = f"an intended change? refresh with: {refresh_command(report_dir)}"
    return "\n".join([head, format_table([r.cells() for r in rows]), *([note] if note else []), tail])
