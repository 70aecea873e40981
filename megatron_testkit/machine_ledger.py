"""The machine's admission ledger: one per user and boot, shared by every top-level session.

Each session's own ledger (`megatron_testkit.admission`) bounds its launches by its runner's memory
(``KIT_HOST_MEMORY`` or its cgroup), but two sessions a developer runs side by side (two terminals,
two projects) would each admit that whole memory. Top-level sessions therefore also admit every
launch in this ledger, so the sum over sessions never exceeds the machine:

- Top-level: a session with no kit session above it (``KIT_OUTER_SESSION`` names the first one, and
  counts only while that process is this one or one of its ancestors). A nested session keeps the
  private ledger it makes (this repository's self-tests run whole sessions inside a test), and a
  rank never sees the machine ledger: a launch inside a rank would wait for memory its parent holds.
- Its memory: ``KIT_MACHINE_MEMORY``, else MemAvailable (within this process' memory cgroup's
  limit), re-measured whenever no launch holds or waits for any, so a figure taken on a busy
  machine does not last the whole boot. A launch larger than that waits until it runs alone.
- Where: ``KIT_MACHINE_ADMISSION_DIR``, else ``<temp dir>/megatron-testkit-<uid>/admission-<boot id>``,
  a folder only this user can write (refused otherwise, with one warning). ``KIT_MACHINE_ADMISSION=0``
  turns it off.
"""

from __future__ import annotations

import contextlib
import os
import stat
import tempfile
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from megatron_testkit import admission, procfs, runner_limit
from megatron_testkit.budgets import parse_setting

__all__ = [
    "MACHINE_DIR_ENV",
    "MACHINE_ENV",
    "MACHINE_LEDGER_ENV",
    "MACHINE_MEMORY_ENV",
    "MACHINE_TICKET_ENV",
    "OUTER_SESSION_ENV",
    "MachineLedger",
    "MachineLedgerRefused",
    "enabled",
    "is_top_level",
    "launch_ledger",
    "machine_capacity",
    "memory_setting",
    "open_for_session",
    "session_marker",
]

MACHINE_ENV = "KIT_MACHINE_ADMISSION"  # 0/off: top-level sessions do not share the machine's ledger
MACHINE_DIR_ENV = "KIT_MACHINE_ADMISSION_DIR"  # where the machine's ledger lives (a user setting)
MACHINE_MEMORY_ENV = "KIT_MACHINE_MEMORY"  # the memory all top-level sessions share
# Set by a top-level session for its own processes (workers, launchers); removed for ranks and by
# nested sessions: the machine ledger this process' launches also go through.
MACHINE_LEDGER_ENV = "KIT_MACHINE_LEDGER"
MACHINE_TICKET_ENV = "KIT_MACHINE_ADMISSION_TICKET"  # a machine ticket in the ranks' environment
OUTER_SESSION_ENV = "KIT_OUTER_SESSION"  # "<pid>:<start ticks>" of the top-level session


class MachineLedgerRefused(UserWarning):
    """The machine ledger's default folder is not this user's alone: sessions do not share admission."""


def enabled(environ: Mapping[str, str] | None = None) -> bool:
    """False when ``KIT_MACHINE_ADMISSION=0`` (or ``off``); ValueError for anything but 0/1/on/off."""
    raw = (os.environ if environ is None else environ).get(MACHINE_ENV, "").strip().lower()
    if raw not in ("", "0", "1", "on", "off"):
        raise ValueError(f"{MACHINE_ENV}={raw!r}: expected 1 (on, the default) or 0 (off)")
    return raw not in ("0", "off")


def memory_setting(environ: Mapping[str, str] | None = None) -> int | None:
    """``KIT_MACHINE_MEMORY`` in bytes (None when unset); ValueError naming it."""
    raw = (os.environ if environ is None else environ).get(MACHINE_MEMORY_ENV, "").strip()
    return parse_setting(MACHINE_MEMORY_ENV, raw) if raw else None


def machine_capacity(environ: Mapping[str, str] | None = None) -> admission.Capacity:
    """``KIT_MACHINE_MEMORY``, else MemAvailable now, within this process' memory cgroup's limit."""
    environ = os.environ if environ is None else environ
    given = memory_setting(environ)
    cores = admission._cores()
    if given is not None:
        raw = environ[MACHINE_MEMORY_ENV].strip()
        return admission.Capacity(given, cores, f"{MACHINE_MEMORY_ENV}={raw}")
    available = admission._mem_available() or admission.psutil.virtual_memory().available
    group = runner_limit.memory_cgroup_of()
    limit = runner_limit.group_limit_bytes(group) if group is not None else None
    if limit is not None and limit < available:
        return admission.Capacity(limit, cores, f"the memory cgroup's limit ({group})")
    return admission.Capacity(available, cores, "MemAvailable while no launch held any")


class MachineLedger(admission.Ledger):
    """The machine's ledger: the tickets of its ranks in their own variable, its capacity the
    machine's, re-measured whenever it is idle."""

    marker_env = MACHINE_TICKET_ENV

    def own_capacity(self) -> admission.Capacity:
        return machine_capacity()

    def refresh(self, ledger: dict[str, Any]) -> bool:
        """Idle (no launch holds or waits): take the machine's memory now."""
        if ledger["entries"] or ledger["waiting"]:
            return False
        cap = machine_capacity()
        before = (ledger["limit_bytes"], ledger.get("source"))
        ledger["limit_bytes"], ledger["cores"], ledger["source"] = cap.memory_bytes, cap.cores, cap.source
        return before != (ledger["limit_bytes"], ledger["source"])

    def admit_within(self, share: int, world_size: int, label: str) -> admission.Ticket:
        """Admit ``share``, or the machine's whole memory when it is larger (it then runs alone)."""
        limit = self.snapshot()["limit_bytes"]
        return self.admit(min(share, limit), world_size, label)


def session_marker() -> str:
    """This process as ``KIT_OUTER_SESSION`` names the top-level session: ``<pid>:<start ticks>``."""
    return f"{os.getpid()}:{procfs.start_ticks(os.getpid())}"


def _ancestors() -> set[tuple[int, int | None]]:
    """This process and its ancestors, each as (pid, start ticks)."""
    out: set[tuple[int, int | None]] = set()
    pid = os.getpid()
    for _ in range(256):  # deeper than any real tree; a loop in /proc cannot hold us
        out.add((pid, procfs.start_ticks(pid)))
        try:
            with open(f"/proc/{pid}/stat") as f:
                text = f.read()
            pid = int(text[text.rindex(")") + 2 :].split()[1])
        except (OSError, ValueError, IndexError):
            break
        if pid <= 0:
            break
    return out


def is_top_level(environ: Mapping[str, str] | None = None) -> bool:
    """True unless ``KIT_OUTER_SESSION`` names this process or one of its ancestors (a session
    inside a test, a worker, or a rank; a stale value left in a shell names none)."""
    raw = (os.environ if environ is None else environ).get(OUTER_SESSION_ENV, "")
    pid, _, start = raw.partition(":")
    if not pid.isdigit() or not start.isdigit():
        return True
    return (int(pid), int(start)) not in _ancestors()


def _default_folder() -> Path | None:
    """``<temp dir>/megatron-testkit-<uid>/admission-<boot id>``; None (one warning) when the user's
    folder there is not a folder of this user's that only it can write."""
    user = Path(tempfile.gettempdir()) / f"megatron-testkit-{os.getuid()}"
    with contextlib.suppress(FileExistsError):
        os.mkdir(user, 0o700)
    info = os.lstat(user)
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o022:
        warnings.warn(
            f"{user} is not a folder of this user's that only it can write: top-level sessions on "
            f"this machine do not share admission (set {MACHINE_DIR_ENV} to a folder of yours)",
            MachineLedgerRefused,
            stacklevel=3,
        )
        return None
    return user / f"admission-{procfs.boot_id() or 'unknown-boot'}"


def open_for_session(environ: Mapping[str, str] | None = None) -> MachineLedger | None:
    """The machine ledger a top-level session joins (made when missing); None when it is turned off
    or its default folder cannot be trusted. The caller decides that the session is top-level."""
    environ = os.environ if environ is None else environ
    if not enabled(environ):
        return None
    configured = environ.get(MACHINE_DIR_ENV, "").strip()
    folder = Path(configured) if configured else _default_folder()
    if folder is None:
        return None
    ledger = MachineLedger.create(folder, machine_capacity(environ))
    assert isinstance(ledger, MachineLedger)
    return ledger


def launch_ledger(environ: Mapping[str, str] | None = None) -> MachineLedger | None:
    """The machine ledger this process' launches also go through (``KIT_MACHINE_LEDGER``, set by a
    top-level session), None outside one or with admission off."""
    environ = os.environ if environ is None else environ
    folder = environ.get(MACHINE_LEDGER_ENV, "").strip()
    if not folder or not admission.enabled(environ) or not Path(folder, admission.LEDGER_FILE).is_file():
        return None
    return MachineLedger(folder)
