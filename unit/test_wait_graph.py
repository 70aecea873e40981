"""megatron_testkit.wait_graph: the deadlock rule on who waits for whom, without spawning.

functional/test_stall.py proves the same on real gloo ranks (the state lines written by
`megatron_testkit.waits`); here each case of the rule is built from the waits directly.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from megatron_testkit import stall, wait_graph
from megatron_testkit.stall import Position, StallDetector
from megatron_testkit.wait_graph import RankWaits, Wait

pytestmark = pytest.mark.L0

PAIRS = {"g01": (0, 1), "g12": (1, 2), "g02": (0, 2), "world": (0, 1, 2)}


def in_collective(
    group: str, seq: int, entered: dict[str, int], *, op: str = "all_reduce", **kw
) -> RankWaits:
    wait = Wait(op, "collective", group, seq, None, op, True, "MainThread")
    return RankWaits(threads=(wait,), groups=PAIRS, entered=entered, **kw)


def outside(entered: dict[str, int]) -> RankWaits:
    return RankWaits(groups=PAIRS, entered=entered)


def judge(views: dict[int, RankWaits], blocked: set[int], exited: set[int] = frozenset()):
    live = [r for r in views if r not in exited]
    return wait_graph.judge(5.0, live, blocked, views, exited, {r: None for r in live})


def test_three_ranks_on_three_pair_groups_are_a_symmetric_cycle() -> None:
    views = {
        0: in_collective("g01", 1, {"g01": 1}),
        1: in_collective("g12", 1, {"g12": 1}),
        2: in_collective("g02", 1, {"g02": 1}),
    }
    verdict = judge(views, {0, 1, 2})
    assert verdict is not None and verdict.rank == 0 and verdict.cycle == (0, 1, 2, 0)
    assert "the cycle is symmetric" in verdict.why and "rank 0 -> rank 1 -> rank 2 -> rank 0" in verdict.why
    assert verdict.waits == (
        "rank 0 waits in all_reduce #1 of group [0, 1] for rank 1",
        "rank 1 waits in all_reduce #1 of group [1, 2] for rank 2",
        "rank 2 waits in all_reduce #1 of group [0, 2] for rank 0",
    )


def test_a_rank_waiting_for_a_rank_that_runs_is_never_in_a_deadlock() -> None:
    # Ranks 0 and 1 are blocked in the world's all_reduce #1; rank 2 has not entered it and runs
    # (computes, or sleeps in user code): it may still come. Blocked for any time, no verdict.
    views = {
        0: in_collective("world", 1, {"world": 1}),
        1: in_collective("world", 1, {"world": 1}),
        2: outside({}),
    }
    assert judge(views, {0, 1}) is None


def test_a_group_whose_sequence_is_not_known_on_every_member_is_judged_without_it() -> None:
    # The same pair cycle, but rank 1 counted collectives on {1, 2} the wrappers never saw
    # (torch's own sequence number differs from its count): no cycle is named through that group,
    # and without it nothing is certain.
    views = {
        0: in_collective("g01", 1, {"g01": 1}),
        1: in_collective("g12", 1, {"g12": 1}, inexact=frozenset({"g12"})),
        2: in_collective("g02", 1, {"g02": 1}),
    }
    assert judge(views, {0, 1, 2}) is None


def test_a_wait_on_a_rank_that_exited_names_it() -> None:
    views = {
        0: in_collective("world", 2, {"world": 2}),
        1: in_collective("world", 2, {"world": 2}),
        2: outside({"world": 1}),  # its last known state: one world collective entered
    }
    verdict = judge(views, {0, 1}, exited={2})
    assert verdict is not None and verdict.rank == 2
    assert "rank 2 exited while ranks 0, 1 wait for it" in verdict.why
    assert verdict.waits[0] == "rank 0 waits in all_reduce #2 of group [0, 1, 2] for rank 2 (exited)"


def test_the_rank_most_others_wait_for_is_named_and_knock_ons_say_so() -> None:
    # Ranks 0-1 in the world's all_reduce; rank 2 in a barrier of {1, 2}.
    views = {
        0: in_collective("world", 1, {"world": 1}),
        1: in_collective("world", 1, {"world": 1}),
        2: in_collective("g12", 1, {"g12": 1}, op="barrier"),
    }
    verdict = judge(views, {0, 1, 2})
    assert verdict is not None and verdict.rank == 2 and verdict.cycle == (2, 1, 2)
    assert (
        "symmetric" not in verdict.why
        and "(2 of them in a group collective it has not entered)" in verdict.why
    )
    assert verdict.waits == (
        "rank 0 waits in all_reduce #1 of group [0, 1, 2] for rank 2 (knock-on)",
        "rank 1 waits in all_reduce #1 of group [0, 1, 2] for rank 2",
        "rank 2 waits in barrier #1 of group [1, 2] for rank 1",
    )


def test_a_receive_waits_for_its_sender_until_the_matching_send_is_entered() -> None:
    pair = {"world": (0, 1)}
    barrier = Wait("barrier", "collective", "world", 3, None, "barrier", True, "MainThread")
    recv = Wait("recv", "recv", "world", 2, 0, "recv", True, "MainThread")
    # Rank 0 sent rank 1 one message and waits in the world's barrier #3, which rank 1 (two
    # entered) has not reached: rank 1 waits in its second receive from rank 0.
    views = {
        0: RankWaits((barrier,), pair, {"world": 3}, sent={1: 1}),
        1: RankWaits((recv,), pair, {"world": 2}),
    }
    verdict = wait_graph.judge(5.0, [0, 1], {0, 1}, views, set(), {0: "barrier #4", 1: "recv #3"})
    # Rank 1 is the one elsewhere: rank 0 waits for it in a group collective it has not entered.
    assert verdict is not None and verdict.rank == 1 and verdict.cycle == (1, 0, 1)
    assert verdict.waits == (
        "rank 0 waits in barrier #3 of group [0, 1] for rank 1",
        "rank 1 waits in recv #2 from rank 0 for rank 0",
    )
    assert "rank 1 is in recv #3 (of all its collectives; recv #2 from rank 0)" in verdict.why
    # Once rank 0 entered its second send, the receive is no longer waiting for it.
    views[0] = RankWaits((barrier,), pair, {"world": 3}, sent={1: 2})
    assert wait_graph.judge(5.0, [0, 1], {0, 1}, views, set(), {}) is None


def test_members_at_one_number_in_different_collectives_are_a_mismatch() -> None:
    views = {
        0: in_collective("g01", 3, {"g01": 3}),
        1: in_collective("g01", 3, {"g01": 3}, op="broadcast"),
    }
    verdict = judge(views, {0, 1})
    assert verdict is not None and verdict.mismatch and verdict.rank == 0
    assert verdict.why.startswith(
        "collective mismatch: rank 0 is in all_reduce #3 of group [0, 1] while rank 1 is in broadcast #3 of group [0, 1]"
    )


def test_an_async_ops_wait_is_the_same_collective_as_the_blocking_call() -> None:
    # Rank 0 waits on the Work of its async all_reduce #2; rank 1 is in a blocking all_reduce #2
    # and rank 2 has not come: no mismatch, and no deadlock while rank 2 runs.
    waiting = Wait(
        "wait on all_reduce", "collective", "world", 2, None, "wait on all_reduce", True, "MainThread"
    )
    views = {
        0: RankWaits((waiting,), PAIRS, {"world": 2}),
        1: in_collective("world", 2, {"world": 2}),
        2: outside({"world": 1}),
    }
    assert judge(views, {0, 1}) is None


def test_a_state_line_is_read_as_untrusted_input() -> None:
    state = {
        "waits": [
            {"op": "all_reduce", "kind": "collective", "group": "g", "seq": 1, "main": True},
            {"op": "x", "kind": "teleport", "seq": 1},  # an unknown kind: dropped
            {"op": "y", "kind": "recv", "seq": -4},  # a negative number: dropped
            "not a wait",
        ],
        "groups": {"g": [0, 1], "bad": [0, "one"]},
        "entered": {"g": 1, "h": True},
        "sent": {"1": 2, "x": 3},
    }
    waits = wait_graph.parse_waits(state)
    assert waits is not None and len(waits.threads) == 1 and waits.main is not None
    assert waits.groups == {"g": (0, 1)} and waits.entered == {"g": 1} and waits.sent == {1: 2}
    assert wait_graph.parse_waits({"seq": 3}) is None  # no waits: the per-rank rule's view
    assert wait_graph.parse_waits({"overflow": 2_000_000}).overflow


def test_a_long_state_line_grows_instead_of_being_cut(tmp_path: Path) -> None:
    # Many groups (megatron-core makes dozens): far beyond the first 512 bytes, read back whole.
    groups = {str(i): list(range(64)) for i in range(40)}
    fd = os.open(tmp_path / "rank0.state", os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        fields = {"inside": "all_reduce #1", "seq": 1, "ready": True, "waits": [], "groups": groups}
        size = stall.write_state(fd, fields)
        assert size > stall.STATE_LINE_BYTES and size % stall.STATE_LINE_BYTES == 0
        position = stall.read_position(tmp_path, 0, os.getpid())
        assert position is not None and position.waits is not None and len(position.waits.groups) == 40
        # A shorter state later is padded to the grown size: no tail of the longer one is left.
        assert stall.write_state(fd, {"inside": None, "seq": 2, "ready": True, "waits": []}, size) == size
        position = stall.read_position(tmp_path, 0, os.getpid())
        assert position is not None and position.seq == 2 and position.waits == RankWaits()
        # Over the maximum: a short line that says so, never a cut one.
        huge = {**fields, "groups": {str(i): list(range(1000)) for i in range(400)}}
        stall.write_state(fd, huge, size)
        position = stall.read_position(tmp_path, 0, os.getpid())
        assert position is not None and position.waits is not None and position.waits.overflow
    finally:
        os.close(fd)


def test_a_state_line_read_mid_rewrite_keeps_the_last_position() -> None:
    waits = in_collective("world", 1, {"world": 1})
    detector = StallDetector(5.0)
    detector.observe(0.0, 0, Position("all_reduce #1", 1, 1, True, 1.0, waits))
    detector.observe(3.0, 0, None)  # unreadable this poll
    assert detector.stalled(6.0, 0)


def test_two_groups_over_the_same_ranks_are_told_apart_by_name() -> None:
    """Each rank all-reducing on its own `new_group([0, 1])`: both waits read `all_reduce #1 of group
    [0, 1]`, an impossible-looking deadlock, until the group's name says they are two groups."""
    groups = {"5": (0, 1), "6": (0, 1), "0": (0, 1)}
    views = {
        0: RankWaits(
            threads=(Wait("all_reduce", "collective", "5", 1, None, "all_reduce", True, "MainThread"),),
            groups=groups,
            entered={"5": 1},
        ),
        1: RankWaits(
            threads=(Wait("all_reduce", "collective", "6", 1, None, "all_reduce", True, "MainThread"),),
            groups=groups,
            entered={"6": 1},
        ),
    }
    verdict = judge(views, {0, 1})
    assert verdict is not None and verdict.cycle in ((0, 1, 0), (1, 0, 1))
    assert verdict.waits == (
        "rank 0 waits in all_reduce #1 of group [0, 1] (group name '5') for rank 1",
        "rank 1 waits in all_reduce #1 of group [0, 1] (group name '6') for rank 0",
    )
    # One group over those ranks: no name, as before.
    assert wait_graph.describe(views[0].threads[0], {"5": (0, 1)}) == "all_reduce #1 of group [0, 1]"


def _with_tensors(op: str, sizes, dtypes) -> RankWaits:
    wait = Wait(op, "collective", "g01", 2, None, op, True, "MainThread", sizes, dtypes)
    return RankWaits(threads=(wait,), groups=PAIRS, entered={"g01": 2})


def test_members_at_one_number_of_one_collective_with_different_sizes_are_a_mismatch() -> None:
    views = {
        0: _with_tensors("all_reduce", ((4,),), ("float32",)),
        1: _with_tensors("all_reduce", ((8,),), ("float32",)),
    }
    verdict = judge(views, {0, 1})
    assert verdict is not None and verdict.mismatch and verdict.rank == 0
    assert verdict.why == (
        "collective mismatch: rank 0 is in all_reduce #2 of group [0, 1] with float32 [4] while rank 1 is in "
        "all_reduce #2 of group [0, 1] with float32 [8]: members of one group at the same collective of it "
        "passed tensors of different sizes; both blocked with no progress for the stall window"
    )
    assert verdict.waits == (
        "rank 0 is in all_reduce #2 of group [0, 1] with float32 [4]",
        "rank 1 is in all_reduce #2 of group [0, 1] with float32 [8]",
    )


def test_different_dtypes_are_a_mismatch_and_unknown_or_free_tensors_are_not() -> None:
    views = {
        0: _with_tensors("broadcast", ((4,),), ("float32",)),
        1: _with_tensors("broadcast", ((4,),), ("bfloat16",)),
    }
    verdict = judge(views, {0, 1})
    assert verdict is not None and "passed tensors of different dtypes" in verdict.why
    assert "rank 1 is in broadcast #2 of group [0, 1] with bfloat16 [4]" in verdict.why
    # One side's tensors unknown (a wrapper that saw no tensor argument): nothing to compare.
    views[1] = _with_tensors("broadcast", None, None)
    assert judge(views, {0, 1}) is None
    # all_to_all's splits may differ by design: no mismatch from its sizes.
    views = {
        0: _with_tensors("all_to_all_single", ((4,),), ("float32",)),
        1: _with_tensors("all_to_all_single", ((6,),), ("float32",)),
    }
    assert judge(views, {0, 1}) is None


def test_a_state_lines_tensors_are_read_bounded() -> None:
    state = {
        "waits": [
            {
                "op": "all_reduce",
                "kind": "collective",
                "group": "g",
                "seq": 1,
                "main": True,
                "sizes": [[2, 3]],
                "dtypes": ["float32"],
            }
        ]
    }
    waits = wait_graph.parse_waits(state)
    assert waits is not None and waits.main is not None
    assert (waits.main.sizes, waits.main.dtypes) == (((2, 3),), ("float32",))
    state["waits"][0].update(sizes=[[2, "x"]], dtypes=[3])
    waits = wait_graph.parse_waits(state)
    assert (
        waits is not None and waits.main is not None and (waits.main.sizes, waits.main.dtypes) == (None, None)
    )


def test_the_wrappers_note_a_same_tensor_collectives_sizes_and_dtype(tmp_path: Path) -> None:
    """A real one-rank gloo group: the tracker reads the tensor argument, by position or keyword."""
    import torch
    import torch.distributed as dist

    from megatron_testkit.waits import WaitTracker

    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        tracker = WaitTracker()
        frame = tracker.enter("all_reduce", dist.all_reduce, (torch.ones(2, 3),), {})
        assert frame.as_wait()["sizes"] == [[2, 3]] and frame.as_wait()["dtypes"] == ["float32"]
        tracker.leave(frame)
        frame = tracker.enter(
            "broadcast", dist.broadcast, (), {"tensor": torch.zeros(5, dtype=torch.int64), "src": 0}
        )
        assert (frame.as_wait()["sizes"], frame.as_wait()["dtypes"]) == ([[5]], ["int64"])
        tracker.leave(frame)
        frame = tracker.enter("all_gather_object", dist.all_gather_object, ([None], {"a": 1}), {})
        assert "sizes" not in frame.as_wait()  # no tensor all members pass alike
        tracker.leave(frame)
    finally:
        dist.destroy_process_group()
