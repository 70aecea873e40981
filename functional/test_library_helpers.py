"""megatron-core's checkpoint writer keeps a ``multiprocessing`` Manager for the life of the process
that saved: the leak guard ends it with the rank and says so once, instead of counting it as the
test's leak. A Manager the test starts itself is still a leak, killed and counted.

Real parts: megatron-core's ``dist_checkpointing.save`` of a sharded tensor over two gloo ranks
(its torch_dist writer makes the Manager on its first save), in an inner pytest session.
"""

from __future__ import annotations

import importlib.util
import textwrap
from pathlib import Path

import psutil
import pytest

from fixtures.inner_session import run_inner_session
from megatron_testkit import skips

pytestmark = pytest.mark.L1  # an inner session whose ranks spawn megatron's Manager: ~30-60 s

SESSION = textwrap.dedent(
    """
    import multiprocessing

    from megatron_testkit.ranks import run_ranks


    def save_with_megatron(rank, world_size, path):
        import torch
        from megatron.core import dist_checkpointing
        from megatron.core.dist_checkpointing import ShardedTensor

        from megatron_testkit.megatron_cpu import cpu_shim

        tensor = torch.arange(4, dtype=torch.float32) + 4 * rank
        state = {"w": ShardedTensor.from_rank_offsets("w", tensor, (0, rank, world_size))}
        with cpu_shim():
            dist_checkpointing.save(state, path)
        return [p.pid for p in multiprocessing.active_children()]


    KEPT = []


    def own_manager(rank, world_size):
        # Kept for the rank's life as megatron keeps its own, but started by the test's code.
        KEPT.append(multiprocessing.get_context("spawn").Manager())
        return KEPT[-1]._process.pid


    def test_megatrons_writer(tmp_path):
        helpers = run_ranks(save_with_megatron, 2, args=(str(tmp_path),), timeout=240)
        print("HELPERS", [pid for pids in helpers for pid in pids])


    def test_the_tests_own_manager():
        print("OWN", run_ranks(own_manager, 1, timeout=240))
    """
)


def _pids(output: str, tag: str) -> list[int]:
    line = next(line for line in output.splitlines() if tag in line)
    return [int(p) for p in line.split(tag, 1)[1].strip(" []").split(",") if p.strip()]


def test_megatrons_checkpoint_writer_ends_with_its_rank_without_counting_as_a_leak(tmp_path: Path) -> None:
    if importlib.util.find_spec("megatron") is None:
        skips.skip("megatron", "megatron-core is not installed")
    inner = run_inner_session(tmp_path, "test_helpers.py", SESSION, "-s", "-W", "always")
    output = inner["output"]
    rows = inner["rows"]
    writer = rows["test_megatrons_writer"]
    assert writer["outcome"] == "passed", (writer, output[-4000:])
    helpers = _pids(output, "HELPERS")
    assert helpers, output[-4000:]  # megatron's save did start its Manager in each rank
    assert writer["leaked_processes"] == 0, writer
    for pid in helpers:  # ended with its rank all the same
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE, pid
    assert "LibraryHelperWarning" in output
    assert "megatron.core.dist_checkpointing.strategies.filesystem_async keeps a helper process" in output
    # The test's own Manager is the test's: killed and counted, as before.
    own = rows["test_the_tests_own_manager"]
    assert own["leaked_processes"] >= 1, own
    assert not psutil.pid_exists(_pids(output, "OWN")[0]) or (
        psutil.Process(_pids(output, "OWN")[0]).status() == psutil.STATUS_ZOMBIE
    )
