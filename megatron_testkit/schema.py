"""The session report's schema, typed and versioned: the one definition its writers and readers share.

Written by the launcher (`Run`, one per `run_ranks` launch), folded by the plugin into one
`TestEntry` per test and one `Report` per session (``kit-report.json``); read back by
``ci/verdicts.py`` and ``python -m ci repro``. The JSON field names are a contract: they are the
dataclass field names below and do not change without a new `REPORT_VERSION`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any

from megatron_testkit.metrics import TestMetrics

REPORT_VERSION = 2  # 2: TestEntry.metrics (recorded series)
READ_VERSIONS = (1, 2)  # a version-1 report reads as one without metrics
OUTCOMES = ("passed", "failed", "skipped", "error")


class SchemaError(ValueError):
    """A report, or part of one, that does not follow this schema; the message says where."""


@dataclass
class Failure:
    """Why a test failed: the rank and kind when a launch names one (None for in-process failures)."""

    rank: int | None
    kind: str | None
    first_line: str
    message: str

    @classmethod
    def from_json(cls, data: Any, where: str = "failure") -> Failure:
        """Parse a ``failure`` object; missing text fields read as empty."""
        if not isinstance(data, dict):
            raise SchemaError(f"{where} is not an object")
        rank = data.get("rank")
        return cls(
            rank=rank if isinstance(rank, int) and not isinstance(rank, bool) else None,
            kind=str(data["kind"]) if data.get("kind") else None,
            first_line=str(data.get("first_line") or ""),
            message=str(data.get("message") or ""),
        )


@dataclass
class RankPeak:
    """One rank's peaks (bytes; None when unknown) and how its process ended."""

    rank: int
    peak_host_bytes: int | None = None
    peak_device_bytes: int | None = None
    exit_code: int | None = None
    signal: str | None = None

    @classmethod
    def from_json(cls, data: Any, where: str = "rank") -> RankPeak:
        """Parse a ``ranks[]`` entry (``rank`` required, the rest optional)."""
        if not isinstance(data, dict) or not _is_int(data.get("rank")):
            raise SchemaError(f"{where} has no integer 'rank'")
        return cls(**{f.name: data.get(f.name) for f in fields(cls)})


@dataclass
class Run:
    """What one `run_ranks` launch measured (carried from xdist workers as its JSON)."""

    world_size: int
    backend: str
    started: float
    seed: int
    duration_s: float
    log_dir: str | None
    ranks: list[RankPeak]
    failure: Failure | None = None
    leaked_processes: int = 0

    def to_json(self) -> dict[str, Any]:
        """The launch as plain JSON types."""
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Run:
        """The inverse of `to_json`."""
        values = {f.name: data.get(f.name) for f in fields(cls) if f.name in data}
        values["ranks"] = [RankPeak.from_json(r) for r in data.get("ranks") or []]
        values["failure"] = Failure.from_json(data["failure"]) if data.get("failure") else None
        return cls(**values)


@dataclass
class TestEntry:
    """One test's row in the report: its outcome, launches folded into per-rank maxima, budgets."""

    __test__ = False  # not a pytest test class

    nodeid: str
    outcome: str
    duration_s: float = 0.0
    world_size: int = 0
    backend: str | None = None
    seed: int | None = None
    budget_host_bytes: int | None = None
    budget_device_bytes: int | None = None
    peak_host_bytes: int | None = None
    peak_device_bytes: int | None = None
    ranks: list[RankPeak] = field(default_factory=list)
    failure: Failure | None = None
    pytest_rss_before_bytes: int | None = None
    pytest_rss_after_bytes: int | None = None
    leaked_processes: int = 0
    log_dir: str | None = None
    launches: int = 0
    worker: str | None = None
    skip_capability: str | None = None  # what a skipped test declared it needs (megatron_testkit.skips)
    metrics: TestMetrics | None = None  # recorded metric series and their platform (golden values)

    def to_json(self) -> dict[str, Any]:
        """The row as plain JSON types, in the report's field names."""
        return asdict(self)

    @classmethod
    def from_json(cls, data: Any, where: str = "test") -> TestEntry:
        """Parse a ``tests[]`` entry: ``nodeid`` and ``outcome`` required, the rest lenient."""
        if not isinstance(data, dict) or not isinstance(data.get("nodeid"), str) or "outcome" not in data:
            raise SchemaError(f"{where} has no 'nodeid' and 'outcome'")
        values: dict[str, Any] = {f.name: data[f.name] for f in fields(cls) if f.name in data}
        for name in (
            "world_size",
            "seed",
            "peak_host_bytes",
            "peak_device_bytes",
            "budget_host_bytes",
            "budget_device_bytes",
            "pytest_rss_before_bytes",
            "pytest_rss_after_bytes",
        ):
            if name in values and not _is_int(values[name]):
                values[name] = None
        values["world_size"] = values.get("world_size") or 0
        values["leaked_processes"] = (
            values.get("leaked_processes") if _is_int(values.get("leaked_processes")) else 0
        )
        values["outcome"] = str(data["outcome"])
        if not isinstance(values.get("skip_capability"), str):
            values["skip_capability"] = None
        values["metrics"] = _metrics(data.get("metrics"), f"{where}.metrics")
        values["ranks"] = [
            RankPeak.from_json(r, f"{where}.ranks[{i}]")
            for i, r in enumerate(data.get("ranks") or [])
            if isinstance(r, dict)
        ]
        values["failure"] = (
            Failure.from_json(data["failure"], f"{where}.failure")
            if isinstance(data.get("failure"), dict)
            else None
        )
        return cls(**values)


@dataclass
class Session:
    """The ``session`` header the plugin writes: where and on what the session ran.

    ``ci_job`` is the CI row that ran it (``KIT_CI_JOB``, None locally), which
    ``python -m ci repro --from-report`` replays; ``megatron_core`` is the installed release
    (None when it is not installed). A `Report` keeps the header as a dict, so readers of older
    reports without a field still parse; `from_json` reads it back leniently.
    """

    started: str
    duration_s: float
    pytest_args: list[str]
    markexpr: str
    host: str
    platform: str
    python: str
    cpu_count: int | None
    gpus: int
    torch: str | None
    megatron_core: str | None
    ci_job: str | None
    pytest_rss_start_bytes: int | None
    pytest_rss_end_bytes: int | None
    allowed_skips: list[str] | None = None  # KIT_ALLOWED_SKIPS (None: unset, skips unchecked)

    def to_json(self) -> dict[str, Any]:
        """The header as plain JSON types, in the report's field names."""
        return asdict(self)

    @classmethod
    def from_json(cls, data: Any) -> Session:
        """Parse a ``session`` object; a missing or mistyped field reads as None (or empty)."""
        if not isinstance(data, dict):
            raise SchemaError("'session' is not an object")
        values: dict[str, Any] = {f.name: data.get(f.name) for f in fields(cls)}
        for name in ("ci_job", "megatron_core", "torch"):
            if not isinstance(values[name], str):
                values[name] = None
        values["gpus"] = values["gpus"] if _is_int(values["gpus"]) else 0
        values["pytest_args"] = [str(a) for a in values["pytest_args"] or []]
        for name in ("started", "markexpr", "host", "platform", "python"):
            values[name] = str(values[name] or "")
        values["duration_s"] = float(values["duration_s"] or 0.0)
        allowed = values["allowed_skips"]
        values["allowed_skips"] = [str(a) for a in allowed] if isinstance(allowed, list) else None
        return cls(**values)


@dataclass
class Report:
    """A whole session: ``version``, the ``session`` header (free-form) and the ``tests`` rows."""

    session: dict[str, Any]
    tests: list[TestEntry]
    version: int = REPORT_VERSION

    def to_json(self) -> dict[str, Any]:
        """The report as written to ``kit-report.json``."""
        return {"version": self.version, "session": self.session, "tests": [t.to_json() for t in self.tests]}

    @classmethod
    def from_json(cls, data: Any) -> Report:
        """Parse a report; `SchemaError` says what is missing or of another version."""
        if not isinstance(data, dict) or data.get("version") not in READ_VERSIONS:
            found = data.get("version") if isinstance(data, dict) else type(data).__name__
            raise SchemaError(f"not a version-{REPORT_VERSION} kit report (version: {found!r})")
        tests = data.get("tests")
        if not isinstance(tests, list):
            raise SchemaError("no 'tests' list")
        session = data.get("session", {})
        if not isinstance(session, dict):
            raise SchemaError("'session' is not an object")
        return cls(
            session=session, tests=[TestEntry.from_json(t, f"tests[{i}]") for i, t in enumerate(tests)]
        )


def _metrics(data: Any, where: str) -> TestMetrics | None:
    try:
        return TestMetrics.from_json(data, where) if data is not None else None
    except ValueError as exc:
        raise SchemaError(str(exc)) from None


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
