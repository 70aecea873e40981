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
- A warm parent (`megatron_testkit.warm_start`) is counted once, at its resident memory after its
  imports, by the process that started it (`Ledger.charge`): not per worker that forks from it nor
  per launch. It runs already, so it is recorded at once; launches after it wait for room instead.
  Its entry names the parent, so it leaves the ledger when the parent stops or dies. Such a
  standing charge never makes a launch wait for ever: a launch that fits the runner alone but not
  beside the warm parents is admitted once no other launch holds memory (it then runs alone,
  beside them).
- Over-commit is impossible by construction: every read-check-write of the ledger runs under an
  exclusive ``flock`` of its lock file (`safe_write.Folder.lock`; read by the bounded reader,
  written atomically by the one writer), and the entries of dead processes are reclaimed by
  whoever reads next. A process is named by its pid and its start in clock ticks after boot
  (`procfs.start_ticks`: a reused pid has another, a clock step changes none, a zombie is dead),
  within the boot the ledger names.
- A dead launcher's ranks die with it; what they started (re-parented to init) carries the launch's
  marker (``KIT_ADMISSION_TICKET``: ticket, launcher, ledger) in its own environment, and whoever
  reclaims the entry kills the processes that carry it. The ledger is untrusted: a pid it names
  is never signalled for being named there.
- A release that cannot be written (a full disk) never holds the share, in any process: it leaves
  an empty file ``admission.released-<ticket>`` beside the ledger (an empty file needs no data
  block), every reader counts a ticket with one as released, and the next write drops both. The
  releasing process also leaves the ticket out itself (should even that file fail) and retries the
  write in the background until one succeeds.
- The ledger is input too: one that is unreadable, too large, of another format, or with an entry
  it cannot trust (no bytes, negative bytes) is set aside (renamed, one warning naming it), and the
  new one counts the launches still running on this ledger (their ranks' current memory) until
  they end, so it never over-admits.
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
import dataclasses
import json
import os
import re
import stat
import threading
import time
import uuid
import warnings
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

from accounting.json_input import JsonInputError, load_json
from megatron_testkit import procfs, proctree
from megatron_testkit.budgets import format_size, parse_setting
from megatron_testkit.safe_write import Folder

__all__ = [
    "ADMISSION_ENV",
    "DEFAULT_RANK_BYTES",
    "DEFAULT_RANK_MEMORY_ENV",
    "LEDGER_ENV",
    "TICKET_ENV",
    "Capacity",
    "Ledger",
    "LedgerSetAside",
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
# In each rank's environment (inherited by what it starts): ``<ticket>:<launcher pid>:<its start>:<ledger folder>``.
TICKET_ENV = "KIT_ADMISSION_TICKET"
# A rank of a test without a memory_budget: above what this repository's undeclared rank tests
# peak at (a gloo rank with torch and a small megatron model, 250-500 MiB in the L0 report).
DEFAULT_RANK_BYTES = 1 << 30
LEDGER_FILE = "admission.json"
LOCK_FILE = "admission.lock"
RELEASED_PREFIX = "admission.released-"  # + a ticket id: its release could not rewrite the ledger
_MAX_LEDGER_BYTES = 1 << 20  # a ledger of live launches and waiters; anything larger is not ours
_POLL_S = 0.1
_RETRY_S = 1.0  # how often a release that could not be written is tried again
LEDGER_VERSION = 2  # 2: processes named by start ticks after boot, within the ledger's boot id
STANDING = "standing"  # an entry's flag: memory held for the session's length (a warm parent), not a launch's
_ID = re.compile(r"[0-9A-Za-z_.-]{1,64}")  # ticket ids: uuid4 hex; never a ':' (the marker's separator)


class NeverFits(ValueError):
    """A launch whose ranks' budgets exceed the runner's whole memory: it could only wait forever."""


class LedgerSetAside(UserWarning):
    """A ledger the kit could not use was renamed and a new one made in its place."""


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
    marker: str = ""  # TICKET_ENV's value for the launch's ranks


def _identity(pid: int | None = None) -> tuple[int, int]:
    """A process as the ledger names it: pid and start in clock ticks after boot (a reused pid has
    another); ValueError when it is gone or a zombie."""
    pid = os.getpid() if pid is None else pid
    start = procfs.start_ticks(pid)
    if start is None:
        raise ValueError(f"process {pid} is gone")
    return pid, start


def _alive(item: Mapping[str, Any]) -> bool:
    return procfs.start_ticks(item["pid"]) == item["start"]


def _count(value: Any, *, positive: bool = False) -> bool:
    """A JSON integer (never a bool) that is not negative (or, with ``positive``, above 0)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= (1 if positive else 0)


def _process_problem(item: Any) -> str | None:
    """Why a ledger item (entry, waiter, session) cannot be trusted; None when it can."""
    if not isinstance(item, dict):
        return "is not an object"
    if not isinstance(item.get("id"), str) or not _ID.fullmatch(item["id"]):
        return "has no valid 'id'"
    if not _count(item.get("pid"), positive=True) or not _count(item.get("start")):
        return "names no process ('pid', 'start')"
    if not _count(item.get("bytes", 0)) or not _count(item.get("cores", 0)):
        return "has negative or non-integer 'bytes' or 'cores'"
    return None


def _ledger_problem(ledger: Any) -> str | None:
    """Why a ledger's content cannot be used; None when it can. An entry without bytes or with
    negative bytes is never trusted: counted as nothing, it would let launches over-commit."""
    if not isinstance(ledger, dict):
        return "not an object"
    if ledger.get("version") != LEDGER_VERSION:
        return f"format {ledger.get('version')!r}, not {LEDGER_VERSION}"
    for key, check in (("limit_bytes", _count), ("cores", _count), ("peak_bytes", _count)):
        if not check(ledger.get(key), positive=key != "peak_bytes"):
            return f"field {key!r} is missing or not a count"
    for key, kind in (("boot_id", str), ("entries", list), ("waiting", list), ("sessions", dict)):
        if not isinstance(ledger.get(key), kind):
            return f"field {key!r} is missing or not {kind.__name__}"
    for key in ("entries", "waiting"):
        for i, item in enumerate(ledger[key]):
            if key == "entries" and not (isinstance(item, dict) and _count(item.get("bytes"))):
                return f"{key}[{i}] has no 'bytes' or negative 'bytes'"
            problem = _process_problem(item)
            if problem:
                return f"{key}[{i}] {problem}"
    for name, session in ledger["sessions"].items():
        problem = _process_problem({**session, "id": "s"}) if isinstance(session, dict) else "not an object"
        if problem or not _count(session.get("peak_bytes", 0)):
            return f"sessions[{name!r}] {problem or 'has a negative peak'}"
    return None


def _marker(ticket_id: str, pid: int, start: int, folder: Path) -> str:
    return f"{ticket_id}:{pid}:{start}:{folder}"


def _parse_marker(value: str) -> tuple[str, int, int, str] | None:
    parts = value.split(":", 3)
    if len(parts) != 4 or not _ID.fullmatch(parts[0]) or not parts[1].isdigit() or not parts[2].isdigit():
        return None
    return parts[0], int(parts[1]), int(parts[2]), parts[3]


# Tickets released here whose write was refused, per ledger folder: left out of this process' reads
# and writes (so its own next launch is not held), and retried until a write succeeds.
_unreleased: dict[str, set[str]] = {}
_unreleased_ledgers: dict[str, Ledger] = {}
_unreleased_lock = threading.Lock()
_retry_thread: threading.Thread | None = None


def _retry_releases() -> None:
    """Rewrite each ledger that still holds a ticket released here, every `_RETRY_S`, until none does."""
    global _retry_thread
    while True:
        time.sleep(_RETRY_S)
        with _unreleased_lock:
            ledgers = [_unreleased_ledgers[folder] for folder, ids in _unreleased.items() if ids]
            if not ledgers:
                _retry_thread = None
                return
        for ledger in ledgers:
            with contextlib.suppress(Exception):  # still refused (or gone): tried again later
                ledger.flush()


class Ledger:
    """The session's ledger in ``folder`` (``admission.json`` and its lock file)."""

    marker_env = TICKET_ENV  # the variable that carries this ledger's tickets in the ranks' environment

    def __init__(self, folder: str | os.PathLike[str], *, create: bool = True) -> None:
        self.files = Folder(folder, create=create, what="the admission ledger's folder")
        self.folder = self.files.path
        self.path = self.folder / LEDGER_FILE
        self._buried: set[str] = set()  # tickets the last read left out for their released-file

    def _released_file(self, ticket_id: str) -> bool:
        """Whether a release left its file for ``ticket_id`` (looked up by the exact id of an entry
        the ledger holds, never by listing the folder: the folder's names are not read)."""
        with contextlib.suppress(OSError):
            info = self.files.lstat(RELEASED_PREFIX + ticket_id)
            return info is not None and stat.S_ISREG(info.st_mode)
        return False

    @staticmethod
    def fresh(cap: Capacity) -> dict[str, Any]:
        """An empty ledger of ``cap`` for this boot."""
        return {
            "version": LEDGER_VERSION,
            "boot_id": procfs.boot_id(),
            "limit_bytes": cap.memory_bytes,
            "cores": cap.cores,
            "source": cap.source,
            "entries": [],
            "waiting": [],
            "sessions": {},
            "peak_bytes": 0,
        }

    def own_capacity(self) -> Capacity:
        """The capacity a new ledger of this kind gets (set aside and made anew): the runner's."""
        return capacity()

    def refresh(self, ledger: dict[str, Any]) -> bool:
        """Bring a readable ledger up to date before use (in place); whether it changed. Nothing here."""
        return False

    @classmethod
    def create(cls, folder: str | os.PathLike[str], cap: Capacity) -> Ledger:
        """The ledger in ``folder``, made with ``cap`` unless one is there (then it keeps its own)."""
        ledger = cls(folder)
        with ledger._locked():
            if not ledger.path.exists():
                ledger._save(cls.fresh(cap))
        return ledger

    # -- the file, under its lock -------------------------------------------------------------------
    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        with self.files.lock(LOCK_FILE):
            yield

    def _load(self) -> dict[str, Any]:
        return self._read()[0]

    def _read(self) -> tuple[dict[str, Any], bool]:
        """The ledger without what dead processes held or waited for and without the tickets released
        here whose write was refused; and whether that differs from the file (so it is worth writing).
        A ledger that cannot be used is set aside and replaced (`_set_aside`)."""
        self._buried = set()
        try:
            ledger = load_json(self.path, limit=_MAX_LEDGER_BYTES, what="admission ledger", max_depth=8)
            problem = _ledger_problem(ledger)
        except JsonInputError as exc:  # unreadable, over its size cap, not JSON
            ledger, problem = None, str(exc)
        else:
            problem = problem and f"admission ledger {self.path}: {problem}"
        if problem is not None:
            return self._set_aside(problem), True
        changed = False
        if ledger["boot_id"] != procfs.boot_id():  # written before a reboot: no process of it lives
            ledger["entries"], ledger["waiting"], ledger["sessions"] = [], [], {}
            ledger["boot_id"], changed = procfs.boot_id(), True
        with _unreleased_lock:
            released = _unreleased.get(str(self.folder), set())
            released &= {e["id"] for e in ledger["entries"]}  # written out by now: forgotten
        self._buried = {e["id"] for e in ledger["entries"] if self._released_file(e["id"])}
        released = released | self._buried
        dead = [e for e in ledger["entries"] if e["id"] not in released and not _alive(e)]
        entries = [e for e in ledger["entries"] if e["id"] not in released and _alive(e)]
        waiting = [w for w in ledger["waiting"] if _alive(w)]
        sessions = {k: v for k, v in ledger["sessions"].items() if _alive(v)}
        changed = changed or (len(entries), len(waiting), len(sessions)) != (
            len(ledger["entries"]),
            len(ledger["waiting"]),
            len(ledger["sessions"]),
        )
        ledger["entries"], ledger["waiting"], ledger["sessions"] = entries, waiting, sessions
        self._end_leftovers(dead)
        return ledger, self.refresh(ledger) or changed

    def _end_leftovers(self, dead: list[dict[str, Any]]) -> None:
        """Kill what the ranks of dead launchers left running (helpers re-parented to init): only
        processes whose own environment carries such a launch's marker, which names the dead
        launcher (pid and start) and this ledger; never a pid because the ledger names it."""
        for entry in dead:
            marker = _marker(entry["id"], entry["pid"], entry["start"], self.folder)
            for proc in proctree.marked(self.marker_env, marker):
                with contextlib.suppress(psutil.Error):
                    proc.kill()

    def _set_aside(self, problem: str) -> dict[str, Any]:
        """Rename an unusable ledger (one warning naming both paths) and make a new one that counts
        the launches still running on this ledger at their ranks' current memory, written at once.
        Its capacity is the kit's own figure from this environment (`capacity`), never the file's."""
        aside = None
        if self.files.lstat(LEDGER_FILE) is not None:
            name = f"{LEDGER_FILE}.set-aside-{time.strftime('%Y%m%dT%H%M%S')}-{uuid.uuid4().hex[:8]}"
            aside = self.files.rename(LEDGER_FILE, name)
        ledger = self.fresh(self.own_capacity())
        ledger["entries"] = self.running_launches()
        ledger["peak_bytes"] = sum(e["bytes"] for e in ledger["entries"])
        self._save(ledger)  # at once: the next reader finds it, not a missing file to warn about again
        where = f"set aside as {aside}" if aside is not None else "missing"
        with warnings.catch_warnings():
            warnings.simplefilter("always", LedgerSetAside)  # a warning, never a failed launch
            warnings.warn(
                f"{problem}: {where}; the new ledger counts the {len(ledger['entries'])} launch(es) "
                "still running on it at their ranks' current memory until they end",
                LedgerSetAside,
                stacklevel=3,
            )
        return ledger

    def running_launches(self) -> list[dict[str, Any]]:
        """Entries for the launches on this ledger whose launcher still runs, found by the marker in
        their ranks' (and helpers') own environment: their resident memory now, summed."""
        held: dict[tuple[str, int, int], int] = {}
        for item in os.scandir("/proc"):
            if not item.name.isdigit():
                continue
            value = procfs.environ_value(item.name, self.marker_env)
            parsed = _parse_marker(value) if value else None
            if parsed is None or parsed[3] != str(self.folder):
                continue
            ticket_id, pid, start, _ = parsed
            if procfs.start_ticks(pid) != start:
                continue
            key = (ticket_id, pid, start)
            held[key] = held.get(key, 0) + (procfs.rss_bytes(item.name) or 0)
        return [
            {
                "id": ticket_id,
                "pid": pid,
                "start": start,
                "bytes": size,
                "cores": 0,
                "label": "a launch running when the ledger was set aside (its ranks' memory then)",
                "since": time.time(),
            }
            for (ticket_id, pid, start), size in held.items()
        ]

    def _save(self, ledger: dict[str, Any]) -> None:
        """Write the ledger; then remove the released-files of the tickets it no longer holds."""
        self.files.write_text(LEDGER_FILE, json.dumps(ledger))
        held = {e["id"] for e in ledger["entries"]}
        for ticket_id in self._buried - held:
            with contextlib.suppress(OSError):  # left behind: an id never used again, harmless
                self.files.remove(RELEASED_PREFIX + ticket_id)
        self._buried = set()

    def flush(self) -> None:
        """Write the ledger back if reading it dropped something (dead processes' entries, tickets
        released here whose write was refused)."""
        with self._locked():
            ledger, changed = self._read()
            if changed:
                self._save(ledger)

    # -- reading -----------------------------------------------------------------------------------
    def snapshot(self) -> dict[str, Any]:
        """The ledger as it is now (dead processes' entries already left out)."""
        with self._locked():
            return self._load()

    # -- sessions ----------------------------------------------------------------------------------
    def join_session(self, session_id: str) -> None:
        """Register a session, whose peak of admitted memory is tracked from now on."""
        pid, start = _identity()
        with self._locked():
            ledger = self._load()
            total = sum(e["bytes"] for e in ledger["entries"])
            ledger["sessions"][session_id] = {"pid": pid, "start": start, "peak_bytes": total}
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
        pid, start = _identity()
        me = {"id": uuid.uuid4().hex, "pid": pid, "start": start, "bytes": share, "label": label}
        started = time.monotonic()
        try:
            while True:
                with self._locked():
                    ledger, changed = self._read()
                    self._refuse(ledger, share, world_size, label)
                    before = json.dumps(ledger)
                    ticket = self._try_admit(ledger, me, world_size, time.monotonic() - started)
                    if changed or json.dumps(ledger) != before:  # else nothing to write
                        self._save(ledger)
                if ticket is not None:
                    return dataclasses.replace(ticket, marker=_marker(ticket.id, pid, start, self.folder))
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
        launches = sum(e["bytes"] for e in ledger["entries"] if e.get(STANDING) is not True)
        first = ledger["waiting"][0]["id"] == me["id"]
        # A launch that fits the runner alone runs when no other launch holds memory, even where
        # standing charges (warm parents, which never leave while the session runs) leave too
        # little room beside them: it would otherwise wait for ever.
        fits = total + me["bytes"] <= ledger["limit_bytes"] or (
            launches == 0 and me["bytes"] <= ledger["limit_bytes"]
        )
        if not first or not fits:
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

    def charge(self, pid: int, size: int, label: str) -> Ticket:
        """Count ``size`` bytes that the running process ``pid`` holds (a warm parent), at once: it
        runs already, so it is never queued, and the launches after it wait for room instead. Its
        entry names that process, so it leaves the ledger at `release` or when the process ends."""
        pid, start = _identity(pid)
        me = {"id": uuid.uuid4().hex, "pid": pid, "start": start, "bytes": size, "cores": 0, "label": label}
        me[STANDING] = True
        with self._locked():
            ledger, _changed = self._read()
            ledger["entries"].append({**me, "since": time.time()})
            total = sum(e["bytes"] for e in ledger["entries"])
            ledger["peak_bytes"] = max(int(ledger.get("peak_bytes") or 0), total)
            for session in ledger["sessions"].values():
                session["peak_bytes"] = max(int(session.get("peak_bytes") or 0), total)
            self._save(ledger)
        return Ticket(me["id"], size, 0, 0, 0.0, total)

    def release(self, ticket: Ticket) -> None:
        """The launch ended: its share is free again. A release that cannot be written (a full disk)
        never holds the share: it leaves the ticket's released-file, which every reader honours,
        this process leaves the ticket out from now on, and retries the write in the background
        until one succeeds; nothing is raised."""
        global _retry_thread
        try:
            with self._locked():
                ledger = self._load()
                ledger["entries"] = [e for e in ledger["entries"] if e["id"] != ticket.id]
                self._save(ledger)
            return
        except (OSError, ValueError):  # WriteRefused (a full disk), a lock that stayed taken
            pass
        with contextlib.suppress(OSError), self.files.open_new(RELEASED_PREFIX + ticket.id):
            pass  # empty: made where no byte can be written; already there is as good
        with _unreleased_lock:
            _unreleased.setdefault(str(self.folder), set()).add(ticket.id)
            _unreleased_ledgers[str(self.folder)] = self
            if _retry_thread is None:
                _retry_thread = threading.Thread(
                    target=_retry_releases, name="kit-admission-release", daemon=True
                )
                _retry_thread.start()


def session_ledger(environ: Mapping[str, str] | None = None) -> Ledger | None:
    """The ledger this process' launches go through (``KIT_ADMISSION_DIR``), None when admission is
    off or no session made one (a plain script calling run_ranks)."""
    environ = os.environ if environ is None else environ
    folder = environ.get(LEDGER_ENV, "").strip()
    if not folder or not enabled(environ) or not Path(folder, LEDGER_FILE).is_file():
        return None
    return Ledger(folder)
