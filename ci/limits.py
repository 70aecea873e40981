"""The CI runner's memory limit, applied to a whole local run (pytest and every rank it spawns).

A CI job gets killed when pytest plus all its ranks exceed the runner's memory; per-rank budgets
alone cannot reproduce that. In order of preference:

1. ``cgroup v2``: a child cgroup of ours with ``memory.max`` (and no swap), where the unified
   hierarchy has the memory controller and we may create cgroups (root, or a delegated subtree);
2. ``cgroup v1``: the same with ``memory.limit_in_bytes`` on a v1 memory hierarchy;
3. ``systemd-run``: a transient scope with ``MemoryMax`` when a systemd manager answers;
4. ``env``: nothing enforces the whole run; the size is passed in ``KIT_HOST_MEMORY`` for the
   plugin to clamp per-rank budgets.

The chosen method is reported, never silently downgraded. The cgroup methods also give the run's
peak memory and the number of kernel OOM kills, which `repro` prints next to the limit.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from fixtures.budgets import format_size

METHODS = ("cgroup2", "cgroup1", "systemd-run", "env")


@dataclass
class MemoryLimit:
    """A memory limit ready to wrap a command; `close()` removes what it created."""

    method: str
    limit_bytes: int | None
    detail: str
    cgroup: Path | None = None
    prefix: list[str] = field(default_factory=list)
    tried: list[str] = field(default_factory=list)

    def wrap(self, command: list[str]) -> list[str]:
        """The command to run so that it, and everything it starts, is inside the limit."""
        if self.cgroup is not None:
            # The shell moves itself into the cgroup before exec'ing the command: no process of
            # the run ever starts outside it, and no preexec_fn runs in a forked Python.
            procs = self.cgroup / "cgroup.procs"
            return ["sh", "-c", 'echo $$ > "$0" && exec "$@"', str(procs), *command]
        return [*self.prefix, *command]

    def peak_bytes(self) -> int | None:
        """The run's peak memory as the cgroup counted it (None without a cgroup)."""
        name = {"cgroup2": "memory.peak", "cgroup1": "memory.max_usage_in_bytes"}.get(self.method)
        return _read_int(self.cgroup / name) if self.cgroup is not None and name else None

    def oom_kills(self) -> int | None:
        """Processes the kernel killed for exceeding the limit (None without a cgroup)."""
        if self.cgroup is None:
            return None
        name = "memory.events" if self.method == "cgroup2" else "memory.oom_control"
        try:
            for line in (self.cgroup / name).read_text().splitlines():
                key, _, value = line.partition(" ")
                if key == "oom_kill":
                    return int(value)
        except OSError:
            return None
        return 0

    def describe(self) -> str:
        """One line: the method, the size and where, with the methods that were not available."""
        if self.limit_bytes is None:
            return "no runner memory limit (this job defines none)"
        text = f"{format_size(self.limit_bytes)} for the whole run via {self.method} ({self.detail})"
        if self.tried:
            text += f"; unavailable: {'; '.join(self.tried)}"
        return text

    def close(self) -> None:
        """Remove the cgroup (all its processes have exited by now)."""
        if self.cgroup is not None:
            with contextlib.suppress(OSError):
                self.cgroup.rmdir()


def _read_int(path: Path) -> int | None:
    try:
        return int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def _mounts() -> list[tuple[str, str, set[str]]]:
    """(mount point, fs type, options) of every cgroup mount."""
    out = []
    try:
        lines = Path("/proc/self/mounts").read_text().splitlines()
    except OSError:
        return out
    for line in lines:
        parts = line.split()
        if len(parts) >= 4 and parts[2] in ("cgroup", "cgroup2"):
            out.append((parts[1], parts[2], set(parts[3].split(","))))
    return out


def _own_cgroup(controller: str | None) -> str | None:
    """Our path in the v2 hierarchy (controller None) or in the v1 hierarchy of `controller`."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controller is None and controllers == "":
            return path
        if controller is not None and controller in controllers.split(","):
            return path
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
    mount = next((m for m, kind, _ in _mounts() if kind == "cgroup2"), None)
    own = _own_cgroup(None)
    if mount is None or own is None:
        raise OSError("no cgroup2 mount")
    parent = Path(mount) / own.lstrip("/")
    controllers = (parent / "cgroup.subtree_control").read_text().split()
    if "memory" not in controllers:
        raise OSError(f"memory is not in {parent}/cgroup.subtree_control")
    child = _make_child(parent, {"memory.max": str(limit), "memory.swap.max": "0"})
    return MemoryLimit("cgroup2", limit, str(child), cgroup=child)


def _cgroup1(limit: int) -> MemoryLimit:
    mount = next((m for m, kind, opts in _mounts() if kind == "cgroup" and "memory" in opts), None)
    own = _own_cgroup("memory")
    if mount is None or own is None:
        raise OSError("no cgroup v1 memory hierarchy")
    parent = Path(mount) / own.lstrip("/")
    # memsw (memory + swap) equal to the limit means no swap; it is absent without swap accounting.
    child = _make_child(
        parent, {"memory.limit_in_bytes": str(limit), "memory.memsw.limit_in_bytes": str(limit)}
    )
    return MemoryLimit("cgroup1", limit, str(child), cgroup=child)


def _systemd_run(limit: int) -> MemoryLimit:
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
    return MemoryLimit("systemd-run", limit, "transient scope with MemoryMax", prefix=[*prefix, "--"])


def _env(limit: int) -> MemoryLimit:
    return MemoryLimit(
        "env",
        limit,
        "KIT_HOST_MEMORY passed to the plugin; the whole run is NOT capped",
    )


_STRATEGIES = {"cgroup2": _cgroup2, "cgroup1": _cgroup1, "systemd-run": _systemd_run, "env": _env}


def apply_memory_limit(limit_bytes: int | None, method: str = "auto") -> MemoryLimit:
    """The strongest available way to cap a run at `limit_bytes` (or exactly `method` when named).

    ``method="auto"`` tries cgroup v2, cgroup v1, systemd-run, then env; a named method that is
    unavailable raises OSError saying why.
    """
    if limit_bytes is None:
        return MemoryLimit("none", None, "no limit")
    if method != "auto":
        if method not in _STRATEGIES:
            raise ValueError(f"unknown limit method {method!r}: expected auto or one of {', '.join(METHODS)}")
        return _STRATEGIES[method](limit_bytes)
    tried = []
    for name in METHODS:
        try:
            chosen = _STRATEGIES[name](limit_bytes)
        except (OSError, subprocess.SubprocessError) as exc:
            tried.append(f"{name}: {exc}")
            continue
        chosen.tried = tried
        return chosen
    raise AssertionError("the env method always applies")
