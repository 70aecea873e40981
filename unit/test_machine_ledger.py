"""megatron_testkit.machine_ledger: which sessions share the machine's ledger, its capacity, and a
ledger written in another boot; real processes and real files."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import pytest

from megatron_testkit import admission, machine_ledger
from megatron_testkit.admission import Capacity, Ledger
from megatron_testkit.machine_ledger import MachineLedger

pytestmark = pytest.mark.L0

MiB = 2**20

TOP_LEVEL = "from megatron_testkit.machine_ledger import is_top_level; print(is_top_level())"


def _top_level_in_child(outer: str | None) -> str:
    env = {k: v for k, v in os.environ.items() if k != machine_ledger.OUTER_SESSION_ENV}
    if outer is not None:
        env[machine_ledger.OUTER_SESSION_ENV] = outer
    done = subprocess.run(
        [sys.executable, "-c", TOP_LEVEL], env=env, capture_output=True, text=True, timeout=60
    )
    return done.stdout.strip() or done.stderr


def test_a_session_is_nested_only_below_the_session_its_variable_names() -> None:
    assert _top_level_in_child(None) == "True"
    assert _top_level_in_child(machine_ledger.session_marker()) == "False"  # this process: its parent
    sibling = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        pid, start = admission._identity(sibling.pid)
        # A live session that is not an ancestor (a value left in a shell, another terminal's).
        assert _top_level_in_child(f"{pid}:{start}") == "True"
        assert _top_level_in_child(f"{os.getpid()}:{start + 1}") == "True"  # this pid, another start
        assert _top_level_in_child("garbage") == "True"
    finally:
        sibling.kill()
        sibling.wait()


def test_a_ledger_written_in_another_boot_holds_nothing(tmp_path: Path) -> None:
    ledger = Ledger.create(tmp_path / "ledger", Capacity(1000 * MiB, 2, "a test's 1000 MiB"))
    held = ledger.admit(900 * MiB, 1, "t::held")  # held by this live process
    data = json.loads(ledger.path.read_text())
    data["boot_id"] = "another-boot"  # pids and start ticks named another boot's processes
    ledger.path.write_text(json.dumps(data))
    assert ledger.snapshot()["entries"] == []
    assert ledger.admit(900 * MiB, 1, "t::next").queued_s < 1.0
    assert held.id not in [e["id"] for e in ledger.snapshot()["entries"]]


def test_a_launch_larger_than_the_machine_waits_to_run_alone(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv(machine_ledger.MACHINE_MEMORY_ENV, "1000MiB")
    machine = MachineLedger.create(tmp_path / "machine", machine_ledger.machine_capacity())
    big = machine.admit_within(1500 * MiB, 2, "t::big")  # its session allows 1.5 GiB; the machine 1000 MiB
    assert big.bytes == 1000 * MiB
    got: list[admission.Ticket] = []
    small = threading.Thread(
        target=lambda: got.append(machine.admit_within(10 * MiB, 1, "t::small")), daemon=True
    )
    small.start()
    small.join(timeout=0.5)
    assert got == []  # nothing runs beside it
    machine.release(big)
    small.join(timeout=10)
    assert got and got[0].admitted_total == 10 * MiB


def test_the_machines_memory_is_measured_again_whenever_no_launch_holds_any(
    tmp_path: Path, monkeypatch
) -> None:
    monkeypatch.setenv(machine_ledger.MACHINE_MEMORY_ENV, "1000MiB")
    machine = MachineLedger.create(tmp_path / "machine", machine_ledger.machine_capacity())
    held = machine.admit(100 * MiB, 1, "t::held")
    monkeypatch.setenv(machine_ledger.MACHINE_MEMORY_ENV, "2000MiB")
    assert machine.snapshot()["limit_bytes"] == 1000 * MiB  # kept while a launch holds memory
    machine.release(held)
    snapshot = machine.snapshot()
    assert snapshot["limit_bytes"] == 2000 * MiB and snapshot["source"] == "KIT_MACHINE_MEMORY=2000MiB"


def test_the_default_folder_is_per_user_and_boot_and_refused_when_others_can_write_it(
    tmp_path: Path, monkeypatch
) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.delenv(machine_ledger.MACHINE_DIR_ENV, raising=False)
    ledger = machine_ledger.open_for_session()
    assert ledger is not None
    user = tmp_path / f"megatron-testkit-{os.getuid()}"
    boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    assert ledger.folder == user / f"admission-{boot}"
    assert oct(user.stat().st_mode & 0o777) == oct(0o700)
    user.chmod(0o777)  # another user could plant a ledger or a link in it
    with pytest.warns(machine_ledger.MachineLedgerRefused, match="only it can write"):
        assert machine_ledger.open_for_session() is None
    assert machine_ledger.open_for_session({machine_ledger.MACHINE_ENV: "0"}) is None


@pytest.mark.parametrize(
    ("env", "says"),
    [
        (
            {"KIT_MACHINE_ADMISSION": "maybe"},
            "KIT_MACHINE_ADMISSION='maybe': expected 1 (on, the default) or 0",
        ),
        ({"KIT_MACHINE_MEMORY": "lots"}, "KIT_MACHINE_MEMORY='lots': cannot parse memory size"),
    ],
)
def test_bad_machine_settings_are_one_line_naming_the_variable(env: dict, says: str) -> None:
    with pytest.raises(ValueError) as excinfo:
        machine_ledger.enabled(env)
        machine_ledger.memory_setting(env)
    assert str(excinfo.value).startswith(says)
