"""The kernel log's OOM-kill records, read from a saved log in /dev/kmsg's record form.

The lines are records this machine's kernel wrote for real memory-cgroup OOM kills (only the cgroup
path shortened): the ``oom-kill:`` summary, the ``Killed process`` line and the ``invoked
oom-killer`` line that names no victim.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron_testkit import kernel_log

pytestmark = pytest.mark.L0

LOG = (
    "4,339,13985581808,-;python invoked oom-killer: gfp_mask=0xcc0(GFP_KERNEL), order=0, oom_score_adj=0\n"
    " SUBSYSTEM=memory\n"
    "6,418,13985582384,-;oom-kill:constraint=CONSTRAINT_MEMCG,nodemask=(null),cpuset=/,mems_allowed=0,"
    "oom_memcg=/kit-repro-12959,task_memcg=/kit-repro-12959,task=python,pid=13060,uid=0\n"
    "3,419,13985582409,-;Memory cgroup out of memory: Killed process 13060 (python) total-vm:628404kB, "
    "anon-rss:204288kB, file-rss:6084kB, shmem-rss:0kB, UID:0 pgtables:472kB oom_score_adj:0\n"
    "3,421,14003337800,-;Out of memory: Killed process 13290 (python) total-vm:1kB\n"
    "6,422,14003337900,-;random: crng reseeded due to virtual machine fork\n"
)


@pytest.fixture
def log(tmp_path: Path) -> str:
    path = tmp_path / "kmsg"
    path.write_text(LOG)
    return str(path)


def test_each_killed_pid_is_found_with_the_kernels_line(log: str) -> None:
    found = kernel_log.oom_kill_records({13060, 13290, 4242}, since=0.0, path=log)
    assert set(found) == {13060, 13290}
    assert found[13060].startswith("oom-kill:constraint=CONSTRAINT_MEMCG") and "pid=13060," in found[13060]
    assert found[13290] == "Out of memory: Killed process 13290 (python) total-vm:1kB"


def test_records_before_the_launch_and_other_pids_are_not_evidence(log: str) -> None:
    # 13985.58 s after boot for 13060's kill, 14003.34 s for 13290's.
    assert kernel_log.oom_kill_records({13060, 13290}, since=14000.0, path=log) == {
        13290: "Out of memory: Killed process 13290 (python) total-vm:1kB"
    }
    assert kernel_log.oom_kill_records({1}, since=0.0, path=log) == {}


def test_a_log_that_cannot_be_read_is_no_evidence(tmp_path: Path) -> None:
    assert kernel_log.oom_kill_records({13060}, since=0.0, path=str(tmp_path / "absent")) == {}
    assert kernel_log.readable(str(tmp_path / "absent")) is False


@pytest.mark.parametrize(
    ("line", "pid"),
    [
        ("Memory cgroup out of memory: Killed process 13060 (python) total-vm:628404kB", 13060),
        ("oom-kill:constraint=CONSTRAINT_NONE,task=python,pid=77,uid=0", 77),
        ("python invoked oom-killer: gfp_mask=0xcc0(GFP_KERNEL), order=0", None),
        ("Killed process group 12", None),
    ],
)
def test_the_victim_pid_of_a_message(line: str, pid: int | None) -> None:
    assert kernel_log.oom_kills(line) == pid
