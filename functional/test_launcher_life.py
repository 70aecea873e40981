"""The launcher in real CI life, in this process: arguments, results, daemons, worker memory.

Each test makes the real thing happen (a double-forked daemon, a rank that closes its own stderr,
a worker process holding memory) through `run_ranks` and asserts what the launch reports. The
session-level cases (signals, shared report folders, bad environment) are in
`functional/test_launcher_session_life.py`.
"""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from fixtures.inner_session import inner_env, run_inner_session
from megatron_testkit import attribution
from megatron_testkit.budgets import MemoryBudget, parse_size
from megatron_testkit.ranks import RankFailure, run_ranks

pytestmark = pytest.mark.L0


def returns_rank(rank: int, world_size: int) -> int:
    return rank


@pytest.fixture
def scratch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty folder where this test's launches make their directories (and nothing else)."""
    root = tmp_path / "launches"
    root.mkdir()
    monkeypatch.setattr(attribution, "_scratch_root", str(root))
    context = attribution.current()
    assert context is not None
    monkeypatch.setattr(context, "log_root", None)  # not the outer session's --kit-report folder
    return root


@pytest.mark.parametrize("timeout", [float("nan"), float("inf"), 0, -5.0, "30"])
def test_a_timeout_that_is_not_finite_and_positive_is_refused_before_anything_is_made(
    timeout: Any, scratch: Path
) -> None:
    # NaN disabled hang detection, inf overflowed in every rank, 0 and below read as an instant
    # hang, a string failed deep inside: each is the caller's mistake, said before any spawn.
    with pytest.raises((ValueError, TypeError), match="timeout must be"):
        run_ranks(returns_rank, 1, timeout=timeout)
    assert list(scratch.iterdir()) == []


@pytest.mark.parametrize("world_size", [2.0, "2", True])
def test_a_world_size_that_is_not_an_int_is_refused_before_anything_is_made(
    world_size: Any, scratch: Path
) -> None:
    with pytest.raises(TypeError, match="world_size must be a positive int"):
        run_ranks(returns_rank, world_size, timeout=60)
    assert list(scratch.iterdir()) == []


def raise_after_closing_output(rank: int, world_size: int) -> None:
    os.close(1)
    os.close(2)
    raise ValueError("raised after stdout and stderr were closed")


def test_an_exception_raised_after_closing_stderr_is_recorded_not_a_crash() -> None:
    with pytest.raises(RankFailure) as info:
        run_ranks(raise_after_closing_output, 1, timeout=120)
    assert (info.value.rank, info.value.kind) == (0, "error")
    assert (
        str(info.value).splitlines()[0]
        == "rank 0 error: ValueError: raised after stdout and stderr were closed"
    )


_FAST_CHUNK = 64 * 2**20
_WATCHDOG_INTERVAL_S = 0.02  # rank_worker's default
_SWITCH_INTERVAL_S = 0.005  # CPython's default: how long a thread waits before it asks for the GIL


def grow_as_fast_as_it_can(rank: int, world_size: int) -> int:
    """64 MiB bytearrays back to back: each holds the GIL through its whole memset."""
    held = [bytearray(_FAST_CHUNK) for _ in range(24)]  # 1.5 GiB, three times the budget
    return len(held)


def _chunk_time_s() -> float:
    """The fastest of a few 64 MiB allocations here (fresh pages each: the free unmaps them)."""
    times = []
    for _ in range(4):
        start = time.perf_counter()
        chunk = bytearray(_FAST_CHUNK)
        times.append(time.perf_counter() - start)
        del chunk
    return min(times)


def test_a_rank_past_its_host_budget_is_stopped_within_a_few_chunks_of_it() -> None:
    """The overshoot a runner must absorb is the watchdog's interval, no more. Before, its /proc
    reads and its record's writing each released the GIL, and each release let the function
    allocate another chunk: on a 512 MiB budget a rank was seen at 1.2-1.5 GiB, or seen at
    538 MiB and exited at 1.1-1.9 GiB (the runner death the budget is there to prevent)."""
    budget = parse_size("512MiB")
    assert budget is not None
    chunk_s = _chunk_time_s()
    with pytest.raises(RankFailure) as info:
        run_ranks(grow_as_fast_as_it_can, 1, timeout=120, budget=MemoryBudget(host_bytes=budget))
    assert (info.value.rank, info.value.kind) == (0, "oom"), str(info.value)
    seen = re.search(r"host memory budget exceeded: RSS (\S+ \S+) > budget", str(info.value))
    assert seen is not None, str(info.value)
    detected = parse_size(seen.group(1))
    assert detected is not None and detected > budget
    (record,) = info.value.records
    assert record.peak_host_bytes is not None
    # Seen: the chunk that crossed the budget, the chunks the function allocates while the
    # watchdog sleeps its interval and then waits the switch interval for the GIL (at the
    # fastest chunk time measured here; a rank allocates no faster), and the chunk in flight
    # when it asks. 32 MiB for the rounding of the message's figure and the interpreter's own.
    during_the_wait = math.ceil((_WATCHDOG_INTERVAL_S + _SWITCH_INTERVAL_S) / chunk_s)
    assert detected <= budget + (2 + during_the_wait) * _FAST_CHUNK + 32 * 2**20, (detected, chunk_s)
    # Stopped: the watchdog parks the main thread before it releases the GIL again; the main
    # thread finishes the chunk it is in (one), one more if the GIL changed hands between the
    # reading and the trip (two); 32 MiB for writing the record (the JSON, the stack's text).
    assert record.peak_host_bytes <= detected + 2 * _FAST_CHUNK + 32 * 2**20, (
        record.peak_host_bytes,
        detected,
    )
    # The record's stack is the test's function, not the frames that parked it.
    assert "grow_as_fast_as_it_can" in (record.traceback or ""), record.traceback
    assert "_park" not in (record.traceback or ""), record.traceback


def _refuse_outside_a_rank() -> str:
    if "KIT_RANK_SPEC" not in os.environ:
        raise RuntimeError("this result only unpickles inside a rank")
    return "unpickled"


class OnlyInARank:
    """A result whose unpickling fails in the parent (as a class the parent cannot import would)."""

    def __reduce__(self) -> tuple[Any, ...]:
        return (_refuse_outside_a_rank, ())


def returns_unreadable(rank: int, world_size: int) -> Any:
    return OnlyInARank() if rank == 1 else rank


def test_a_result_that_fails_to_unpickle_names_its_rank_and_the_launch_is_recorded() -> None:
    context = attribution.current()
    assert context is not None
    before = len(context.runs)
    with pytest.raises(RankFailure) as info:
        run_ranks(returns_unreadable, 2, timeout=120)
    assert info.value.rank == 1
    first = str(info.value).splitlines()[0]
    assert first.startswith("rank 1 error: RuntimeError: rank 1 finished but its result could not be read"), (
        first
    )
    assert "this result only unpickles inside a rank" in first
    assert len(context.runs) == before + 1
    assert context.runs[-1].failure is not None and context.runs[-1].failure.rank == 1


# Scenarios that leave processes behind on purpose (a daemon, a worker orphaned by its rank's
# budget stop): they run in an inner session, so the leaks they count are in its report, not in
# this session's (whose tests must end with leaked_processes 0).
LEAVING = textwrap.dedent(
    '''
    import os, subprocess, sys, time
    from pathlib import Path

    from megatron_testkit.budgets import MemoryBudget
    from megatron_testkit.ranks import run_ranks

    # A daemon as a rank's library might start one: fork, new session, fork again, the middle
    # exits, so the daemon is re-parented away from the rank and out of its process group.
    DAEMON = """if True:
        import os, sys, time
        path = sys.argv[1]
        if os.fork() == 0:
            os.setsid()
            if os.fork() == 0:
                with open(path + ".tmp", "w") as f:
                    f.write(str(os.getpid()))
                os.replace(path + ".tmp", path)
                time.sleep(300)
            os._exit(0)
        os.wait()
    """


    def start_daemon(rank, world_size, path):
        subprocess.run(
            [sys.executable, "-c", DAEMON, path],
            check=True,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        while not os.path.exists(path):
            time.sleep(0.01)
        return int(Path(path).read_text())


    # A worker process (a DataLoader worker, a pool) that holds memory for its rank.
    HOLDER = "import sys, time; b = b'x' * (int(sys.argv[1]) * 2**20); print('ready', flush=True); time.sleep(60)"


    def worker_holds(rank, world_size, mib, holder_rank):
        if rank != holder_rank:
            return 0
        child = subprocess.Popen([sys.executable, "-c", HOLDER, str(mib)], stdout=subprocess.PIPE, text=True)
        try:
            assert child.stdout.readline().strip() == "ready"
            time.sleep(1.0)  # 50 samples of the rank's watchdog (every 20 ms), 20 of the launcher's
            return child.pid
        finally:
            child.kill()
            child.wait()


    def test_daemon():
        run_ranks(start_daemon, 1, timeout=120, args=(os.path.abspath("daemon.pid"),))


    def test_worker_memory_against_the_budget():
        # 800 MiB held by the worker alone is over the 600 MiB budget, whatever the rank itself
        # holds (an idle rank with torch is ~300 MiB, under the budget on its own).
        run_ranks(worker_holds, 1, timeout=120, args=(800, 0), budget=MemoryBudget.parse(host="600MiB"))


    def test_worker_memory_against_the_runner(monkeypatch):
        # Two idle ranks hold ~600 MiB together, under the 1200 MiB runner limit; rank 1's worker
        # adds 1000 MiB, which the runner's kernel charges to the job as the ranks' own.
        monkeypatch.setenv("KIT_HOST_MEMORY", "1200MiB")
        monkeypatch.delenv("KIT_RANK_CGROUP", raising=False)
        run_ranks(worker_holds, 2, timeout=120, args=(1000, 1))


    # The same daemon, started with an empty environment (`env -i`): it carries no launch marker,
    # left the rank's process group and session, and its parent exited. Holding `mib` MiB.
    BARE_DAEMON = DAEMON.replace("time.sleep(300)", "hold = b'x' * (int(sys.argv[2]) << 20); time.sleep(300)")


    def start_bare_daemon(rank, world_size, path, mib):
        subprocess.run(
            [sys.executable, "-c", BARE_DAEMON, path, str(mib)],
            env={},
            check=True,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        while not os.path.exists(path):
            time.sleep(0.01)
        pid = int(Path(path).read_text())
        # Until the daemon holds its `mib` (on a loaded machine 800 MiB took longer than a fixed
        # 1 s to touch), then 50 samples of the rank's watchdog (every 20 ms).
        deadline = time.monotonic() + 60
        while mib and time.monotonic() < deadline:
            with open(f"/proc/{pid}/statm") as f:
                if int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") >= mib << 20:
                    break
            time.sleep(0.01)
        time.sleep(1.0)
        return pid


    def test_bare_daemon():
        run_ranks(start_bare_daemon, 1, timeout=120, args=(os.path.abspath("bare.pid"), 0))


    def test_bare_daemon_memory_against_the_budget():
        # 800 MiB held by the daemon alone is over the 600 MiB budget (an idle rank is ~300 MiB).
        args = (os.path.abspath("bare-big.pid"), 800)
        run_ranks(start_bare_daemon, 1, timeout=120, args=args, budget=MemoryBudget.parse(host="600MiB"))


    def flood(rank, world_size, mib):
        chunk = b"x" * (1 << 20)
        for _ in range(mib):
            sys.stdout.buffer.write(chunk)
        sys.stdout.buffer.write(b"\\nLAST LINE\\n")
        sys.stdout.flush()


    def test_floods_its_log(monkeypatch):
        monkeypatch.setenv("KIT_RANK_LOG_BYTES", "1MiB")
        run_ranks(flood, 1, timeout=120, args=(64,))


    def forge_record(rank, world_size):
        import json
        spec = json.load(open(os.environ["KIT_RANK_SPEC"]))
        with open(os.path.join(spec["run_dir"], f"rank{rank}.json"), "w") as f:
            f.write("[" * 100_000 + "]" * 100_000)  # past the recursion limit of any JSON parser
        os._exit(0)


    def test_forged_record():
        run_ranks(forge_record, 1, timeout=120)
    '''
)


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.fixture(scope="module")
def leaving(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """The LEAVING scenarios, run once in an inner session; the daemon's pid with the results."""
    root = tmp_path_factory.mktemp("leaving")
    result = run_inner_session(root, "test_leaving.py", LEAVING)
    # Written by the daemons (the inner session runs in root).
    pids = {name: root / f"{name}.pid" for name in ("daemon", "bare", "bare-big")}
    daemons = {name: int(p.read_text()) if p.exists() else None for name, p in pids.items()}
    yield {**result, **daemons}
    for pid in daemons.values():
        if pid is not None and _alive(pid):
            psutil.Process(pid).kill()  # only where the launcher failed to (its test says so)


def test_a_double_forked_daemon_is_killed_and_counted_as_leaked(leaving: dict[str, Any]) -> None:
    row = leaving["rows"]["test_daemon"]
    assert row["outcome"] == "passed", leaving["output"][-3000:]
    assert leaving["daemon"] is not None
    assert not _alive(leaving["daemon"]), "the daemon outlived its launch"
    assert row["leaked_processes"] >= 1


def test_a_worker_process_holding_memory_counts_against_its_rank_budget(leaving: dict[str, Any]) -> None:
    row = leaving["rows"]["test_worker_memory_against_the_budget"]
    assert row["outcome"] == "failed", leaving["output"][-3000:]
    failure = row["failure"]
    assert (failure["rank"], failure["kind"]) == (0, "oom")
    assert "host memory budget exceeded" in failure["first_line"] and "descendant" in failure["first_line"]
    (peak,) = row["ranks"]
    # Stopped as the sum crossed the budget, while the worker was still filling its 800 MiB.
    assert peak["peak_host_bytes"] > parse_size("600MiB")
    assert "import sys, time" in (peak["peak_process"] or ""), peak
    assert "\0" not in peak["peak_process"], peak  # the command line's NUL separators are spaces


def test_a_daemon_that_cleared_its_environment_is_killed_and_counted_as_leaked(
    leaving: dict[str, Any],
) -> None:
    """`env -i` drops the launch's marker; the ranks and the launcher adopt orphans anyway."""
    row = leaving["rows"]["test_bare_daemon"]
    assert row["outcome"] == "passed", leaving["output"][-3000:]
    assert leaving["bare"] is not None
    assert not _alive(leaving["bare"]), "the daemon outlived its launch"
    assert row["leaked_processes"] >= 1


def test_a_daemon_that_cleared_its_environment_counts_against_its_rank_budget(
    leaving: dict[str, Any],
) -> None:
    row = leaving["rows"]["test_bare_daemon_memory_against_the_budget"]
    assert row["outcome"] == "failed", leaving["output"][-3000:]
    failure = row["failure"]
    assert (failure["rank"], failure["kind"]) == (0, "oom")
    assert "host memory budget exceeded" in failure["first_line"] and "descendant" in failure["first_line"]
    assert leaving["bare-big"] is not None and not _alive(leaving["bare-big"])
    assert row["leaked_processes"] >= 1


def test_a_rank_that_floods_its_output_gets_a_capped_log_with_head_tail_and_a_cut_line(
    leaving: dict[str, Any],
) -> None:
    row = leaving["rows"]["test_floods_its_log"]
    assert row["outcome"] == "passed", leaving["output"][-3000:]
    log = Path(row["log_dir"]) / "rank0.log"
    size = log.stat().st_size
    assert 2**20 <= size < 2**20 + 512, size  # the cap (KIT_RANK_LOG_BYTES=1MiB) and the cut line
    data = log.read_bytes()
    cut = 64 * 2**20 + len(b"\nLAST LINE\n") - 2**20  # what was written, less what is kept
    assert f"[kit: {cut} bytes of rank 0's output cut here".encode() in data
    assert data.startswith(b"x" * 1000) and data.endswith(b"x\nLAST LINE\n")


def test_a_forged_rank_record_is_a_crash_verdict_not_a_recursion_error(leaving: dict[str, Any]) -> None:
    row = leaving["rows"]["test_forged_record"]
    assert row["outcome"] == "failed", leaving["output"][-3000:]
    failure = row["failure"]
    assert (failure["rank"], failure["kind"]) == (0, "crash"), failure
    assert "RecursionError" not in failure["message"]


def test_the_whole_run_limit_counts_a_ranks_worker_processes(leaving: dict[str, Any]) -> None:
    row = leaving["rows"]["test_worker_memory_against_the_runner"]
    assert row["outcome"] == "failed", leaving["output"][-3000:]
    failure = row["failure"]
    assert (failure["rank"], failure["kind"]) == (1, "oom")
    assert "KIT_HOST_MEMORY" in failure["first_line"] and "descendant" in failure["first_line"]


RACER = textwrap.dedent(
    """
    import os, sys, time

    def note_and_wait(rank, world_size, path):
        open(path, "w").close()
        time.sleep(120)
    """
)
# The launcher dies right after spawning, before its rank could ask the kernel to die with it:
# `_Launch.start` returns once the rank process exists, and the rank then needs hundreds of
# milliseconds of imports before it registers. Making pytest die in that window by chance is
# not repeatable; exiting there on purpose is. The launch is cold (KIT_WARM_START=0): the window is a
# spawned rank's. A rank forked from the warm parent has nothing left to import, and dies with
# that parent, which dies with its owner (functional/test_warm_start.py).
LAUNCHER = textwrap.dedent(
    """
    import os, sys
    sys.path.insert(0, sys.argv[1])
    from racer import note_and_wait
    from megatron_testkit.ranks import _Launch

    launch = _Launch(note_and_wait, 1, backend="gloo", timeout=120, args=(sys.argv[2],), env=None, budget=None)
    launch.start()
    print(launch.ranks[0].proc.pid, flush=True)
    os._exit(0)
    """
)


def test_a_rank_whose_launcher_died_before_it_registered_runs_nothing(tmp_path: Path) -> None:
    (tmp_path / "racer.py").write_text(RACER)
    ran = tmp_path / "ran"
    out = subprocess.run(
        [sys.executable, "-c", LAUNCHER, str(tmp_path), str(ran)],
        env={**inner_env(), "KIT_WARM_START": "0"},
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    rank = int(out.stdout.split()[0])
    try:
        deadline = time.monotonic() + 60
        while _alive(rank) and not ran.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not ran.exists(), "the orphaned rank ran the test's function"
        assert not _alive(rank), "the orphaned rank is still running"
    finally:
        if _alive(rank):
            psutil.Process(rank).kill()
