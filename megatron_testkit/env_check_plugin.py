"""Every ``KIT_*`` variable the kit reads, parsed at configuration: a bad value is a one-line usage
error naming it, not an abort at import nor a failure blamed on the first test or rank. A plugin
module registered by `megatron_testkit.plugin`.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from megatron_testkit import admission, attribution, heartbeat, machine_ledger, stall


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config: pytest.Config) -> None:
    """First of the kit's configuration: the session's ledgers and launches read these values."""
    _check_kit_environment()


def _check_kit_environment() -> None:
    """Parse every ``KIT_*`` variable the kit reads, now: a bad value is a one-line usage error
    naming it, not an abort at import nor a failure blamed on the first test or rank."""
    from megatron_testkit import devices, platforms, rank_log, ranks, runner_limit, warm_start

    checks = (
        ranks.default_timeout,
        platforms.platform_override,
        rank_log.log_cap,
        runner_limit.host_memory_limit,
        lambda: devices.device_memory_cap(None),
        lambda: devices.host_budget(1, cuda=True),
        devices.required_gpus,
        lambda: attribution.seed_for(""),
        _check_rank_cgroup,
        admission.enabled,
        admission.default_rank_bytes,
        machine_ledger.enabled,
        machine_ledger.memory_setting,
        stall.default_window,
        heartbeat.interval,
        warm_start.check_settings,
    )
    for check in checks:
        try:
            check()
        except ValueError as exc:
            raise pytest.UsageError(f"kit: {exc}") from None


def _check_rank_cgroup() -> None:
    from megatron_testkit.runner_limit import RANK_CGROUP_ENV

    raw = os.environ.get(RANK_CGROUP_ENV, "")
    if raw and not Path(raw, "cgroup.procs").is_file():
        raise ValueError(f"{RANK_CGROUP_ENV}={raw!r}: not a cgroup directory (no cgroup.procs in it)")
