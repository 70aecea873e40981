"""The kernel's own record of an OOM kill, read from ``/dev/kmsg``: evidence that a SIGKILL was memory.

The OOM killer prints nothing to the process it kills; the kernel logs it (``Out of memory: Killed
process 123 (python) ...``, ``Memory cgroup out of memory: Killed process ...``, and on newer kernels
an ``oom-kill:...,pid=123,...`` summary). Reading the log needs privileges (``dmesg_restrict``):
where it cannot be read there is no such evidence, and a SIGKILL stays a crash. The log is the
kernel's, but what it says is read as untrusted text: bounded, and only records since the launch.
"""

from __future__ import annotations

import os
import re
from collections.abc import Collection

KMSG = "/dev/kmsg"
# Bounds on one read of the log: the kernel's ring buffer is a few MiB at most.
_MAX_RECORDS = 1 << 16
_MAX_BYTES = 16 * 2**20
_KILLED = re.compile(r"\bKilled process (\d+)\b|\boom-kill:.*?\bpid=(\d+)\b")


def readable(path: str = KMSG) -> bool:
    """Whether this process may read the kernel's log (root, or ``dmesg_restrict`` off)."""
    try:
        os.close(os.open(path, os.O_RDONLY | os.O_NONBLOCK))
    except OSError:
        return False
    return True


def oom_kills(line: str) -> int | None:
    """The pid a kernel log message says the OOM killer killed, or None."""
    match = _KILLED.search(line)
    return int(match.group(1) or match.group(2)) if match else None


def parse_record(record: str) -> tuple[float, str] | None:
    """``(seconds since boot, message)`` of one ``/dev/kmsg`` record
    (``prio,seq,usec,flags[,...];message``), or None for one that is not in that form."""
    head, sep, message = record.partition(";")
    fields = head.split(",")
    if not sep or len(fields) < 3 or not fields[2].isdigit():
        return None
    return int(fields[2]) / 1e6, message.splitlines()[0] if message else ""


def oom_kill_records(pids: Collection[int], since: float, path: str = KMSG) -> dict[int, str]:
    """For each of ``pids`` the kernel logged as killed by the OOM killer at or after ``since``
    (``time.monotonic()`` seconds, the clock ``/dev/kmsg`` stamps records with), that message;
    {} where the log cannot be read."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError:
        return {}
    found: dict[int, str] = {}
    read, pending = 0, b""
    try:
        for _ in range(_MAX_RECORDS):
            try:
                chunk = os.read(fd, 8192)  # /dev/kmsg: one record per read; a saved log: lines
            except BlockingIOError:  # the end of the log
                break
            except OSError:  # EPIPE: records were overwritten while reading; go on with the next
                continue
            read += len(chunk)
            if not chunk or read > _MAX_BYTES:
                break
            *lines, pending = (pending + chunk).split(b"\n")
            for line in lines:
                _note(line.decode(errors="replace"), pids, since, found)
        _note(pending.decode(errors="replace"), pids, since, found)
    finally:
        os.close(fd)
    return found


def _note(record: str, pids: Collection[int], since: float, found: dict[int, str]) -> None:
    """Add ``record``'s message to ``found`` when it is an OOM kill of one of ``pids`` since ``since``."""
    parsed = parse_record(record)  # a continuation line (" SUBSYSTEM=...") is not a record
    if parsed is None or parsed[0] < since:
        return
    pid = oom_kills(parsed[1])
    if pid is not None and pid in pids:
        found.setdefault(pid, parsed[1].strip()[:300])
