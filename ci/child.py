"""Run one child process (pytest, or `ci/test.sh` that runs it) so that a stop request reaches it.

CI runners stop a job with SIGTERM (a cancel sends SIGINT first) to the process they started:
`python -m ci job` or `python -m ci repro`. Without forwarding, that process dies and the pytest
it runs goes on as an orphan and writes no report. Here the parent passes SIGTERM, SIGINT, SIGHUP
and SIGQUIT on and waits for the child to finish its own shutdown (report, junit, ranks torn
down), then goes on with the child's exit code.

Without a terminal (CI), the child gets its own process group and a signal goes to the whole
group, so a shell script's pytest gets it too, and the parent waits until the group is empty.
With a terminal on stdin, the child stays in the terminal's group (Ctrl-C, a debugger's prompt
work as in a plain shell) and a signal sent to the parent alone is passed to the child.
Stdlib only: `python -m ci job` runs before the kit is installed.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

# SIGHUP (a closed terminal or SSH session) and SIGQUIT (stacks, then stop) too: the kit's plugin
# stops a session on each of them with a report, as on SIGTERM.
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)
# How long the parent waits, once the child exited, for the rest of its process group (a shell
# script's pytest writing its report); a runner's own hard kill comes later than this.
GROUP_GRACE_S = 60.0


def _own_group() -> bool:
    """Whether the child gets its own process group: not when stdin is a terminal."""
    try:
        return not os.isatty(sys.stdin.fileno())
    except (AttributeError, OSError, ValueError):
        return True


def start(command: Sequence[str], *, cwd: Path | str, env: Mapping[str, str]) -> subprocess.Popen:
    """Start `command` (in its own process group unless stdin is a terminal)."""
    return subprocess.Popen(list(command), cwd=cwd, env=dict(env), process_group=0 if _own_group() else None)


def _send(proc: subprocess.Popen, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        if os.getpgid(proc.pid) == proc.pid:
            os.killpg(proc.pid, signum)
        else:
            proc.send_signal(signum)


def _group_gone(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


def wait_forwarding(proc: subprocess.Popen) -> int:
    """Wait for `proc` (and its own process group), passing SIGTERM/SIGINT received meanwhile on.

    Signal handlers can only be set in the main thread; elsewhere this is a plain wait.
    """
    own_group = proc.poll() is None and os.getpgid(proc.pid) == proc.pid
    if threading.current_thread() is not threading.main_thread():
        return proc.wait()
    previous = {sig: signal.signal(sig, lambda signum, _frame: _send(proc, signum)) for sig in FORWARDED}
    try:
        returncode = proc.wait()
        deadline = time.monotonic() + GROUP_GRACE_S
        while own_group and not _group_gone(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        return returncode
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def run_child(command: Sequence[str], *, cwd: Path | str, env: Mapping[str, str]) -> int:
    """Run `command` to its end with signals forwarded; its exit code (128 + N when killed by signal N)."""
    return exit_code(wait_forwarding(start(command, cwd=cwd, env=env)))


def exit_code(returncode: int) -> int:
    """A shell's exit code for a return code: a child killed by signal N is 128 + N."""
    return returncode if returncode >= 0 else 128 - returncode
