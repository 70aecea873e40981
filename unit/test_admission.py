"""megatron_testkit.admission: the session's memory ledger, with real processes and real file locks."""

from __future__ import annotations

import json
import multiprocessing
import subprocess
import sys
import threading
import time
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
        pid, ctime = admission._identity(child.pid)
        data = json.loads(ledger.path.read_text())
        data["entries"] = [
            {"id": "dead", "pid": pid, "ctime": ctime, "bytes": 600 * MiB, "label": "t::killed"},
            # A live pid (this process) with another start time: the process that made it is gone.
            {
                "id": "reused",
                "pid": admission._identity()[0],
                "ctime": 1.0,
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
