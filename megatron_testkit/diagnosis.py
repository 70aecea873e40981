"""From what every rank left behind to one verdict: which rank, which kind, and why.

Functions over `RankRecord`s (the one file they read: the ranks' flight-recorder dumps, when the
launcher's evidence names them), so the rules are unit-testable without spawning anything.
The rules, in order:

1. A rank that failed on its own (an exception that is not a knock-on, a signal, an exit without
   a record, status 0 included) is a root-cause candidate; the earliest by time wins.
2. A knock-on failure (a collective that failed because a peer went away: gloo's "Connection
   closed by peer", NCCL's "communicator was aborted") is the root cause only when nothing else
   failed; the dead peer is the story, not the survivor that noticed.
3. When nothing failed before the timeout it is a hang; the rank that entered the fewest
   collectives is named (the one the others wait for), the lowest rank on ties. A deadlock found
   by the stall rule (`megatron_testkit.stall`) names the rank its verdict names, with every
   rank's position.
4. An ``oom`` before the test's function started (the rank's startup footprint over the host
   budget) is the budget's fault, no rank's: `BudgetBelowFootprint`.

`judge` applies them once and gives the launcher its verdict: the `RankFailure` to raise (its
message leads with the root cause), or None when every rank returned. What the rules note beside
the records (the stall rule's verdict, the rank whose collective timed out) is the `Verdict`'s.
"""

from __future__ import annotations

import re
import signal
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from megatron_testkit import flight_recorder
from megatron_testkit.budgets import format_size
from megatron_testkit.rank_record import RankRecord
from megatron_testkit.schema import Failure

if TYPE_CHECKING:
    from megatron_testkit.stall import Stall

__all__ = [
    "BudgetBelowFootprint",
    "Evidence",
    "RankFailure",
    "RankRecord",
    "Verdict",
    "classify",
    "format_failure",
    "judge",
    "root_cause",
    "signal_name",
    "without_kit_frames",
]

_OOM_PATTERNS = re.compile(
    r"out of memory|can't allocate memory|cannot allocate memory|not enough memory|"
    r"memory budget exceeded|CUDA error: out of memory|OutOfMemoryError|"
    # cuBLAS's and cuDNN's failed workspace or handle allocation (CUBLAS_STATUS_ALLOC_FAILED,
    # CUDNN_STATUS_ALLOC_FAILED), and the runtime's error name where its message is not printed.
    r"_STATUS_ALLOC_FAILED|cudaErrorMemoryAllocation",
    re.IGNORECASE,
)
_OOM_TYPES = {"MemoryError", "torch.OutOfMemoryError", "torch.cuda.OutOfMemoryError"}
_KNOCK_ON_PATTERNS = re.compile(
    r"Connection closed by peer|Connection reset by peer|Broken pipe|"
    r"communicator was aborted|NCCL communicator.*abort|ProcessGroup.*abort|"
    r"peer.*(closed|died|exited)|Socket Timeout|Connection refused|"
    r"Application timeout caused pair closure|DistNetworkError|ncclRemoteError",
    re.IGNORECASE,
)
_WATCHDOG_PATTERNS = re.compile(
    r"Watchdog caught collective operation timeout|collective operation timeout|"
    r"ProcessGroupNCCL.*[Tt]imeout",
)
_TIMEOUT_PATTERNS = re.compile(
    r"Watchdog caught collective operation timeout|collective operation timeout|"
    r"Timed out waiting|timed out after",
    re.IGNORECASE,
)


class BudgetBelowFootprint(ValueError):
    """A host budget smaller than a rank's startup or idle footprint: no test function can run within it."""


# Users import it from the launcher (`megatron_testkit.ranks`, its documented home), and the first
# line of a failed test names it there: shown and pickled under that name, which resolves to this class.
BudgetBelowFootprint.__module__ = "megatron_testkit.ranks"


class RankFailure(Exception):
    """A launch failed. ``rank`` is the root cause, ``kind`` one of oom, error, crash, hang.

    ``records`` holds a `RankRecord` for every rank; ``log_dir`` the directory with the rank
    logs, records and stack dumps. ``str()`` leads with ``rank <r> <kind>: ...``.
    """

    def __init__(
        self, message: str, *, rank: int, kind: str, records: list[RankRecord], log_dir: str | None
    ) -> None:
        super().__init__(message)
        self.rank = rank
        self.kind = kind
        self.records = records
        self.log_dir = log_dir

    def __reduce__(self) -> tuple[Any, ...]:
        # Keyword-only arguments: the default exception pickling would lose them.
        return (_rebuild_failure, (str(self), self.rank, self.kind, self.records, self.log_dir))

    def to_failure(self, limit: int | None = None) -> Failure:
        """The report's ``failure`` entry (the message's last ``limit`` characters, all by default)."""
        message = str(self)
        text = message[-limit:] if limit else message
        return Failure(self.rank, self.kind, message.splitlines()[0] if message else "", text)


def _rebuild_failure(
    message: str, rank: int, kind: str, records: list[RankRecord], log_dir: str | None
) -> RankFailure:
    return RankFailure(message, rank=rank, kind=kind, records=records, log_dir=log_dir)


def signal_name(returncode: int | None) -> str | None:
    """``-9`` -> ``"SIGKILL"`` (Popen's negative return codes), else None."""
    if returncode is None or returncode >= 0:
        return None
    try:
        return signal.Signals(-returncode).name
    except ValueError:
        return f"signal {-returncode}"


def classify(record: RankRecord) -> None:
    """Set `kind` and `knock_on` on a failed record (others keep kind None)."""
    if record.status == "hung":
        record.kind = "hang"
        return
    if record.status != "failed":
        return
    text = f"{record.exc_type or ''}: {record.exc_message or ''}"
    if record.exc_type is None:
        # No Python exception: a signal or a bare exit, diagnosed from the rank's last output.
        oom_line = _oom_line(record)
        if oom_line is not None:
            record.kind, record.oom_line = "oom", oom_line
        elif record.log_tail and _WATCHDOG_PATTERNS.search(record.log_tail):
            # NCCL's watchdog aborts a rank whose collective timed out: a hang, not a crash.
            record.kind = "hang"
        else:
            record.kind = "crash"
    elif record.kind_hint == "oom" or record.exc_type in _OOM_TYPES or _OOM_PATTERNS.search(text):
        record.kind = "oom"
    elif _KNOCK_ON_PATTERNS.search(text):
        record.kind = "error"
        record.knock_on = True
    elif _TIMEOUT_PATTERNS.search(text):
        record.kind = "hang"
    else:
        record.kind = "error"


def _oom_line(record: RankRecord) -> str | None:
    """The last line of a rank's output that says it ran out of memory, when it died without a
    Python exception (``terminate`` after "CUDA error: out of memory", cuBLAS's
    CUBLAS_STATUS_ALLOC_FAILED, then SIGABRT or an exit). A SIGKILL is never named from output:
    the OOM killer prints nothing to the rank, and whatever the rank printed before it was killed
    may have been survived; it is ``oom`` only with the launcher's evidence (a budget or runner
    limit it enforced, the memory cgroup's OOM-kill count), which sets ``kind_hint``."""
    if record.signal == "SIGKILL" or not record.log_tail:
        return None
    for line in reversed(record.log_tail.splitlines()):
        if _OOM_PATTERNS.search(line):
            return line.strip()[:300]
    return None


@dataclass
class Verdict:
    """The rank to blame and what the rules noted beside the records: the stall rule's deadlock
    verdict that named it, or the rank whose collective timed out while it was the one behind."""

    root: RankRecord
    records: list[RankRecord]
    stall: Stall | None = None
    timed_out_rank: int | None = None

    @property
    def kind(self) -> str:
        """The root cause's kind: oom, error, crash or hang."""
        return self.root.kind or "error"


@dataclass(frozen=True)
class Evidence:
    """What the launcher knows beside the ranks' records: whether the launch hung, the stall rule's
    verdict, the host budget, and what a failure's message shows (the timeout, the start, the
    logs, the ranks' flight-recorder dumps, the line that replays the launch)."""

    hung: bool = False
    stall: Stall | None = None
    host_budget: int | None = None
    timeout: float | None = None
    started: float | None = None
    shown_logs: str | None = None  # the logs as the message names them
    log_dir: str | None = None  # `RankFailure.log_dir`: the absolute folder
    dumps: Path | None = None  # the stem of the ranks' flight-recorder dumps (`flight_recorder.DUMP_STEM`)
    repro: str | None = None


def judge(records: list[RankRecord], evidence: Evidence | None = None) -> RankFailure | None:
    """The launch's verdict (the rules in the module docstring): the `RankFailure` to raise, or None
    when every rank returned. `BudgetBelowFootprint` when the root cause is a rank's startup
    footprint over the host budget."""
    evidence = evidence or Evidence()
    verdict = decide(records, evidence)
    if verdict is None:
        return None
    message = format_failure(
        verdict, timeout=evidence.timeout, log_dir=evidence.shown_logs, started=evidence.started
    )
    if evidence.dumps is not None:
        # NCCL dumps on a watchdog timeout and on the launcher's request before it kills a rank;
        # any rank may also have dumped on its own (gloo records too): what they say joins the message.
        traces = flight_recorder.read_dumps(evidence.dumps, range(len(records)))
        findings = flight_recorder.diagnose(traces, len(records)) if traces else []
        message += "".join(f"\nflight recorder: {line}" for line in findings)
    if evidence.repro:
        message += f"\nrepro: {evidence.repro}"
    return RankFailure(
        message, rank=verdict.root.rank, kind=verdict.kind, records=records, log_dir=evidence.log_dir
    )


def decide(records: list[RankRecord], evidence: Evidence) -> Verdict | None:
    """The `Verdict` (None when every rank returned and the launch did not hang)."""
    verdict = _blame(records)
    if verdict is None and not evidence.hung:
        return None
    assert verdict is not None
    if evidence.stall is not None and verdict.root.status == "hung":
        # Deadlocked: the rank the others wait for, as the stall rule named it.
        root = records[evidence.stall.rank]
        root.kind = "hang"
        verdict = Verdict(root, records, stall=evidence.stall)
    _refuse_if_failed_at_startup(verdict.root, evidence.host_budget)
    return verdict


def _refuse_if_failed_at_startup(root: RankRecord, host_budget: int | None) -> None:
    """A host budget crossed before the test's function started is the budget's fault, no rank's."""
    if root.kind == "oom" and root.in_function is False and host_budget is not None:
        raise BudgetBelowFootprint(
            f"host memory budget {format_size(host_budget)} is below a rank's startup footprint: "
            f"rank {root.rank} crossed it before the test's function started (Python, torch, the "
            f"test's module, the process group): raise memory_budget(host=...). {root.summary()}"
        )


def root_cause(records: list[RankRecord]) -> RankRecord | None:
    """The rank to blame (rules 1-3 in the module docstring), or None when every rank succeeded."""
    verdict = _blame(records)
    return verdict.root if verdict is not None else None


def _blame(records: list[RankRecord]) -> Verdict | None:
    """Rules 1-3: classify every record, then name the root cause."""
    for record in records:
        classify(record)
    failed = [r for r in records if r.status == "failed"]
    primary = [r for r in failed if not r.knock_on] or failed
    if primary:
        first = min(primary, key=lambda r: (r.time if r.time is not None else float("inf"), r.rank))
        if first.kind != "hang":
            return Verdict(first, records)
        # A collective timed out: the rank that timed out was waiting, the one it waited for is
        # the story. Among the stuck ranks, blame the one that entered the fewest collectives.
        stuck = [r for r in records if r.kind == "hang" or r.status in ("torn_down", "hung")]
        laggard = min(stuck, key=lambda r: (r.collective_seq, r.rank))
        laggard.kind = "hang"
        return Verdict(laggard, records, timed_out_rank=first.rank)
    hung = [r for r in records if r.status == "hung"]
    if hung:
        return Verdict(min(hung, key=lambda r: (r.collective_seq, r.rank)), records)
    return None


# The kit's own frames between a test's call and torch (collective counting, the wait on an async
# op): left out of the stacks a failure shows; the rank's log and stacks file keep them.
_KIT_FRAME = re.compile(
    r'^\s*File "[^"]*megatron_testkit[/\\](collectives|stall|waits|per_test_rank)\.py", line \d+'
)


def without_kit_frames(text: str) -> str:
    """A traceback or faulthandler stack without the kit's wrapper frames (and their source lines)."""
    out: list[str] = []
    skipping = False
    for line in text.splitlines():
        if _KIT_FRAME.match(line):
            skipping = True
            continue
        if skipping and line.startswith("    ") and not line.lstrip().startswith("File "):
            continue  # the skipped frame's source line and its carets
        skipping = False
        out.append(line)
    return "\n".join(out)


def _indent(text: str, prefix: str) -> str:
    return "\n".join(prefix + line for line in text.rstrip().splitlines())


def format_failure(
    verdict: Verdict,
    *,
    timeout: float | None = None,
    log_dir: str | None = None,
    started: float | None = None,
) -> str:
    """The `RankFailure` message: the root cause first, then the other ranks, then the logs."""
    others = [r for r in verdict.records if r.rank != verdict.root.rank]
    lines = [_headline(verdict, timeout), "", *_root_lines(verdict, started)]
    if others:
        lines += ["", "Other ranks:", *_other_lines(others, deadlocked=verdict.stall is not None)]
    if log_dir:
        lines += ["", f"Rank logs: {log_dir}"]
    lines += _output_lines([verdict.root, *others])
    return "\n".join(lines)


def _headline(verdict: Verdict, timeout: float | None) -> str:
    """The message's first line: ``rank <r> <kind>: why``."""
    root, kind = verdict.root, verdict.kind
    if kind == "hang" and verdict.stall is not None:
        return f"rank {root.rank} hang: {verdict.stall.why}; stacks and collective counts of every rank below"
    if kind != "hang" or root.status == "failed":
        return f"rank {root.rank} {kind}: {root.summary()}"
    if verdict.timed_out_rank is not None:
        why = f"a collective timed out on rank {verdict.timed_out_rank}"
    elif timeout is not None:
        why = f"no rank finished within {timeout:g} s of its set-up"
    else:
        why = "the launch timed out"
    last = f", last {root.last_collective}" if root.last_collective else ", none yet"
    return (
        f"rank {root.rank} hang: {why}; rank {root.rank} entered the fewest collectives "
        f"({root.collective_seq}{last}); stacks of every rank below"
    )


def _root_lines(verdict: Verdict, started: float | None) -> list[str]:
    """The root cause: when, the stall rule's findings, its last collective, traceback and stack."""
    root, kind, stalled = verdict.root, verdict.kind, verdict.stall
    when = f" at +{root.time - started:.2f} s" if root.time is not None and started is not None else ""
    lines = [f"Root cause: rank {root.rank} ({kind}){when}"]
    if stalled is not None and getattr(stalled, "waits", ()):
        lines.append("  who waits for whom (the wait-for graph, megatron_testkit.wait_graph):")
        lines += [f"    {line}" for line in stalled.waits]
    if stalled is not None:
        lines.append("  where every rank was (the stall rule, megatron_testkit.stall):")
        lines += [f"    {line}" for line in stalled.lines]
    if root.last_collective:
        lines.append(f"  last collective entered: {root.last_collective}")
    if root.traceback:
        lines.append(_indent(without_kit_frames(root.traceback), "  "))
    if root.stack and (kind in ("hang", "crash") or not root.traceback):
        lines.append(f"  Python stack of rank {root.rank} (faulthandler):")
        lines.append(_indent(without_kit_frames(root.stack), "    "))
    return lines


def _other_lines(others: list[RankRecord], deadlocked: bool) -> list[str]:
    """One line per other rank (what became of it, its last collective), a stuck one's stack."""
    lines = []
    for rec in others:
        if rec.status == "failed":
            why = " (knock-on: a peer went away)" if rec.knock_on else ""
            desc = f"{rec.kind}{why}: {rec.summary()}"
        elif rec.status == "torn_down":
            desc = "still running; torn down by the launcher after the root cause"
        elif rec.status == "hung" and deadlocked:
            desc = "blocked too (deadlocked with the root cause)"
        elif rec.status == "hung":
            desc = "hung (still running at the timeout)"
        else:
            desc = "finished"
        if rec.last_collective:
            desc += f"; last collective entered: {rec.last_collective}"
        lines.append(f"  rank {rec.rank}: {desc}")
        if rec.stack and (rec.status in ("hung", "torn_down") or rec.kind == "hang"):
            lines.append(_indent(without_kit_frames(rec.stack), "      "))
    return lines


def _output_lines(records: list[RankRecord]) -> list[str]:
    """Each rank's last lines of output, root cause first, prefixed by its rank."""
    lines = []
    for rec in records:
        if rec.log_tail and rec.log_tail.strip():
            lines.append(f"--- rank {rec.rank} output (last lines) ---")
            lines.append(_indent(rec.log_tail, f"[rank{rec.rank}] "))
    return lines
