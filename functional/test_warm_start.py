"""Warm starts with real processes: ranks forked from the warm parent, and every reason to start cold.

A warm launch's ranks are children of the warm parent (not of pytest), each imports the test's
module after the fork, and the report says how each launch started and why. The parent dies with
its owner, also on ``kill -9``, and takes its ranks with it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from fixtures.inner_session import WITHOUT_HYPOTHESIS, run_inner_session
from megatron_testkit import admission, attribution, machine_ledger, warm_start
from megatron_testkit.ranks import run_ranks

pytestmark = pytest.mark.L0

# Set at import: equal to the pid of the process that imported this module.
IMPORTED_IN = os.getpid()


def where_am_i(rank: int, world_size: int) -> tuple[int, int, int, bool]:
    """(pid, parent pid, pid that imported this module, torch preloaded before the module)."""
    return os.getpid(), os.getppid(), IMPORTED_IN, "torch" in sys.modules


def where_am_i_and_the_module(rank: int, world_size: int, module: str) -> tuple[int, int, int, bool, bool]:
    """`where_am_i`, and whether ``module`` was imported in this rank (by the parent it forked from)."""
    return (*where_am_i(rank, world_size), module in sys.modules)


def _warm_parent_ready() -> None:
    """Wait until the warm parent of the current preload set is up: a launch never waits for it
    (while it imports torch, launches start cold)."""
    warm_start.parent_for(warm_start.preload_set())


def _last_run():
    context = attribution.current()
    assert context is not None
    return context.runs[-1]


@pytest.fixture
def own_parents():
    """Warm parents this test starts are its own: ended afterwards, so later tests start fresh.
    Under xdist too: the controller's broker is set aside, since the controller cannot import the
    modules a test writes into its own tmp_path (it answered with a parent that lacked them)."""
    before, failed = dict(warm_start._parents), dict(warm_start._failed)
    dropped, lines = dict(warm_start._dropped), len(warm_start._dropped_lines)
    broker = warm_start._broker_path
    warm_start._parents.clear()
    warm_start.set_broker(None)
    yield
    warm_start.set_broker(broker)
    for starting in list(warm_start._starting.values()):  # a rebuild still importing: ended too
        starting.wait(warm_start._START_TIMEOUT_S)
    warm_start.stop_all()
    warm_start._failed.clear()
    warm_start._parents.update(before)
    warm_start._failed.update(failed)
    warm_start._dropped.clear()
    warm_start._dropped.update(dropped)
    del warm_start._dropped_lines[lines:]  # the outer session's header does not report them


def test_a_warm_launch_forks_its_ranks_from_the_parent_and_imports_the_test_module_after_the_fork(
    own_parents: None,
) -> None:
    # own_parents: a parent started with this process' environment as it is now (an earlier test
    # in this process may have changed a variable, which rightly sends launches cold).
    _warm_parent_ready()
    results = run_ranks(where_am_i, 2, timeout=120)
    run = _last_run()
    assert run.start_mode == "warm", run.start_reason
    parents = {ppid for _pid, ppid, _i, _t in results}
    assert len(parents) == 1 and parents <= warm_start.parent_pids()  # forked by the warm parent
    for pid, _ppid, imported_in, torch_loaded in results:
        assert imported_in == pid  # the test's module was imported in the rank itself, after the fork
        assert pid != os.getpid() and torch_loaded
    # A second launch forks from the same parent.
    again = run_ranks(where_am_i, 2, timeout=120)
    assert {r[1] for r in again} == parents
    assert _last_run().setup_s is not None


def test_a_launch_setting_a_variable_that_an_import_may_read_starts_cold(own_parents: None) -> None:
    _warm_parent_ready()  # so that the variable, not a parent still starting, is why it is cold
    results = run_ranks(where_am_i, 2, timeout=120, env={"SOME_LIBRARY_SETTING": "1"})
    run = _last_run()
    assert run.start_mode == "cold"
    assert "SOME_LIBRARY_SETTING" in (run.start_reason or "")
    assert all(ppid == os.getpid() for _pid, ppid, _i, _t in results)  # spawned by this process
    # A variable of the kit's own is read after the fork: warm.
    _warm_parent_ready()
    run_ranks(where_am_i, 2, timeout=120, env={"KIT_SOMETHING_OF_OURS": "1"})
    assert _last_run().start_mode == "warm", _last_run().start_reason


def setting_seen_at_import(rank: int, world_size: int) -> str | None:
    """What the preloaded module `kit_reads_at_import` read from the environment when imported."""
    import kit_reads_at_import  # type: ignore[import-not-found]  # written by the test below

    return kit_reads_at_import.SETTING


def test_a_variable_a_preloaded_module_reads_at_import_starts_cold_and_the_rank_reads_it_afresh(
    own_parents: None, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    (tmp_path / "kit_reads_at_import.py").write_text(
        "import os\nSETTING = os.environ.get('LIBRARY_SETTING_READ_AT_IMPORT')\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("KIT_WARM_PRELOAD", "kit_reads_at_import")
    _warm_parent_ready()
    # Forked from the parent, the rank would see the parent's import (None): it must start cold.
    (seen,) = run_ranks(setting_seen_at_import, 1, timeout=120, env={"LIBRARY_SETTING_READ_AT_IMPORT": "7"})
    run = _last_run()
    assert (run.start_mode, seen) == ("cold", "7"), run.start_reason
    assert "LIBRARY_SETTING_READ_AT_IMPORT" in (run.start_reason or "")
    # Control: without it the launch is warm and the rank has the parent's import of the module.
    (seen,) = run_ranks(setting_seen_at_import, 1, timeout=120)
    assert (_last_run().start_mode, seen) == ("warm", None), _last_run().start_reason


@pytest.mark.fresh_interpreter
def test_the_fresh_interpreter_marker_starts_cold() -> None:
    ((_pid, ppid, _i, _t),) = run_ranks(where_am_i, 1, timeout=120)
    assert ppid == os.getpid()
    run = _last_run()
    assert (run.start_mode, run.start_reason) == ("cold", "the test is marked fresh_interpreter")


def test_kit_warm_start_0_turns_warm_starts_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KIT_WARM_START", "0")
    ((_pid, ppid, _i, _t),) = run_ranks(where_am_i, 1, timeout=120)
    assert ppid == os.getpid()
    assert (_last_run().start_mode, _last_run().start_reason) == ("cold", "KIT_WARM_START=0")


def test_a_preload_that_fails_to_import_is_reported_and_the_parent_serves_without_it(
    own_parents: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KIT_WARM_PRELOAD", "kit_no_such_module_anywhere")
    with pytest.warns(
        warm_start.WarmPreloadWarning, match="kit_no_such_module_anywhere.*ModuleNotFoundError"
    ):
        _warm_parent_ready()
    run_ranks(where_am_i, 1, timeout=120)
    run = _last_run()
    assert run.start_mode == "warm"
    assert "preload failed: kit_no_such_module_anywhere (ModuleNotFoundError" in (run.start_reason or "")


def test_a_launch_waits_for_a_parent_still_starting_and_keeps_its_whole_start_up_timeout(
    own_parents: None, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The first launch finds the parent importing (a preload that takes 6 s) and waits for it
    rather than start its ranks cold beside it. The wait is not the ranks' start-up: their 5 s
    timeout counts from the fork (it used to count from the request, so the wait alone timed the
    launch out). 5 s is over 30x a forked rank's start here (setup_s ~0.13 s on the CPU runner)."""
    (tmp_path / "kit_slow_import.py").write_text("import time\ntime.sleep(6)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("KIT_WARM_PRELOAD", "kit_slow_import")
    results = run_ranks(where_am_i, 2, timeout=5)
    run = _last_run()
    assert run.start_mode == "warm", run.start_reason
    assert {ppid for _pid, ppid, _i, _t in results} <= warm_start.parent_pids()
    assert run.setup_s is not None and run.setup_s > 6  # the wait is in the launch's start time


def test_a_thread_started_in_the_parent_falls_back_to_cold_with_the_reason(
    own_parents: None, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    (tmp_path / "kit_starts_a_thread.py").write_text(
        "import threading, time\nthreading.Thread(target=time.sleep, args=(3600,), daemon=True).start()\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("KIT_WARM_PRELOAD", "kit_starts_a_thread")
    _warm_parent_ready()
    mark = warm_start.dropped_mark()
    first = warm_start.parent_for(warm_start.preload_set())
    results = run_ranks(where_am_i, 2, timeout=120)
    run = _last_run()
    assert run.start_mode == "cold"
    assert "runs 2 OS threads" in (run.start_reason or ""), run.start_reason
    assert all(ppid == os.getpid() for _pid, ppid, _i, _t in results)
    # The module that started the thread is named, dropped from the set, and the parent rebuilt
    # without it: once the new parent is up, launches are warm again and never see the module.
    assert "kit_starts_a_thread started 1 OS thread at import" in (run.start_reason or "")
    _warm_parent_ready()
    for _ in range(2):
        results = run_ranks(where_am_i_and_the_module, 2, args=("kit_starts_a_thread",), timeout=120)
        assert _last_run().start_mode == "warm", _last_run().start_reason
        assert {r[4] for r in results} == {False}  # the rebuilt parent never imported it
        parents = {r[1] for r in results}
        assert len(parents) == 1 and parents <= warm_start.parent_pids() and first.pid not in parents
    assert not _alive(first.pid)  # the unsafe parent ended once its replacement was up
    (line,) = warm_start.dropped_since(mark)  # said once, for the session's header
    assert line.startswith(
        "kit_starts_a_thread was dropped from the warm preload set: it started 1 OS thread"
    )


def test_the_warm_parents_memory_is_in_the_admission_ledgers_once_and_leaves_them_with_it(
    own_parents: None, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # Ledgers of this test's own, large enough that no launch waits: the session's and the machine's.
    room = admission.Capacity(64 << 30, 2, "this test")
    session = admission.Ledger.create(tmp_path / "session", room)
    machine = machine_ledger.MachineLedger.create(tmp_path / "machine", room)
    monkeypatch.setenv(admission.LEDGER_ENV, str(session.folder))
    monkeypatch.setenv(machine_ledger.MACHINE_LEDGER_ENV, str(machine.folder))
    parent = warm_start.parent_for(warm_start.preload_set())
    rss = psutil.Process(parent.pid).memory_info().rss
    for ledger in (session, machine):
        (entry,) = ledger.snapshot()["entries"]  # the parent's, and nothing else yet
        assert entry["pid"] == parent.pid
        # Its resident memory when it was charged. The parent has been idle in its serve loop
        # since: its RSS moves by the few pages that loop touches, far below 10% of a process that
        # imported torch (an idle rank is about 170-230 MiB).
        assert 0.9 * rss <= entry["bytes"] <= 1.1 * rss, (entry["bytes"], rss)
    # Launches fork from it: it stays one entry (not one per launch), theirs come and go.
    for _ in range(2):
        results = run_ranks(where_am_i, 2, timeout=120)
        assert {ppid for _pid, ppid, _i, _t in results} == {parent.pid}
        for ledger in (session, machine):
            assert [e["pid"] for e in ledger.snapshot()["entries"]] == [parent.pid]
    # It leaves both ledgers when it stops...
    warm_start.stop_all()
    assert session.snapshot()["entries"] == machine.snapshot()["entries"] == []
    # ... and when it dies without a word: its entry names the process, which is gone.
    again = warm_start.parent_for(warm_start.preload_set())
    assert [e["pid"] for e in session.snapshot()["entries"]] == [again.pid]
    os.kill(again.pid, signal.SIGKILL)
    assert again.proc is not None
    again.proc.wait(timeout=30)
    assert session.snapshot()["entries"] == machine.snapshot()["entries"] == []


# A rank that starts a sleeper without its session and environment (no launch marker), and exits
# at once: the launcher never sees the sleeper in the rank's tree; it re-parents to the warm parent,
# which hands it back to the launch. In an inner session: the leak it counts is that session's.
ORPHANING = textwrap.dedent(
    """
    import os, subprocess

    import pytest

    from megatron_testkit import RankFailure, attribution, warm_start
    from megatron_testkit.ranks import run_ranks


    def leave_an_orphan(rank, world_size):
        proc = subprocess.Popen(["sleep", "300"], env={}, start_new_session=True)
        with open("orphan.pid", "w") as f:
            f.write(str(proc.pid))
        os._exit(0)


    def test_orphan():
        warm_start.parent_for(warm_start.preload_set())  # up before the launch, which then goes warm
        with pytest.raises(RankFailure):  # exited without returning
            run_ranks(leave_an_orphan, 1, timeout=120)
        # Counted and killed by the launch itself, before the leak guard looks after the test.
        run = attribution.current().runs[-1]
        with open("launch.txt", "w") as f:
            f.write(f"{run.start_mode} {run.leaked_processes}")
    """
)


def test_a_ranks_orphan_is_handed_back_and_counted_as_leaked(tmp_path: Path) -> None:
    result = run_inner_session(tmp_path, "test_orphaning.py", ORPHANING)
    row = result["rows"]["test_orphan"]
    sleeper = int((tmp_path / "orphan.pid").read_text())
    try:
        (launch,) = row["launches"]
        assert launch["start_mode"] == "warm", launch["start_reason"]
        assert row["leaked_processes"] == 1, result["output"]
        # The launch counted it itself (handed over by the warm parent), not only the leak guard.
        mode, leaked = (tmp_path / "launch.txt").read_text().split()
        assert (mode, leaked) == ("warm", "1"), result["output"][-3000:]
        assert not _alive(sleeper)
    finally:
        if _alive(sleeper):
            os.kill(sleeper, signal.SIGKILL)


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


SLEEPING = textwrap.dedent(
    """
    import os, time

    from megatron_testkit import warm_start
    from megatron_testkit.ranks import run_ranks


    def sleep_and_say(rank, world_size, ready):
        with open(f"{ready}.{rank}.tmp", "w") as f:
            f.write(f"{os.getpid()} {os.getppid()}")
        os.replace(f"{ready}.{rank}.tmp", f"{ready}.{rank}")
        time.sleep(300)


    def test_sleeps(tmp_path):
        warm_start.parent_for(warm_start.preload_set())  # up before the launch, which then goes warm
        run_ranks(sleep_and_say, 2, args=(str(tmp_path / "ready"),), timeout=600)
    """
)


def test_pytest_killed_with_9_takes_the_warm_parent_and_its_ranks_within_a_second(tmp_path: Path) -> None:
    (tmp_path / "test_inner.py").write_text(SLEEPING)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "KIT_ADMISSION"))}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            *WITHOUT_HYPOTHESIS,
            f"--basetemp={tmp_path / 'base'}",
        ],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 120
        found: list[Path] = []
        while len(found) < 2 and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.1)
            found = [p for p in (tmp_path / "base").rglob("ready.[01]")]
        assert len(found) == 2, "the inner session's ranks never started"
        pids = [tuple(int(x) for x in p.read_text().split()) for p in found]
        ranks = {pid for pid, _ppid in pids}
        parents = {ppid for _pid, ppid in pids}
        assert len(parents) == 1 and proc.pid not in parents  # forked from the warm parent
        (parent,) = parents
        assert psutil.Process(parent).ppid() == proc.pid  # the parent is the session's child
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        killed = time.monotonic()
        # The bound, 1 s: no user-space code runs between pytest's death and theirs. The kernel
        # sends PR_SET_PDEATHSIG's SIGKILL to the warm parent as pytest exits, and to each rank as
        # the parent exits; SIGKILL cannot be caught or deferred. What remains is the kernel freeing
        # each address space (a few hundred MiB, mostly shared pages: milliseconds) and waiting
        # for a core on a loaded 2-core runner (a few scheduler periods: tens of ms). 1 s is over
        # ten times that, so a process still alive then did not die with its parent. A zombie
        # counts as gone (`_alive`): its reaping is init's, not ours.
        while any(_alive(pid) for pid in {*ranks, parent}) and time.monotonic() - killed < 1.0:
            time.sleep(0.02)
        left = [pid for pid in {*ranks, parent} if _alive(pid)]
        assert not left, f"still alive 1 s after pytest was killed: {left}"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


TWO_WORKERS = textwrap.dedent(
    """
    import os

    import pytest

    from megatron_testkit import admission, warm_start
    from megatron_testkit.ranks import run_ranks


    def parent_of_rank(rank, world_size):
        return os.getppid()


    def charged(pid):
        # How many entries of the session's admission ledger name this process.
        return sum(e["pid"] == pid for e in admission.session_ledger().snapshot()["entries"])


    @pytest.mark.parametrize("n", range(4))
    def test_launch(n):
        warm_start.parent_for(warm_start.preload_set())  # up before the launch, which then goes warm
        (ppid,) = run_ranks(parent_of_rank, 1, timeout=120)
        with open(f"ppid.{os.environ['PYTEST_XDIST_WORKER']}.{n}", "w") as f:
            f.write(f"{ppid} {os.getppid()} {os.getpid()}")
        with open(f"charged.{os.environ['PYTEST_XDIST_WORKER']}.{n}", "w") as f:
            f.write(str(charged(ppid)))
    """
)


def test_two_xdist_workers_fork_from_the_controllers_one_warm_parent(tmp_path: Path) -> None:
    result = run_inner_session(tmp_path, "test_workers.py", TWO_WORKERS, "-n", "2")
    assert result["rc"] == 0, result["output"][-3000:]
    seen = [tuple(int(x) for x in p.read_text().split()) for p in tmp_path.glob("ppid.gw*")]
    assert len(seen) == 4
    assert len({worker for _ppid, _controller, worker in seen}) == 2, seen  # both workers launched
    parents = {ppid for ppid, _controller, _worker in seen}
    controllers = {controller for _ppid, controller, _worker in seen}
    assert len(parents) == 1 and len(controllers) == 1, seen  # one warm parent for the session
    launches = [launch for row in result["rows"].values() for launch in row["launches"]]
    assert [launch["start_mode"] for launch in launches] == ["warm"] * 4, launches
    # Its memory is in the session's admission ledger once, whichever worker looks, after any launch.
    charged = [int(p.read_text()) for p in tmp_path.glob("charged.gw*")]
    assert charged == [1] * 4, charged
