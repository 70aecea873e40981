"""Run one child process (pytest) so that a stop request reaches it: SIGTERM and SIGINT are forwarded.

CI runners stop a job with SIGTERM (a cancel sends SIGINT first), to the process they started:
`python -m ci job` or `python -m ci repro`. Without forwarding, that process dies and the pytest
it runs goes on as an orphan, writing no report. Here the parent passes each signal on and waits
for the child to finish its own shutdown (report, junit, ranks torn down), then goes on with its
exit code. A terminal's Ctrl-C reaches the child directly as well (same process group); the
forwarded copy follows it. Stdlib only: `python -m ci job` runs before the kit is installed.
"""

from __future__ import annotations

import contextlib
import signal
import subprocess
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import FrameType

FORWARDED = (signal.SIGTERM, signal.SIGINT)


def wait_forwarding(proc: subprocess.Popen) -> int:
    """Wait for `proc`, passing SIGTERM/SIGINT received meanwhile on to it; its return code.

    Signal handlers can only be set in the main thread; elsewhere this is a plain wait.
    """
    if threading.current_thread() is not threading.main_thread():
        return proc.wait()

    def forward(signum: int, _frame: FrameType | None) -> None:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signum)

    previous = {sig: signal.signal(sig, forward) for sig in FORWARDED}
    try:
        return proc.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def run_child(command: Sequence[str], *, cwd: Path | str, env: Mapping[str, str]) -> int:
    """Run `command` to its end with signals forwarded; its exit code (128 + N when killed by signal N)."""
    proc = subprocess.Popen(list(command), cwd=cwd, env=dict(env))
    return exit_code(wait_forwarding(proc))


def exit_code(returncode: int) -> int:
    """A shell's exit code for a return code: a child killed by signal N is 128 + N."""
    return returncode if returncode >= 0 else 128 - returncode
