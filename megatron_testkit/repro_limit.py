"""The memory limit a repro builds around its run's ranks (cgroup, systemd scope or env), pytest left outside.

A CI job dies when its processes exceed the runner's memory; per-rank budgets alone cannot
reproduce that. The ranks of every `run_ranks` launch of the run share one limit; pytest stays
outside it, so it always survives to write the report. In order of preference:

1. ``cgroup2``: a child cgroup of ours with ``memory.max`` (no swap), where the unified hierarchy
   has the memory controller and we may create cgroups (root, or a delegated subtree);
2. ``cgroup1``: the same with ``memory.limit_in_bytes`` on a v1 memory hierarchy;
3. ``systemd-run``: a transient scope with ``MemoryMax``, held open by a placeholder process;
4. ``env``: no kernel limit; the ranks' summed RSS is checked against the limit every few ms and
   the rank that pushed it over is killed and named `oom` (the kit enforces it itself).

A `RankWatcher` finds the ranks among pytest's descendants (the launcher names them
``kit-rank-R-of-W`` on their command line) and moves each into the group as soon as it appears,
knowing from its environment which test launched it. A rank's memory is its own RSS plus its
descendants' (its worker processes are charged to the job as its own). Before the env method kills
a rank it leaves a note in the rank's launch directory, so the launcher's verdict and the report
say `oom` as this summary does. A kernel OOM kill in the group is read from
the group's own counters (v2 ``memory.events`` oom_kill, v1 ``memory.oom_control`` oom_kill, else
a ``memory.failcnt`` rise) and pinned on the rank that died with it. The group is removed once its
last process has exited. The chosen method is reported, never silently downgraded.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from megatron_testkit.budgets import format_size
from megatron_testkit.procfs import tree_rss
from megatron_testkit.runner_limit import (
    RANK_CGROUP_ENV,
    cgroup_mounts,
    launch_dir_of,
    note_memory_kill,
    own_cgroup,
    rank_over_limit,
    read_oom_counters,
)

__all__ = [
    "METHODS",
    "RANK_CGROUP_ENV",
    "Kill",
    "MemoryLimit",
    "RankWatcher",
    "apply_memory_limit",
    "rank_over_limit",
]

METHODS = ("cgroup2", "cgroup1", "systemd-run", "env")
RANK_ARG = re.compile(r"^kit-rank-(\d+)-of-(\d+)$")
POLL_S = 0.02
# The env method's decision (`rank_over_limit`), the ranks' group variable and the OOM counter
# reader live in megatron_testkit.runner_limit: the launcher enforces and reads the same limit.


# --- the group ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Kill:
    """A rank the limit killed: which test, which rank, and what the group's counters said."""

    nodeid: str | None
    rank: int
    world_size: int
    pid: int
    reason: str


@dataclass
class MemoryLimit:
    """A memory limit for the ranks of a run; `close()` removes what it created."""

    method: str
    limit_bytes: int | None
    detail: str
    cgroup: Path | None = None
    prefix: list[str] = field(default_factory=list)
    tried: list[str] = field(default_factory=list)
    holder: subprocess.Popen | None = None  # systemd-run's placeholder process
    leftovers: int = 0
    owner: str = "python -m megatron_testkit repro"  # who holds the limit: named in a kill's verdict

    def wrap(self, command: list[str]) -> list[str]:
        """`command` run entirely inside the group (for a single process; `repro` uses `watch`)."""
        if self.cgroup is not None:
            # The shell moves itself into the cgroup before exec'ing the command: no process of
            # the command ever starts outside it, and no preexec_fn runs in a forked Python.
            procs = self.cgroup / "cgroup.procs"
            return ["sh", "-c", 'echo $$ > "$0" && exec "$@"', str(procs), *command]
        return [*self.prefix, *command]

    def adopt(self, pid: int) -> None:
        """Move process `pid` into the group (OSError when it has exited or we may not)."""
        if self.cgroup is not None:
            (self.cgroup / "cgroup.procs").write_text(str(pid))

    def watch(self, root_pid: int) -> RankWatcher:
        """Start moving the ranks among `root_pid`'s descendants into the limit (see `RankWatcher`)."""
        watcher = RankWatcher(self, root_pid)
        watcher.start()
        return watcher

    def peak_bytes(self) -> int | None:
        """The group's peak memory as the kernel counted it (None without a cgroup)."""
        name = {"cgroup2": "memory.peak", "cgroup1": "memory.max_usage_in_bytes"}.get(self.method)
        if self.method == "systemd-run":
            name = "memory.peak" if (self.cgroup and (self.cgroup / "memory.peak").exists()) else None
        return _read_int(self.cgroup / name) if self.cgroup is not None and name else None

    def oom_kills(self) -> int | None:
        """Processes the kernel killed for exceeding the limit (None when the group cannot say)."""
        return read_oom_counters(self.cgroup).oom_kill if self.cgroup is not None else None

    def failcnt(self) -> int | None:
        """v1's count of allocations that hit the limit (the fallback where oom_kill is not kept)."""
        return read_oom_counters(self.cgroup).failcnt if self.cgroup is not None else None

    def describe(self) -> str:
        """One line: the method, the size and where, with the methods that were not available."""
        if self.limit_bytes is None:
            return "no runner memory limit (this job defines none)"
        text = f"{format_size(self.limit_bytes)} for the ranks of the run via {self.method} ({self.detail})"
        if self.tried:
            text += f"; unavailable: {'; '.join(self.tried)}"
        return text

    def pids(self) -> list[int]:
        """The processes in the group now."""
        if self.cgroup is None:
            return []
        try:
            return [int(x) for x in (self.cgroup / "cgroup.procs").read_text().split()]
        except (OSError, ValueError):
            return []

    def close(self, wait_s: float = 10.0) -> None:
        """Remove the group once its last process has exited; a process still in it after
        `wait_s` (a rank that outlived its launcher) is killed first and counted in `leftovers`."""
        if self.holder is not None:
            with contextlib.suppress(OSError):
                self.holder.kill()
            with contextlib.suppress(Exception):
                self.holder.wait(timeout=5)
        if self.cgroup is None or self.method == "systemd-run":
            return  # systemd removes an empty transient scope itself
        deadline = time.monotonic() + wait_s
        while self.pids() and time.monotonic() < deadline:
            time.sleep(0.05)
        left = self.pids()
        self.leftovers = len(left)
        for pid in left:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while True:
            try:
                self.cgroup.rmdir()
                return
            except FileNotFoundError:
                return
            except OSError:
                if time.monotonic() > deadline:
                    return
                time.sleep(0.05)


def _read_int(path: Path) -> int | None:
    try:
        return int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def _make_child(parent: Path, files: dict[str, str]) -> Path:
    """Create `parent/kit-repro-<pid>` and write `files` into it; raise OSError with the reason."""
    if not parent.is_dir():
        raise OSError(f"{parent} does not exist")
    child = parent / f"kit-repro-{os.getpid()}"
    child.mkdir(exist_ok=True)
    try:
        required = next(iter(files))
        if not (child / required).exists():
            raise OSError(f"{child} has no {required} (memory controller not enabled for children)")
        for name, value in files.items():
            try:
                (child / name).write_text(value)
            except OSError:
                if name == required:
                    raise
    except OSError:
        child.rmdir()
        raise
    return child


def _cgroup2(limit: int) -> MemoryLimit:
    mount = next((m for m, kind, _ in cgroup_mounts() if kind == "cgroup2"), None)
    own = own_cgroup(None)
    if mount is None or own is None:
        raise OSError("no cgroup2 mount")
    parent = Path(mount) / own.lstrip("/")
    controllers = (parent / "cgroup.subtree_control").read_text().split()
    if "memory" not in controllers:
        raise OSError(f"memory is not in {parent}/cgroup.subtree_control")
    child = _make_child(parent, {"memory.max": str(limit), "memory.swap.max": "0"})
    return MemoryLimit("cgroup2", limit, str(child), cgroup=child)


def _cgroup1(limit: int) -> MemoryLimit:
    mount = next((m for m, kind, opts in cgroup_mounts() if kind == "cgroup" and "memory" in opts), None)
    own = own_cgroup("memory")
    if mount is None or own is None:
        raise OSError("no cgroup v1 memory hierarchy")
    parent = Path(mount) / own.lstrip("/")
    # memsw (memory + swap) equal to the limit means no swap; it is absent without swap accounting.
    child = _make_child(
        parent,
        {
            "memory.limit_in_bytes": str(limit),
            "memory.memsw.limit_in_bytes": str(limit),
            # A rank is moved in after it starts: its memory so far moves with it.
            "memory.move_charge_at_immigrate": "3",
        },
    )
    return MemoryLimit("cgroup1", limit, str(child), cgroup=child)


def _systemd_run(limit: int) -> MemoryLimit:
    """A transient scope kept open by `sleep`; the ranks are moved into its cgroup."""
    exe = shutil.which("systemd-run")
    if exe is None:
        raise OSError("systemd-run is not installed")
    prefix = [exe, "--scope", "--quiet", "-p", f"MemoryMax={limit}", "-p", "MemorySwapMax=0"]
    if os.geteuid() != 0:
        prefix.insert(1, "--user")
    probe = subprocess.run([*prefix, "true"], capture_output=True, text=True, timeout=30)
    if probe.returncode != 0:
        reason = (probe.stderr.strip().splitlines() or [f"exit code {probe.returncode}"])[0]
        raise OSError(f"systemd-run: {reason}")
    holder = subprocess.Popen([*prefix, "--", "sleep", "infinity"], stdin=subprocess.DEVNULL)
    deadline = time.monotonic() + 10
    mount = next((m for m, kind, _ in cgroup_mounts() if kind == "cgroup2"), None)
    while time.monotonic() < deadline:
        path = own_cgroup(None, holder.pid)
        if mount and path and path.endswith(".scope"):
            return MemoryLimit(
                "systemd-run", limit, f"transient scope {path} with MemoryMax",
                cgroup=Path(mount) / path.lstrip("/"), holder=holder,
            )  # fmt: skip
        time.sleep(0.05)
    holder.kill()
    holder.wait()
    raise OSError("systemd-run: the transient scope's cgroup did not appear")


def _env(limit: int) -> MemoryLimit:
    return MemoryLimit(
        "env",
        limit,
        "no kernel limit: the ranks' summed RSS is checked every 20 ms, the rank that pushes it over is killed",
    )


def _owned(limit: MemoryLimit, owner: str | None) -> MemoryLimit:
    if owner is not None:
        limit.owner = owner
    return limit


_STRATEGIES = {"cgroup2": _cgroup2, "cgroup1": _cgroup1, "systemd-run": _systemd_run, "env": _env}


def apply_memory_limit(
    limit_bytes: int | None, method: str = "auto", owner: str | None = None
) -> MemoryLimit:
    """The strongest available way to cap the ranks at `limit_bytes` (or exactly `method` when named).

    ``method="auto"`` tries cgroup v2, cgroup v1, systemd-run, then env; a named method that is
    unavailable raises OSError saying why. `owner` is the command holding the limit, named in the
    verdict of a rank it kills (default: the kit's repro).
    """
    if limit_bytes is None:
        return MemoryLimit("none", None, "no limit")
    if method != "auto":
        if method not in _STRATEGIES:
            raise ValueError(f"unknown limit method {method!r}: expected auto or one of {', '.join(METHODS)}")
        return _owned(_STRATEGIES[method](limit_bytes), owner)
    tried = []
    for name in METHODS:
        try:
            chosen = _STRATEGIES[name](limit_bytes)
        except (OSError, subprocess.SubprocessError) as exc:
            tried.append(f"{name}: {exc}")
            continue
        chosen.tried = tried
        return _owned(chosen, owner)
    raise AssertionError("the env method always applies")


# --- the ranks -----------------------------------------------------------------------------------


@dataclass
class _Rank:
    pid: int
    rank: int
    world_size: int
    nodeid: str | None
    rss: int = 0
    alive: bool = True


def _rank_of(pid: int) -> tuple[int, int] | None:
    """(rank, world size) when process `pid` is a rank the kit's launcher started."""
    try:
        args = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return None
    for arg in args:
        match = RANK_ARG.match(arg.decode(errors="replace"))
        if match:
            return int(match.group(1)), int(match.group(2))
    return None


def _test_of(pid: int) -> str | None:
    """The node id of the test that launched rank `pid` (PYTEST_CURRENT_TEST, inherited by ranks)."""
    try:
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    for item in env:
        if item.startswith(b"PYTEST_CURRENT_TEST="):
            value = item.split(b"=", 1)[1].decode(errors="replace")
            return value.rsplit(" (", 1)[0]
    return None


def _children(pid: int) -> list[int]:
    out = []
    with contextlib.suppress(OSError):
        for task in Path(f"/proc/{pid}/task").iterdir():
            with contextlib.suppress(OSError):
                out += [int(x) for x in (task / "children").read_text().split()]
    return out


def _descendants(root: int) -> list[int]:
    seen, todo = [], [root]
    while todo:
        for child in _children(todo.pop()):
            if child not in seen:
                seen.append(child)
                todo.append(child)
    return seen


def _rss(pid: int) -> int | None:
    """Resident bytes of a rank and its descendants (its worker processes are charged to the
    runner as its own), None once the rank is gone or a zombie."""
    tree = tree_rss(pid)
    return None if tree is None else tree[0]


class RankWatcher(threading.Thread):
    """Moves every rank under `root_pid` into the limit's group as it appears; enforces the env
    method; pins each OOM kill on the rank that died with it (`stop()` returns them)."""

    def __init__(self, limit: MemoryLimit, root_pid: int) -> None:
        super().__init__(name="kit-rank-watcher", daemon=True)
        self.limit, self.root_pid = limit, root_pid
        self.ranks: dict[int, _Rank] = {}
        self.kills: list[Kill] = []
        self.errors: list[str] = []
        self._stop_event = threading.Event()
        self._counted = limit.oom_kills()
        self._failcnt = limit.failcnt()
        self._pending = 0
        self._note = ""
        self._previous: dict[int, int] = {}
        self._recent: list[tuple[float, _Rank]] = []  # deaths not yet pinned to a kill

    def run(self) -> None:
        while not self._stop_event.is_set():
            self.tick()
            self._stop_event.wait(POLL_S)
        self.tick()

    def stop(self) -> list[Kill]:
        """Stop watching (after pytest exited) and return the ranks the limit killed."""
        self._stop_event.set()
        if self.is_alive():
            self.join(timeout=10)
        return self.kills

    def tick(self) -> None:
        """One poll: adopt new ranks, sample RSS, enforce (env), attribute OOM kills (cgroups)."""
        for pid in _descendants(self.root_pid):
            if pid in self.ranks:
                continue
            found = _rank_of(pid)
            if found is None:
                continue
            rank = _Rank(pid, found[0], found[1], _test_of(pid))
            self.ranks[pid] = rank
            try:
                self.limit.adopt(pid)
            except OSError as exc:
                self.errors.append(f"rank {rank.rank} (pid {pid}) could not join {self.limit.cgroup}: {exc}")
        died: list[_Rank] = []
        for rank in self.ranks.values():
            if not rank.alive:
                continue
            rss = _rss(rank.pid)
            if rss is None:
                rank.alive = False
                died.append(rank)
            else:
                rank.rss = rss
        if self.limit.method == "env" and self.limit.limit_bytes is not None:
            self._enforce(self.limit.limit_bytes)
        elif self.limit.cgroup is not None:
            self._attribute(died)

    def _enforce(self, limit_bytes: int) -> None:
        alive = {r.pid: r for r in self.ranks.values() if r.alive}
        current = {pid: r.rss for pid, r in alive.items()}
        culprit = rank_over_limit(self._previous, current, limit_bytes)
        self._previous = current
        if culprit is None:
            return
        rank = alive[culprit]
        total = sum(current.values())
        reason = (
            f"the ranks' summed RSS {format_size(total)} exceeded the runner's {format_size(limit_bytes)} "
            f"(env method); rank {rank.rank} grew most and was killed at {format_size(rank.rss)}"
        )
        # Said before the kill, in the rank's launch directory: the launcher then names the death
        # `oom` as this summary does, instead of a bare SIGKILL (one kill, one verdict).
        run_dir = launch_dir_of(rank.pid)
        if run_dir is not None:
            note_memory_kill(run_dir, rank.rank, f"killed by {self.limit.owner}: {reason}")
        with contextlib.suppress(OSError):
            os.killpg(rank.pid, signal.SIGKILL)  # the rank leads its own group: its workers go too
        with contextlib.suppress(OSError):
            os.kill(rank.pid, signal.SIGKILL)
        rank.alive = False
        self._previous.pop(culprit, None)
        self.kills.append(Kill(rank.nodeid, rank.rank, rank.world_size, rank.pid, reason))

    def _attribute(self, died: Sequence[_Rank]) -> None:
        counted = self.limit.oom_kills()
        source = "memory.events" if self.limit.method != "cgroup1" else "memory.oom_control"
        if counted is not None and self._counted is not None:
            if counted > self._counted:
                self._pending += counted - self._counted
                self._note = f"{source} oom_kill {self._counted} -> {counted}"
                self._counted = counted
        elif died:
            failcnt = self.limit.failcnt()
            if failcnt is not None and self._failcnt is not None and failcnt > self._failcnt:
                self._pending += 1  # no oom_kill counter: a rank died after hitting the limit
                self._note = f"memory.failcnt {self._failcnt} -> {failcnt}"
                self._failcnt = failcnt
        # The kernel kills the largest process of the group; a rank that died within a second
        # of a kill not yet accounted for is it (the counter and the death are seen a poll apart).
        now = time.monotonic()
        self._recent = [(t, r) for t, r in self._recent if now - t < 1.0] + [(now, r) for r in died]
        for _, rank in sorted(self._recent, key=lambda item: -item[1].rss):
            if self._pending <= 0:
                break
            self._pending -= 1
            self._recent = [(t, r) for t, r in self._recent if r is not rank]
            self.kills.append(
                Kill(
                    rank.nodeid, rank.rank, rank.world_size, rank.pid,
                    f"killed by the kernel OOM killer in the ranks' capped cgroup ({self._note}; limit "
                    f"{format_size(self.limit.limit_bytes)}, rank at {format_size(rank.rss)} when last seen)",
                )
            )  # fmt: skip
