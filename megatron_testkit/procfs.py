"""The kit's one reader of a process' memory from /proc: the peak (VmHWM), the current RSS (VmRSS) and
what a descendant adds (its private pages); and the one reset of this process' peak (`reset_peak_rss`).

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


def reset_peak_rss() -> bool:
    """Set this process' VmHWM back to its current RSS (``5`` into ``/proc/self/clear_refs``, Linux
    4.0+), so that the next `peak_rss_bytes` is the peak since now; False where the kernel refuses."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    return True


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


def unique_bytes(pid: int | str) -> int | None:
    """The memory only this process holds (USS: its private pages), from /proc/<pid>/smaps_rollup.

    A descendant's share of a rank's memory: a forked child's RSS includes every copy-on-write
    page it still shares with the rank (a checkpoint writer forked from a 600 MiB rank reads
    600 MiB), which the kernel charges once. Its private pages are what it adds. Falls back to
    VmRSS where smaps_rollup is missing (kernels before 4.14); None when the process is gone.
    """
    total = None
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith(("Private_Clean:", "Private_Dirty:", "Private_Hugetlb:")):
                    total = (total or 0) + int(line.split()[1]) * 1024
    except FileNotFoundError:
        return rss_bytes(pid) if os.path.exists(f"/proc/{pid}") else None
    except (OSError, ValueError, IndexError):
        return None
    return total


def current_rss_bytes() -> int:
    """This process' resident set size now, from /proc/self/statm (cheap enough every 20 ms)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def children(pid: int | str = "self") -> list[int]:
    """The direct children of a process (every thread's), from /proc; empty when it is gone."""
    out: list[int] = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for task in tasks:
        try:
            with open(f"/proc/{pid}/task/{task}/children") as f:
                out += [int(x) for x in f.read().split()]
        except (OSError, ValueError):
            continue
    return out


def descendant_pids(pid: int | str = "self") -> list[int]:
    """Every live descendant of a process, parents before their children."""
    seen: list[int] = []
    todo = children(pid)
    while todo:
        child = todo.pop(0)
        if child not in seen:
            seen.append(child)
            todo += children(child)
    return seen


def tree_rss(pid: int | str = "self") -> tuple[int, list[tuple[int, int]]] | None:
    """A process' resident set plus the memory its descendants add (each one's `unique_bytes`).

    Returns ``(total bytes, [(pid, bytes) of each descendant that holds memory])``; None when the
    process itself is gone. Memory a worker process holds (a DataLoader worker, a pool) is the
    rank's as far as the runner's memory is concerned: the kernel charges it to the same job, and
    pages a forked worker still shares with its parent once.
    """
    own = rss_bytes(pid)
    if own is None:
        return None
    parts = []
    for child in descendant_pids(pid):
        size = unique_bytes(child)
        if size:
            parts.append((child, size))
    return own + sum(size for _, size in parts), parts


def command_line(pid: int, limit: int = 160) -> str:
    """``"pid 123: python -c ..."`` for messages (the process' arguments, clipped)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            # Arguments (NUL-separated) and any whitespace as single spaces; no NUL byte is kept.
            text = " ".join(f.read().replace(b"\0", b" ").decode(errors="replace").split())
    except OSError:
        text = "(gone)"
    return f"pid {pid}: {text[:limit]}"


def cpu_seconds(pid: int | str = "self", tid: int | None = None) -> float | None:
    """CPU time (user + system) a process has used, all its threads, or one thread ``tid`` of it;
    None when it is gone. From /proc/<pid>[/task/<tid>]/stat, in clock ticks."""
    path = f"/proc/{pid}/stat" if tid is None else f"/proc/{pid}/task/{tid}/stat"
    try:
        with open(path) as f:
            text = f.read()
        # The command name (field 2) is in parentheses and may hold spaces: split after it.
        fields = text[text.rindex(")") + 2 :].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def start_ticks(pid: int | str = "self") -> int | None:
    """When a live process started, in clock ticks after boot (/proc/<pid>/stat field 22); None when
    it is gone or a zombie (it has exited; only its exit status waits to be collected).

    A process' identity beside its pid: a reused pid has another start. Boot-relative, unlike
    psutil's ``create_time()``, which adds a boot time re-derived from the wall clock on each call,
    so a clock step (NTP on a fresh VM, a resumed VM) would make every process look new.
    """
    try:
        with open(f"/proc/{pid}/stat") as f:
            text = f.read()
        # The command name (field 2) is in parentheses and may hold spaces: split after it.
        fields = text[text.rindex(")") + 2 :].split()
        state, start = fields[0], int(fields[19])
    except (OSError, ValueError, IndexError):
        return None
    return None if state in ("Z", "X", "x") else start


def boot_id() -> str:
    """This boot's id (/proc/sys/kernel/random/boot_id; '' where there is none): start times in
    clock ticks after boot name a process within one boot only."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


def environ_value(pid: int | str, name: str) -> str | None:
    """The value of ``name`` in a process' own environment (None when unset, unreadable or gone)."""
    prefix = f"{name}=".encode()
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            for item in f.read().split(b"\0"):
                if item.startswith(prefix):
                    return item[len(prefix) :].decode(errors="replace")
    except OSError:
        return None
    return None
