"""Memory admission across a whole session, xdist workers and nested sessions included.

Per-test budgets bound each test, not their overlap: ``pytest -n 4`` puts 4 workers x M ranks x
their budget in flight at once. One ledger per session holds the runner's memory and cores and
every admitted launch; a launch starts when its ranks' budgets (budget x world size) fit in
what is free, and otherwise waits, first come first served, the wait recorded as ``queued_s``.

- The runner's memory: ``KIT_HOST_MEMORY``, else the memory cgroup's limit, else MemAvailable
  when the ledger is made; its cores: this process' CPU affinity.
- A launch's share: its host budget per rank (the CUDA host allowance included,
  `devices.rank_host_budget`), or `DEFAULT_RANK_BYTES` (``KIT_DEFAULT_RANK_MEMORY``) for a test
  that declares none. A share larger than the whole runner can never fit: `NeverFits` at once.
- Over-commit is impossible by construction: every read-check-write of the ledger runs under an
  exclusive ``flock`` of its lock file (`safe_write.Folder.lock`; read by the bounded reader,
  written atomically by the one writer), and the entries of dead processes (pid and start time,
  so a reused pid is not mistaken for its predecessor) are reclaimed by whoever reads next.
- Where: the xdist controller (or a lone session) makes the ledger's folder, in the session's
  log folder under ``--kit-report`` or a temporary one otherwise, and names it to every process
  it starts in ``KIT_ADMISSION_DIR``: workers, and pytest sessions a test runs inside this one,
  join it (the runner's memory is one). Ranks do not inherit it: a launch inside a rank would
  wait for memory its own parent holds.

``KIT_ADMISSION=0`` turns admission off (every launch starts at once; the memory-stress test's
control). Cores are shared, never waited for: a launch's ranks get the free cores as threads.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
import uuid
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

from accounting.json_input import load_json
from megatron_testkit.budgets import format_size, parse_setting
from megatron_testkit.safe_write import Folder

__all__ = [
    "ADMISSION_ENV",
    "DEFAULT_RANK_BYTES",
    "DEFAULT_RANK_MEMORY_ENV",
    "LEDGER_ENV",
    "Capacity",
    "Ledger",
    "NeverFits",
    "Ticket",
    "capacity",
    "default_rank_bytes",
    "enabled",
    "session_ledger",
]

LEDGER_ENV = "KIT_ADMISSION_DIR"
ADMISSION_ENV = "KIT_ADMISSION"
DEFAULT_RANK_MEMORY_ENV = "KIT_DEFAULT_RANK_MEMORY"
# A rank of a test without a memory_budget: above what this repository's undeclared rank tests
# peak at (a gloo rank with torch and a small megatron model, 250-500 MiB in the L0 report).
DEFAULT_RANK_BYTES = 1 << 30
LEDGER_FILE = "admission.json"
LOCK_FILE = "admission.lock"
_MAX_LEDGER_BYTES = 1 << 20  # a ledger of live launches and waiters; anything larger is not ours
_POLL_S = 0.1


class NeverFits(ValueError):
    """A launch whose ranks' budgets exceed the runner's whole memory: it could only wait forever."""


@dataclass(frozen=True)
class Capacity:
    """The runner's memory in bytes, its cores, and where the memory figure came from."""

    memory_bytes: int
    cores: int
    source: str


def enabled(environ: Mapping[str, str] | None = None) -> bool:
    """False when ``KIT_ADMISSION=0`` (or ``off``); ValueError for anything but 0/1/on/off."""
    raw = (os.environ if environ is None else environ).get(ADMISSION_ENV, "").strip().lower()
    if raw not in ("", "0", "1", "on", "off"):
        raise ValueError(f"{ADMISSION_ENV}={raw!r}: expected 1 (on, the default) or 0 (off)")
    return raw not in ("0", "off")


def default_rank_bytes(environ: Mapping[str, str] | None = None) -> int:
    """``KIT_DEFAULT_RANK_MEMORY`` in bytes, else `DEFAULT_RANK_BYTES`; ValueError naming it."""
    raw = (os.environ if environ is None else environ).get(DEFAULT_RANK_MEMORY_ENV, "").strip()
    return parse_setting(DEFAULT_RANK_MEMORY_ENV, raw) if raw else DEFAULT_RANK_BYTES


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def _mem_available(meminfo: str = "/proc/meminfo") -> int | None:
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in Path(meminfo).read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return None


def capacity(environ: Mapping[str, str] | None = None) -> Capacity:
    """The runner's memory and cores: ``KIT_HOST_MEMORY``, else the memory cgroup's limit, else
    MemAvailable now (the ledger is made once per session, at its start)."""
    from megatron_testkit import runner_limit

    environ = os.environ if environ is None else environ
    raw = environ.get(runner_limit.HOST_MEMORY_ENV, "").strip()
    if raw:
        size = parse_setting(runner_limit.HOST_MEMORY_ENV, raw)
        return Capacity(size, _cores(), f"{runner_limit.HOST_MEMORY_ENV}={raw}")
    group = runner_limit.memory_cgroup_of()
    limit = runner_limit.group_limit_bytes(group) if group is not None else None
    if limit is not None:
        return Capacity(limit, _cores(), f"the memory cgroup's limit ({group})")
    available = _mem_available() or psutil.virtual_memory().available
    return Capacity(available, _cores(), "MemAvailable at the session's start")


@dataclass(frozen=True)
class Ticket:
    """One admitted launch: its ledger id, share, the threads each rank gets and how long it queued."""

    id: str
    bytes: int
    cores: int
    threads: int
    queued_s: float
    admitted_total: int  # every admitted launch's bytes, this one's included, when it was admitted


def _identity(pid: int | None = None) -> tuple[int, float]:
    """A process as the ledger names it: pid and start time (a reused pid has another)."""
    proc = psutil.Process(pid)
    return proc.pid, round(proc.create_time(), 2)


def _alive(item: Mapping[str, Any]) -> bool:
    try:
        return _identity(int(item["pid"])) == (int(item["pid"]), float(item["ctime"]))
    except (psutil.Error, KeyError, TypeError, ValueError):
        return False


class Ledger:
    """The session's ledger in ``folder`` (``admission.json`` and its lock file)."""

    def __init__(self, folder: str | os.PathLike[str]) -> None:
        self.files = Folder(folder, what="the admission ledger's folder")
        self.folder = self.files.path
        self.path = self.folder / LEDGER_FILE

    @classmethod
    def create(cls, folder: str | os.PathLike[str], cap: Capacity) -> Ledger:
        """The ledger in ``folder``, made with ``cap`` unless one is there (then it keeps its own)."""
        ledger = cls(folder)
        with ledger._locked():
            if not ledger.path.exists():
                ledger._save(
                    {
                        "version": 1,
                        "limit_bytes": cap.memory_bytes,
                        "cores": cap.cores,
                        "source": cap.source,
                        "entries": [],
                        "waiting": [],
                        "sessions": {},
                        "peak_bytes": 0,
                    }
                )
        return ledger

    # -- the file, under its lock -------------------------------------------------------------------
    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        with self.files.lock(LOCK_FILE):
            yield

    def _load(self) -> dict[str, Any]:
        ledger = load_json(self.path, limit=_MAX_LEDGER_BYTES, what="admission ledger", max_depth=8)
        if not isinstance(ledger, dict):
            raise ValueError(f"admission ledger {self.path} is not an object")
        for key, kind in (("limit_bytes", int), ("cores", int), ("entries", list), ("waiting", list)):
            if not isinstance(ledger.get(key), kind):
                raise ValueError(
                    f"admission ledger {self.path}: field {key!r} is missing or not {kind.__name__}"
                )
        ledger.setdefault("sessions", {})
        ledger.setdefault("peak_bytes", 0)
        # Reclaim what dead processes held or waited for (a worker killed mid-launch).
        ledger["entries"] = [e for e in ledger["entries"] if _alive(e)]
        ledger["waiting"] = [w for w in ledger["waiting"] if _alive(w)]
        return ledger

    def _save(self, ledger: dict[str, Any]) -> None:
        self.files.write_text(LEDGER_FILE, json.dumps(ledger))

    # -- reading -----------------------------------------------------------------------------------
    def snapshot(self) -> dict[str, Any]:
        """The ledger as it is now (dead processes' entries already left out)."""
        with self._locked():
            return self._load()

    # -- sessions ----------------------------------------------------------------------------------
    def join_session(self, session_id: str) -> None:
        """Register a session, whose peak of admitted memory is tracked from now on."""
        pid, ctime = _identity()
        with self._locked():
            ledger = self._load()
            total = sum(e["bytes"] for e in ledger["entries"])
            ledger["sessions"][session_id] = {"pid": pid, "ctime": ctime, "peak_bytes": total}
            self._save(ledger)

    def leave_session(self, session_id: str) -> dict[str, Any]:
        """Unregister a session; its figures: ``limit_bytes``, ``cores``, ``source``, ``peak_bytes``."""
        with self._locked():
            ledger = self._load()
            mine = ledger["sessions"].pop(session_id, None) or {}
            self._save(ledger)
        return {
            "limit_bytes": ledger["limit_bytes"],
            "cores": ledger["cores"],
            "source": str(ledger.get("source") or ""),
            "peak_bytes": int(mine.get("peak_bytes") or 0),
        }

    # -- launches ----------------------------------------------------------------------------------
    def refuse_never_fits(self, share: int, world_size: int, label: str) -> None:
        """`NeverFits` when ``share`` exceeds the runner's whole memory (before anything is made)."""
        with self._locked():
            ledger = self._load()
        self._refuse(ledger, share, world_size, label)

    @staticmethod
    def _refuse(ledger: dict[str, Any], share: int, world_size: int, label: str) -> None:
        if share > ledger["limit_bytes"]:
            raise NeverFits(
                f"{label}: needs {format_size(share)} ({world_size} rank(s) x "
                f"{format_size(share // max(1, world_size))}) but the runner has "
                f"{format_size(ledger['limit_bytes'])} ({ledger.get('source')}): it can never "
                f"be admitted; lower memory_budget(host=...) or the world size"
            )

    def admit(self, share: int, world_size: int, label: str, *, poll_s: float = _POLL_S) -> Ticket:
        """Wait until ``share`` bytes fit beside every admitted launch (first come, first served),
        then record it; `NeverFits` at once for a share above the runner's memory."""
        pid, ctime = _identity()
        me = {"id": uuid.uuid4().hex, "pid": pid, "ctime": ctime, "bytes": share, "label": label}
        started = time.monotonic()
        try:
            while True:
                with self._locked():
                    ledger = self._load()
                    self._refuse(ledger, share, world_size, label)
                    before = json.dumps(ledger)
                    ticket = self._try_admit(ledger, me, world_size, time.monotonic() - started)
                    if json.dumps(ledger) != before:  # queued or admitted: else nothing to write
                        self._save(ledger)
                if ticket is not None:
                    return ticket
                time.sleep(poll_s)
        except BaseException:
            with contextlib.suppress(Exception), self._locked():
                ledger = self._load()
                ledger["waiting"] = [w for w in ledger["waiting"] if w["id"] != me["id"]]
                self._save(ledger)
            raise

    @staticmethod
    def _try_admit(
        ledger: dict[str, Any], me: dict[str, Any], world_size: int, waited: float
    ) -> Ticket | None:
        """Admit ``me`` into ``ledger`` (in place) if it is first in line and fits; else queue it."""
        if not any(w["id"] == me["id"] for w in ledger["waiting"]):
            ledger["waiting"].append(me)
        total = sum(e["bytes"] for e in ledger["entries"])
        first = ledger["waiting"][0]["id"] == me["id"]
        if not first or total + me["bytes"] > ledger["limit_bytes"]:
            return None
        used_cores = sum(e.get("cores", 0) for e in ledger["entries"])
        threads = max(1, (ledger["cores"] - used_cores) // max(1, world_size))
        cores = min(ledger["cores"], threads * world_size)
        ledger["waiting"] = ledger["waiting"][1:]
        ledger["entries"].append({**me, "cores": cores, "since": time.time()})
        total += me["bytes"]
        ledger["peak_bytes"] = max(int(ledger.get("peak_bytes") or 0), total)
        for session in ledger["sessions"].values():
            session["peak_bytes"] = max(int(session.get("peak_bytes") or 0), total)
        return Ticket(me["id"], me["bytes"], cores, threads, round(waited, 3), total)

    def release(self, ticket: Ticket) -> None:
        """The launch ended: its share is free again."""
        with self._locked():
            ledger = self._load()
            ledger["entries"] = [e for e in ledger["entries"] if e["id"] != ticket.id]
            self._save(ledger)


def session_ledger(environ: Mapping[str, str] | None = None) -> Ledger | None:
    """The ledger this process' launches go through (``KIT_ADMISSION_DIR``), None when admission is
    off or no session made one (a plain script calling run_ranks)."""
    environ = os.environ if environ is None else environ
    folder = environ.get(LEDGER_ENV, "").strip()
    if not folder or not enabled(environ) or not Path(folder, LEDGER_FILE).is_file():
        return None
    return Ledger(folder)
