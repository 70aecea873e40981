"""The failure report's verdict rules (`megatron_testkit.diagnosis`), on hand-built rank records.

The real faults are caused in functional/test_launcher.py; here each rule is pinned down on its
own, including orders of events that are hard to provoke on purpose.
"""

from __future__ import annotations

import pytest

from megatron_testkit.diagnosis import Evidence, RankRecord, judge, root_cause, signal_name

pytestmark = pytest.mark.L0

CLOSED = "[gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:1234"


def failed(
    rank: int, t: float | None, exc_type: str | None = None, message: str = "", **kw: object
) -> RankRecord:
    return RankRecord(rank=rank, status="failed", time=t, exc_type=exc_type, exc_message=message, **kw)


def test_a_knock_on_error_is_never_the_root_cause_even_when_it_came_first() -> None:
    # The survivor noticed the dead peer before the parent saw the peer's exit.
    survivor = failed(0, 10.0, "RuntimeError", CLOSED)
    dead = failed(1, 10.4, signal="SIGKILL")
    root = root_cause([survivor, dead])
    assert (root.rank, root.kind) == (1, "crash")
    assert survivor.knock_on and survivor.kind == "error"


def test_the_earliest_real_failure_wins() -> None:
    records = [
        failed(0, 5.0, "ValueError", "late"),
        failed(1, 4.0, "KeyError", "early"),
        failed(2, 3.0, "RuntimeError", CLOSED),
    ]
    assert root_cause(records).rank == 1


def test_only_knock_ons_still_name_the_earliest() -> None:
    records = [
        failed(0, 5.0, "RuntimeError", CLOSED),
        failed(1, 4.0, "RuntimeError", "Connection reset by peer"),
    ]
    assert (root_cause(records).rank, root_cause(records).kind) == (1, "error")


@pytest.mark.parametrize(
    ("exc_type", "message", "hint", "kind"),
    [
        ("torch.OutOfMemoryError", "CUDA out of memory. Tried to allocate 2.00 GiB", None, "oom"),
        ("MemoryError", "", None, "oom"),
        (
            "RuntimeError",
            "DefaultCPUAllocator: can't allocate memory: you tried to allocate 8 bytes",
            None,
            "oom",
        ),
        ("megatron_testkit.MemoryBudgetExceeded", "host memory budget exceeded", "oom", "oom"),
        ("ValueError", "bad shard", None, "error"),
        ("RuntimeError", "Timed out waiting 10000ms for recv operation to complete", None, "hang"),
        (None, "", None, "crash"),
    ],
)
def test_each_failure_maps_to_its_kind(
    exc_type: str | None, message: str, hint: str | None, kind: str
) -> None:
    record = failed(0, 1.0, exc_type, message, kind_hint=hint, exit_code=None if exc_type else 3)
    assert root_cause([record]).kind == kind


def test_a_collective_timeout_blames_the_rank_that_entered_the_fewest_collectives() -> None:
    waiting = failed(0, 9.0, "RuntimeError", "Timed out waiting 10000ms for recv", collective_seq=5)
    behind = RankRecord(rank=1, status="torn_down", collective_seq=4, last_collective="broadcast #4")
    root = root_cause([waiting, behind])
    assert (root.rank, root.kind) == (1, "hang")
    message = str(judge([waiting, behind], Evidence(timeout=60)))
    assert message.splitlines()[0] == (
        "rank 1 hang: a collective timed out on rank 0; rank 1 entered the fewest collectives "
        "(4, last broadcast #4); stacks of every rank below"
    )


def test_a_timeout_with_no_failure_names_the_laggard_and_shows_every_stack() -> None:
    records = [
        RankRecord(rank=0, status="hung", collective_seq=3, stack='File "a.py", line 1 in wait_here'),
        RankRecord(rank=1, status="hung", collective_seq=2, stack='File "a.py", line 9 in stuck_here'),
    ]
    root = root_cause(records)
    assert (root.rank, root.kind) == (1, "hang")
    message = str(judge(records, Evidence(timeout=30)))
    assert message.startswith("rank 1 hang: no rank finished within 30 s")
    assert "stuck_here" in message and "wait_here" in message


def test_every_rank_succeeding_has_no_root_cause() -> None:
    assert root_cause([RankRecord(rank=0, status="ok"), RankRecord(rank=1, status="ok")]) is None


def test_the_message_leads_with_the_root_cause_and_then_shows_the_others() -> None:
    root = failed(
        1, 2.0, "torch.OutOfMemoryError", "CUDA out of memory", traceback="Traceback...\nOOM here\n"
    )
    other = failed(0, 2.1, "RuntimeError", CLOSED, last_collective="all_reduce #3")
    root.log_tail, other.log_tail = "allocating", "waiting"
    records = [other, root]
    assert root_cause(records) is root
    lines = str(judge(records, Evidence(shown_logs="/logs/x", started=0.0))).splitlines()
    assert lines[0] == "rank 1 oom: torch.OutOfMemoryError: CUDA out of memory"
    assert lines[2] == "Root cause: rank 1 (oom) at +2.00 s"
    text = "\n".join(lines)
    assert "rank 0: error (knock-on: a peer went away)" in text
    assert "last collective entered: all_reduce #3" in text
    assert text.index("[rank1] allocating") < text.index("[rank0] waiting")
    assert "Rank logs: /logs/x" in text


def test_signal_names() -> None:
    assert signal_name(-9) == "SIGKILL"
    assert signal_name(-11) == "SIGSEGV"
    assert signal_name(1) is None
    assert signal_name(None) is None


def test_a_rank_aborted_by_the_nccl_watchdog_is_a_hang_not_a_crash() -> None:
    # NCCL's watchdog cannot be triggered on a CPU runner: the record is built from the log line
    # ProcessGroupNCCL prints before it aborts the process.
    tail = "[rank0]:[E ProcessGroupNCCL.cpp:632] [Rank 0] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=7, OpType=ALLREDUCE)"
    aborted = failed(0, 30.0, signal="SIGABRT", collective_seq=7, log_tail=tail)
    behind = failed(1, 30.1, signal="SIGABRT", collective_seq=6, log_tail=tail.replace("Rank 0", "Rank 1"))
    root = root_cause([aborted, behind])
    assert (root.rank, root.kind) == (1, "hang")


def test_an_oom_before_the_watchdog_fires_is_the_root_cause() -> None:
    # The seed's story: one rank's OOM made the others wait until NCCL's watchdog fired.
    oom = failed(1, 12.0, "torch.OutOfMemoryError", "CUDA out of memory. Tried to allocate 3.00 GiB")
    watchdog = failed(0, 40.0, signal="SIGABRT", log_tail="Watchdog caught collective operation timeout")
    root = root_cause([watchdog, oom])
    assert (root.rank, root.kind) == (1, "oom")


def test_the_kits_own_frames_are_left_out_of_the_stacks_a_failure_shows() -> None:
    from megatron_testkit.diagnosis import without_kit_frames

    traceback = (
        "Traceback (most recent call last):\n"
        '  File "/p/test_x.py", line 31, in body\n'
        "    dist.barrier()\n"
        '  File "/site/megatron_testkit/collectives.py", line 150, in counted\n'
        "    result = original(*args, **kwargs)\n"
        "             ^^^^^^^^^^^^^^^^^^^^^^^^^\n"
        '  File "/site/torch/distributed/distributed_c10d.py", line 5356, in barrier\n'
        "    work.wait()\n"
        '  File "/site/megatron_testkit/stall.py", line 110, in wait\n'
        "    return original(self, *args, **kwargs)\n"
        "RuntimeError: timed out"
    )
    assert without_kit_frames(traceback) == (
        "Traceback (most recent call last):\n"
        '  File "/p/test_x.py", line 31, in body\n'
        "    dist.barrier()\n"
        '  File "/site/torch/distributed/distributed_c10d.py", line 5356, in barrier\n'
        "    work.wait()\n"
        "RuntimeError: timed out"
    )
    stack = (
        "Current thread 0x01 (most recent call first):\n"
        '  File "/site/megatron_testkit/stall.py", line 110 in wait\n'
        '  File "/site/torch/distributed/distributed_c10d.py", line 3252 in all_reduce\n'
        '  File "/site/megatron_testkit/collectives.py", line 150 in counted\n'
        '  File "/p/test_x.py", line 8 in body'
    )
    assert without_kit_frames(stack) == (
        "Current thread 0x01 (most recent call first):\n"
        '  File "/site/torch/distributed/distributed_c10d.py", line 3252 in all_reduce\n'
        '  File "/p/test_x.py", line 8 in body'
    )
