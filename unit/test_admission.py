"""megatron_testkit.admission: the session's memory ledger, with real processes and real file locks."""

from __future__ import annotations

import json
import multiprocessing
import os
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path

import pytest

from megatron_testkit import admission
from megatron_testkit.admission import Capacity, Ledger, NeverFits

pytestmark = pytest.mark.L0

MiB = 2**20


def ledger_of(tmp_path: Path, limit: int = 1000 * MiB, cores: int = 4) -> Ledger:
    return Ledger.create(tmp_path / "ledger", Capacity(limit, cores, "a test's 1000 MiB"))


def test_admitted_launches_add_up_and_release_frees_their_share(tmp_path: Path) -> None:
    ledger = ledger_of(tmp_path)
    a = ledger.admit(400 * MiB, 2, "t::a")
    b = ledger.admit(500 * MiB, 2, "t::b")
    assert a.admitted_total == 400 * MiB
    assert b.admitted_total == 900 * MiB
    assert sum(e["bytes"] for e in ledger.snapshot()["entries"]) == 900 * MiB
    ledger.release(a)
    assert [e["id"] for e in ledger.snapshot()["entries"]] == [b.id]
    assert ledger.snapshot()["peak_bytes"] == 900 * MiB


def test_a_launch_that_does_not_fit_waits_for_a_release_and_its_wait_is_measured(tmp_path: Path) -> None:
    ledger = ledger_of(tmp_path)
    held = ledger.admit(700 * MiB, 1, "t::held")
    got: list[admission.Ticket] = []
    waiter = threading.Thread(target=lambda: got.append(ledger.admit(400 * MiB, 1, "t::waits", poll_s=0.02)))
    waiter.start()
    time.sleep(0.5)
    assert got == []  # 700 + 400 > 1000: still queued
    assert [w["label"] for w in ledger.snapshot()["waiting"]] == ["t::waits"]
    ledger.release(held)
    waiter.join(timeout=10)
    assert got and got[0].queued_s >= 0.4
    assert ledger.snapshot()["waiting"] == []


def test_a_standing_charge_counts_at_once_and_leaves_with_its_process(tmp_path: Path) -> None:
    # A warm parent's memory: recorded for the running process it names, never queued; launches
    # fit beside it; it leaves when released, or when that process ends without a release.
    ledger = ledger_of(tmp_path)
    held = ledger.admit(700 * MiB, 1, "t::held")
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        charge = ledger.charge(holder.pid, 400 * MiB, "a warm parent")  # 700 + 400 > 1000: not queued
        assert charge.admitted_total == 1100 * MiB
        assert [(e["pid"], e["bytes"]) for e in ledger.snapshot()["entries"]][1] == (holder.pid, 400 * MiB)
        ledger.release(held)
        ledger.admit(600 * MiB, 1, "t::beside")  # 400 + 600 <= 1000
        got: list[admission.Ticket] = []
        waiter = threading.Thread(target=lambda: got.append(ledger.admit(100 * MiB, 1, "t::w", poll_s=0.02)))
        waiter.start()
        time.sleep(0.5)
        assert got == []  # 400 + 600 + 100 > 1000: the charge holds room like a launch
        holder.kill()
        holder.wait()
        waiter.join(timeout=10)
        assert got, "the charge of a process that ended still held its room"
        assert holder.pid not in [e["pid"] for e in ledger.snapshot()["entries"]]
        ledger.release(charge)  # gone already: a release is a no-op
    finally:
        holder.kill()
        holder.wait()


def test_a_launch_that_fits_the_runner_alone_never_waits_for_ever_beside_a_standing_charge(
    tmp_path: Path,
) -> None:
    ledger = ledger_of(tmp_path)
    ledger.charge(os.getpid(), 400 * MiB, "a warm parent")
    # 400 + 800 > 1000, but no launch holds anything: it runs alone beside the charge.
    alone = ledger.admit(800 * MiB, 1, "t::alone", poll_s=0.02)
    assert alone.queued_s < 1.0
    # A second launch waits for it: the exception is for a launch alone, never two at once.
    got: list[admission.Ticket] = []
    waiter = threading.Thread(target=lambda: got.append(ledger.admit(100 * MiB, 1, "t::w", poll_s=0.02)))
    waiter.start()
    time.sleep(0.5)
    assert got == []
    ledger.release(alone)
    waiter.join(timeout=10)
    assert got


def test_a_launch_that_can_never_fit_fails_at_once_naming_the_numbers(tmp_path: Path) -> None:
    ledger = ledger_of(tmp_path)
    with pytest.raises(NeverFits) as excinfo:
        ledger.admit(1200 * MiB, 4, "t::big")  # into an empty ledger: it would wait forever
    assert str(excinfo.value) == (
        "t::big: needs 1.17 GiB (4 rank(s) x 300.00 MiB) but the runner has 1000.00 MiB "
        "(a test's 1000 MiB): it can never be admitted; lower memory_budget(host=...) or the world size"
    )
    assert ledger.snapshot()["waiting"] == [] and ledger.snapshot()["entries"] == []


def test_waiters_are_admitted_first_come_first_served(tmp_path: Path) -> None:
    ledger = ledger_of(tmp_path)
    held = ledger.admit(900 * MiB, 1, "t::held")
    order: list[str] = []

    def wait(label: str, share: int) -> None:
        ledger.admit(share, 1, label, poll_s=0.02)
        order.append(label)

    big = threading.Thread(target=wait, args=("big", 800 * MiB))
    big.start()
    time.sleep(0.3)  # big is first in line
    small = threading.Thread(target=wait, args=("small", 50 * MiB))
    small.start()
    time.sleep(0.3)
    # 900 + 50 fits, but small came after big: it waits behind it (no starvation of big launches).
    assert order == []
    ledger.release(held)
    big.join(timeout=10)
    small.join(timeout=10)
    assert order == ["big", "small"]


def _hammer(folder: str, share: int, rounds: int, out: multiprocessing.Queue) -> None:
    ledger = Ledger(folder)
    worst = 0
    for _ in range(rounds):
        ticket = ledger.admit(share, 1, "hammer", poll_s=0.005)
        worst = max(worst, sum(e["bytes"] for e in ledger.snapshot()["entries"]))
        time.sleep(0.002)
        ledger.release(ticket)
    out.put(worst)


def test_concurrent_processes_never_over_commit_the_ledger(tmp_path: Path) -> None:
    # 6 processes, each needing 300 of 1000 MiB, admit and release 15 times as fast as they can:
    # at most 3 fit at once, and no admitted sum any of them ever saw exceeds the limit.
    ledger = ledger_of(tmp_path)
    context = multiprocessing.get_context("fork")
    out = context.Queue()
    procs = [context.Process(target=_hammer, args=(str(ledger.folder), 300 * MiB, 15, out)) for _ in range(6)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
        assert p.exitcode == 0
    worst = [out.get(timeout=5) for _ in procs]
    assert max(worst) <= 900 * MiB
    assert ledger.snapshot()["peak_bytes"] == 900 * MiB  # they did run 3 at a time
    assert ledger.snapshot()["entries"] == []


def test_a_dead_process_entry_and_a_reused_pid_are_reclaimed(tmp_path: Path) -> None:
    ledger = ledger_of(tmp_path)
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        pid, start = admission._identity(child.pid)
        data = json.loads(ledger.path.read_text())
        data["entries"] = [
            {"id": "dead", "pid": pid, "start": start, "bytes": 600 * MiB, "label": "t::killed"},
            # A live pid (this process) with another start time: the process that made it is gone.
            {
                "id": "reused",
                "pid": admission._identity()[0],
                "start": 1,
                "bytes": 300 * MiB,
                "label": "t::old",
            },
        ]
        ledger.path.write_text(json.dumps(data))
        assert [e["id"] for e in ledger.snapshot()["entries"]] == ["dead"]  # the live child's stays
    finally:
        child.kill()
        child.wait()
    # Its process is gone: whoever reads next reclaims the share, and 900 MiB fit at once.
    ticket = ledger.admit(900 * MiB, 1, "t::next")
    assert [e["id"] for e in ledger.snapshot()["entries"]] == [ticket.id]


def test_a_session_sees_the_peak_admitted_while_it_ran(tmp_path: Path) -> None:
    ledger = ledger_of(tmp_path)
    early = ledger.admit(100 * MiB, 1, "before the session")
    ledger.join_session("s")
    a = ledger.admit(300 * MiB, 1, "a")
    b = ledger.admit(200 * MiB, 1, "b")
    for t in (early, a, b):
        ledger.release(t)
    ledger.admit(50 * MiB, 1, "c")
    figures = ledger.leave_session("s")
    assert figures == {
        "limit_bytes": 1000 * MiB,
        "cores": 4,
        "source": "a test's 1000 MiB",
        "peak_bytes": 600 * MiB,
    }


def test_cores_are_shared_out_as_threads_never_waited_for(tmp_path: Path) -> None:
    ledger = ledger_of(tmp_path, cores=4)
    first = ledger.admit(10 * MiB, 2, "a")
    second = ledger.admit(10 * MiB, 2, "b")
    third = ledger.admit(10 * MiB, 2, "c")  # no core is free: admitted anyway, one thread a rank
    assert (first.threads, second.threads, third.threads) == (2, 1, 1)


def test_the_runners_memory_is_kit_host_memory_else_the_cgroup_else_memavailable(monkeypatch) -> None:
    assert admission.capacity({"KIT_HOST_MEMORY": "7GB"}).memory_bytes == 7 * 10**9
    assert admission.capacity({"KIT_HOST_MEMORY": "7GB"}).source == "KIT_HOST_MEMORY=7GB"
    with pytest.raises(ValueError, match="KIT_HOST_MEMORY='7 parsecs'"):
        admission.capacity({"KIT_HOST_MEMORY": "7 parsecs"})
    from megatron_testkit import runner_limit

    monkeypatch.setattr(runner_limit, "memory_cgroup_of", lambda: None)  # a machine without a cgroup limit
    cap = admission.capacity({})
    assert cap.source == "MemAvailable at the session's start"
    assert 0 < cap.memory_bytes <= admission.psutil.virtual_memory().total


@pytest.mark.parametrize(
    ("env", "says"),
    [
        ({"KIT_ADMISSION": "maybe"}, "KIT_ADMISSION='maybe': expected 1 (on, the default) or 0 (off)"),
        ({"KIT_DEFAULT_RANK_MEMORY": "lots"}, "KIT_DEFAULT_RANK_MEMORY='lots': cannot parse memory size"),
    ],
)
def test_bad_admission_settings_are_one_line_naming_the_variable(env: dict, says: str) -> None:
    with pytest.raises(ValueError) as excinfo:
        admission.enabled(env)
        admission.default_rank_bytes(env)
    assert str(excinfo.value).startswith(says)


def test_admission_settings_read_as_documented() -> None:
    assert admission.enabled({}) and not admission.enabled({"KIT_ADMISSION": "0"})
    assert admission.default_rank_bytes({}) == admission.DEFAULT_RANK_BYTES == 2**30
    assert admission.default_rank_bytes({"KIT_DEFAULT_RANK_MEMORY": "512MiB"}) == 512 * MiB
    assert admission.session_ledger({"KIT_ADMISSION_DIR": "/nonexistent"}) is None


def _never_called(rank: int, world_size: int) -> None:
    raise AssertionError("spawned")


def test_run_ranks_refuses_a_launch_that_can_never_fit_before_making_anything(
    tmp_path: Path, monkeypatch
) -> None:
    from megatron_testkit import attribution
    from megatron_testkit.budgets import MemoryBudget
    from megatron_testkit.ranks import run_ranks

    ledger_of(tmp_path)  # a session's ledger of 1000 MiB, as the plugin makes one
    monkeypatch.setenv(admission.LEDGER_ENV, str(tmp_path / "ledger"))
    monkeypatch.setattr(attribution, "_scratch_root", str(tmp_path / "scratch"))
    monkeypatch.setattr(attribution.current(), "log_root", None)  # no --kit-report folder: scratch only
    runs_before = len(attribution.current().runs)
    with pytest.raises(
        NeverFits, match=r"needs 1.17 GiB \(2 rank\(s\) x 600.00 MiB\) but the runner has 1000.00 MiB"
    ):
        run_ranks(_never_called, 2, budget=MemoryBudget.parse(host="600MiB"))
    assert not (tmp_path / "scratch").exists()  # no launch directory was made
    assert len(attribution.current().runs) == runs_before  # and no launch recorded


def _admitting_child(folder: Path, share: int, then: str = "time.sleep(120)") -> subprocess.Popen:
    """A real process that admits ``share`` into the ledger, prints 'admitted', then runs ``then``."""
    code = (
        "import resource, signal, sys, time\n"
        "from megatron_testkit.admission import Ledger\n"
        f"ledger = Ledger({str(folder)!r})\n"
        f"ticket = ledger.admit({share}, 1, 'child')\n"
        "print('admitted', flush=True)\n"
        f"{then}\n"
    )
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert child.stdout is not None and child.stdout.readline() == "admitted\n"
    return child


def _state(pid: int) -> str:
    """A process' state letter from /proc/<pid>/stat (the test's own reading, not the kit's)."""
    text = Path(f"/proc/{pid}/stat").read_text()
    return text[text.rindex(")") + 2 :].split()[0]


def test_a_holder_killed_and_never_reaped_is_dead_and_its_share_is_free(tmp_path: Path) -> None:
    # xdist's controller leaves a worker killed with -9 (the OOM killer's signal) as a zombie: its
    # pid and start time still read, but it holds nothing.
    ledger = ledger_of(tmp_path)
    child = _admitting_child(ledger.folder, 900 * MiB)
    try:
        child.kill()  # SIGKILL, and no wait(): it stays a zombie of this process
        deadline = time.monotonic() + 10
        while _state(child.pid) != "Z" and time.monotonic() < deadline:
            time.sleep(0.02)
        assert _state(child.pid) == "Z"
        assert ledger.snapshot()["entries"] == []
        ticket = ledger.admit(900 * MiB, 1, "t::next", poll_s=0.02)  # at once: it no longer waits
        assert ticket.queued_s < 1.0
        assert _state(child.pid) == "Z"  # still unreaped when it was admitted
    finally:
        child.wait()


def test_a_wall_clock_step_leaves_live_holders_alive(tmp_path: Path, monkeypatch) -> None:
    # Stepping the clock needs root (CAP_SYS_TIME), so the step is simulated where psutil sees it:
    # its create_time() adds a boot time re-derived from the wall clock (btime in /proc/stat) on
    # each call, and a clock step moves that figure by the step. The ledger must not read it.
    import psutil._pslinux

    ledger = ledger_of(tmp_path)
    child = _admitting_child(ledger.folder, 600 * MiB)
    try:
        held = ledger.admit(300 * MiB, 1, "t::mine")
        real_boot_time = psutil._pslinux.boot_time
        monkeypatch.setattr(psutil._pslinux, "boot_time", lambda: real_boot_time() + 3600.0)
        assert psutil.Process(child.pid).create_time() > time.time() + 3000  # the step as psutil sees it
        assert len(ledger.snapshot()["entries"]) == 2  # both holders still count
        got: list[admission.Ticket] = []
        waiter = threading.Thread(target=lambda: got.append(ledger.admit(400 * MiB, 1, "t::w", poll_s=0.02)))
        waiter.daemon = True
        waiter.start()
        waiter.join(timeout=0.5)
        assert got == []  # 600 + 300 + 400 > 1000: it waits
        ledger.release(held)
        waiter.join(timeout=10)
        assert got and got[0].admitted_total == 1000 * MiB
    finally:
        child.kill()
        child.wait()


RELEASE_ON_A_FULL_DISK = """
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the write fails with EFBIG, as ENOSPC would
soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
resource.setrlimit(resource.RLIMIT_FSIZE, (16, hard))  # the disk is full: no ledger can be written
ledger.release(ticket)
print('released', len(ledger.snapshot()['entries']), flush=True)
time.sleep(1.5)
resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))  # the disk has room again
print('room', flush=True)
time.sleep(120)
"""


def test_a_release_that_cannot_be_written_never_holds_the_share(tmp_path: Path) -> None:
    # The full disk is real: the file-size limit makes the kernel refuse the ledger's rewrite.
    ledger = ledger_of(tmp_path)
    child = _admitting_child(ledger.folder, 900 * MiB, then=RELEASE_ON_A_FULL_DISK)
    try:
        assert child.stdout is not None
        # It did not raise, and its own next launch would not count the share it released.
        assert child.stdout.readline() == "released 0\n"
        in_file = json.loads(ledger.path.read_text())["entries"]
        assert [e["label"] for e in in_file] == ["child"]  # not written yet
        assert child.stdout.readline() == "room\n"
        deadline = time.monotonic() + 10  # retried every second in the background
        while ledger.snapshot()["entries"] and time.monotonic() < deadline:
            time.sleep(0.1)
        assert ledger.snapshot()["entries"] == []
        assert child.poll() is None  # the holder is alive: only the retried release freed it
        assert ledger.admit(900 * MiB, 1, "t::next").queued_s < 1.0
    finally:
        child.kill()
        child.wait()


RELEASE_THAT_WRITES_NOTHING = """
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the write fails with EFBIG, as ENOSPC would
resource.setrlimit(resource.RLIMIT_FSIZE, (0, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
ledger.release(ticket)
print('released', flush=True)
time.sleep(120)  # alive, its limit never lifted: its own background retries keep failing
"""


def test_a_release_that_cannot_be_written_frees_the_share_for_every_other_process(tmp_path: Path) -> None:
    # Another process sharing the ledger (a second session on the machine ledger) must not wait
    # for the holder's rewrite: the holder is alive and its file-size limit is never lifted.
    ledger = ledger_of(tmp_path)
    child = _admitting_child(ledger.folder, 900 * MiB, then=RELEASE_THAT_WRITES_NOTHING)
    try:
        assert child.stdout is not None and child.stdout.readline() == "released\n"
        in_file = json.loads(ledger.path.read_text())["entries"]
        assert [e["label"] for e in in_file] == ["child"]  # the release really wrote nothing
        got: list[admission.Ticket] = []
        other = Ledger(ledger.folder)  # this process: another reader of the same ledger
        waiter = threading.Thread(
            target=lambda: got.append(other.admit(900 * MiB, 1, "t::other", poll_s=0.02))
        )
        waiter.daemon = True
        waiter.start()
        waiter.join(timeout=10)  # admitted at once; 10 s only bounds a failure on a loaded runner
        assert got and got[0].admitted_total == 900 * MiB  # the holder's 900 MiB no longer count
        assert child.poll() is None  # still alive, its ticket never rewritten by itself
        # The write that admitted it dropped the holder's entry, and with it the released-file.
        assert [e["label"] for e in json.loads(ledger.path.read_text())["entries"]] == ["t::other"]
        assert [p.name for p in ledger.folder.iterdir() if p.name.startswith("admission.released-")] == []
    finally:
        child.kill()
        child.wait()


def _forged(ledger: Ledger, how: str) -> bytes:
    """The ledger's file made unusable in one way; its bytes."""
    data = json.loads(ledger.path.read_text())
    me = {"id": "forged", "pid": admission._identity()[0], "start": admission._identity()[1], "label": "x"}
    if how == "not JSON":
        raw = b'{"version": 2, "entries": ['
    elif how == "over its size cap":
        data["padding"] = "x" * (2 << 20)
        raw = json.dumps(data).encode()
    elif how == "another format":
        data["version"] = 1
        raw = json.dumps(data).encode()
    elif how == "an entry without bytes":
        data["entries"] = [me]
        raw = json.dumps(data).encode()
    else:  # an entry with negative bytes, held by a live process (this one)
        data["entries"] = [{**me, "bytes": -900 * MiB}]
        raw = json.dumps(data).encode()
    ledger.path.write_bytes(raw)
    return raw


@pytest.mark.parametrize(
    "how", ["not JSON", "over its size cap", "another format", "an entry without bytes", "negative bytes"]
)
def test_an_unusable_ledger_is_set_aside_with_one_warning_and_fails_no_launch(
    tmp_path: Path, monkeypatch, how: str
) -> None:
    monkeypatch.setenv("KIT_HOST_MEMORY", "1000MiB")  # the new ledger's capacity: the kit's own figure
    ledger = ledger_of(tmp_path)
    raw = _forged(ledger, how)
    with pytest.warns(admission.LedgerSetAside) as caught:
        ticket = ledger.admit(900 * MiB, 1, "t::after")
    assert len(caught) == 1
    aside = list(ledger.folder.glob("admission.json.set-aside-*"))
    assert len(aside) == 1 and aside[0].read_bytes() == raw  # renamed, never rewritten
    assert str(aside[0]) in str(caught[0].message) and "\n" not in str(caught[0].message)
    # Nothing of the forged entry counts: 900 MiB admitted is 900 MiB, never less.
    assert ticket.admitted_total == 900 * MiB
    snapshot = ledger.snapshot()
    assert snapshot["limit_bytes"] == 1000 * MiB and [e["id"] for e in snapshot["entries"]] == [ticket.id]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # one warning: the new ledger reads without another
        ledger.release(ticket)
        assert ledger.snapshot()["entries"] == []
