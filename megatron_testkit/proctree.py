"""Finding and ending the processes a rank leaves behind.

Each rank starts in its own session, so its process group holds the rank and every helper it
starts without a new session (dist_checkpointing's multiprocessing Manager and resource_tracker
among them). Killing the group ends the lot, even after the rank itself has died and its helpers
were re-parented. A snapshot of descendants taken while the rank lived catches helpers that left
the group (daemons calling setsid). A process cannot opt out of the rest: every rank, and the
launcher while it launches, is a child subreaper (``PR_SET_CHILD_SUBREAPER``, Linux), so an orphan
anywhere below a rank re-parents to the rank (counted in its memory, found as its descendant) and,
once the rank is gone, to the launcher (found as one of its new children: `adopted_since`). The
launch's marker in the environment (`marked`) is a second net that a process can drop (``env -i``).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import threading
import time
from collections.abc import Callable

import psutil

from megatron_testkit import procfs

# The multiprocessing infrastructure processes are singletons reused for the whole session: they
# are not leaks of a test, and killing them would break the next user of multiprocessing.
_INFRASTRUCTURE = ("multiprocessing.resource_tracker", "multiprocessing.forkserver")
# The session's warm parents (`megatron_testkit.warm_start`), exempt by pid, never by command line:
# every rank forked from one carries its command line. Their descendants are not exempt.
EXEMPT_PIDS: set[int] = set()


_PR_SET_CHILD_SUBREAPER = 36  # linux/prctl.h
_subreaper_lock = threading.Lock()
_subreaper_holders = 0


def set_child_subreaper(on: bool) -> bool:
    """Make this process a child subreaper (or stop being one); False where the platform has none."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(_PR_SET_CHILD_SUBREAPER, int(on), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def hold_subreaper() -> None:
    """This process adopts its descendants' orphans until as many `release_subreaper` calls (one
    per launch: launches may overlap in threads); processes outside launches re-parent as before."""
    global _subreaper_holders
    with _subreaper_lock:
        if _subreaper_holders == 0:
            set_child_subreaper(True)
        _subreaper_holders += 1


def release_subreaper() -> None:
    """The end of one `hold_subreaper`; the last one turns adoption off (adopted children stay)."""
    global _subreaper_holders
    with _subreaper_lock:
        _subreaper_holders = max(0, _subreaper_holders - 1)
        if _subreaper_holders == 0:
            set_child_subreaper(False)


def adopted_since(before: set[int], own: set[int]) -> list[int]:
    """This process' children that were not its children in `before` and are not in `own` (the
    ranks it spawned): orphans of a launch re-parented here while it was a subreaper."""
    return [
        pid for pid in procfs.children() if pid not in before and pid not in own and pid not in EXEMPT_PIDS
    ]


def reap(pids: list[int]) -> None:
    """Collect the exit status of the given children that have exited (no zombie is left)."""
    for pid in pids:
        with contextlib.suppress(ChildProcessError, OSError):
            os.waitpid(pid, os.WNOHANG)


def descendants(pid: int) -> list[psutil.Process]:
    """Every live descendant of ``pid`` (empty when it is gone)."""
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return []


def group_members(pgid: int) -> list[psutil.Process]:
    """Live (non-zombie) processes whose process group is ``pgid``."""
    members = []
    for proc in psutil.process_iter(["status"]):
        try:
            if proc.info["status"] == psutil.STATUS_ZOMBIE:
                continue
            if os.getpgid(proc.pid) == pgid:
                members.append(proc)
        except (ProcessLookupError, psutil.Error):
            continue
    return members


def marked(name: str, value: str) -> list[psutil.Process]:
    """Live processes whose environment holds ``name=value`` (ours only: others' are unreadable).

    Finds what a launch left wherever it went: re-parented to init after a double fork, in a
    session of its own. A process that rewrote its environment escapes this check.
    """
    needle = f"{name}={value}".encode()
    found = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/environ", "rb") as f:
                if needle not in f.read().split(b"\0"):
                    continue
            proc = psutil.Process(int(entry.name))
        except (OSError, psutil.Error):
            continue
        if _is_live(proc):
            found.append(proc)
    return found


def signal_group(pgid: int, signum: int) -> None:
    """Send ``signum`` to a process group; a group that is already gone is fine."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signum)


def kill_tree(
    pgids: list[int],
    extra: list[psutil.Process] = (),
    timeout: float = 5.0,
    kept: Callable[[psutil.Process], bool] | None = None,
) -> int:
    """SIGKILL the groups and the extra processes; wait until they are gone.

    Returns how many processes other than the group leaders were still alive (helpers left
    behind), which the report shows as ``leaked_processes``; those ``kept`` says yes to (asked while
    they live) are killed too but not counted (a library's helpers kept for the rank's life,
    `megatron_testkit.library_helpers`).
    """
    # Only processes still alive count: helpers sampled earlier (e.g. checkpoint writers that
    # megatron forks and joins) may have exited cleanly before the rank did.
    leftovers = {p.pid: p for pgid in pgids for p in group_members(pgid) if p.pid != pgid and _is_live(p)}
    for proc in extra:
        if proc.pid not in pgids and _is_live(proc):
            leftovers.setdefault(proc.pid, proc)
    counted = [pid for pid, proc in leftovers.items() if kept is None or not kept(proc)]
    for pgid in pgids:
        signal_group(pgid, signal.SIGKILL)
    for proc in leftovers.values():
        with contextlib.suppress(psutil.Error):
            proc.kill()
    deadline = time.monotonic() + timeout
    alive = list(leftovers.values())
    while alive and time.monotonic() < deadline:
        _gone, alive = psutil.wait_procs(alive, timeout=0.1)
        alive = [p for p in alive if _is_live(p)]
    return len(counted)


def _is_live(proc: psutil.Process) -> bool:
    try:
        return proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def is_infrastructure(proc: psutil.Process) -> bool:
    """True for multiprocessing's session-wide helpers (resource_tracker, forkserver)."""
    try:
        cmdline = " ".join(proc.cmdline())
    except psutil.Error:
        return False
    return any(name in cmdline for name in _INFRASTRUCTURE)


def leaked_children(pid: int | None = None) -> list[psutil.Process]:
    """Live descendants of ``pid`` (default: this process), multiprocessing helpers excepted."""
    procs = descendants(os.getpid() if pid is None else pid)
    return [p for p in procs if p.pid not in EXEMPT_PIDS and _is_live(p) and not is_infrastructure(p)]


def describe(proc: psutil.Process) -> str:
    """``"pid 123: python -m foo"`` for messages."""
    try:
        return f"pid {proc.pid}: {' '.join(proc.cmdline())[:200]}"
    except psutil.Error:
        return f"pid {proc.pid}: (gone)"
