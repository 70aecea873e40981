"""A preload whose import starts a thread, end to end in a session of its own: dropped from the
warm preload set, the warm parent rebuilt without it, and the session header saying so once.

L1: it imports torch into two warm parents one after the other (the L0 test in test_warm_start.py
proves the rebuild itself within one process).
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from fixtures.inner_session import run_inner_session

pytestmark = pytest.mark.L1

# A session whose preload set holds a module that starts a thread at import: its first launches
# start cold, the parent is rebuilt without the module, and the session says so once.
DROPPING = textwrap.dedent(
    """
    import sys

    from megatron_testkit import warm_start
    from megatron_testkit.ranks import run_ranks


    def loaded(rank, world_size):
        return "kit_starts_a_thread" in sys.modules


    def test_launches():
        warm_start.parent_for(warm_start.preload_set())  # the parent that runs the module's thread
        run_ranks(loaded, 1, timeout=120)  # refused: cold, and the parent is rebuilt without it
        warm_start.parent_for(warm_start.preload_set())  # the rebuilt parent is up
        assert run_ranks(loaded, 1, timeout=120) == [False]
        assert run_ranks(loaded, 1, timeout=120) == [False]
    """
)


def test_a_dropped_preload_is_said_once_in_the_session_header_and_later_launches_are_warm(
    tmp_path: Path,
) -> None:
    (tmp_path / "kit_starts_a_thread.py").write_text(
        "import threading, time\nthreading.Thread(target=time.sleep, args=(3600,), daemon=True).start()\n"
    )
    result = run_inner_session(
        tmp_path, "test_dropping.py", DROPPING, env={"KIT_WARM_PRELOAD": "kit_starts_a_thread"}
    )
    assert result["rc"] == 0, result["output"][-3000:]
    (row,) = result["rows"].values()
    modes = [launch["start_mode"] for launch in row["launches"]]
    assert modes == ["cold", "warm", "warm"], row["launches"]
    assert "kit_starts_a_thread started 1 OS thread at import" in row["launches"][0]["start_reason"]
    (line,) = result["report"]["session"]["warm_preload_dropped"]
    assert line.startswith("kit_starts_a_thread was dropped from the warm preload set")
    assert result["output"].count("warm start: kit_starts_a_thread was dropped") == 1, result["output"]
    assert result["report"]["version"] == 5
