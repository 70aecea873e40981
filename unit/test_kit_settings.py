"""The kit's settings table: docs/settings.md is generated from it, it names every setting the
kit's code reads, its defaults are the code's, and what the kit sets for itself is never recorded."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from megatron_testkit import kit_settings
from megatron_testkit.budgets import parse_size
from megatron_testkit.kit_settings import ENV, INI, OPTION, SETTINGS

pytestmark = pytest.mark.L0

REPO = Path(__file__).resolve().parent.parent
BY_NAME = {s.name: s for s in SETTINGS}


def test_docs_settings_md_is_the_table() -> None:
    page = (REPO / "docs" / "settings.md").read_text()
    assert page == kit_settings.markdown(), (
        "docs/settings.md differs from megatron_testkit/kit_settings.py: regenerate it with "
        "python -m megatron_testkit.kit_settings > docs/settings.md"
    )


def _source() -> str:
    return "\n".join(p.read_text() for p in sorted((REPO / "megatron_testkit").glob("*.py")))


def test_every_kit_variable_the_kit_reads_is_in_the_table() -> None:
    # Every quoted "KIT_..." name in the shipped kit's code (its constants and os.environ reads).
    read = set(re.findall(r"""["'](KIT_[A-Z0-9_]+)["']""", _source()))
    assert read, "the pattern finds the kit's variables"
    table = {s.name for s in SETTINGS if s.where == ENV}
    assert read - table == set(), f"add these to megatron_testkit/kit_settings.py: {sorted(read - table)}"
    assert table - read == set(), f"the kit no longer reads: {sorted(table - read)}"


def test_every_ini_option_and_command_line_option_is_in_the_table() -> None:
    # The plugin modules' own, and per-test ranks' (registered by the launch plugin through
    # per_test.add_options).
    kit = REPO / "megatron_testkit"
    plugin = "\n".join(p.read_text() for p in [*sorted(kit.glob("*plugin.py")), kit / "per_test.py"])
    ini = set(re.findall(r'addini\(\s*"(\w+)"', plugin))
    options = set(re.findall(r'addoption\(\s*"(--[\w-]+)"', plugin))
    assert ini and options
    assert ini == {s.name for s in SETTINGS if s.where == INI}
    assert options == {s.name for s in SETTINGS if s.where == OPTION}


def test_the_tables_defaults_are_the_codes() -> None:
    from megatron_testkit import admission, devices, rank_log, ranks, stall

    assert float(BY_NAME["KIT_RANK_TIMEOUT"].default) == ranks.DEFAULT_TIMEOUT == 300.0
    assert float(BY_NAME["KIT_STALL_WINDOW"].default) == stall.DEFAULT_WINDOW_S
    assert parse_size(BY_NAME["KIT_RANK_LOG_BYTES"].default) == rank_log.DEFAULT_CAP
    assert parse_size(BY_NAME["KIT_DEFAULT_RANK_MEMORY"].default) == admission.DEFAULT_RANK_BYTES
    assert parse_size(BY_NAME["KIT_CUDA_HOST_ALLOWANCE"].default) == devices.CUDA_HOST_ALLOWANCE
    assert int(BY_NAME["KIT_REQUIRE_GPUS"].default) == devices.required_gpus({})
    assert BY_NAME["kit_leak_guard"].default == "ranks"


def test_the_launch_timeouts_default_is_in_the_docs() -> None:
    page = (REPO / "docs" / "settings.md").read_text()
    assert re.search(r"^\| `KIT_RANK_TIMEOUT` \| 300 \| seconds a launch may run", page, re.MULTILINE)


def test_what_the_kit_sets_for_itself_is_never_recorded_as_a_setting_of_the_run() -> None:
    from megatron_testkit.repro_settings import recorded_settings, restorable

    environ = {
        "KIT_ADMISSION_DIR": "/home/runner/work/reports/logs/session-x/admission",
        "KIT_RANK_SPEC": "/tmp/x/spec.json",
        "KIT_METRICS_DIR": "/tmp/x/metrics",
        "KIT_LAUNCHER_PID": "123",
        "KIT_RANK_CGROUP": "/sys/fs/cgroup/kit",
        "KIT_HOST_MEMORY": "7GB",
        "KIT_FAULT_TRIALS": "3",  # a project's own variable: recorded, a repro says to set it
    }
    assert [s.name for s in recorded_settings(environ)] == ["KIT_FAULT_TRIALS", "KIT_HOST_MEMORY"]
    # An older report that recorded the ledger's folder: nothing to restore, nothing to warn about.
    restored = restorable(
        [{"name": "KIT_ADMISSION_DIR", "value": "/x"}, {"name": "KIT_HOST_MEMORY", "value": "7GB"}]
    )
    assert restored.applied == {"KIT_HOST_MEMORY": "7GB"} and restored.left_out == []


def test_a_path_under_the_report_folder_is_given_relative_to_it() -> None:
    from megatron_testkit.report_dir import in_report_folder

    root = "/r/reports/logs/session-1"
    assert in_report_folder("/r/reports/logs/session-1/t.py-x", root) == "logs/session-1/t.py-x"
    assert in_report_folder("/tmp/kit-ranks-1", root) is None
    assert in_report_folder("/r/reports/logs/session-1/t", None) is None
    assert in_report_folder("/r/x/t", "/r/x") is None  # not a session log folder


def test_every_setting_a_report_records_is_restored_by_repro_or_left_out_with_its_reason() -> None:
    """A documented setting that repro called "not a setting of the kit" (KIT_HEARTBEAT, added with
    the settings table but not to repro's list) read as a mistake in every repro of its reports."""
    from megatron_testkit.repro_settings import KIT_SETTINGS, NOT_RESTORED, restorable

    recorded = {s.name for s in SETTINGS if s.recorded}
    assert recorded == set(KIT_SETTINGS) | set(NOT_RESTORED), "a recorded setting repro knows nothing of"
    restored = restorable([{"name": name, "value": "1"} for name in sorted(recorded)])
    assert set(restored.applied) == set(KIT_SETTINGS)
    assert dict(restored.left_out) == NOT_RESTORED
    assert not any("not a setting of the kit" in why for _, why in restored.left_out)
