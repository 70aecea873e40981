"""`megatron_testkit.runner_limit`: the env method's culprit, the limit's variable, the OOM counters.

The launcher's use of them, with real ranks, is in functional/test_launcher.py; `ci/limits.py`'s,
in unit/test_repro.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron_testkit.runner_limit import (
    OomCounters,
    group_limit_bytes,
    host_memory_limit,
    oom_kills_between,
    rank_over_limit,
    read_oom_counters,
)

pytestmark = pytest.mark.L0


def test_rank_over_limit_names_the_rank_that_grew_most() -> None:
    # Under the limit: nobody. 300 + 300 = 600 <= 600.
    assert rank_over_limit({0: 100, 1: 100}, {0: 300, 1: 300}, 600) is None
    # Over: rank 1 grew by 250, rank 0 by 200 -> rank 1, though rank 0 is larger.
    assert rank_over_limit({0: 200, 1: 100}, {0: 400, 1: 350}, 700) == 1
    # A rank that appeared since the previous sample grew from 0.
    assert rank_over_limit({0: 500}, {0: 510, 2: 100}, 600) == 2
    # Equal growth: the larger RSS; equal again: the lower rank.
    assert rank_over_limit({0: 100, 1: 200}, {0: 300, 1: 400}, 600) == 1
    assert rank_over_limit({0: 100, 1: 100}, {0: 400, 1: 400}, 700) == 0
    # Over at the first sample: the largest, as the kernel's OOM killer picks.
    assert rank_over_limit({}, {0: 100, 1: 900, 3: 50}, 800) == 1
    assert rank_over_limit({}, {}, 0) is None


def test_the_launcher_enforces_kit_host_memory_only_without_a_cgroup() -> None:
    assert host_memory_limit({}) is None
    assert host_memory_limit({"KIT_HOST_MEMORY": "7GB"}) == 7 * 10**9
    assert host_memory_limit({"KIT_HOST_MEMORY": "512MiB"}) == 512 * 2**20
    # In a cgroup the kernel enforces the limit; the launcher reads its counters instead.
    assert host_memory_limit({"KIT_HOST_MEMORY": "7GB", "KIT_RANK_CGROUP": "/sys/fs/cgroup/x"}) is None
    with pytest.raises(ValueError, match="KIT_HOST_MEMORY='lots'"):
        host_memory_limit({"KIT_HOST_MEMORY": "lots"})


def _group(tmp_path: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    return tmp_path


def test_oom_counters_read_v2_events_then_v1_oom_control_then_failcnt(tmp_path: Path) -> None:
    # The kernel's own formats: v2 memory.events, v1 memory.oom_control (oom_kill since Linux 4.13).
    (tmp_path / "v2").mkdir()
    v2 = _group(tmp_path / "v2", {
        "memory.events": "low 0\nhigh 0\nmax 12\noom 2\noom_kill 2\noom_group_kill 0\n",
    })  # fmt: skip
    assert read_oom_counters(v2) == OomCounters(2, None, "memory.events")
    # A group's own kills only (v2 counts its descendants' in memory.events): the local file,
    # where the kernel keeps one (Linux 5.2+); otherwise the hierarchical one.
    assert read_oom_counters(v2, local=True) == OomCounters(2, None, "memory.events")
    (v2 / "memory.events.local").write_text("low 0\nhigh 0\nmax 3\noom 1\noom_kill 0\noom_group_kill 0\n")
    assert read_oom_counters(v2, local=True) == OomCounters(0, None, "memory.events.local")
    assert read_oom_counters(v2) == OomCounters(2, None, "memory.events")
    (tmp_path / "v1").mkdir()
    v1 = _group(tmp_path / "v1", {
        "memory.oom_control": "oom_kill_disable 0\nunder_oom 0\noom_kill 1\n",
        "memory.failcnt": "37\n",
    })  # fmt: skip
    assert read_oom_counters(v1) == OomCounters(1, 37, "memory.oom_control")
    (tmp_path / "old").mkdir()
    old = _group(
        tmp_path / "old", {"memory.oom_control": "oom_kill_disable 0\nunder_oom 0\n", "memory.failcnt": "5"}
    )
    assert read_oom_counters(old) == OomCounters(None, 5, None)
    assert read_oom_counters(tmp_path / "missing") == OomCounters(None, None, None)


def test_oom_kills_between_two_readings() -> None:
    assert oom_kills_between(
        OomCounters(0, 3, "memory.oom_control"), OomCounters(2, 9, "memory.oom_control")
    ) == (
        2,
        "memory.oom_control oom_kill 0 -> 2",
    )
    # The limit was hit (failcnt rose) but nobody was OOM-killed: oom_kill is what counts.
    assert (
        oom_kills_between(OomCounters(1, 3, "memory.oom_control"), OomCounters(1, 9, "memory.oom_control"))
        is None
    )
    # No oom_kill kept: a failcnt rise counts as one kill.
    assert oom_kills_between(OomCounters(None, 3, None), OomCounters(None, 4, None)) == (
        1,
        "memory.failcnt 3 -> 4",
    )
    assert oom_kills_between(OomCounters(None, 3, None), OomCounters(None, 3, None)) is None
    assert oom_kills_between(OomCounters(None, None, None), OomCounters(None, None, None)) is None


def test_group_limit_reads_v2_max_and_v1_limit_in_bytes(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    (tmp_path / "c").mkdir()
    assert group_limit_bytes(_group(tmp_path / "a", {"memory.max": "314572800\n"})) == 300 * 2**20
    assert group_limit_bytes(_group(tmp_path / "b", {"memory.max": "max\n"})) is None
    assert (
        group_limit_bytes(_group(tmp_path / "c", {"memory.limit_in_bytes": "9223372036854771712\n"})) is None
    )
