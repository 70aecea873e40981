"""megatron_testkit.heartbeat: a progress line starts on a line of its own, and says how long it queued.

functional/test_heartbeat.py proves both in a real pytest session; here the pieces, with pytest's
own terminal writer.
"""

from __future__ import annotations

import io
import os

import pytest
from _pytest._io import TerminalWriter

from megatron_testkit import heartbeat

pytestmark = pytest.mark.L0


@pytest.fixture
def terminal(monkeypatch: pytest.MonkeyPatch):
    """The heartbeat's terminal descriptor replaced by a pipe this test reads; its settings restored."""
    read, write = os.pipe()
    monkeypatch.setattr(heartbeat, "_terminal_fd", write)
    saved = heartbeat.followed_terminal()
    yield lambda: os.read(read, 4096).decode()
    heartbeat.follow_terminal(saved[0], column_unknown=saved[1])
    os.close(read)
    os.close(write)


def test_a_line_written_after_pytests_dots_starts_on_a_new_line(terminal) -> None:
    writer = TerminalWriter(io.StringIO())
    writer.write("unit/test_x.py ..")
    heartbeat.follow_terminal(lambda: writer)
    heartbeat.write_line("test_x: 2 ranks, 12 s: ranks 0-1 computing")
    assert terminal() == "\ntest_x: 2 ranks, 12 s: ranks 0-1 computing\n"
    # pytest's next dot starts the new line, and its width counts from there.
    assert writer.width_of_current_line == 0
    heartbeat.write_line("test_x: 2 ranks, 27 s: ranks 0-1 computing")
    assert terminal() == "test_x: 2 ranks, 27 s: ranks 0-1 computing\n"  # at a line's start: no blank line


def test_an_xdist_worker_cannot_see_the_controllers_line_and_always_starts_a_new_one(terminal) -> None:
    heartbeat.follow_terminal(None, column_unknown=True)
    heartbeat.write_line("test_x: 2 ranks, 12 s: starting")
    assert terminal() == "\ntest_x: 2 ranks, 12 s: starting\n"


@pytest.mark.parametrize(
    ("elapsed", "queued", "expected"),
    [
        (40.0, 0.0, "test_x: 3 ranks, 40 s: ranks 0-2 computing"),
        (40.0, 0.4, "test_x: 3 ranks, 40 s: ranks 0-2 computing"),  # a free ledger's milliseconds
        (52.0, 12.0, "test_x: 3 ranks, 52 s (queued 12 s, running 40 s): ranks 0-2 computing"),
        (20.0, 20.0, "test_x: 3 ranks, 20 s (queued 20 s): ranks 0-2 computing"),  # still queued
    ],
)
def test_the_seconds_count_from_the_launchs_start_and_say_how_many_were_queued(
    elapsed: float, queued: float, expected: str
) -> None:
    beat = heartbeat.Heartbeat("test_x", 3, lambda: "ranks 0-2 computing", 15.0, lambda: queued)
    assert beat.line(elapsed) == expected
