"""The kit's one reader of a process' memory from /proc: the peak (VmHWM) and the current RSS (VmRSS).

VmHWM, not ``ru_maxrss``: Linux carries ``ru_maxrss`` over an exec, so a rank spawned from a large
pytest process would report its parent's RSS as its own peak.
"""

from __future__ import annotations

import os


def peak_rss_bytes(pid: int | str = "self") -> int | None:
    """The kernel's high-water mark of a process' resident set (VmHWM) in bytes; None when gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def rss_bytes(pid: int | str) -> int | None:
    """A process' resident set size now (VmRSS) in bytes; None when it is gone or a zombie."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def current_rss_bytes() -> int:
    """This process' resident set size now, from /proc/self/statm (cheap enough every 20 ms)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
