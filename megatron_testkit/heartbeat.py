"""A launch that runs long says what it is doing: one progress line per interval.

Past `AFTER_S` a launch prints, every ``KIT_HEARTBEAT`` seconds (default `DEFAULT_INTERVAL_S`,
``0`` off), a line such as ``test_x: 3 ranks, 40 s: ranks 0-1 in all_reduce #4 of [0, 1, 2] for
12 s, rank 2 computing`` (or ``queued for admission``, ``starting``). Its seconds count from the
launch's start (the ``run_ranks`` call); when the launch waited for admission, the line says how
long: ``test_x: 3 ranks, 52 s (queued 12 s, running 40 s): ...``. It goes to the terminal's
descriptor saved before pytest captured output (`save_terminal`, called by the plugin first
thing), so it shows under capture, in CI logs and from xdist workers (whose stderr is the
controller's); outside pytest, to stderr. A line never continues pytest's progress dots: where
this process owns the terminal (`follow_terminal`) it starts a new line when pytest's is not
empty; an xdist worker cannot see the controller's line and always starts a new one.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

__all__ = [
    "AFTER_S",
    "DEFAULT_INTERVAL_S",
    "HEARTBEAT_ENV",
    "Heartbeat",
    "follow_terminal",
    "followed_terminal",
    "interval",
    "ranks_text",
    "save_terminal",
    "write_line",
]

HEARTBEAT_ENV = "KIT_HEARTBEAT"  # seconds between lines, 0 for none
DEFAULT_INTERVAL_S = 15.0
# A launch shorter than this prints nothing: most tests' launches end well within it.
AFTER_S = 10.0

_terminal_fd: int | None = None
# pytest's terminal writer where this process prints the progress dots (None: not known), and
# whether the line the cursor is on cannot be known here (an xdist worker: the controller's).
_terminal_writer: Callable[[], Any] | None = None
_column_unknown = False
# Queued less than this: the line does not mention it (a free ledger answers in milliseconds).
QUEUED_SHOWN_S = 1.0


def interval(environ: Mapping[str, str] | None = None) -> float | None:
    """``KIT_HEARTBEAT`` in seconds (None: off), else `DEFAULT_INTERVAL_S`; ValueError naming it."""
    raw = (os.environ if environ is None else environ).get(HEARTBEAT_ENV, "").strip()
    if not raw:
        return DEFAULT_INTERVAL_S
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not 0 <= value < float("inf"):
        raise ValueError(
            f"{HEARTBEAT_ENV}={raw!r}: expected seconds between progress lines (e.g. 15), or 0 for none"
        )
    return value or None


def save_terminal() -> None:
    """Keep a copy of stderr as it is now (before pytest's capture), for the progress lines."""
    global _terminal_fd
    if _terminal_fd is None:
        with contextlib.suppress(OSError):
            _terminal_fd = os.dup(2)


def follow_terminal(writer: Callable[[], Any] | None, *, column_unknown: bool = False) -> None:
    """Where pytest's progress dots are: ``writer()`` gives its terminal writer (or None); with
    ``column_unknown`` (an xdist worker) every line starts on a new one."""
    global _terminal_writer, _column_unknown
    _terminal_writer, _column_unknown = writer, column_unknown


def followed_terminal() -> tuple[Callable[[], Any] | None, bool]:
    """What `follow_terminal` was last given (a session restores it when it ends)."""
    return _terminal_writer, _column_unknown


def _new_line_first() -> bool:
    """Whether the cursor may be mid-line (after pytest's dots); tells pytest its line ended."""
    if _column_unknown:
        return True
    try:
        writer = _terminal_writer() if _terminal_writer is not None else None
        if writer is None or not writer.width_of_current_line:
            return False
        # The line below is pytest's now: its next dot starts a line, and counts its width from 0.
        writer._current_line = ""
    except Exception:  # another pytest's writer: start a new line, to be safe
        return True
    return True


def write_line(line: str) -> None:
    """Write one progress line to the terminal saved before capture, on a line of its own."""
    text = ("\n" if _new_line_first() else "") + line + "\n"
    with contextlib.suppress(OSError):
        os.write(_terminal_fd if _terminal_fd is not None else 2, text.encode(errors="replace"))


def ranks_text(ranks: list[int]) -> str:
    """``rank 2``, ``ranks 0-1``, ``ranks 0, 2-3``."""
    ranks = sorted(ranks)
    runs: list[list[int]] = []
    for r in ranks:
        if runs and r == runs[-1][-1] + 1:
            runs[-1].append(r)
        else:
            runs.append([r])
    parts = [f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]) for run in runs]
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(parts)


class Heartbeat:
    """A daemon thread printing ``name: N ranks, T s: <status()>`` every interval past `AFTER_S`.

    T counts from the launch's start; ``queued()`` gives the seconds of it spent waiting for
    admission so far, which the line states when there were any (`line`).
    """

    def __init__(
        self,
        name: str,
        world_size: int,
        status: Callable[[], str],
        every: float | None,
        queued: Callable[[], float] = lambda: 0.0,
    ) -> None:
        self.name, self.world_size, self.status, self.every = name, world_size, status, every
        self.queued = queued
        self.started = time.monotonic()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> Heartbeat:
        if self.every is not None:
            self._thread = threading.Thread(target=self._run, name="kit-heartbeat", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def _run(self) -> None:
        assert self.every is not None
        next_at = self.started + max(AFTER_S, self.every)
        while not self._stop.wait(max(0.0, next_at - time.monotonic())):
            write_line(self.line(time.monotonic() - self.started))
            next_at += self.every

    def line(self, elapsed: float) -> str:
        """``name: N ranks, 40 s: <status>``, or ``name: N ranks, 52 s (queued 12 s, running 40 s): ...``."""
        try:
            status = self.status()
        except Exception as exc:  # a status read while the launch changes: say so, keep beating
            status = f"(status unavailable: {type(exc).__name__})"
        try:
            queued = min(max(0.0, float(self.queued())), elapsed)
        except Exception:
            queued = 0.0
        when = f"{elapsed:.0f} s"
        if queued >= QUEUED_SHOWN_S:
            running = elapsed - queued
            when += (
                f" (queued {queued:.0f} s, running {running:.0f} s)"
                if running >= 0.5
                else f" (queued {queued:.0f} s)"
            )
        return f"{self.name}: {self.world_size} ranks, {when}: {status}"
