"""The kit's folders under ``--kit-report DIR``: only its own finished session folders are removed."""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

import pytest

from megatron_testkit.report_dir import MARKER, SessionLogs, remove_finished

pytestmark = pytest.mark.L0


def test_only_finished_folders_the_kit_marked_are_removed(tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    finished, live, users = logs / "session-old", logs / "session-live", logs / "users-own"
    for folder in (finished, live, users):
        folder.mkdir(parents=True)
        (folder / "rank0.log").write_text("x")
    (finished / MARKER).write_text("")
    (live / MARKER).write_text("")
    (logs / "notes.txt").write_text("a user's file")
    (logs / "link").symlink_to(finished)
    with open(live / MARKER) as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # its session is still running
        assert remove_finished(logs) == [finished]
    assert not finished.exists()
    assert (live / "rank0.log").exists() and (users / "rank0.log").exists()
    assert (logs / "notes.txt").read_text() == "a user's file"


def test_a_session_folder_is_locked_until_closed_then_removable(tmp_path: Path) -> None:
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "mine.log").write_text("kept")
    session = SessionLogs(tmp_path)
    assert session.path.parent == tmp_path / "logs" and str(os.getpid()) in session.path.name
    assert remove_finished(tmp_path / "logs") == []  # locked by this session
    session.close()
    assert remove_finished(tmp_path / "logs") == [session.path]
    assert (tmp_path / "logs" / "mine.log").read_text() == "kept"


def test_a_folder_whose_marker_is_a_link_is_never_removed(tmp_path: Path) -> None:
    """A link named like the kit's marker (dangling or to a lockable file) is not the kit's marker."""
    logs = tmp_path / "logs"
    users, dangling = logs / "users-own", logs / "dangling"
    for folder in (users, dangling):
        folder.mkdir(parents=True)
        (folder / "work.txt").write_text("keep")
    (tmp_path / "a-file").write_text("")
    (users / MARKER).symlink_to(tmp_path / "a-file")
    (dangling / MARKER).symlink_to(tmp_path / "missing")
    assert remove_finished(logs) == []
    assert (users / "work.txt").read_text() == "keep" and (dangling / "work.txt").read_text() == "keep"
