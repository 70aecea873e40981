"""The session report's schema, typed and versioned: the one definition its writers and readers share.

Written by the launcher (`Run`, one per `run_ranks` launch), folded by the plugin into one
`TestEntry` per test (each launch kept as a `Launch` with its verdict) and one `Report` per session
(``kit-report.json``); read back by `megatron_testkit.verdicts` and ``python -m megatron_testkit
repro``. The JSON field names are a contract: they are the dataclass field names below and do not
change without a new `REPORT_VERSION`; reports of every older version still read.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from accounting.json_input import JsonInputError, load_json, printable
from megatron_testkit.memory_series import RankMemory
from megatron_testkit.metrics import TestMetrics
from megatron_testkit.report_fields import (
    BYTES,
    COUNT,
    MAX_COUNT,
    MAX_FLOAT,
    MAX_GPUS,
    MAX_INT,
    MAX_LAUNCHES,
    MAX_NODEID_CHARS,
    MAX_SETTING_CHARS,
    MAX_TESTS,
    MAX_TEXT_CHARS,
    MAX_WORLD_SIZE,
    RANK,
    SIZE,
    WORLD_SIZE,
    JsonRecord,
    SchemaError,
    bounds,
    declared_fields,
    read_object,
    read_value,
)

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

# The bounds (MAX_*) live with the reader that applies them (`megatron_testkit.report_fields`);
# these names stay importable from here.
__all__ = [
    "MAX_COUNT", "MAX_FLOAT", "MAX_GPUS", "MAX_INT", "MAX_LAUNCHES", "MAX_NODEID_CHARS",
    "MAX_REPORT_BYTES", "MAX_SETTING_CHARS", "MAX_TESTS", "MAX_TEXT_CHARS", "MAX_WORLD_SIZE",
    "OUTCOMES", "READ_VERSIONS", "REPORT_VERSION", "START_MODES", "CpuSubstitution", "Failure",
    "Launch", "RankPeak", "Report", "ReportError", "Run", "SchemaError", "Session", "SessionRef",
    "Setting", "TestEntry", "check_report", "read_report",
]  # fmt: skip
# The largest report read: about 1 kB per test plus failure text the writer clips to 20 000
# characters, so 32 MiB holds a whole suite that failed; parsed, it is roughly ten times that.
MAX_REPORT_BYTES = 32 * 2**20
# Entries of the session's short lists (its recorded settings, the CPU layer's substitutions).
MAX_SHORT_LIST = 1024


class ReportError(JsonInputError):
    """A report that is missing, too large, not JSON, or not a well-formed kit report (versions 1 to 5)."""


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


def _read_metrics(data: Any, where: str) -> TestMetrics:
    """A test's ``metrics``: read by `TestMetrics`' own strict reader (golden files share it)."""
    if isinstance(data, dict) and data.get("megatron_core") is not None:
        read_value(data["megatron_core"], str, f"{where}.megatron_core", {}, strict=True)
    try:
        return TestMetrics.from_json(data, where)
    except (ValueError, TypeError) as exc:  # TypeError: a value that is not a number
        raise SchemaError(str(exc)) from None


def _whole_series(series: RankMemory) -> bool:
    """A rank's series whose times and sizes pair up (one that does not is left out)."""
    return len(series.t_s) == len(series.rss_bytes)


@dataclass
class Failure(JsonRecord):
    """Why a test failed: the rank and kind when a launch names one (None for in-process failures)."""

    rank: int | None = field(metadata=bounds(range=RANK))
    kind: str | None = field(metadata=bounds(empty_is_none=True))
    first_line: str
    message: str


@dataclass
class RankPeak(JsonRecord):
    """One rank's peaks (bytes; None when unknown) and how its process ended."""

    rank: int = field(metadata=bounds(range=RANK, required=True))
    peak_host_bytes: int | None = field(default=None, metadata=SIZE)
    peak_device_bytes: int | None = field(default=None, metadata=SIZE)
    exit_code: int | None = None
    signal: str | None = None
    # The rank's host peak counts its descendants (worker processes, pools); when one of them held
    # memory at that peak, the largest: "pid 12: python -c ... held 800MiB".
    peak_process: str | None = None


@dataclass
class Run(JsonRecord):
    """What one `run_ranks` launch measured (carried from xdist workers as its JSON)."""

    world_size: int = field(metadata=bounds(range=WORLD_SIZE))
    backend: str
    started: float
    seed: int
    duration_s: float
    log_dir: str | None
    ranks: list[RankPeak] = field(metadata=bounds(items=MAX_WORLD_SIZE))
    failure: Failure | None = None
    leaked_processes: int = field(default=0, metadata=bounds(range=COUNT))
    # The ranks' own CUDA device (the lowest rank that used one; None on CPU) and the golden
    # platform they named (`megatron_testkit.platforms.launch_platform`); absent in older reports.
    device: str | None = None
    platform: str | None = None
    # Seconds the launch waited for the session's admission ledger, and the bytes it was admitted
    # with (its ranks' budgets, or the default per rank); None without admission or before version 3.
    queued_s: float | None = None
    admitted_bytes: int | None = field(default=None, metadata=SIZE)
    # Seconds from spawn until every rank's process group was up (Python, torch, the test's module,
    # the rendezvous): the launch timeout counts from there. None when they never all got there.
    setup_s: float | None = None
    # The launch's folder relative to the --kit-report folder (version 4; None outside one).
    rank_logs: str | None = None
    # Each rank's RSS over the launch, sampled by the launcher's poll (version 4).
    memory: list[RankMemory] | None = field(
        default=None, metadata=bounds(items=MAX_WORLD_SIZE, keep=_whole_series)
    )
    # How the ranks started: "warm" (forked from the warm parent), "cold" (spawned), "mixed" (the
    # parent refused a later rank), and why (the reason it went cold; on a warm start, the preloads
    # that failed). None before version 4.
    start_mode: str | None = field(default=None, metadata=bounds(choices=START_MODES))
    start_reason: str | None = None


@dataclass
class Launch(JsonRecord):
    """One launch of a test, with its verdict: kept whether the test caught its `RankFailure` or not.

    ``rank``/``kind``/``first_line`` are the root cause (None, None, "" for a launch that passed);
    the peaks are the largest of its ranks'; ``caught``: it failed and the test went on past it
    (the test's own outcome is not this launch's failure).
    """

    world_size: int = field(metadata=bounds(range=WORLD_SIZE))
    backend: str
    seed: int
    duration_s: float = 0.0
    rank: int | None = field(default=None, metadata=bounds(range=RANK))
    kind: str | None = field(default=None, metadata=bounds(empty_is_none=True))
    first_line: str = ""
    peak_host_bytes: int | None = field(default=None, metadata=SIZE)
    peak_device_bytes: int | None = field(default=None, metadata=SIZE)
    caught: bool = False
    # Each rank's RSS over the launch (version 4; None before, or when not sampled).
    memory: list[RankMemory] | None = field(
        default=None, metadata=bounds(items=MAX_WORLD_SIZE, keep=_whole_series)
    )
    # Version 4: warm, cold or mixed, why, and seconds from the request until every rank's process
    # group was up (the launch's start time); None in older reports.
    start_mode: str | None = field(default=None, metadata=bounds(choices=START_MODES))
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


def _max_of(values: list[int | None]) -> int | None:
    known = [v for v in values if v is not None]
    return max(known) if known else None


@dataclass
class TestEntry(JsonRecord):
    """One test's row in the report: its outcome, launches folded into per-rank maxima, budgets."""

    __test__ = False  # not a pytest test class

    nodeid: str = field(metadata=bounds(chars=MAX_NODEID_CHARS, required=True))
    outcome: str = field(metadata=bounds(choices=OUTCOMES, required=True))
    duration_s: float = 0.0
    world_size: int = field(default=0, metadata=bounds(range=WORLD_SIZE))
    backend: str | None = None
    seed: int | None = None
    budget_host_bytes: int | None = field(default=None, metadata=SIZE)
    budget_device_bytes: int | None = field(default=None, metadata=SIZE)
    peak_host_bytes: int | None = field(default=None, metadata=SIZE)
    peak_device_bytes: int | None = field(default=None, metadata=SIZE)
    ranks: list[RankPeak] = field(default_factory=list, metadata=bounds(items=MAX_WORLD_SIZE))
    failure: Failure | None = None
    pytest_rss_before_bytes: int | None = field(default=None, metadata=SIZE)
    pytest_rss_after_bytes: int | None = field(default=None, metadata=SIZE)
    leaked_processes: int = field(default=0, metadata=bounds(range=COUNT))
    log_dir: str | None = None
    # Every launch and its verdict, in order (versions 1 and 2 kept a count: it reads as []).
    launches: list[Launch] = field(default_factory=list, metadata=bounds(items=MAX_LAUNCHES))
    worker: str | None = None
    skip_capability: str | None = None  # what a skipped test declared it needs (megatron_testkit.skips)
    # Recorded metric series and their platform (golden values).
    metrics: TestMetrics | None = field(default=None, metadata=bounds(read=_read_metrics))
    # Summed over its launches: seconds waited for admission and spent setting ranks up; the
    # largest admitted share (bytes).
    queued_s: float | None = None
    admitted_bytes: int | None = field(default=None, metadata=SIZE)
    setup_s: float | None = None
    # The first kept launch folder relative to the report folder (``log_dir`` is its absolute
    # path on the machine that ran); version 4, None outside a --kit-report folder.
    rank_logs: str | None = None
    # The test function's line in its file (pytest's location, 1-based; version 4): where a CI
    # annotation points.
    line: int | None = field(default=None, metadata=bounds(range=(1, MAX_INT)))


@dataclass
class Setting(JsonRecord):
    """One environment variable of the session that a repro restores (``KIT_*``, hypothesis's)."""

    name: str = field(metadata=bounds(chars=256))
    value: str = field(metadata=bounds(chars=MAX_SETTING_CHARS))


@dataclass
class CpuSubstitution(JsonRecord):
    """One call the CPU layer substituted in a session (``torch.cuda.set_device``, an NCCL
    ``new_group`` given gloo), and how often."""

    call: str = field(metadata=bounds(chars=256, required=True))
    count: int = field(metadata=bounds(range=(0, MAX_INT), required=True))


@dataclass
class SessionRef(JsonRecord):
    """One session of a report folder that several sessions shared (`megatron_testkit.session_merge`):
    who it was, and which rows are its own (``tests[first_test : first_test + tests]``)."""

    started: str
    host: str
    markexpr: str
    pytest_args: list[str]
    first_test: int = field(metadata=bounds(range=(0, MAX_TESTS)))
    tests: int = field(metadata=bounds(range=(0, MAX_TESTS)))
    ci_job: str | None = None
    exit_status: int | None = None
    duration_s: float = 0.0


@dataclass
class Session(JsonRecord):
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
    cpu_count: int | None = field(metadata=bounds(range=COUNT))
    gpus: int = field(metadata=bounds(range=(0, MAX_GPUS)))
    torch: str | None
    megatron_core: str | None
    ci_job: str | None
    pytest_rss_start_bytes: int | None = field(metadata=bounds(range=BYTES))
    pytest_rss_end_bytes: int | None = field(metadata=bounds(range=BYTES))
    allowed_skips: list[str] | None = None  # KIT_ALLOWED_SKIPS (None: unset, skips unchecked)
    exit_status: int | None = None  # pytest's exit status (2: interrupted); None in older reports
    # The sessions merged into this report when several wrote one --kit-report folder (oldest
    # first, each with the range of its rows); None for a report of one session.
    sessions: list[SessionRef] | None = None
    # The oldest sessions a merge dropped past MAX_TESTS rows.
    dropped_sessions: int | None = field(default=None, metadata=bounds(range=COUNT))
    # What a repro restores (version 3): the KIT_* and hypothesis variables set, hypothesis's seed,
    # the runner's memory limit (KIT_HOST_MEMORY, else the memory cgroup's limit, and which), and
    # whether the skip policy's summary was asked for (KIT_ALLOWED_SKIPS or kit_skip_summary).
    settings: list[Setting] | None = field(default=None, metadata=bounds(items=MAX_SHORT_LIST))
    hypothesis_seed: int | None = None
    runner_memory_bytes: int | None = field(default=None, metadata=SIZE)
    runner_memory_source: str | None = None
    skip_summary: bool | None = None
    # Memory admission (version 3; None without it): the runner's memory the ledger held
    # (``admission_source`` says where the figure came from), the session's peak of admitted
    # memory against it, and the share a rank of a test without a memory_budget is admitted with.
    admission_limit_bytes: int | None = field(default=None, metadata=SIZE)
    admission_peak_bytes: int | None = field(default=None, metadata=SIZE)
    admission_source: str | None = None
    admission_default_rank_bytes: int | None = field(default=None, metadata=SIZE)
    # Version 4: who created the pytest process' CUDA context when a test's own code did not (the
    # kit reading a rank's CUDA tensors, or something before any test); None otherwise.
    cuda_context: str | None = None
    # Version 5: what the CPU layer substituted (most frequent first); None when it substituted nothing.
    cpu_substitutions: list[CpuSubstitution] | None = field(
        default=None, metadata=bounds(items=MAX_SHORT_LIST)
    )
    # Version 5: one line per module dropped from the warm preload set (its import started a thread
    # or initialised CUDA; the warm parent was rebuilt without it); None when none was.
    warm_preload_dropped: list[str] | None = None


# The header's outcome counts, which the report's writer adds beside the `Session` fields.
_OUTCOME_COUNTS = bounds(items=len(OUTCOMES), keys=OUTCOMES, range=(0, MAX_TESTS))


@dataclass
class Report:
    """A whole session: ``version``, the ``session`` header (its `Session` fields and
    ``outcome_counts``, kept as a dict) and the ``tests`` rows."""

    session: dict[str, Any]
    tests: list[TestEntry]
    version: int = REPORT_VERSION

    def to_json(self) -> dict[str, Any]:
        """The report as written to ``kit-report.json``."""
        return {"version": self.version, "session": self.session, "tests": [t.to_json() for t in self.tests]}

    @classmethod
    def from_json(cls, data: Any) -> Report:
        """A report read leniently (the kit's own rows, older versions): `SchemaError` says what is
        missing or of another version; the header is kept as given."""
        _check_envelope(data)
        tests = [TestEntry.from_json(t, f"tests[{i}]") for i, t in enumerate(data["tests"])]
        return cls(session=data.get("session", {}), tests=tests)


def _check_envelope(data: Any) -> None:
    """The report's frame: a version read here, a ``tests`` list, a ``session`` object."""
    if not isinstance(data, dict) or data.get("version") not in READ_VERSIONS:
        found = data.get("version") if isinstance(data, dict) else type(data).__name__
        raise SchemaError(f"not a version-{REPORT_VERSION} kit report (version: {found!r})")
    if not isinstance(data.get("tests"), list):
        raise SchemaError("no 'tests' list")
    if not isinstance(data.get("session", {}), dict):
        raise SchemaError("'session' is not an object")


def check_report(data: Any) -> Report:
    """`data` checked field by field against the dataclasses' types and the bounds they declare.

    Fail closed: a field of another type (a string where an int belongs, an object where text
    belongs), a number or text past its bound, or an unknown outcome raises `SchemaError` naming
    the field. Keys the schema does not define are ignored (never read). The session header is
    checked for the fields `Session` defines and ``outcome_counts``; its other keys are dropped.
    """
    if isinstance(data, dict) and isinstance(data.get("tests"), list) and len(data["tests"]) > MAX_TESTS:
        raise SchemaError(f"tests has more than {MAX_TESTS} entries")
    _check_envelope(data)
    tests = data["tests"]
    if data["version"] < 3:  # a row's ``launches`` was a count: checked, then read as no records
        tests = [_without_launch_count(t, f"tests[{i}]") for i, t in enumerate(tests)]
    rows = [read_object(t, TestEntry, f"tests[{i}]", strict=True) for i, t in enumerate(tests)]
    return Report(session=_check_session(data.get("session", {})), tests=rows)


def _without_launch_count(test: Any, where: str) -> Any:
    """A version-1/2 row: its ``launches`` count checked as an int, then left out (no records)."""
    if not isinstance(test, dict) or test.get("launches") is None:
        return test
    read_value(test["launches"], int, f"{where}.launches", {"range": COUNT}, strict=True)
    return {key: value for key, value in test.items() if key != "launches"}


def _check_session(session: dict[str, Any]) -> dict[str, Any]:
    """The header's `Session` fields and ``outcome_counts``, each checked, as given; null and other
    keys left out."""
    out: dict[str, Any] = {}
    for f in declared_fields(Session):
        if session.get(f.name) is not None:
            f.read(session[f.name], f"session.{f.name}", True)
            out[f.name] = session[f.name]
    counts = session.get("outcome_counts")
    if counts is not None:
        out["outcome_counts"] = read_value(
            counts, dict[str, int], "session.outcome_counts", _OUTCOME_COUNTS, strict=True
        )
    return out
