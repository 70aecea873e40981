"""The kit's folders under ``--kit-report DIR``: one marked, locked folder of rank logs per session.

``DIR`` may be shared: a user's own ``--kit-report .`` holds their ``logs/``, and two sessions
(two CI steps, two terminals) may write to one ``DIR`` at once. So each session keeps its launch
folders in ``DIR/logs/<session>/``, created by the kit with a marker file that the session holds
locked (``flock``) while it runs. Only folders with the marker whose lock is free (their session
has ended) are ever removed; anything else under ``DIR/logs`` is left alone.
"""

from __future__ import annotations

import datetime
import fcntl
import os
import shutil
from pathlib import Path
from typing import IO

MARKER = ".megatron-testkit-session"


class SessionLogs:
    """This session's log folder, locked for as long as the session runs (`close` releases it)."""

    def __init__(self, report_dir: Path) -> None:
        logs = report_dir / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        remove_finished(logs)
        stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
        self.path = logs / f"session-{stamp}-{os.getpid()}"
        self.path.mkdir()
        self._lock: IO[str] | None = open(self.path / MARKER, "w")  # noqa: SIM115 (held until close)
        fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        self._lock.write(f"rank logs of the pytest session with pid {os.getpid()}\n")
        self._lock.flush()

    def close(self) -> None:
        """Release the lock: the folder is kept for people and artifacts, removable by a later session."""
        if self._lock is not None:
            self._lock.close()
            self._lock = None


def remove_finished(logs: Path) -> list[Path]:
    """Remove the kit's session folders under ``logs`` whose session has ended; return them.

    A folder without the kit's marker is not the kit's (a user's own ``logs/`` content, or a
    folder of another tool): it stays. A folder whose marker is locked belongs to a live session.
    """
    removed: list[Path] = []
    try:
        children = sorted(logs.iterdir())
    except OSError:
        return removed
    for child in children:
        marker = child / MARKER
        if child.is_symlink() or not marker.is_file():
            continue
        try:
            with open(marker) as f:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                shutil.rmtree(child, ignore_errors=True)
                removed.append(child)
        except OSError:
            continue  # locked: its session is still running
    return removed
