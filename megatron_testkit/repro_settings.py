"""What a session records so that a repro can run its tests again the same way, and what a repro restores.

The session header (`megatron_testkit.schema.Session`, version 3) records the environment
variables that change what a test does (`recorded_settings`: every ``KIT_*`` the session saw, and
``CI``, ``HYPOTHESIS_PROFILE``, ``PYTHONHASHSEED``), hypothesis's seed and the runner's memory
limit (``KIT_HOST_MEMORY``, else the limit of the memory cgroup the session ran in). A report is
untrusted input (a CI artifact a fork's pull request controls), so `restorable` gives back only
the kit's own settings, each of which the plugin parses at start (a bad value is a usage error,
never code), and the three others with their value's form checked; everything else it lists as
left out, with the reason. Stdlib only.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from megatron_testkit import kit_settings
from megatron_testkit.schema import MAX_SETTING_CHARS, Setting

# The kit's settings a repro restores: each is parsed by the plugin at configuration.
KIT_SETTINGS = (
    "KIT_SEED",
    "KIT_RANK_TIMEOUT",
    "KIT_PG_TIMEOUT_S",
    "KIT_ALLOWED_SKIPS",
    "KIT_REQUIRE_GPUS",
    "KIT_HOST_MEMORY",
    "KIT_DEVICE_MEMORY",
    "KIT_CUDA_HOST_ALLOWANCE",
    "KIT_GOLDEN_PLATFORM",
    "KIT_RANK_LOG_BYTES",
    "KIT_TRACK_COLLECTIVES",
    "KIT_CI_JOB",
    "KIT_STALL_WINDOW",
    "KIT_HEARTBEAT",
    "KIT_ADMISSION",
    "KIT_DEFAULT_RANK_MEMORY",
    "KIT_WARM_START",
)
# The kit's settings a report records but a repro does not set, and why (the settings table's
# test holds every recorded setting to one of the two lists).
NOT_RESTORED = {
    "KIT_MACHINE_ADMISSION": "a policy of the machine that ran: set it yourself for this machine",
    "KIT_MACHINE_MEMORY": "the memory of the machine that ran: set it yourself for this machine",
    "KIT_WARM_PRELOAD": "it names modules to import, never taken from a report: set it yourself",
}
# Set by the kit for its own processes (the launcher for its ranks, the session for its workers:
# KIT_ADMISSION_DIR), or naming a path of the machine that ran: never recorded (the settings table).
NOT_RECORDED = kit_settings.NOT_RECORDED
# Others that change what a test does, and the form their value must have to be restored.
_OTHER_FORMS = {
    "CI": re.compile(r"[A-Za-z0-9_.-]{0,32}"),
    "HYPOTHESIS_PROFILE": re.compile(r"[A-Za-z0-9_.-]{1,64}"),
    "PYTHONHASHSEED": re.compile(r"random|[0-9]{1,10}"),
}
_KIT_VALUE = re.compile(r"[A-Za-z0-9_.,:=+<>@%/ -]*")


def recorded_settings(environ: Mapping[str, str] | None = None) -> list[Setting]:
    """The variables a repro restores, as set in this process (sorted by name)."""
    environ = os.environ if environ is None else environ
    names = [n for n in environ if (n.startswith("KIT_") and n not in NOT_RECORDED) or n in _OTHER_FORMS]
    return [Setting(name, environ[name][:MAX_SETTING_CHARS]) for name in sorted(names)]


def hypothesis_seed(config: Any) -> int | None:
    """hypothesis's ``--hypothesis-seed`` of the session (None without it or without hypothesis)."""
    try:
        value = config.getoption("hypothesis_seed", None)
    except (ValueError, AttributeError):
        return None
    text = str(value).strip() if value is not None else ""
    return int(text) if text.lstrip("-").isdigit() and len(text) < 20 else None


def runner_memory() -> tuple[int | None, str | None]:
    """The runner's memory limit the session ran under, and its source (``KIT_HOST_MEMORY`` or the
    memory cgroup's file); (None, None) when there is none."""
    from megatron_testkit.budgets import parse_size
    from megatron_testkit.runner_limit import HOST_MEMORY_ENV, group_limit_bytes, memory_cgroup_of

    raw = os.environ.get(HOST_MEMORY_ENV, "").strip()
    if raw:
        try:
            return parse_size(raw), HOST_MEMORY_ENV
        except ValueError:
            return None, None  # the plugin's start-up check says what is wrong with it
    group = memory_cgroup_of()
    limit = group_limit_bytes(group) if group is not None else None
    return (limit, "cgroup") if limit is not None else (None, None)


@dataclass
class Restored:
    """The settings a repro applies, and those it leaves out (name, why)."""

    applied: dict[str, str] = field(default_factory=dict)
    left_out: list[tuple[str, str]] = field(default_factory=list)


def restorable(settings: Iterable[Setting | Mapping[str, Any]]) -> Restored:
    """Of a report's recorded settings, those a repro may set: the kit's own (`KIT_SETTINGS`) and
    the others of `_OTHER_FORMS`, each with a value of the expected form."""
    out = Restored()
    for item in settings:
        name, value = (item.name, item.value) if isinstance(item, Setting) else (item["name"], item["value"])
        name, value = str(name), str(value)
        if name in _OTHER_FORMS:
            ok = bool(_OTHER_FORMS[name].fullmatch(value))
        elif name in KIT_SETTINGS:
            ok = bool(_KIT_VALUE.fullmatch(value)) and len(value) <= 1024
        elif name in NOT_RECORDED:
            continue  # an older report's record of what the kit set for itself: nothing to restore
        elif name in NOT_RESTORED:
            out.left_out.append((name, NOT_RESTORED[name]))
            continue
        else:
            out.left_out.append((name, "not a setting of the kit: set it yourself if the test reads it"))
            continue
        if not ok:
            out.left_out.append((name, "its recorded value is not of the form the kit reads"))
            continue
        out.applied[name] = value
    return out
