"""The session report's schema, typed and versioned: the one definition its writers and readers share.

Written by the launcher (`Run`, one per `run_ranks` launch), folded by the plugin into one
`TestEntry` per test (each launch kept as a `Launch` with its verdict) and one `Report` per session
(``kit-report.json``); read back by `megatron_testkit.verdicts` and ``python -m megatron_testkit
repro``. The JSON field names are a contract: they are the dataclass field names below and do not
change without a new `REPORT_VERSION`; reports of every older version still read.
"""

from __future__ import annotations

import copy
import functools
import math
import os
import types
import typing
from dataclasses import asdict, dataclass, field, fields, is_dataclass
from typing import Any

from accounting.json_input import JsonInputError, load_json, printable
from megatron_testkit.memory_series import MAX_SERIES_POINTS, RankMemory
from megatron_testkit.metrics import TestMetrics

# 2: TestEntry.metrics (recorded series). Optional additions that older readers parse unchanged
# (absent reads as None) keep the version: the ``interrupted`` outcome, the session's
# ``exit_status``, a rank's ``peak_process``, a launch's ``device`` and ``platform``.
# 3: TestEntry.launches is a list of `Launch` records (each launch's verdict, caught or not; it was
# a count); the session records what a repro needs: ``settings`` (the KIT_* and hypothesis
# variables), ``hypothesis_seed``, ``runner_memory_bytes``/``runner_memory_source``, and
# ``skip_summary``; memory admission (megatron_testkit.admission): a launch's and a test's
# ``queued_s``, ``admitted_bytes`` and ``setup_s``, the session's ``admission_*`` figures (limit,
# peak admitted).
# 4: a launch's and a test's ``rank_logs`` (the rank-log folder relative to the report folder, so
# that a downloaded artifact resolves it; ``log_dir`` keeps the absolute path of the machine that
# ran); a test's ``line`` (its function's line: CI annotations point there); a launch's
# ``memory`` (each rank's RSS over time, sampled by the launcher: `megatron_testkit.memory_series`);
# the session's ``cuda_context`` (who created the pytest process' CUDA context, when a test's own
# code did not); a launch's ``start_mode`` (warm, cold, mixed), ``start_reason``
# (megatron_testkit.warm_start) and, in the file's launches, ``setup_s``.
# 5: the session's ``cpu_substitutions`` (what the CPU layer, megatron_testkit.megatron_cpu,
# substituted in the pytest process and its ranks: each call once, with how often) and
# ``warm_preload_dropped`` (modules dropped from the warm preload set because their import made
# forking unsafe).
REPORT_VERSION = 5
# A version-1 report reads as one without metrics; versions 1 and 2 read with ``launches`` []
# (they kept only a count, no launch's verdict), without the version-3 session fields and without
# admission; versions 1 to 3 without the version-4 fields, 1 to 4 without the version-5 ones.
READ_VERSIONS = (1, 2, 3, 4, 5)
# ``interrupted``: the session was stopped (Ctrl-C, SIGTERM) while the test ran; see the session's
# ``exit_status``.
START_MODES = ("warm", "cold", "mixed")
OUTCOMES = ("passed", "failed", "skipped", "error", "interrupted")

# Bounds on what a report read back may hold. A report comes from a CI artifact, which a fork's
# pull request controls, so every size and count in it is bounded before anything is built from it.
# The largest multi-node job the kit merges; sets and lists of ranks are built from world sizes.
MAX_WORLD_SIZE = 1 << 16
# GPUs of one session (merged reports sum nodes); repro writes CUDA_VISIBLE_DEVICES from it.
MAX_GPUS = 1 << 12
# Rows of one report: the whole suite is a few thousand tests, parametrized ones included.
MAX_TESTS = 100_000
# Counts (launches, leaked processes) and other list lengths, e.g. the session's pytest arguments.
MAX_COUNT = 1 << 20
# A node id: pytest's ids are a path plus names and parameters, well under this.
MAX_NODEID_CHARS = 4096
# Any other text (a failure's message: the writer keeps its last 20 000 characters; a hang's
# stacks of every rank can be longer).
MAX_TEXT_CHARS = 1 << 20
# Integers are C int64 where the kit writes them; floats (durations, epoch seconds) are finite.
MAX_INT = 2**63 - 1
MAX_FLOAT = 1e15
# The largest report read: about 1 kB per test plus failure text the writer clips to 20 000
# characters, so 32 MiB holds a whole suite that failed; parsed, it is roughly ten times that.
MAX_REPORT_BYTES = 32 * 2**20


class SchemaError(ValueError):
    """A report, or part of one, that does not follow this schema; the message says where."""


class ReportError(JsonInputError):
    """A report that is missing, too large, not JSON, or not a well-formed kit report (versions 1 to 4)."""


def read_report(path: str | os.PathLike[str]) -> Report:
    """The kit report at `path`: read by the bounded reader (`accounting.json_input`: a regular
    file of at most `MAX_REPORT_BYTES`, strict JSON, bounded depth), then checked field by field
    (`check_report`); `ReportError` in one line naming the file and the field otherwise."""
    try:
        data = load_json(path, limit=MAX_REPORT_BYTES, what="kit report")
    except JsonInputError as exc:
        raise ReportError(str(exc), exc.strerror) from None
    try:
        return check_report(data)
    except SchemaError as exc:
        name = printable(os.fspath(path), 300)
        if str(exc).startswith("not a version"):
            raise ReportError(f"{name} is {exc}") from None
        raise ReportError(f"{name}: {printable(str(exc), 300)}") from None


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
    # The rank's host peak counts its descendants (worker processes, pools); when one of them held
    # memory at that peak, the largest: "pid 12: python -c ... held 800MiB".
    peak_process: str | None = None

    @classmethod
    def from_json(cls, data: Any, where: str = "rank") -> RankPeak:
        """Parse a ``ranks[]`` entry (``rank`` required, the rest optional)."""
        if not isinstance(data, dict) or not _is_int(data.get("rank")):
            raise SchemaError(f"{where} has no integer 'rank'")
        values = {f.name: data.get(f.name) for f in fields(cls)}
        if not isinstance(values["peak_process"], str):
            values["peak_process"] = None
        return cls(**values)


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
    # The ranks' own CUDA device (the lowest rank that used one; None on CPU) and the golden
    # platform they named (`megatron_testkit.golden.launch_platform`); absent in older reports.
    device: str | None = None
    platform: str | None = None
    # Seconds the launch waited for the session's admission ledger, and the bytes it was admitted
    # with (its ranks' budgets, or the default per rank); None without admission or before version 3.
    queued_s: float | None = None
    admitted_bytes: int | None = None
    # Seconds from spawn until every rank's process group was up (Python, torch, the test's module,
    # the rendezvous): the launch timeout counts from there. None when they never all got there.
    setup_s: float | None = None
    # The launch's folder relative to the --kit-report folder (version 4; None outside one).
    rank_logs: str | None = None
    # Each rank's RSS over the launch, sampled by the launcher's poll (version 4).
    memory: list[RankMemory] | None = None
    # How the ranks started: "warm" (forked from the warm parent), "cold" (spawned), "mixed" (the
    # parent refused a later rank), and why (the reason it went cold; on a warm start, the preloads
    # that failed). None before version 4.
    start_mode: str | None = None
    start_reason: str | None = None

    def to_json(self) -> dict[str, Any]:
        """The launch as plain JSON types."""
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Run:
        """The inverse of `to_json`."""
        values = {f.name: data.get(f.name) for f in fields(cls) if f.name in data}
        values["ranks"] = [RankPeak.from_json(r) for r in data.get("ranks") or []]
        values["failure"] = Failure.from_json(data["failure"]) if data.get("failure") else None
        for key in ("device", "platform", "rank_logs", "start_reason"):
            values[key] = values[key] if isinstance(values.get(key), str) else None
        values["memory"] = _memory(data.get("memory"))
        values["start_mode"] = values.get("start_mode") if values.get("start_mode") in START_MODES else None
        for key in ("queued_s", "setup_s"):
            values[key] = float(values[key]) if _is_number(values.get(key)) else None
        values["admitted_bytes"] = (
            values.get("admitted_bytes") if _is_int(values.get("admitted_bytes")) else None
        )
        return cls(**values)


@dataclass
class Launch:
    """One launch of a test, with its verdict: kept whether the test caught its `RankFailure` or not.

    ``rank``/``kind``/``first_line`` are the root cause (None, None, "" for a launch that passed);
    the peaks are the largest of its ranks'; ``caught``: it failed and the test went on past it
    (the test's own outcome is not this launch's failure).
    """

    world_size: int
    backend: str
    seed: int
    duration_s: float = 0.0
    rank: int | None = None
    kind: str | None = None
    first_line: str = ""
    peak_host_bytes: int | None = None
    peak_device_bytes: int | None = None
    caught: bool = False
    # Each rank's RSS over the launch (version 4; None before, or when not sampled).
    memory: list[RankMemory] | None = None
    # Version 4: warm, cold or mixed, why, and seconds from the request until every rank's process
    # group was up (the launch's start time); None in older reports.
    start_mode: str | None = None
    start_reason: str | None = None
    setup_s: float | None = None

    @property
    def failed(self) -> bool:
        """Whether the launch failed (a rank named, or a kind)."""
        return self.kind is not None or self.rank is not None

    def cause(self) -> str:
        """``"rank 1 oom"`` (or ``"oom"`` without a rank); ``"passed"`` for a launch that passed."""
        if not self.failed:
            return "passed"
        kind = self.kind or "error"
        return f"rank {self.rank} {kind}" if self.rank is not None else kind

    @classmethod
    def from_run(cls, run: Run) -> Launch:
        """The launch record of one `Run` (not yet marked caught)."""
        failure = run.failure
        return cls(
            world_size=run.world_size,
            backend=run.backend,
            seed=run.seed,
            duration_s=round(float(run.duration_s or 0.0), 3),
            rank=failure.rank if failure else None,
            kind=failure.kind if failure else None,
            first_line=failure.first_line if failure else "",
            peak_host_bytes=_max_of([r.peak_host_bytes for r in run.ranks]),
            peak_device_bytes=_max_of([r.peak_device_bytes for r in run.ranks]),
            memory=run.memory,
            start_mode=run.start_mode,
            start_reason=run.start_reason,
            setup_s=run.setup_s,
        )

    @classmethod
    def from_json(cls, data: Any, where: str = "launch") -> Launch:
        """Parse a ``launches[]`` entry (checked beforehand by `check_report` when read from a file)."""
        if not isinstance(data, dict):
            raise SchemaError(f"{where} is not an object")
        values = {f.name: data[f.name] for f in fields(cls) if f.name in data}
        for name in ("rank", "peak_host_bytes", "peak_device_bytes"):
            if name in values and not _is_int(values[name]):
                values[name] = None
        values["kind"] = str(values["kind"]) if values.get("kind") else None
        values["first_line"] = str(values.get("first_line") or "")
        values["caught"] = values.get("caught") is True
        values["memory"] = _memory(data.get("memory"))
        values["start_mode"] = values.get("start_mode") if values.get("start_mode") in START_MODES else None
        values["start_reason"] = (
            values["start_reason"] if isinstance(values.get("start_reason"), str) else None
        )
        values["setup_s"] = float(values["setup_s"]) if _is_number(values.get("setup_s")) else None
        values.setdefault("world_size", 0)
        values.setdefault("backend", "")
        values.setdefault("seed", 0)
        return cls(**values)


def _memory(data: Any) -> list[RankMemory] | None:
    """A launch's ``memory`` field read leniently (checked beforehand by `check_report` when read
    from a file): entries that are not a rank's series are dropped."""
    if not isinstance(data, list):
        return None
    out = []
    for item in data:
        if isinstance(item, RankMemory):
            out.append(item)
        elif isinstance(item, dict) and _is_int(item.get("rank")):
            t, rss = item.get("t_s"), item.get("rss_bytes")
            if isinstance(t, list) and isinstance(rss, list) and len(t) == len(rss):
                out.append(RankMemory(item["rank"], list(t), list(rss)))
    return out


def _max_of(values: list[int | None]) -> int | None:
    known = [v for v in values if v is not None]
    return max(known) if known else None


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
    launches: list[Launch] = field(default_factory=list)  # every launch and its verdict, in order
    worker: str | None = None
    skip_capability: str | None = None  # what a skipped test declared it needs (megatron_testkit.skips)
    metrics: TestMetrics | None = None  # recorded metric series and their platform (golden values)
    # Summed over its launches: seconds waited for admission and spent setting ranks up; the
    # largest admitted share (bytes).
    queued_s: float | None = None
    admitted_bytes: int | None = None
    setup_s: float | None = None
    # The first kept launch folder relative to the report folder (``log_dir`` is its absolute
    # path on the machine that ran); version 4, None outside a --kit-report folder.
    rank_logs: str | None = None
    # The test function's line in its file (pytest's location, 1-based; version 4): where a CI
    # annotation points.
    line: int | None = None

    def to_json(self) -> dict[str, Any]:
        """The row as plain JSON types, in the report's field names."""
        return _as_json(self)

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
            "admitted_bytes",
            "line",
        ):
            if name in values and not _is_int(values[name]):
                values[name] = None
        for name in ("queued_s", "setup_s"):
            if name in values and not _is_number(values[name]):
                values[name] = None
        values["world_size"] = values.get("world_size") or 0
        values["leaked_processes"] = (
            values.get("leaked_processes") if _is_int(values.get("leaked_processes")) else 0
        )
        values["outcome"] = str(data["outcome"])
        for name in ("skip_capability", "rank_logs"):
            if not isinstance(values.get(name), str):
                values[name] = None
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
        launches = data.get("launches")
        values["launches"] = [
            Launch.from_json(item, f"{where}.launches[{i}]")
            for i, item in enumerate(launches if isinstance(launches, list) else [])
            if isinstance(item, dict)
        ]  # a version-1/2 count reads as no launch records
        return cls(**values)


@dataclass
class Setting:
    """One environment variable of the session that a repro restores (``KIT_*``, hypothesis's)."""

    name: str
    value: str


@dataclass
class CpuSubstitution:
    """One call the CPU layer substituted in a session (``torch.cuda.set_device``, an NCCL
    ``new_group`` given gloo), and how often."""

    call: str
    count: int


@dataclass
class SessionRef:
    """One session of a report folder that several sessions shared (`megatron_testkit.report_merge`):
    who it was, and which rows are its own (``tests[first_test : first_test + tests]``)."""

    started: str
    host: str
    markexpr: str
    pytest_args: list[str]
    first_test: int
    tests: int
    ci_job: str | None = None
    exit_status: int | None = None
    duration_s: float = 0.0


@dataclass
class Session:
    """The ``session`` header the plugin writes: where and on what the session ran.

    ``ci_job`` is the CI row that ran it (``KIT_CI_JOB``, None locally), which
    ``python -m megatron_testkit repro --from-report`` replays; ``megatron_core`` is the installed release
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
    exit_status: int | None = None  # pytest's exit status (2: interrupted); None in older reports
    # The sessions merged into this report when several wrote one --kit-report folder (oldest
    # first, each with the range of its rows); None for a report of one session.
    sessions: list[SessionRef] | None = None
    dropped_sessions: int | None = None  # the oldest sessions a merge dropped past MAX_TESTS rows
    # What a repro restores (version 3): the KIT_* and hypothesis variables set, hypothesis's seed,
    # the runner's memory limit (KIT_HOST_MEMORY, else the memory cgroup's limit, and which), and
    # whether the skip policy's summary was asked for (KIT_ALLOWED_SKIPS or kit_skip_summary).
    settings: list[Setting] | None = None
    hypothesis_seed: int | None = None
    runner_memory_bytes: int | None = None
    runner_memory_source: str | None = None
    skip_summary: bool | None = None
    # Memory admission (version 3; None without it): the runner's memory the ledger held
    # (``admission_source`` says where the figure came from), the session's peak of admitted
    # memory against it, and the share a rank of a test without a memory_budget is admitted with.
    admission_limit_bytes: int | None = None
    admission_peak_bytes: int | None = None
    admission_source: str | None = None
    admission_default_rank_bytes: int | None = None
    # Version 4: who created the pytest process' CUDA context when a test's own code did not (the
    # kit reading a rank's CUDA tensors, or something before any test); None otherwise.
    cuda_context: str | None = None
    # Version 5: what the CPU layer substituted (most frequent first); None when it substituted nothing.
    cpu_substitutions: list[CpuSubstitution] | None = None
    # Version 5: one line per module dropped from the warm preload set (its import started a thread
    # or initialised CUDA; the warm parent was rebuilt without it); None when none was.
    warm_preload_dropped: list[str] | None = None

    def to_json(self) -> dict[str, Any]:
        """The header as plain JSON types, in the report's field names."""
        return asdict(self)

    @classmethod
    def from_json(cls, data: Any) -> Session:
        """Parse a ``session`` object; a missing or mistyped field reads as None (or empty)."""
        if not isinstance(data, dict):
            raise SchemaError("'session' is not an object")
        values: dict[str, Any] = {f.name: data.get(f.name) for f in fields(cls)}
        for name in ("ci_job", "megatron_core", "torch", "admission_source", "cuda_context"):
            if not isinstance(values[name], str):
                values[name] = None
        for name in ("admission_limit_bytes", "admission_peak_bytes", "admission_default_rank_bytes"):
            values[name] = values[name] if _is_int(values[name]) else None
        values["gpus"] = values["gpus"] if _is_int(values["gpus"]) else 0
        values["exit_status"] = values["exit_status"] if _is_int(values["exit_status"]) else None
        values["dropped_sessions"] = (
            values["dropped_sessions"] if _is_int(values["dropped_sessions"]) else None
        )
        values["pytest_args"] = [str(a) for a in values["pytest_args"] or []]
        for name in ("started", "markexpr", "host", "platform", "python"):
            values[name] = str(values[name] or "")
        values["duration_s"] = float(values["duration_s"] or 0.0)
        allowed = values["allowed_skips"]
        values["allowed_skips"] = [str(a) for a in allowed] if isinstance(allowed, list) else None
        dropped = values["warm_preload_dropped"]
        values["warm_preload_dropped"] = (
            [str(a) for a in dropped] if isinstance(dropped, list) and dropped else None
        )
        merged = values["sessions"]
        values["sessions"] = [r for r in merged if isinstance(r, dict)] if isinstance(merged, list) else None
        settings = values["settings"]
        values["settings"] = (
            [
                Setting(str(s["name"]), str(s["value"]))
                for s in settings
                if isinstance(s, dict) and "name" in s
            ]
            if isinstance(settings, list)
            else None
        )
        for name in ("hypothesis_seed", "runner_memory_bytes"):
            values[name] = values[name] if _is_int(values[name]) else None
        source = values["runner_memory_source"]
        values["runner_memory_source"] = source if isinstance(source, str) else None
        values["skip_summary"] = values["skip_summary"] if isinstance(values["skip_summary"], bool) else None
        shim = values["cpu_substitutions"]
        values["cpu_substitutions"] = (
            [
                CpuSubstitution(str(s["call"]), s["count"])
                for s in shim
                if isinstance(s, dict) and "call" in s and _is_int(s.get("count"))
            ]
            if isinstance(shim, list)
            else None
        )
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
    except (ValueError, TypeError) as exc:  # TypeError: a value that is not a number
        raise SchemaError(str(exc)) from None


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


# ---- checking a report read back: every field typed and bounded, fail closed -----------------

# Fields a row cannot do without; the others have defaults or read leniently when absent.
_REQUIRED = {
    "TestEntry": ("nodeid", "outcome"),
    "RankPeak": ("rank",),
    "RankMemory": ("rank", "t_s", "rss_bytes"),
    "CpuSubstitution": ("call", "count"),
}
# Integer fields with a narrower range than +-MAX_INT: (low, high), both included; sizes in bytes
# (``*_bytes``) are 0 to MAX_INT.
_INT_RANGES = {
    "world_size": (0, MAX_WORLD_SIZE),
    "rank": (0, MAX_WORLD_SIZE - 1),
    "gpus": (0, MAX_GPUS),
    "cpu_count": (0, MAX_COUNT),
    "launch_count": (0, MAX_COUNT),  # a version-1/2 row's ``launches``
    "first_test": (0, MAX_TESTS),
    "dropped_sessions": (0, MAX_COUNT),
    "tests": (0, MAX_TESTS),
    "leaked_processes": (0, MAX_COUNT),
    "line": (1, MAX_INT),
    "count": (0, MAX_INT),
}
# A setting's name and value: environment variables, short.
MAX_SETTING_CHARS = 4096
_TEXT_LIMITS = {"nodeid": MAX_NODEID_CHARS, "name": 256, "value": MAX_SETTING_CHARS, "call": 256}
# Launches of one test: a test that launches in a loop is still far under this.
MAX_LAUNCHES = 10_000
_LIST_LIMITS = {
    "ranks": MAX_WORLD_SIZE,
    "tests": MAX_TESTS,
    "launches": MAX_LAUNCHES,
    "settings": 1024,
    "cpu_substitutions": 1024,
    "memory": MAX_WORLD_SIZE,
    "t_s": MAX_SERIES_POINTS,
    "rss_bytes": MAX_SERIES_POINTS,
}


def check_report(data: Any) -> Report:
    """`data` checked field by field against the dataclasses' types and the bounds above.

    Fail closed: a field of another type (a string where an int belongs, an object where text
    belongs), a number or text past its bound, or an unknown outcome raises `SchemaError` naming
    the field. Keys the schema does not define are ignored (never read). The session header is
    checked for the fields `Session` defines and ``outcome_counts``; its other keys are dropped.
    """
    if isinstance(data, dict) and isinstance(data.get("tests"), list) and len(data["tests"]) > MAX_TESTS:
        raise SchemaError(f"tests has more than {MAX_TESTS} entries")
    Report.from_json(data)  # the structure first: version, 'tests' list, 'session' object, required keys
    if data["version"] < 3:
        data = {
            **data,
            "tests": [_launch_count_checked(t, f"tests[{i}]") for i, t in enumerate(data["tests"])],
        }
    _check_value(data["tests"], list[TestEntry], "tests", "tests")
    session = _check_session(data.get("session", {}))
    return Report.from_json({"version": REPORT_VERSION, "session": session, "tests": data["tests"]})


def _launch_count_checked(test: dict[str, Any], where: str) -> dict[str, Any]:
    """A version-1/2 row: its ``launches`` count checked as an int, then left out (no records)."""
    if test.get("launches") is not None:
        _check_value(test["launches"], int, f"{where}.launches", "launch_count")
    return {key: value for key, value in test.items() if key != "launches"}


_SCALARS = (str, int, float, bool, type(None))


@functools.cache
def _field_names(cls: type) -> tuple[str, ...]:
    return tuple(f.name for f in fields(cls))


def _as_json(value: Any) -> Any:
    """What `dataclasses.asdict` gives for a row, without its deep copy of every immutable scalar
    (half the time of reading or merging a report of 100,000 rows); other values it copies alike."""
    if type(value) in _SCALARS:
        return value
    if is_dataclass(value) and not isinstance(value, type):
        return {name: _as_json(getattr(value, name)) for name in _field_names(type(value))}
    if type(value) is list:
        return [_as_json(item) for item in value]
    if type(value) is dict:
        return {_as_json(key): _as_json(item) for key, item in value.items()}
    if type(value) is tuple:
        return tuple(_as_json(item) for item in value)
    return copy.deepcopy(value)


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    """`typing.get_type_hints(cls)`, once per class: it compiles every annotation on each call
    (3 ms a row of 100,000 in a report that `merge-reports` reads, 5 minutes a report)."""
    return typing.get_type_hints(cls)


def _check_session(session: dict[str, Any]) -> dict[str, Any]:
    hints = _hints(Session)
    out: dict[str, Any] = {}
    for name, kind in hints.items():
        if session.get(name) is not None:
            out[name] = _check_value(session[name], kind, f"session.{name}", name)
    counts = session.get("outcome_counts")
    if counts is not None:
        if not isinstance(counts, dict) or len(counts) > len(OUTCOMES):
            raise SchemaError("session.outcome_counts is not an object of outcome counts")
        for outcome, n in counts.items():
            _check_value(outcome, str, "session.outcome_counts", "outcome")
            _check_value(n, int, f"session.outcome_counts.{outcome}", "tests")
        out["outcome_counts"] = dict(counts)
    return out


def _check_value(value: Any, kind: Any, where: str, name: str) -> Any:
    """`value` if it is of type `kind` within the bounds for field `name`, else `SchemaError`."""
    origin, args = typing.get_origin(kind), typing.get_args(kind)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return value
        kind = next(a for a in args if a is not type(None))
        origin, args = typing.get_origin(kind), typing.get_args(kind)
    if origin is list:
        limit = _LIST_LIMITS.get(name, MAX_COUNT)
        if not isinstance(value, list) or len(value) > limit:
            raise SchemaError(f"{where} is not a list of at most {limit} entries")
        for i, item in enumerate(value):
            _check_value(item, args[0], f"{where}[{i}]", name)
        return value
    if is_dataclass(kind):
        return _check_object(value, kind, where)
    if kind is bool:
        if not isinstance(value, bool):
            raise SchemaError(f"{where} is not true or false")
    elif kind is int:
        low, high = _INT_RANGES.get(name, (0 if name.endswith("_bytes") else -MAX_INT, MAX_INT))
        if not _is_int(value) or not low <= value <= high:
            raise SchemaError(f"{where} is not an integer in [{low}, {high}]")
    elif kind is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        if not ok or not math.isfinite(value) or abs(value) > MAX_FLOAT:
            raise SchemaError(f"{where} is not a finite number")
    elif kind is str:
        limit = _TEXT_LIMITS.get(name, MAX_TEXT_CHARS)
        if not isinstance(value, str) or len(value) > limit:
            raise SchemaError(f"{where} is not text of at most {limit} characters")
        if name == "outcome" and value not in OUTCOMES:
            raise SchemaError(f"{where} is not one of {', '.join(OUTCOMES)}")
        if name == "start_mode" and value not in START_MODES:
            raise SchemaError(f"{where} is not one of {', '.join(START_MODES)}")
    return value


def _check_object(value: Any, cls: type, where: str) -> Any:
    if not isinstance(value, dict):
        raise SchemaError(f"{where} is not an object")
    required = _REQUIRED.get(cls.__name__, ())
    for name, kind in _hints(cls).items():
        # null reads as absent (the field's default) for every field a row can do without
        if value.get(name) is not None or name in required:
            _check_value(value.get(name), kind, f"{where}.{name}", name)
    return value
