"""The kit's leak guard: no child process and no initialised default process group may outlive a
test, so the next test of the shared session does not inherit them.

Acts on the tests that launched ranks, are marked ``world_size`` or ``leak_guard``, or on every
test with the ini option ``kit_leak_guard = all`` (``off`` disables it). A project's own
long-lived workers (a ProcessPoolExecutor kept across tests) are left alone, and so are the
processes a library keeps for a rank's life (``kit_library_helpers``,
`megatron_testkit.library_helpers`). A plugin module registered by `megatron_testkit.plugin`.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator

import psutil
import pytest

from megatron_testkit import attribution, library_helpers

_LEAK_GUARD_MODES = ("ranks", "all", "off")
_SAVED_LIBRARY_HELPERS = pytest.StashKey[tuple]()
# How many child processes the guard killed after a test (its teardown report carries the count).
LEAKED = pytest.StashKey[int]()


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addini(
        "kit_leak_guard",
        "which tests the kit's leak guard checks for leftover child processes and process groups: "
        "'ranks' (default: tests that launched ranks or are marked world_size/leak_guard), 'all', 'off'",
        default="ranks",
    )
    parser.addini(
        "kit_library_helpers",
        "processes a library keeps for the life of a rank, which the leak guard ends with the rank "
        "without calling them the test's leak, one a line: 'module:PREFIX' (a multiprocessing process "
        "started by that module's code) or 'command:TEXT' (in its command line); default "
        "megatron-core's checkpoint writer (module:megatron.core.dist_checkpointing)",
        type="linelist",
        default=list(library_helpers.DEFAULT),
    )


def pytest_configure(config: pytest.Config) -> None:
    _leak_guard_mode(config)  # a bad value is a usage error now, not in the first test's teardown
    _declare_library_helpers(config)


def pytest_unconfigure(config: pytest.Config) -> None:
    declared = config.stash.get(_SAVED_LIBRARY_HELPERS, None)
    if declared is not None:
        library_helpers.set_declared(declared)


@pytest.fixture(autouse=True)
def kit_leak_guard(request: pytest.FixtureRequest) -> Iterator[None]:
    """Fail a test that leaves child processes or an initialised default process group behind.

    Protects the shared session: the next test would otherwise inherit a process group (and its
    sockets) or a stray rank using CPU and memory. Leaked processes are killed, the group is
    destroyed, then the test errors in teardown saying what it left. Acts only on the tests the
    ``kit_leak_guard`` ini option selects (see the module docstring); the rest are untouched.
    """
    from megatron_testkit import proctree

    mode = _leak_guard_mode(request.config)
    if mode == "off":
        yield
        return
    # Baselines: what wider-scoped fixtures set up before this test is theirs, not a leak.
    before = {p.pid for p in proctree.leaked_children()}
    group_before = _default_group_initialised()
    yield
    if not _guarded(request.node, mode):
        return
    problems = []
    # A library's helper kept for the process' life (under torchrun, megatron-core's checkpoint
    # writer in this rank): not the test's leak, said once (`megatron_testkit.library_helpers`).
    kept = library_helpers.Kept(library_helpers.started())
    leaked = [p for p in proctree.leaked_children() if p.pid not in before and not kept(p)]
    library_helpers.warn(kept.seen)
    if leaked:
        problems.append(
            f"{len(leaked)} child process(es) still alive after the test (killed): "
            + "; ".join(proctree.describe(p) for p in leaked)
        )
        for proc in leaked:
            with contextlib.suppress(psutil.Error):
                proc.kill()
        psutil.wait_procs(leaked, timeout=5)
    request.node.stash[LEAKED] = len(leaked)
    if _default_group_initialised() and not group_before:
        with contextlib.suppress(Exception):
            sys.modules["torch.distributed"].destroy_process_group()
        problems.append(
            "the default torch.distributed process group was left initialised in the pytest "
            "process (destroyed now): run multi-rank code through run_ranks, or destroy it"
        )
    if problems:
        pytest.fail("kit leak guard: " + " | ".join(problems), pytrace=False)


def _declare_library_helpers(config: pytest.Config) -> None:
    """``kit_library_helpers`` for the session's launches (and, under torchrun, this process: the
    rank is the pytest process, whose library helpers live as long as it)."""
    from megatron_testkit.ranks import in_torchrun

    try:
        entries = library_helpers.parse(config.getini("kit_library_helpers"))
    except ValueError as exc:
        raise pytest.UsageError(f"kit: {exc}") from None
    config.stash[_SAVED_LIBRARY_HELPERS] = library_helpers.set_declared(entries)
    if in_torchrun():
        library_helpers.track(entries)


def _leak_guard_mode(config: pytest.Config) -> str:
    mode = str(config.getini("kit_leak_guard") or "ranks").strip().lower()
    if mode not in _LEAK_GUARD_MODES:
        raise pytest.UsageError(
            f"kit_leak_guard = {mode!r} in the pytest ini: expected one of {', '.join(_LEAK_GUARD_MODES)}"
        )
    return mode


def _guarded(item: pytest.Item, mode: str) -> bool:
    """Whether the leak guard acts on this test: every test under ``all``, else rank tests."""
    if mode == "all" or item.get_closest_marker("leak_guard") or item.get_closest_marker("world_size"):
        return True
    context = attribution.current()
    return bool(context is not None and context.runs)


def _default_group_initialised() -> bool:
    dist = sys.modules.get("torch.distributed")  # never import torch just to check
    return bool(dist is not None and dist.is_available() and dist.is_initialized())
