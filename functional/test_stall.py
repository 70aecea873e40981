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
