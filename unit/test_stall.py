"""megatron_testkit.stall: the deadlock rule on rank positions, and the NCCL flight recorder's view.

The detector is a pure function of positions over time, so every case of the rule is shown here
without spawning; functional/test_stall.py proves it on real gloo ranks.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megatron_testkit import flight_recorder, heartbeat, stall
from megatron_testkit.stall import Position, StallDetector

pytestmark = pytest.mark.L0

WINDOW = 10.0


def at(inside: str | None, seq: int, group_seq: int | None = None, work: float = 1.0) -> Position:
    return Position(inside, seq, seq if group_seq is None else group_seq, True, work)


def watch(positions: dict[int, list[tuple[float, Position]]]) -> StallDetector:
    detector = StallDetector(WINDOW)
    for rank, seen in positions.items():
        for now, position in seen:
            detector.observe(now, rank, position)
    return detector


def test_every_rank_blocked_in_a_collective_past_the_window_is_a_deadlock_naming_the_laggard() -> None:
    # Rank 1 waits in a receive nobody sends (one of the group's collectives so far); rank 0 in
    # the group's barrier #2: rank 1 is the one behind in the group's sequence.
    detector = watch(
        {
            0: [(0.0, at("barrier #2", 2)), (11.0, at("barrier #2", 2))],
            1: [(0.0, at("recv #2", 2, 1)), (11.0, at("recv #2", 2, 1))],
        }
    )
    assert detector.verdict(5.0, [0, 1]) is None  # within the window: nothing yet
    verdict = detector.verdict(11.0, [0, 1])
    assert verdict is not None and verdict.rank == 1
    assert "no progress for 10 s (the stall window); rank 1 is in recv #2" in verdict.why
    assert verdict.lines == (
        "rank 0: in barrier #2 for 11.0 s, CPU +0.00 s; 2 collectives entered, 2 of them the group's",
        "rank 1: in recv #2 for 11.0 s, CPU +0.00 s; 2 collectives entered, 1 of them the group's",
    )


def test_a_rank_computing_or_sleeping_outside_any_collective_is_never_judged() -> None:
    # Rank 1 sleeps (no CPU) in user code for 100 windows while rank 0 waits for it.
    detector = watch(
        {
            0: [(0.0, at("all_reduce #1", 1)), (1000.0, at("all_reduce #1", 1))],
            1: [(0.0, at(None, 0, work=1.0)), (1000.0, at(None, 0, work=1.0))],
        }
    )
    assert detector.stalled(1000.0, 0)
    assert detector.verdict(1000.0, [0, 1]) is None


def test_cpu_progress_inside_a_collective_restarts_the_window() -> None:
    # Both inside one all_reduce, but rank 1 uses CPU (moving a large buffer): not stalled.
    detector = StallDetector(WINDOW)
    for now in range(0, 31, 5):
        detector.observe(float(now), 0, at("all_reduce #3", 3, work=1.0))
        detector.observe(float(now), 1, at("all_reduce #3", 3, work=1.0 + now))
    assert detector.stalled(30.0, 0) and not detector.stalled(30.0, 1)
    assert detector.verdict(30.0, [0, 1]) is None
    # The progress threshold: MIN_CPU_S plus CPU_SHARE of the window, no less.
    assert detector.min_work == pytest.approx(stall.MIN_CPU_S + stall.CPU_SHARE * WINDOW)


def test_a_new_collective_restarts_the_window() -> None:
    detector = StallDetector(WINDOW)
    detector.observe(0.0, 0, at("barrier #1", 1))
    detector.observe(9.0, 0, at("barrier #2", 2))
    assert not detector.stalled(15.0, 0) and detector.stalled(19.0, 0)


def test_waiting_while_a_peer_is_stalled_in_a_different_collective_is_blocked() -> None:
    # Rank 1 has only just entered its broadcast (it still has CPU time to show), but rank 0 has
    # been stalled in an all_reduce for the whole window: rank 1 can never complete its op.
    detector = watch(
        {
            0: [(0.0, at("all_reduce #4", 4)), (12.0, at("all_reduce #4", 4))],
            1: [(11.0, at("broadcast #4", 4, 3)), (12.0, at("broadcast #4", 4, 3))],
        }
    )
    assert not detector.stalled(12.0, 1)
    verdict = detector.verdict(12.0, [0, 1])
    assert verdict is not None and verdict.rank == 1


def test_a_rank_just_entering_the_same_collective_is_not_blocked_yet() -> None:
    # Rank 1 arrives late in the barrier rank 0 stalls in: that barrier may now complete.
    detector = watch(
        {0: [(0.0, at("barrier #2", 2)), (12.0, at("barrier #2", 2))], 1: [(11.5, at("barrier #2", 2))]}
    )
    assert detector.verdict(12.0, [0, 1]) is None


def test_waiting_while_a_peer_has_exited_is_blocked() -> None:
    detector = watch(
        {
            0: [(0.0, at("all_reduce #2", 2))],
            1: [(0.0, at("all_reduce #2", 2))],
            2: [(9.0, at("barrier #3", 3))],
        }
    )
    detector.rank_exited(0)
    verdict = detector.verdict(10.0, [1, 2])
    assert verdict is not None
    assert verdict.lines[-1] == "rank 0: exited"


def test_a_rank_without_a_position_yet_holds_the_verdict_back() -> None:
    detector = watch({0: [(0.0, at("barrier #1", 1))]})
    assert detector.verdict(100.0, [0, 1]) is None


@pytest.mark.parametrize(
    ("raw", "window"),
    [("", stall.DEFAULT_WINDOW_S), ("5", 5.0), (" 12.5 ", 12.5), ("off", None), ("OFF", None)],
)
def test_the_window_is_kit_stall_window_else_30_s(raw: str, window: float | None) -> None:
    assert stall.DEFAULT_WINDOW_S <= 30  # the bound on the default
    assert stall.default_window({stall.WINDOW_ENV: raw}) == window


@pytest.mark.parametrize("raw", ["0", "-1", "nan", "inf", "soon"])
def test_a_bad_window_is_one_line_naming_the_variable(raw: str) -> None:
    with pytest.raises(ValueError) as excinfo:
        stall.default_window({stall.WINDOW_ENV: raw})
    assert str(excinfo.value) == (
        f"KIT_STALL_WINDOW={raw!r}: expected a finite number of seconds above 0 (e.g. 30) or 'off'"
    )


def _dump(path: Path, states: list[str]) -> None:
    entries = [
        {
            "pg_id": 0,
            "process_group": ["0", "default_pg"],
            "collective_seq_id": i + 1,
            "p2p_seq_id": 0,
            "is_p2p": False,
            "profiling_name": "nccl:all_reduce",
            "state": state,
            "input_sizes": [[4]],
        }
        for i, state in enumerate(states)
    ]
    path.write_text(json.dumps({"version": "2.4", "entries": entries, "pg_status": {}}))


def test_on_nccl_the_flight_recorder_gives_the_position_and_the_progress(tmp_path: Path) -> None:
    # The JSON form of a dump (PyTorch's _dump_fr_trace_json), as NCCL's monitor thread writes it.
    stem = tmp_path / flight_recorder.DUMP_STEM
    _dump(flight_recorder.dump_path(stem, 0), ["completed", "completed", "started"])
    _dump(flight_recorder.dump_path(stem, 1), ["completed", "completed"])
    positions = stall.nccl_positions(stem, [0, 1, 2])
    assert set(positions) == {0, 1}  # rank 2 left no dump: judged by the host view
    # The op is named as the call that makes it; the waits are the wait-for graph's input.
    assert positions[0] == Position("all_reduce #3", 3, 3, True, 2.0, positions[0].waits)
    assert positions[0].waits is not None and positions[0].waits.main is not None
    assert (positions[0].waits.main.op, positions[0].waits.main.seq) == ("all_reduce", 3)
    assert positions[1] == Position(None, 2, 2, True, 2.0, positions[1].waits)
    assert positions[1].waits is not None and positions[1].waits.main is None
    # A rank whose op stays started with no op completing, window after window, is stalled.
    detector = StallDetector(WINDOW, min_work=0.5)
    detector.observe(0.0, 0, positions[0])
    detector.observe(11.0, 0, positions[0])
    assert detector.stalled(11.0, 0)


@pytest.mark.parametrize(("raw", "every"), [("", 15.0), ("2", 2.0), (" 0.5 ", 0.5), ("0", None)])
def test_kit_heartbeat_is_the_interval_and_0_turns_it_off(raw: str, every: float | None) -> None:
    assert heartbeat.interval({heartbeat.HEARTBEAT_ENV: raw}) == every


@pytest.mark.parametrize("raw", ["-1", "soon", "inf", "nan"])
def test_a_bad_kit_heartbeat_is_one_line_naming_it(raw: str) -> None:
    with pytest.raises(ValueError) as excinfo:
        heartbeat.interval({heartbeat.HEARTBEAT_ENV: raw})
    assert str(excinfo.value) == (
        f"KIT_HEARTBEAT={raw!r}: expected seconds between progress lines (e.g. 15), or 0 for none"
    )


def test_ranks_are_named_in_runs() -> None:
    assert heartbeat.ranks_text([2]) == "rank 2"
    assert heartbeat.ranks_text([1, 0]) == "ranks 0-1"
    assert heartbeat.ranks_text([0, 2, 3, 5]) == "ranks 0, 2-3, 5"
