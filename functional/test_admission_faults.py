"""Admission when things go wrong with real launches: a worker killed with -9 and never reaped while
its ranks' helpers run on, a ledger that turns unusable while a launch runs, and a disk that fills
during a launch (caused for real with RLIMIT_FSIZE)."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import psutil
import pytest

from fixtures.inner_session import inner_env, run_inner_session
from megatron_testkit import admission
from megatron_testkit.admission import Capacity, Ledger

pytestmark = pytest.mark.L0

MiB = 2**20

RANK_FUNCTIONS = textwrap.dedent(
    """
    import os, subprocess, sys, time
    from pathlib import Path


    def leave_a_helper(rank, world_size, out):
        # In a session of its own, as a daemon would be: the rank's group kill does not reach it.
        helper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"], start_new_session=True)
        Path(out).write_text(str(helper.pid))
        time.sleep(300)


    def hold(rank, world_size, ready, go):
        import torch

        x = torch.ones(300 * 2**20 // 4)  # 300 MiB, touched: resident
        Path(ready).touch()
        while not os.path.exists(go):
            time.sleep(0.05)
        return float(x[0])
    """
)

LAUNCHER = textwrap.dedent(
    """
    import sys

    sys.path.insert(0, sys.argv[1])
    from kit_rank_functions import leave_a_helper
    from megatron_testkit.ranks import run_ranks

    run_ranks(leave_a_helper, 1, args=(sys.argv[2],), timeout=600)
    """
)


def _state(pid: int) -> str | None:
    """A process' state letter from /proc/<pid>/stat (the test's own reading); None when gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return text[text.rindex(")") + 2 :].split()[0]


def _wait_until(check, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while not check() and time.monotonic() < deadline:
        time.sleep(0.05)
    return bool(check())


def _sleeper(env: dict[str, str] | None = None) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"], env=env)


def test_a_launcher_killed_and_never_reaped_frees_its_share_and_its_ranks_helpers_end(tmp_path: Path) -> None:
    """The xdist worker of a running launch killed with -9 (the OOM killer's signal) stays a zombie of
    the controller; its rank dies with it, and the rank's helper, re-parented out of every tree the
    kit watches, ran on. Whoever reclaims the share ends the helper by the marker in its own
    environment, and nothing else: not a process the ledger names, not one of a live launch."""
    (tmp_path / "kit_rank_functions.py").write_text(RANK_FUNCTIONS)
    ledger = Ledger.create(tmp_path / "ledger", Capacity(4096 * MiB, 2, "a test's 4 GiB"))
    helper_file = tmp_path / "helper.pid"
    env = inner_env({**os.environ, admission.LEDGER_ENV: str(ledger.folder), "KIT_ADMISSION": "1"})
    env.pop("KIT_HOST_MEMORY", None)
    # The launcher's one launch starts cold anyway (a process' first launch never waits for its
    # warm parent); without one, the ledger read entry by entry below holds that launch alone, not
    # also the warm parent it would start and charge meanwhile.
    env["KIT_WARM_START"] = "0"
    launcher = subprocess.Popen(
        [sys.executable, "-c", LAUNCHER, str(tmp_path), str(helper_file)], env=env, cwd=tmp_path
    )
    procs: list[psutil.Process] = []
    decoys: list[subprocess.Popen] = []
    try:
        assert _wait_until(helper_file.exists, 120) and launcher.poll() is None
        helper = psutil.Process(int(helper_file.read_text()))
        procs.append(helper)
        (entry,) = ledger.snapshot()["entries"]
        assert entry["pid"] == launcher.pid
        # Decoys that must live: a process the ledger names as a dead holder (its pid, another
        # start), and one carrying the marker of a launch whose launcher (this process) is alive.
        named = _sleeper()
        mine = admission._identity()
        alive_marker = f"{entry['id']}:{mine[0]}:{mine[1]}:{ledger.folder}"
        marked_alive = _sleeper({**os.environ, admission.TICKET_ENV: alive_marker})
        decoys += [named, marked_alive]
        data = ledger.snapshot()
        data["entries"].append(
            {"id": "forged", "pid": named.pid, "start": 1, "bytes": 1, "label": "forged", "cores": 0}
        )
        ledger._save(data)

        launcher.kill()  # SIGKILL, never waited for: a zombie of this process, as of xdist's controller
        assert _wait_until(lambda: _state(launcher.pid) == "Z", 10)
        assert _state(helper.pid) not in (None, "Z")  # the helper outlived its rank's launcher

        assert ledger.snapshot()["entries"] == []  # the zombie's share is free
        assert _wait_until(lambda: _state(helper.pid) in (None, "Z"), 10), "the helper was left running"
        assert _state(launcher.pid) == "Z"  # still unreaped throughout
        assert named.poll() is None and marked_alive.poll() is None
    finally:
        for proc in procs:
            with contextlib.suppress(psutil.Error):
                proc.kill()
        for decoy in decoys:
            decoy.kill()
            decoy.wait()
        launcher.kill()
        launcher.wait()


def test_a_ledger_set_aside_mid_launch_counts_the_running_ranks_until_they_end(
    tmp_path: Path, monkeypatch, recwarn: pytest.WarningsRecorder
) -> None:
    """The ledger turns unusable while a rank holds 300 MiB: the new ledger is never empty while it
    runs, so a launch that fits only beside nothing waits for it to end."""
    sys.path.insert(0, str(tmp_path))
    (tmp_path / "kit_rank_functions.py").write_text(RANK_FUNCTIONS)
    import kit_rank_functions  # type: ignore[import-not-found]

    from megatron_testkit import attribution
    from megatron_testkit.ranks import run_ranks

    limit = 2000 * MiB
    # Cold: a warm parent started by this launch would be charged into this ledger at a moment of
    # its own, beside the one launch the ledger must hold (read entry by entry below).
    monkeypatch.setenv("KIT_WARM_START", "0")
    monkeypatch.setenv("KIT_HOST_MEMORY", str(limit))  # the rebuilt ledger's capacity, and the ranks' limit
    ledger = Ledger.create(tmp_path / "ledger", admission.capacity())
    monkeypatch.setenv(admission.LEDGER_ENV, str(ledger.folder))
    monkeypatch.setattr(attribution, "_scratch_root", str(tmp_path / "scratch"))
    monkeypatch.setattr(attribution.current(), "log_root", None)
    ready, go = tmp_path / "ready", tmp_path / "go"
    results: list[object] = []
    launch = threading.Thread(
        target=lambda: results.append(run_ranks(kit_rank_functions.hold, 1, args=(str(ready), str(go)))),
        daemon=True,
    )
    launch.start()
    waiter_got: list[admission.Ticket] = []
    try:
        assert _wait_until(ready.exists, 120)
        ledger.path.write_text('{"version": 2, "entries": [')  # truncated: not JSON
        with pytest.warns(admission.LedgerSetAside) as caught:
            (entry,) = ledger.snapshot()["entries"]
        assert len(caught) == 1
        # The rank holds a touched 300 MiB tensor (resident) on top of Python and torch.
        assert entry["pid"] == os.getpid() and entry["bytes"] >= 300 * MiB
        # Fits only if the running rank counted for less than 300 MiB: it must wait for its end.
        share = limit - 300 * MiB + MiB
        waiter = threading.Thread(
            target=lambda: waiter_got.append(ledger.admit(share, 1, "t::w", poll_s=0.05))
        )
        waiter.daemon = True
        waiter.start()
        waiter.join(timeout=1.5)
        assert waiter_got == []
    finally:
        go.touch()
        launch.join(timeout=120)
    assert results == [[1.0]]
    waiter.join(timeout=10)
    assert waiter_got and waiter_got[0].admitted_total == share
    ledger.release(waiter_got[0])
    assert [w for w in recwarn if issubclass(w.category, admission.LedgerSetAside)] == []  # one warning only
    assert len(list(ledger.folder.glob("admission.json.set-aside-*"))) == 1


DISK_FILLS = textwrap.dedent(
    """
    import os, resource, signal, threading, time
    from pathlib import Path

    from megatron_testkit.ranks import run_ranks


    def wait_for_go(rank, world_size, ready, go):
        Path(ready).touch()
        while not os.path.exists(go):
            time.sleep(0.05)
        return rank


    def test_launch_while_the_disk_fills(tmp_path):
        ready, go = tmp_path / "ready", tmp_path / "go"
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails (EFBIG), as ENOSPC would
        soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)

        def fill_the_disk():
            while not ready.exists():
                time.sleep(0.05)
            resource.setrlimit(resource.RLIMIT_FSIZE, (16, hard))  # the launcher's ledger rewrite fails
            go.touch()

        threading.Thread(target=fill_the_disk, daemon=True).start()
        try:
            assert run_ranks(wait_for_go, 1, args=(str(ready), str(go)), timeout=120) == [0]
        finally:
            resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))  # room again for the report
    """
)


def test_a_launch_whose_release_cannot_be_written_passes_and_keeps_its_report_row(tmp_path: Path) -> None:
    result = run_inner_session(
        tmp_path, "test_disk_fills.py", DISK_FILLS, "-p", "no:randomly", env={"KIT_ADMISSION_DIR": None}
    )
    row = result["rows"]["test_launch_while_the_disk_fills"]
    assert row["outcome"] == "passed", result["output"][-3000:]
    assert row["world_size"] == 1 and row["backend"] == "gloo"
    assert row["peak_host_bytes"] and row["peak_host_bytes"] > 0
    assert row["admitted_bytes"] == admission.DEFAULT_RANK_BYTES
