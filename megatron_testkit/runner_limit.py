"""The memory limit the launcher holds a launch's ranks to (KIT_HOST_MEMORY or a cgroup), kills named oom.

A CI job dies when its processes exceed the runner's memory; ``python -m megatron_testkit repro`` and the CI
job (`ci/limits.py`) reproduce that limit, and the launcher turns it into a named verdict:

- ``KIT_HOST_MEMORY`` (a size) without a cgroup, the *env* method: every poll the launcher sums its
  running ranks' RSS, and the rank that pushed the sum over (`rank_over_limit`) is killed and
  named ``oom``. The sum covers one launch's ranks, not other xdist workers' or pytest's.
- ``KIT_RANK_CGROUP`` (a memory cgroup's directory): each rank joins it as its first act, the
  kernel enforces the limit, and a rank killed by SIGKILL while the group's OOM counter rose is
  named ``oom`` (`read_oom_counters`, `oom_kills_between`). Without the counter the kernel keeps on
  v1 (``oom_kill`` in ``memory.oom_control`` needs Linux 4.13), a ``memory.failcnt`` rise stands in.
- Neither: the ranks share the launcher's own memory cgroup (`memory_cgroup_of`), the container's
  or the CI job's, which is where a runner's kernel OOM kill happens. Its ``oom_kill`` counter is
  read the same way (never ``failcnt``: in a shared group it rises on mere page-cache reclaim), so
  a rank SIGKILLed while it rose is named ``oom``, not ``crash``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "HOST_MEMORY_ENV",
    "RANK_CGROUP_ENV",
    "OomCounters",
    "cgroup_mounts",
    "group_limit_bytes",
    "host_memory_limit",
    "memory_cgroup_of",
    "oom_kills_between",
    "own_cgroup",
    "rank_over_limit",
    "read_oom_counters",
]

HOST_MEMORY_ENV = "KIT_HOST_MEMORY"  # the runner's memory, e.g. "7GB" (ci/jobs.py's CPU rows)
RANK_CGROUP_ENV = "KIT_RANK_CGROUP"  # the ranks' memory cgroup, joined by each rank at start


def rank_over_limit(previous: Mapping[int, int], current: Mapping[int, int], limit_bytes: int) -> int | None:
    """The rank that pushed the ranks' summed RSS over `limit_bytes`, or None while the sum fits.

    `previous` and `current` are RSS samples (rank -> bytes) of the running ranks one poll apart.
    The culprit is the rank that grew most since the previous sample (a rank absent there grew
    from 0); a tie goes to the larger RSS, then the lower rank. With nothing grown (a sum already
    over at the first sample), the largest rank is named: it is what the kernel's OOM killer picks.
    """
    if sum(current.values()) <= limit_bytes:
        return None
    if not current:
        return None
    return max(sorted(current), key=lambda r: (current[r] - previous.get(r, 0), current[r], -r))


def host_memory_limit(environ: Mapping[str, str] | None = None) -> int | None:
    """The limit the launcher enforces itself: ``KIT_HOST_MEMORY`` in bytes, unless the ranks run in
    a cgroup (``KIT_RANK_CGROUP``), where the kernel enforces it; None when unset."""
    from megatron_testkit.budgets import parse_size

    environ = os.environ if environ is None else environ
    raw = environ.get(HOST_MEMORY_ENV, "").strip()
    if not raw or environ.get(RANK_CGROUP_ENV):
        return None
    try:
        return parse_size(raw)
    except ValueError as exc:
        raise ValueError(f"{HOST_MEMORY_ENV}={raw!r}: {exc}") from None


@dataclass(frozen=True)
class OomCounters:
    """A memory cgroup's OOM evidence at one moment: the kernel's OOM kills and v1's failcnt.

    ``source`` names the file ``oom_kill`` came from (``memory.events`` on v2,
    ``memory.oom_control`` on v1); None fields are counters the group does not keep.
    """

    oom_kill: int | None
    failcnt: int | None
    source: str | None


def _read_int(path: Path) -> int | None:
    try:
        return int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def read_oom_counters(group: str | os.PathLike[str], *, local: bool = False) -> OomCounters:
    """The group's ``oom_kill`` (v2 ``memory.events``, else v1 ``memory.oom_control``) and v1's
    ``memory.failcnt``; fields the group does not have (or that cannot be read) are None.

    ``local``: kills in this group only, not in its descendants (v2 ``memory.events.local``; v1's
    counter is the group's own already), for a group other launches' child groups may live under.
    """
    group = Path(group)
    names = ("memory.events.local",) if local else ()
    for name in (*names, "memory.events", "memory.oom_control"):
        try:
            text = (group / name).read_text()
        except OSError:
            continue
        for line in text.splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill":
                return OomCounters(int(value), _read_int(group / "memory.failcnt"), name)
    return OomCounters(None, _read_int(group / "memory.failcnt"), None)


def oom_kills_between(before: OomCounters, after: OomCounters) -> tuple[int, str] | None:
    """How many OOM kills happened between two readings, and a note naming the counter; None if
    none can be seen. A failcnt rise (no ``oom_kill`` kept) counts as one."""
    if before.oom_kill is not None and after.oom_kill is not None:
        if after.oom_kill > before.oom_kill:
            return (
                after.oom_kill - before.oom_kill,
                f"{after.source} oom_kill {before.oom_kill} -> {after.oom_kill}",
            )
        return None
    if before.failcnt is not None and after.failcnt is not None and after.failcnt > before.failcnt:
        return 1, f"memory.failcnt {before.failcnt} -> {after.failcnt}"
    return None


def group_limit_bytes(group: str | os.PathLike[str]) -> int | None:
    """The group's memory limit (v2 ``memory.max``, v1 ``memory.limit_in_bytes``); None if unlimited."""
    group = Path(group)
    for name in ("memory.max", "memory.limit_in_bytes"):
        value = _read_int(group / name)
        if value is not None:
            return value if value < 2**62 else None  # v1 spells "no limit" as a huge number
    return None


def cgroup_mounts(mounts: str | os.PathLike[str] = "/proc/self/mounts") -> list[tuple[str, str, set[str]]]:
    """(mount point, fs type, options) of every cgroup mount (v1 ``cgroup`` and v2 ``cgroup2``)."""
    out = []
    try:
        lines = Path(mounts).read_text().splitlines()
    except OSError:
        return out
    for line in lines:
        parts = line.split()
        if len(parts) >= 4 and parts[2] in ("cgroup", "cgroup2"):
            out.append((parts[1], parts[2], set(parts[3].split(","))))
    return out


def own_cgroup(controller: str | None, pid: int | str = "self") -> str | None:
    """A process's path in the v2 hierarchy (controller None) or in the v1 hierarchy of `controller`."""
    try:
        lines = Path(f"/proc/{pid}/cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controller is None and controllers == "":
            return path
        if controller is not None and controller in controllers.split(","):
            return path
    return None


def memory_cgroup_of(pid: int | str = "self") -> Path | None:
    """The directory of the memory cgroup process `pid` is charged to, if it keeps an OOM counter.

    v2 where the unified hierarchy has the memory controller (``memory.events`` there), else the
    v1 memory hierarchy (``memory.oom_control``); None when neither is mounted or readable (the
    root of a v2 hierarchy has no ``memory.events``: nothing to read there).
    """
    for mount, kind, options in cgroup_mounts():
        if kind == "cgroup2":
            path, counter = own_cgroup(None, pid), "memory.events"
        elif "memory" in options:
            path, counter = own_cgroup("memory", pid), "memory.oom_control"
        else:
            continue
        if path is None:
            continue
        group = Path(mount) / path.lstrip("/")
        if (group / counter).is_file():
            return group
    return None


# --- the verdict of a kill for memory ---------------------------------------------------------------
# Whichever part of the kit kills a rank for the runner's memory (the launcher's KIT_HOST_MEMORY
# check, or the repro's watcher, `megatron_testkit.repro_limit`), it first leaves this note in the rank's launch
# directory, so the launcher names the death `oom` whoever won the race to kill it.
_KILL_NOTE = "rank{rank}.memory-kill"
LAUNCH_SPEC_ENV = "KIT_RANK_SPEC"  # every rank's (and its descendants') marker: its launch's spec file


def note_memory_kill(run_dir: str | os.PathLike[str], rank: int, reason: str) -> None:
    """Say why rank `rank` is about to be killed (atomically: the launcher never reads half)."""
    path = Path(run_dir) / _KILL_NOTE.format(rank=rank)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(reason)
        os.replace(tmp, path)
    except OSError:
        tmp.unlink(missing_ok=True)


def read_memory_kill(run_dir: str | os.PathLike[str], rank: int) -> str | None:
    """The reason a kit part gave before killing rank `rank` for memory, if any did."""
    try:
        return (Path(run_dir) / _KILL_NOTE.format(rank=rank)).read_text().strip() or None
    except OSError:
        return None


def launch_dir_of(pid: int) -> Path | None:
    """The launch directory of a rank the kit started (from its environment); None if not one."""
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    prefix = f"{LAUNCH_SPEC_ENV}=".encode()
    for item in environ:
        if item.startswith(prefix):
            return Path(item[len(prefix) :].decode(errors="replace")).parent
    return None
