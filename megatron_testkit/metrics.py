"""Named metric series a test records (loss per step, FLOPs, tokens, peaks), and how each compares.

A test records through the `kit_metrics` fixture (a `MetricsRecorder`); code inside a rank that
`run_ranks` spawned calls `record()`, which appends a JSON line to a file in the directory the
fixture put in ``KIT_METRICS_DIR`` (spawned ranks inherit the environment), read back when the
test body returns. The series travel in the kit report (`TestEntry.metrics`) and are compared
with committed golden files (`megatron_testkit.golden`). Imports nothing heavy: ranks import it.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from accounting.json_input import JsonInputError, parse_json, printable, read_regular_file

METRICS_DIR_ENV = "KIT_METRICS_DIR"
KINDS = ("exact", "relative", "at_most", "at_least", "none")

Number = int | float

# A metric name is plain text: one line of printable characters (no escapes, no bidi overrides).
MAX_NAME_CHARS = 256
# A step is an integer or a short ASCII label (``rank0``, ``stage1``): golden files sort and
# print them, and their keys are reviewed in a diff.
_STEP = re.compile(r"-?[0-9]{1,18}|[A-Za-z_][A-Za-z0-9_.:/-]{0,63}")
_INTEGER_STEP = re.compile(r"-?[0-9]{1,18}")
# Integer values stay exact and convertible to float (the bounds multiply them by 1 + tolerance).
MAX_INT_VALUE = 2**128
# What the ranks of one test may write (one JSON line per `record` call).
MAX_RANK_LINES_BYTES = 64 * 2**20


class MetricError(ValueError):
    """A metric name, step, value or comparison that the kit refuses; the message names the metric."""


@dataclass(frozen=True)
class Comparison:
    """How a series compares with its golden values, and where the tolerance comes from.

    ``exact``: equal (integer counters). ``relative``: ``|got - golden| <= tolerance * |golden|``.
    ``at_most``: ``got <= golden * (1 + tolerance)`` (memory peaks: golden plus headroom).
    ``at_least``: ``got >= golden * (1 - tolerance)`` (throughput; compared on GPU platforms only).
    ``none``: recorded and diffed, never compared.
    """

    kind: str
    tolerance: float = 0.0
    why: str = ""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"comparison {self.kind!r}: expected one of {', '.join(KINDS)}")
        if not (math.isfinite(self.tolerance) and self.tolerance >= 0):
            raise ValueError(
                f"comparison {self.kind}: tolerance {self.tolerance!r} is not a finite number >= 0"
            )

    def accepts(self, golden: Number, got: Number) -> bool:
        """Whether ``got`` passes against ``golden``. NaN never does, and neither does anything
        against a bound that is not finite: no value can switch a comparison off."""
        if self.kind == "exact":
            return got == golden and type(got) is type(golden)
        if self.kind == "none":
            return True
        try:
            if not (_finite(golden) and _finite(got)):
                return False
            if self.kind == "relative":
                bound = self.tolerance * abs(golden)
                return math.isfinite(bound) and abs(got - golden) <= bound
            bound = golden * (1 + self.tolerance) if self.kind == "at_most" else golden * (1 - self.tolerance)
        except OverflowError:  # an int too large for a float: no bound can be computed
            return False
        if not math.isfinite(bound):
            return False
        return got <= bound if self.kind == "at_most" else got >= bound

    def allowed(self, golden: Number) -> str:
        """The accepted range in words, for the mismatch table."""
        if self.kind == "exact":
            return f"== {golden}"
        if self.kind == "relative":
            return f"{golden} ± {self.tolerance:.3g} rel"
        if self.kind == "at_most":
            return f"<= {golden * (1 + self.tolerance):.6g}"
        if self.kind == "at_least":
            return f">= {golden * (1 - self.tolerance):.6g}"
        return "not compared"

    def to_json(self) -> dict[str, Any]:
        """``{"kind": ..., "tolerance": x, "why": text}``."""
        return asdict(self)

    @classmethod
    def from_json(cls, data: Any, where: str = "comparison") -> Comparison:
        """The inverse of `to_json`, strict: `MetricError` naming ``where`` and the field."""
        if not isinstance(data, dict):
            raise MetricError(f"{where} is not an object with 'kind'")
        kind, tolerance, why = data.get("kind"), data.get("tolerance"), data.get("why", "")
        tolerance = 0.0 if tolerance is None else tolerance  # absent or null: none (exact, none)
        if not isinstance(kind, str) or kind not in KINDS:
            raise MetricError(f"{where}.kind is not one of {', '.join(KINDS)}")
        if isinstance(tolerance, bool) or not isinstance(tolerance, int | float) or not _finite(tolerance):
            raise MetricError(f"{where}.tolerance is not a finite number")
        if tolerance < 0:
            raise MetricError(f"{where}.tolerance is below 0")
        if why is None:
            why = ""
        if not isinstance(why, str) or len(why) > 4096:
            raise MetricError(f"{where}.why is not text of at most 4096 characters")
        return cls(kind, float(tolerance), why)


EXACT = Comparison("exact", why="an integer counter: any change is a change in what was counted")


def relative(tolerance: float, why: str) -> Comparison:
    """A float series within ``tolerance`` relative to golden; ``why`` states the derivation."""
    return Comparison("relative", tolerance, why)


def at_most(headroom: float, why: str) -> Comparison:
    """An upper bound: golden x (1 + ``headroom``) (memory peaks)."""
    return Comparison("at_most", headroom, why)


def at_least(margin: float, why: str) -> Comparison:
    """A lower bound: golden x (1 - ``margin``) (throughput, GPU platforms only)."""
    return Comparison("at_least", margin, why)


NOT_COMPARED = Comparison("none", why="recorded for the report and golden diff only")


@dataclass
class MetricSeries:
    """One named series: its comparison and its values by step (or label, e.g. ``rank0``)."""

    compare: Comparison
    values: dict[str, Number] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        """``{"compare": {...}, "values": {step: value}}``."""
        return {"compare": self.compare.to_json(), "values": dict(self.values)}

    @classmethod
    def from_json(cls, data: Any, where: str = "series") -> MetricSeries:
        """Parse a series, strictly: steps as `check_step` takes them, values finite numbers;
        `MetricError` names ``where`` and the step."""
        if not isinstance(data, dict) or not isinstance(data.get("values"), dict):
            raise MetricError(f"{where}: not a metric series (an object with 'values')")
        compare = Comparison.from_json(data.get("compare"), f"{where}.compare")
        values = {}
        for step, value in data["values"].items():
            key = check_step(where, step)
            values[key] = check_value(f"{where}.values[{key!r}]", value)
        return cls(compare, values)


@dataclass
class TestMetrics:
    """A test's recorded series and the platform they were recorded on (``cpu-gloo``, ``h100-nccl``)."""

    __test__ = False  # not a pytest test class

    platform: str
    megatron_core: str | None = None
    series: dict[str, MetricSeries] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        """As the report's ``metrics`` field."""
        return {
            "platform": self.platform,
            "megatron_core": self.megatron_core,
            "series": {name: s.to_json() for name, s in sorted(self.series.items())},
        }

    @classmethod
    def from_json(cls, data: Any, where: str = "metrics") -> TestMetrics:
        """Parse a report's ``metrics`` field (or a golden file), strictly: `MetricError` names the field."""
        if not isinstance(data, dict) or not isinstance(data.get("series"), dict):
            raise MetricError(f"{where}: not a metrics object (with 'platform' and 'series')")
        platform, core = data.get("platform") or "", data.get("megatron_core")
        if not isinstance(platform, str) or len(platform) > 64:
            raise MetricError(f"{where}.platform is not text of at most 64 characters")
        series = {}
        for name, item in data["series"].items():
            check_name(name)
            series[name] = MetricSeries.from_json(item, f"{where}.series[{printable(name, 80)!r}]")
        return cls(platform=platform, megatron_core=core if isinstance(core, str) else None, series=series)


def _finite(value: Number) -> bool:
    return not isinstance(value, float) or math.isfinite(value)


def check_name(name: Any) -> str:
    """A metric's name: non-empty printable text of at most `MAX_NAME_CHARS` (TypeError for what is
    not text, `MetricError` for text with control characters or too long)."""
    if not isinstance(name, str):
        raise TypeError(f"metric name {name!r} is not a string ({type(name).__name__})")
    if not name or len(name) > MAX_NAME_CHARS or not name.isprintable():
        raise MetricError(
            f"metric name {printable(name, 80)!r} is not one line of at most {MAX_NAME_CHARS} printable characters"
        )
    return name


def check_step(name: str, step: Any) -> str:
    """A step's key: an int (not a bool), or text that is an ASCII integer or a short label
    (``rank0``); `MetricError` naming the metric otherwise."""
    if isinstance(step, int) and not isinstance(step, bool):
        key = str(step)
    elif isinstance(step, str):
        key = step
    else:
        raise MetricError(f"metric {printable(name, 80)!r}: step {step!r} is not an int or a label")
    if not _STEP.fullmatch(key):
        raise MetricError(
            f"metric {printable(name, 80)!r}: step {printable(key, 40)!r} is not an integer or a label "
            "of ASCII letters, digits and _.:/- (at most 64)"
        )
    return key


def check_value(name: str, value: Any) -> Number:
    """A metric value: an int or a float (TypeError otherwise; a bool is not one), finite and an
    int within +-`MAX_INT_VALUE` (`MetricError` otherwise): no value may switch a comparison off."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"metric {printable(name, 80)!r}: value {value!r} is not an int or a float")
    if isinstance(value, float) and not math.isfinite(value):
        raise MetricError(f"metric {printable(name, 80)!r}: value {value!r} is not finite")
    if isinstance(value, int) and abs(value) > MAX_INT_VALUE:
        raise MetricError(f"metric {printable(name, 80)!r}: value is past +-2**128")
    return value


def _default_comparison(name: str, value: Number, compare: Comparison | None) -> Comparison:
    if compare is not None:
        return compare
    if isinstance(value, int):
        return EXACT
    raise ValueError(
        f"metric {name!r}: a float series needs a stated comparison "
        "(metrics.relative(tol, why), at_most, at_least or NOT_COMPARED)"
    )


class MetricsRecorder:
    """The series one test records; `kit_metrics` is one. Steps are keys: ints or labels."""

    def __init__(self, directory: str | os.PathLike | None = None) -> None:
        self.series: dict[str, MetricSeries] = {}
        self.directory = Path(directory) if directory is not None else None

    def record(self, name: str, step: int | str, value: Number, compare: Comparison | None = None) -> None:
        """Record ``value`` at ``step`` of series ``name``; ints default to an exact comparison,
        floats must state theirs. Recording one step twice, or another comparison, is an error."""
        check_name(name)
        key = check_step(name, step)
        value = check_value(f"{name}[{key}]", value)
        compare = _default_comparison(name, value, compare)
        if not isinstance(compare, Comparison):
            raise TypeError(f"metric {printable(name, 80)!r}: compare {compare!r} is not a Comparison")
        series = self.series.setdefault(name, MetricSeries(compare))
        if series.compare != compare:
            raise ValueError(
                f"metric {name!r}: recorded with {series.compare.kind} before, now {compare.kind}"
            )
        if key in series.values:
            raise ValueError(f"metric {name!r}: step {key} recorded twice")
        series.values[key] = value

    def record_steps(
        self, name: str, values: list[Number], compare: Comparison | None = None, first: int = 1
    ) -> None:
        """Record a whole series at steps ``first, first + 1, ...``."""
        for i, value in enumerate(values):
            self.record(name, first + i, value, compare)

    def collect_ranks(self) -> int:
        """Read what ranks wrote into `directory` (one JSON line per `record` call); returns the count.

        Each line is untrusted (a rank may be anything): read through the bounded reader, strict
        JSON, each field checked. A rank killed mid-write leaves its last line cut, which is
        skipped (its test fails for the kill); any other bad line is a `MetricError` naming the file.
        """
        if self.directory is None or not self.directory.is_dir():
            return 0
        n, total = 0, 0
        for path in sorted(self.directory.glob("*.jsonl")):
            data = read_regular_file(path, MAX_RANK_LINES_BYTES, "metric lines")
            total += len(data)
            if total > MAX_RANK_LINES_BYTES:
                raise MetricError(f"the ranks wrote more than {MAX_RANK_LINES_BYTES} bytes of metric lines")
            lines = data.split(b"\n")
            for i, line in enumerate(lines):
                if not line.strip():
                    continue
                where = f"metric line {path.name}:{i + 1}"
                try:
                    item = parse_json(line, where=where, max_depth=4)
                except JsonInputError:
                    if i == len(lines) - 1:
                        continue  # the unterminated last line of a rank killed mid-write
                    raise
                self._record_line(item, where)
                n += 1
            path.unlink()
        return n

    def _record_line(self, item: Any, where: str) -> None:
        if not isinstance(item, dict) or not {"name", "step", "value", "compare"} <= item.keys():
            raise MetricError(f"{where} is not an object with name, step, value and compare")
        name = check_name(item["name"])
        compare = Comparison.from_json(item["compare"], f"{where}.compare")
        self.record(name, item["step"], item["value"], compare)


_active: list[MetricsRecorder] = []  # the recorder of the test running in this process, if any


def activate(recorder: MetricsRecorder | None) -> None:
    """Make ``recorder`` the one `record` writes to in this process (None: none)."""
    _active[:] = [recorder] if recorder is not None else []


def record(name: str, step: int | str, value: Number, compare: Comparison | None = None) -> None:
    """Record one value from anywhere: the running test's recorder in the pytest process (or a
    torchrun rank), else the file ``KIT_METRICS_DIR`` names in a spawned rank; dropped outside a test."""
    if _active:
        _active[0].record(name, step, value, compare)
        return
    directory = os.environ.get(METRICS_DIR_ENV)
    if not directory:
        return
    check_name(name)
    key = check_step(name, step)
    value = check_value(f"{name}[{key}]", value)
    line = {
        "name": name,
        "step": step,
        "value": value,
        "compare": _default_comparison(name, value, compare).to_json(),
    }
    text = json.dumps(line, allow_nan=False) + "\n"
    # Appended from the rank, never through a link: the folder is the fixture's own.
    flags = (
        os.O_WRONLY | os.O_APPEND | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    )
    fd = os.open(Path(directory) / f"rank-{os.getpid()}.jsonl", flags, 0o600)
    try:
        os.write(fd, text.encode())
    finally:
        os.close(fd)
