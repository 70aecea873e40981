"""Under torchrun: a rank whose main thread cannot stop still writes its report, from a thread.

A torchrun rank is a pytest process. Its main thread may be blocked in a gloo or NCCL call that
never returns (a peer failed and never joined the collective): Python runs a signal handler only
between bytecodes of the main thread, so the agent's SIGTERM never becomes the KeyboardInterrupt
that ends the session with a report, and 30 s later the agent SIGKILLs the rank. Two ways out,
both from a thread of the kit's:

- `SignalWatch`: the C-level signal handler also writes the signal's number to a wakeup pipe
  (``signal.set_wakeup_fd``); a thread reading it gives the main thread `GRACE_S` to run the
  Python handler and, if it did not, writes the report itself and ends the process;
- `end_process`: the torchrun stall watch (`megatron_testkit.torchrun_watch`) calls it on a rank
  the deadlock verdict found blocked, with the verdict as the running test's failure.

The plugin registers the function that writes the session's report (`set_writer`); without one
(no pytest session, e.g. a script under torchrun) only the line on stderr is written.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from collections.abc import Callable
from typing import Any

__all__ = ["GRACE_S", "SignalWatch", "end_process", "set_writer"]

# How long the main thread has to run the Python handler of a stop signal before the watch thread
# writes the report: a main thread that runs Python takes it within milliseconds, and the agent
# SIGKILLs 30 s after its SIGTERM.
GRACE_S = 2.0

# (why, failure or None for an interrupt, the session's exit status) -> says why on the session's
# stderr (past pytest's capture) and writes the report
Writer = Callable[[str, Any, int], None]
_writer: Writer | None = None
_ending = threading.Lock()  # one ending per process: a signal and a verdict may race


def set_writer(writer: Writer | None) -> None:
    """The function that writes the session's report now (the plugin's; None: none)."""
    global _writer
    _writer = writer


def end_process(why: str, failure: Any, exitstatus: int, code: int) -> None:
    """Say ``why`` on stderr, write the report with the running test ended by it, exit with ``code``.

    ``failure`` (a `schema.Failure`) fails the running test; None marks it ``interrupted``. Never
    returns; a second caller (another thread) waits for the first to end the process.
    """
    _ending.acquire()
    writer = _writer
    if writer is None:
        with contextlib.suppress(Exception):
            sys.stderr.write(f"kit: {why}\n")
            sys.stderr.flush()
    else:
        try:
            writer(why, failure, exitstatus)
        except Exception as exc:  # a full disk: the writer said why before it wrote
            with contextlib.suppress(Exception):
                sys.stderr.write(f"kit: the report was not written: {exc}\n")
    with contextlib.suppress(Exception):
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(code)


class SignalWatch:
    """Notices stop signals from a thread (the wakeup pipe) and ends the process with a report when
    the main thread did not take the signal within `GRACE_S` (see the module docstring)."""

    def __init__(self, signals: tuple[int, ...], source: str, grace: float = GRACE_S) -> None:
        self.signals = frozenset(int(s) for s in signals)
        self.source = source
        self.grace = grace
        self.handled = threading.Event()  # the main thread's handler ran
        self.read_fd, self.write_fd = os.pipe()
        os.set_blocking(self.write_fd, False)
        self.previous = signal.set_wakeup_fd(self.write_fd, warn_on_full_buffer=False)
        self.thread = threading.Thread(target=self._run, name="kit-signal-watch", daemon=True)
        self.thread.start()

    def taken(self) -> None:
        """The main thread's handler ran (called from it)."""
        self.handled.set()

    def close(self) -> None:
        """Give the wakeup fd back (main thread); the thread ends with the pipe."""
        with contextlib.suppress(ValueError):
            current = signal.set_wakeup_fd(self.previous)
            if current != self.write_fd:  # someone set their own since: theirs stays
                signal.set_wakeup_fd(current)
        for fd in (self.write_fd, self.read_fd):
            with contextlib.suppress(OSError):
                os.close(fd)

    def _run(self) -> None:
        while True:
            try:
                data = os.read(self.read_fd, 64)
            except OSError:
                return
            if not data:
                return
            stops = [n for n in data if n in self.signals]
            if stops and not self.handled.wait(self.grace):
                signum = stops[0]
                name = signal.Signals(signum).name
                why = (
                    f"signal {signum} ({name}){self.source}: the main thread did not take it within "
                    f"{self.grace:g} s (blocked in a call that never returns to Python, e.g. a collective "
                    "a failed peer never joined); the kit's signal watch wrote this rank's report and ends it"
                )
                end_process(why, None, 2, 128 + signum)
