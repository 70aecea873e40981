"""Processes a library keeps for the life of the process that started them: not a test's leak.

megatron-core's asynchronous checkpoint writer (``dist_checkpointing.strategies``) starts a
``multiprocessing`` Manager for its results queue, and a persistent writer process, once per
process, held by module globals and never shut down before the process ends. A spawned rank ends
with ``os._exit`` (no atexit, so the Manager outlives it); under torchrun the rank is the pytest
process and the Manager lives as long as it. The leak guard must not call either a test's leak.

Which processes are a library's is declared by the ini option ``kit_library_helpers`` (one entry
a line; default `DEFAULT`):

- ``module:PREFIX``: a ``multiprocessing`` process started by code of a module whose name starts
  with PREFIX (the innermost caller of ``Process.start`` outside multiprocessing and this kit:
  a Manager started by the test's own code stays the test's, whatever library it imports);
- ``command:TEXT``: a process whose command line contains TEXT.

In a spawned rank, `track` notes each such process as it starts (``rank<N>.helpers`` in the
launch's folder, one JSON line each); the launcher ends them with the rank and leaves them out of
``leaked_processes``, and the test gets one `LibraryHelperWarning` per library (pytest shows it
once in its warnings summary). Under torchrun the plugin's leak guard leaves them to the process.
"""

from __future__ import annotations

import contextlib
import json
import sys
import threading
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from accounting.json_input import JsonInputError, parse_json, read_regular_file

__all__ = ["DEFAULT", "LibraryHelperWarning", "declared", "parse", "read_helpers", "set_declared", "track"]

DEFAULT = ("module:megatron.core.dist_checkpointing",)
_KINDS = ("module", "command")
_MAX_ENTRIES = 64
_MAX_FILE_BYTES = 1 << 16  # a rank's helpers file, read as untrusted input


class LibraryHelperWarning(UserWarning):
    """A library kept a helper process for the rank's life; it ended with the rank, not counted as a leak."""


def parse(lines: Iterable[str]) -> tuple[tuple[str, str], ...]:
    """``kit_library_helpers`` entries as (kind, text); ValueError naming a bad one."""
    out = []
    for raw in lines:
        line = str(raw).strip()
        if not line or line.startswith("#"):
            continue
        kind, sep, text = line.partition(":")
        if not sep or kind.strip() not in _KINDS or not text.strip():
            raise ValueError(
                f"kit_library_helpers entry {line!r}: expected 'module:PREFIX' or 'command:TEXT'"
            )
        out.append((kind.strip(), text.strip()))
    if len(out) > _MAX_ENTRIES:
        raise ValueError(f"kit_library_helpers: {len(out)} entries, at most {_MAX_ENTRIES}")
    return tuple(out)


_DECLARED: tuple[tuple[str, str], ...] = parse(DEFAULT)


def set_declared(entries: tuple[tuple[str, str], ...]) -> tuple[tuple[str, str], ...]:
    """The session's entries (the plugin sets them from the ini); returns the previous ones."""
    global _DECLARED
    previous, _DECLARED = _DECLARED, entries
    return previous


def declared() -> tuple[tuple[str, str], ...]:
    return _DECLARED


# -- in the process that starts them ---------------------------------------------------------------
_STARTED: dict[int, str] = {}  # pid -> "module (description)", this process' library helpers
_LOCK = threading.Lock()
_INSTALLED = False
_SKIP = ("multiprocessing.", "megatron_testkit.library_helpers", "concurrent.futures.")


def started() -> dict[int, str]:
    """The library helpers this process started (pid -> which library, what)."""
    with _LOCK:
        return dict(_STARTED)


def _starter(frame: Any) -> str | None:
    """The module of the innermost caller outside multiprocessing and this module."""
    while frame is not None:
        name = frame.f_globals.get("__name__", "")
        if isinstance(name, str) and not name.startswith(_SKIP) and name != "multiprocessing":
            return name
        frame = frame.f_back
    return None


def track(entries: tuple[tuple[str, str], ...], out: Path | None = None) -> None:
    """Note each ``multiprocessing`` process started by a declared module (and, with ``out``, append
    it to that file for the launcher). Once per process; a no-op without ``module:`` entries."""
    global _INSTALLED
    prefixes = tuple(text for kind, text in entries if kind == "module")
    if _INSTALLED or not prefixes:
        return
    from multiprocessing.process import BaseProcess

    original = BaseProcess.start

    def start(self: Any) -> None:
        original(self)
        module = _starter(sys._getframe(1))
        if module is None or not module.startswith(prefixes) or self.pid is None:
            return
        what = f"{module} ({type(self).__name__} {self.name})"
        with _LOCK:
            _STARTED[self.pid] = what
        if out is not None:
            with contextlib.suppress(OSError), open(out, "a") as f:
                f.write(json.dumps({"pid": self.pid, "by": what[:300]}) + "\n")

    BaseProcess.start = start  # type: ignore[method-assign]
    _INSTALLED = True


# -- in the launcher --------------------------------------------------------------------------------
def read_helpers(run_dir: Path, world_size: int) -> dict[int, str]:
    """The library helpers the launch's ranks noted (pid -> what), read as untrusted lines."""
    out: dict[int, str] = {}
    for rank in range(world_size):
        path = run_dir / f"rank{rank}.helpers"
        try:  # the bounded reader: a FIFO or device is refused before a byte is read
            raw = read_regular_file(path, _MAX_FILE_BYTES, "library helpers file")
        except (OSError, JsonInputError):
            continue  # none noted (or refused): its processes count as the test's, as without this file
        for number, line in enumerate(raw.decode(errors="replace").splitlines(), 1):
            with contextlib.suppress(JsonInputError):
                item = parse_json(line, where=f"{path} line {number}")
                if not isinstance(item, dict):
                    continue
                pid, by = item.get("pid"), item.get("by")
                if isinstance(pid, int) and not isinstance(pid, bool) and pid > 1 and isinstance(by, str):
                    out[pid] = f"rank {rank}: {by[:300]}"
    return out


class Kept:
    """`proctree.kill_tree`'s question, "not the test's leak?", for one launch: a pid the ranks noted,
    a declared ``command:``, or multiprocessing's own infrastructure; ``seen`` lists the library
    helpers it said yes to."""

    def __init__(self, noted: dict[int, str]) -> None:
        self.noted = noted
        self.seen: list[str] = []

    def __call__(self, proc: Any) -> bool:
        from megatron_testkit.proctree import is_infrastructure

        if is_infrastructure(proc):
            # multiprocessing's resource_tracker, started for a Manager: ended with the rank, and
            # no more a leak in a rank than in the pytest process (`proctree.leaked_children`).
            return True
        what = self.noted.get(proc.pid)
        if what is None and any(kind == "command" for kind, _ in _DECLARED):
            try:
                cmdline = " ".join(proc.cmdline())
            except Exception:  # gone, or not ours to read
                return False
            what = cmdline[:300] if matches_command(cmdline, _DECLARED) else None
        if what is not None:
            self.seen.append(what)
        return what is not None


def matches_command(cmdline: str, entries: tuple[tuple[str, str], ...]) -> bool:
    """Whether a process' command line is a declared ``command:`` helper."""
    return any(kind == "command" and text in cmdline for kind, text in entries)


def warn(helpers: Iterable[str]) -> None:
    """One `LibraryHelperWarning` per library (pytest shows each once in its summary)."""
    import warnings

    libraries = sorted({what.split(": ", 1)[-1].split(" (", 1)[0] for what in helpers})
    for library in libraries:
        warnings.warn(
            LibraryHelperWarning(
                f"{library} keeps a helper process for the rank's life: ended with its rank, not counted "
                "as leaked (kit_library_helpers)"
            ),
            stacklevel=3,
        )


def spec_entries() -> list[list[str]]:
    """The session's entries for a rank's spec (JSON)."""
    return [list(entry) for entry in _DECLARED]


def entries_from_spec(value: Any) -> tuple[tuple[str, str], ...]:
    """A spec's entries back (anything malformed is dropped)."""
    out = []
    for item in value if isinstance(value, list) else []:
        if isinstance(item, list) and len(item) == 2 and item[0] in _KINDS and isinstance(item[1], str):
            out.append((item[0], item[1]))
    return tuple(out)
