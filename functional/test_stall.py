"""Deadlocks named within the stall window on real gloo ranks, and what the stall rule leaves alone.

Under `run_ranks`' default timeout (300 s) a deadlock is a ``hang`` as soon as every live rank
has been blocked in a collective for the stall window (the ``stall_window`` marker here), with
every rank's stack and collective counts; ranks that compute, or sleep outside any collective,
for longer than the window are left to finish.
"""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

from megatron_testkit import attribution
from megatron_testkit.ranks import DEFAULT_TIMEOUT, RankFailure, run_ranks

pytestmark = pytest.mark.L0

WINDOW = 4.0


def deadlock(rank: int, world_size: int) -> None:
    """Rank 1 waits for a message rank 0 never sends; rank 0 waits for rank 1 in the barrier."""
    t = torch.ones(1)
    dist.all_reduce(t)
    if rank == 1:
        dist.recv(t, src=0)
    dist.barrier()


def async_deadlock(rank: int, world_size: int) -> None:
    """The same through an async op: rank 0 blocks in ``work.wait()`` of an all_reduce rank 1 never joins."""
    t = torch.ones(1)
    if rank == 0:
        dist.all_reduce(t, async_op=True).wait()
    else:
        dist.recv(t, src=0)


def busy_then_asleep(rank: int, world_size: int, seconds: float) -> float:
    """Rank 0 computes, then sleeps, each longer than the window, while rank 1 waits in the all_reduce."""
    if rank == 0:
        end, n = time.monotonic() + seconds, 0
        while time.monotonic() < end:
            n = (n * 31 + 7) % 1000003
        time.sleep(seconds)
    t = torch.ones(1)
    dist.all_reduce(t)
    return t.item()


@pytest.mark.world_size(2)
@pytest.mark.stall_window(WINDOW)
@pytest.mark.parametrize(("body", "blocked_in"), [(deadlock, "recv #2"), (async_deadlock, "recv #1")])
def test_a_deadlock_under_the_default_timeout_is_a_hang_within_the_stall_window(body, blocked_in) -> None:
    with pytest.raises(RankFailure) as excinfo:
        run_ranks(body, 2)  # the default timeout: 300 s
    failure = excinfo.value
    assert (failure.rank, failure.kind) == (1, "hang")
    message = str(failure)
    assert message.startswith(
        f"rank 1 hang: deadlock: every live rank blocked in a collective with no progress for {WINDOW:g} s "
        f"(the stall window); rank 1 is in {blocked_in}"
    )
    # Where every rank was, with its collective counts, and both ranks' stacks.
    assert "rank 0: in " in message and f"rank 1: in {blocked_in} for " in message
    assert message.count(" collectives entered, ") == 2
    assert message.count(f" in {body.__name__}") >= 2
    # Named by the stall rule, not a timeout: the launch ended before its process group's
    # timeout (240 s for the default 300 s) could have fired, and it says no rank timed out.
    run = attribution.current().runs[-1]
    assert run.duration_s < 0.8 * DEFAULT_TIMEOUT
    assert "timed out" not in message.splitlines()[0]


@pytest.mark.world_size(2)
@pytest.mark.stall_window(WINDOW)
def test_ranks_that_compute_or_sleep_outside_collectives_past_the_window_pass() -> None:
    assert run_ranks(busy_then_asleep, 2, args=(1.5 * WINDOW,)) == [2.0, 2.0]


# ---- the wait-for graph: what is never a hang, and deadlocks named with their cycle ----------------
def _spin(seconds: float) -> int:
    """Use a core for ``seconds`` (a rank that computes)."""
    end, n = time.monotonic() + seconds, 0
    while time.monotonic() < end:
        n = (n * 31 + 7) % 1000003
    return n


def pipeline_bubble(rank: int, world_size: int, seconds: float) -> float:
    """Ranks 0-1 are a TP pair (stage 0), rank 2 stage 1: it waits in ``recv`` while the pair
    computes for ``seconds``, then all-reduces on its own group (back to back, as a layer's
    forward does) and rank 1 sends."""
    tp = dist.new_group([0, 1])
    t = torch.zeros(1 << 20)
    if rank == 2:
        dist.recv(t, src=1)
        return t[0].item()
    _spin(seconds)
    for _ in range(20):  # the pair inside its own collectives while stage 1 waits
        t.fill_(1.0)
        dist.all_reduce(t, group=tp)
    if rank == 1:
        dist.send(t, dst=2)
    return t[0].item()


class SlowToPickle:
    """An object whose pickling computes for ``seconds`` (a large object's pickle, inside the collective)."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def __reduce__(self) -> tuple[object, tuple[int]]:
        _spin(self.seconds)
        return (int, (7,))


def slow_all_gather_object(rank: int, world_size: int, seconds: float) -> list[object]:
    """Ranks 1-2 first reduce on a side group (their histories differ from rank 0's), then every
    rank gathers an object; rank 0's takes ``seconds`` to pickle."""
    side = dist.new_group([1, 2])
    if rank in (1, 2):
        dist.all_reduce(torch.ones(1), group=side)
    out: list[object] = [None] * world_size
    dist.all_gather_object(out, SlowToPickle(seconds) if rank == 0 else rank)
    return out


def background_collective(rank: int, world_size: int, seconds: float) -> float:
    """Rank 0's background thread waits in a side group's all_reduce while its main thread sleeps
    in user code; rank 1 waits for rank 0 in the world's barrier, then joins the side all_reduce."""
    import threading

    side = dist.new_group([0, 1])
    t = torch.ones(1)
    if rank == 0:
        worker = threading.Thread(target=dist.all_reduce, args=(t,), kwargs={"group": side})
        worker.start()
        time.sleep(seconds)
        dist.barrier()
        worker.join()
    else:
        dist.barrier()
        dist.all_reduce(t, group=side)
    return t.item()


@pytest.mark.world_size(3)
@pytest.mark.stall_window(WINDOW)
@pytest.mark.parametrize(
    ("body", "expected"),
    [
        (pipeline_bubble, [2.0, 2.0, 2.0]),
        (slow_all_gather_object, [[7, 1, 2]] * 3),
    ],
    ids=["pipeline-bubble", "pickling-in-all_gather_object"],
)
def test_a_rank_computing_longer_than_the_window_is_no_deadlock_whoever_waits_for_it(body, expected) -> None:
    # The others are blocked longer than the window, but each waits (through its group, or its
    # sender) for a rank that uses CPU: the graph has no cycle, and the launch passes.
    assert run_ranks(body, 3, args=(1.5 * WINDOW,)) == expected


@pytest.mark.world_size(2)
@pytest.mark.stall_window(WINDOW)
def test_a_background_thread_in_a_collective_while_the_main_thread_sleeps_is_no_deadlock() -> None:
    # Blocked means the main thread in a collective: rank 0's runs user code (sleeps).
    assert run_ranks(background_collective, 2, args=(1.5 * WINDOW,)) == [2.0, 2.0]


def pair_cycle(rank: int, world_size: int) -> None:
    """Each rank all-reduces on a different pair group: 0 on {0, 1}, 1 on {1, 2}, 2 on {0, 2}
    (the group passed by position: the wrappers bind arguments by the function's signature)."""
    groups = [dist.new_group([0, 1]), dist.new_group([1, 2]), dist.new_group([0, 2])]
    dist.all_reduce(torch.ones(1), dist.ReduceOp.SUM, groups[rank])


def world_against_side_barrier(rank: int, world_size: int) -> None:
    """Ranks 0-1 all-reduce on the world while rank 2 waits in a barrier of {1, 2}."""
    side = dist.new_group([1, 2])
    if rank == 2:
        dist.barrier(group=side)
    else:
        dist.all_reduce(torch.ones(1))


def _deadlock_message(body) -> tuple[RankFailure, str]:
    with pytest.raises(RankFailure) as excinfo:
        run_ranks(body, 3)
    failure = excinfo.value
    assert failure.kind == "hang"
    # Named within the window plus set-up, long before the process group's timeout.
    assert attribution.current().runs[-1].duration_s < 0.8 * DEFAULT_TIMEOUT
    return failure, str(failure)


@pytest.mark.world_size(3)
@pytest.mark.stall_window(WINDOW)
def test_three_ranks_on_three_pair_groups_are_a_symmetric_cycle() -> None:
    _, message = _deadlock_message(pair_cycle)
    first = message.splitlines()[0]
    assert first.startswith("rank 0 hang: deadlock: every live rank blocked in a collective")
    # Nobody is behind: the verdict says so instead of picking a rank by its counts.
    assert "the cycle is symmetric" in first and "rank 0 -> rank 1 -> rank 2 -> rank 0" in first
    assert "fewest" not in message
    for line in (
        "rank 0 waits in all_reduce #1 of group [0, 1] for rank 1",
        "rank 1 waits in all_reduce #1 of group [1, 2] for rank 2",
        "rank 2 waits in all_reduce #1 of group [0, 2] for rank 0",
    ):
        assert f"\n    {line}\n" in message


@pytest.mark.world_size(3)
@pytest.mark.stall_window(WINDOW)
def test_a_world_all_reduce_against_a_side_barrier_names_the_rank_the_others_wait_for() -> None:
    failure, message = _deadlock_message(world_against_side_barrier)
    assert failure.rank == 2
    first = message.splitlines()[0]
    assert "rank 2 is in barrier #1 " in first and "rank 2 -> rank 1 -> rank 2" in first
    assert "symmetric" not in first
    for line in (
        "rank 0 waits in all_reduce #1 of group [0, 1, 2] for rank 2 (knock-on)",
        "rank 1 waits in all_reduce #1 of group [0, 1, 2] for rank 2",
        "rank 2 waits in barrier #1 of group [1, 2] for rank 1",
    ):
        assert f"\n    {line}\n" in message


def mismatched(rank: int, world_size: int) -> None:
    """Rank 0 all-reduces where rank 1 broadcasts: one group, the same #1, different collectives."""
    t = torch.ones(4)
    if rank == 0:
        dist.all_reduce(t)
    else:
        dist.broadcast(t, src=0)


@pytest.mark.world_size(2)
@pytest.mark.stall_window(WINDOW)
def test_members_of_a_group_in_different_collectives_at_one_number_are_a_collective_mismatch() -> None:
    with pytest.raises(RankFailure) as excinfo:
        run_ranks(mismatched, 2)
    assert (excinfo.value.rank, excinfo.value.kind) == (0, "hang")
    assert str(excinfo.value).startswith(
        "rank 0 hang: collective mismatch: rank 0 is in all_reduce #1 of group [0, 1] while rank 1 is in "
        "broadcast #1 of group [0, 1]"
    )
