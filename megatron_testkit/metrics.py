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
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

METRICS_DIR_ENV = "KIT_METRICS_DIR"
KINDS = ("exact", "relative", "at_most", "at_least", "none")

Number = int | float


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
        """Whether ``got`` passes against ``golden`` (NaN never does)."""
        if self.kind == "exact":
            return got == golden and type(got) is type(golden)
        if self.kind == "relative":
            return abs(got - golden) <= self.tolerance * abs(golden)
        if self.kind == "at_most":
            return got <= golden * (1 + self.tolerance)
        if self.kind == "at_least":
            return got >= golden * (1 - self.tolerance)
        return True

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
    def from_json(cls, data: Any) -> Comparison:
        """The inverse of `to_json`; a ValueError says what is wrong."""
        if not isinstance(data, dict):
            raise ValueError(f"comparison {data!r} is not an object with 'kind'")
        return cls(str(data.get("kind")), float(data.get("tolerance") or 0.0), str(data.get("why") or ""))


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
        """Parse a series; a ValueError names ``where`` when it is not one."""
        if not isinstance(data, dict) or not isinstance(data.get("values"), dict):
            raise ValueError(f"{where}: not a metric series (an object with 'values')")
        try:
            compare = Comparison.from_json(data.get("compare"))
        except ValueError as exc:
            raise ValueError(f"{where}: {exc}") from None
        return cls(compare, {str(k): _check_value(where, v) for k, v in data["values"].items()})


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
        """Parse a report's ``metrics`` field."""
        if not isinstance(data, dict) or not isinstance(data.get("series"), dict):
            raise ValueError(f"{where}: not a metrics object (with 'platform' and 'series')")
        core = data.get("megatron_core")
        return cls(
            platform=str(data.get("platform") or ""),
            megatron_core=core if isinstance(core, str) else None,
            series={
                str(n): MetricSeries.from_json(s, f"{where}.series[{n!r}]") for n, s in data["series"].items()
            },
        )


def _check_value(name: str, value: Any) -> Number:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"metric {name!r}: value {value!r} is not an int or a float")
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
        value = _check_value(name, value)
        compare = _default_comparison(name, value, compare)
        series = self.series.setdefault(name, MetricSeries(compare))
        if series.compare != compare:
            raise ValueError(
                f"metric {name!r}: recorded with {series.compare.kind} before, now {compare.kind}"
            )
        key = str(step)
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
        """Read what ranks wrote into `directory` (one JSON line per `record` call); returns the count."""
        if self.directory is None or not self.directory.is_dir():
            return 0
        n = 0
        for path in sorted(self.directory.glob("*.jsonl")):
            for line in path.read_text().splitlines():
                try:
                    item = json.loads(line)
                except ValueError:
                    continue  # a rank killed mid-write leaves a cut line; its test fails for that
                compare = Comparison.from_json(item["compare"])
                self.record(item["name"], item["step"], item["value"], compare)
                n += 1
            path.unlink()
        return n


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
    value = _check_value(name, value)
    line = {
        "name": name,
        "step": step,
        "value": value,
        "compare": _default_comparison(name, value, compare).to_json(),
    }
    with open(Path(directory) / f"rank-{os.getpid()}.jsonl", "a") as out:
        out.write(json.dumps(line) + "\n")
