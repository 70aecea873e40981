"""A launch that runs long says what it is doing: one progress line per interval.

Past `AFTER_S` a launch prints, every ``KIT_HEARTBEAT`` seconds (default `DEFAULT_INTERVAL_S`,
``0`` off), a line such as ``test_x: 3 ranks, 40 s: ranks 0-1 in all_reduce #4 of [0, 1, 2] for
12 s, rank 2 computing`` (or ``queued for admission``, ``starting``). It goes to the terminal's
descriptor saved before pytest captured output (`save_terminal`, called by the plugin first
thing), so it shows under capture, in CI logs and from xdist workers (whose stderr is the
controller's); outside pytest, to stderr.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable, Mapping

__all__ = [
    "AFTER_S",
    "DEFAULT_INTERVAL_S",
    "HEARTBEAT_ENV",
    "Heartbeat",
    "interval",
    "ranks_text",
    "save_terminal",
]

HEARTBEAT_ENV = "KIT_HEARTBEAT"  # seconds between lines, 0 for none
DEFAULT_INTERVAL_S = 15.0
# A launch shorter than this prints nothing: most tests' launches end well within it.
AFTER_S = 10.0

_terminal_fd: int | None = None


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


def _write(line: str) -> None:
    with contextlib.suppress(OSError):
        os.write(_terminal_fd if _terminal_fd is not None else 2, (line + "\n").encode(errors="replace"))


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
    """A daemon thread printing ``name: N ranks, T s: <status()>`` every interval past `AFTER_S`."""

    def __init__(self, name: str, world_size: int, status: Callable[[], str], every: float | None) -> None:
        self.name, self.world_size, self.status, self.every = name, world_size, status, every
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
            elapsed = time.monotonic() - self.started
            try:
                status = self.status()
            except Exception as exc:  # a status read while the launch changes: say so, keep beating
                status = f"(status unavailable: {type(exc).__name__})"
            _write(f"{self.name}: {self.world_size} ranks, {elapsed:.0f} s: {status}")
            next_at += self.every
