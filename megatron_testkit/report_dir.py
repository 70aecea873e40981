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
import stat
from pathlib import Path
from typing import IO

from megatron_testkit.safe_write import Folder

MARKER = ".megatron-testkit-session"
LOGS = "logs"


def in_report_folder(path: str | os.PathLike[str], log_root: str | os.PathLike[str] | None) -> str | None:
    """``path`` relative to the ``--kit-report`` folder whose session log folder is ``log_root``
    (``DIR/logs/<session>``), e.g. ``logs/session-.../t.py-test_x``; None when ``log_root`` is not
    such a folder or ``path`` lies outside ``DIR``. A downloaded artifact of ``DIR`` resolves it."""
    if not log_root:
        return None
    root = Path(log_root)
    if root.parent.name != LOGS:
        return None
    try:
        return Path(path).relative_to(root.parent.parent).as_posix()
    except ValueError:
        return None


class SessionLogs:
    """This session's log folder, locked for as long as the session runs (`close` releases it).

    Made through the kit's writer (`megatron_testkit.safe_write`): ``DIR`` is resolved once, and
    ``logs/`` and the session's folder below it are never reached through a link. A ``DIR`` that
    is a file, or that cannot be written, is a `WriteRefused` in one line naming it.
    """

    def __init__(self, report_dir: Path) -> None:
        self.folder = Folder(report_dir, what="--kit-report folder")
        logs = self.folder.make_dir(LOGS)
        remove_finished(logs)
        stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
        self.path = self.folder.make_unique_dir(f"{LOGS}/session-{stamp}-{os.getpid()}")
        name = self.path.name
        self._lock: IO[bytes] | None = self.folder.open_new(f"{LOGS}/{name}/{MARKER}")
        fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        self._lock.write(f"rank logs of the pytest session with pid {os.getpid()}\n".encode())
        self._lock.flush()

    def close(self) -> None:
        """Release the lock: the folder is kept for people and artifacts, removable by a later session."""
        if self._lock is not None:
            self._lock.close()
            self._lock = None


def remove_finished(logs: Path) -> list[Path]:
    """Remove the kit's session folders under ``logs`` whose session has ended; return them.

    A folder without the kit's marker is not the kit's (a user's own ``logs/`` content, or a
    folder of another tool): it stays, and so does one whose marker is a link (the kit's marker
    is a regular file it made: a link there, dangling or not, is someone else's). A folder whose
    marker is locked belongs to a live session.
    """
    removed: list[Path] = []
    try:
        children = sorted(logs.iterdir())
    except OSError:
        return removed
    for child in children:
        marker = child / MARKER
        try:
            if child.is_symlink() or not stat.S_ISREG(os.lstat(marker).st_mode):
                continue
            fd = os.open(marker, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0))
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            shutil.rmtree(child, ignore_errors=True)
            removed.append(child)
        except OSError:
            continue  # locked: its session is still running
        finally:
            os.close(fd)
    return removed
