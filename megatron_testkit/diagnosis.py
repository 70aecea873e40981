"""From what every rank left behind to one verdict: which rank, which kind, and why.

Pure functions over `RankRecord`s, so the rules are unit-testable without spawning anything.
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
"""

from __future__ import annotations

import re
import signal
from dataclasses import dataclass, field
from typing import Any

from megatron_testkit.schema import Failure, RankPeak

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


@dataclass
class RankRecord:
    """Everything known about one rank after a launch.

    `status` is ``ok`` (returned), ``failed`` (exception, signal or non-zero exit), ``torn_down``
    (still running when another rank's failure ended the launch) or ``hung`` (still running at
    the timeout). Times are wall-clock seconds (`time.time()`), comparable across the ranks of a
    host.
    """

    rank: int
    status: str
    pid: int | None = None
    exit_code: int | None = None
    signal: str | None = None
    time: float | None = None
    exc_type: str | None = None
    exc_message: str | None = None
    traceback: str | None = None
    kind_hint: str | None = None
    peak_host_bytes: int | None = None
    peak_device_bytes: int | None = None
    peak_process: str | None = None  # the descendant that held most of the rank's peak, if any
    last_collective: str | None = None
    collective_seq: int = 0
    stack: str | None = None
    log_path: str | None = None
    log_tail: str | None = None
    kind: str | None = None
    knock_on: bool = False
    extra: dict = field(default_factory=dict)

    def summary(self) -> str:
        """One line: what this rank died of, e.g. ``RuntimeError: Connection closed by peer``."""
        if self.exc_type:
            text = (self.exc_message or "").strip().splitlines()
            return f"{self.exc_type}: {text[0] if text else ''}".rstrip(": ")
        printed = f" after printing: {self.extra['oom_line']}" if self.extra.get("oom_line") else ""
        if self.signal:
            hint = " (possibly the kernel OOM killer)" if self.signal == "SIGKILL" and not printed else ""
            return f"killed by {self.signal}{hint}{printed}"
        if self.exit_code not in (None, 0):
            return f"exited with code {self.exit_code} without a Python exception{printed}"
        if self.exit_code == 0 and self.status == "failed":
            return "exited with code 0 before returning (no result, no record)"
        return self.status

    def peak(self) -> RankPeak:
        """This rank's row in the report."""
        return RankPeak(
            self.rank,
            self.peak_host_bytes,
            self.peak_device_bytes,
            self.exit_code,
            self.signal,
            self.peak_process,
        )


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
            record.kind, record.extra["oom_line"] = "oom", oom_line
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


def root_cause(records: list[RankRecord]) -> RankRecord | None:
    """The rank to blame (rules in the module docstring), or None when every rank succeeded."""
    for record in records:
        classify(record)
    failed = [r for r in records if r.status == "failed"]
    primary = [r for r in failed if not r.knock_on] or failed
    if primary:
        first = min(primary, key=lambda r: (r.time if r.time is not None else float("inf"), r.rank))
        if first.kind != "hang":
            return first
        # A collective timed out: the rank that timed out was waiting, the one it waited for is
        # the story. Among the stuck ranks, blame the one that entered the fewest collectives.
        stuck = [r for r in records if r.kind == "hang" or r.status in ("torn_down", "hung")]
        laggard = min(stuck, key=lambda r: (r.collective_seq, r.rank))
        laggard.kind = "hang"
        laggard.extra.setdefault("timed_out_rank", first.rank)
        return laggard
    hung = [r for r in records if r.status == "hung"]
    if hung:
        return min(hung, key=lambda r: (r.collective_seq, r.rank))
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
    root: RankRecord,
    records: list[RankRecord],
    *,
    timeout: float | None = None,
    log_dir: str | None = None,
    started: float | None = None,
) -> str:
    """The `RankFailure` message: the root cause first, then the other ranks, then the logs."""
    kind = root.kind or "error"
    stalled = root.extra.get("stall")
    if kind == "hang" and stalled is not None:
        first = f"rank {root.rank} hang: {stalled.why}; stacks and collective counts of every rank below"
    elif kind == "hang" and root.status != "failed":
        if "timed_out_rank" in root.extra:
            why = f"a collective timed out on rank {root.extra['timed_out_rank']}"
        else:
            why = (
                f"no rank finished within {timeout:g} s of its set-up"
                if timeout is not None
                else "the launch timed out"
            )
        last = f", last {root.last_collective}" if root.last_collective else ", none yet"
        first = (
            f"rank {root.rank} hang: {why}; rank {root.rank} entered the fewest collectives "
            f"({root.collective_seq}{last}); stacks of every rank below"
        )
    else:
        first = f"rank {root.rank} {kind}: {root.summary()}"
    lines = [first, ""]
    when = f" at +{root.time - started:.2f} s" if root.time is not None and started is not None else ""
    lines.append(f"Root cause: rank {root.rank} ({kind}){when}")
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
    others = [r for r in records if r.rank != root.rank]
    if others:
        lines += ["", "Other ranks:"]
    for rec in others:
        if rec.status == "failed":
            why = " (knock-on: a peer went away)" if rec.knock_on else ""
            desc = f"{rec.kind}{why}: {rec.summary()}"
        elif rec.status == "torn_down":
            desc = "still running; torn down by the launcher after the root cause"
        elif rec.status == "hung" and stalled is not None:
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
    if log_dir:
        lines += ["", f"Rank logs: {log_dir}"]
    for rec in [root, *others]:
        if rec.log_tail and rec.log_tail.strip():
            lines.append(f"--- rank {rec.rank} output (last lines) ---")
            lines.append(_indent(rec.log_tail, f"[rank{rec.rank}] "))
    return "\n".join(lines)
