"""How this session's launches run: warm starts' preloads (``kit_warm_preload``), the heartbeat's
terminal, and per-test ranks (``--kit-ranks-per-test``, `megatron_testkit.per_test`) or else the CPU
layer for the whole session (``kit_cpu_shim``); the `use_cpu_shim` fixture. A plugin module
registered by `megatron_testkit.plugin`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest

from megatron_testkit import heartbeat, per_test
from megatron_testkit.megatron_cpu import use_cpu_shim  # noqa: F401  (a fixture; imports no torch)
from megatron_testkit.session_plugin import is_xdist_worker

_SAVED_TERMINAL = pytest.StashKey[tuple]()
_SAVED_WARM = pytest.StashKey[tuple]()
_SESSION_SHIM = pytest.StashKey[contextlib.ExitStack]()


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("kit", "multi-rank test kit")
    parser.addini(
        "kit_warm_preload",
        "modules the warm parent imports besides torch and torch.distributed, one per line (ranks "
        "forked from it find them imported; KIT_WARM_PRELOAD adds more, comma-separated)",
        type="linelist",
        default=[],
    )
    per_test.add_options(parser, group)


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_load_initial_conftests(early_config: pytest.Config) -> Iterator[None]:
    """Before pytest captures output (its own wrapper of this hook starts it): keep the terminal's
    stderr for the launches' progress lines (`megatron_testkit.heartbeat`)."""
    heartbeat.save_terminal()
    return (yield)


def pytest_configure(config: pytest.Config) -> None:
    from megatron_testkit import warm_start

    # Saved and restored: an in-process pytester session has its own ini (and, in an xdist
    # worker, the session plugin names the controller's warm broker after this).
    config.stash[_SAVED_WARM] = warm_start.settings()
    warm_start.set_ini_preload(config.getini("kit_warm_preload"))
    # The heartbeat starts its lines on a new line when pytest's dots left this one unfinished.
    config.stash[_SAVED_TERMINAL] = heartbeat.followed_terminal()
    if is_xdist_worker(config):
        heartbeat.follow_terminal(None, column_unknown=True)
    else:
        heartbeat.follow_terminal(lambda: _terminal_writer(config))
    _configure_per_test(config)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    if _SESSION_SHIM in item.config.stash:  # kit_cpu_shim: megatron-core imported since is covered too
        from megatron_testkit.megatron_cpu import cover_late_imports

        cover_late_imports()


def pytest_unconfigure(config: pytest.Config) -> None:
    terminal = config.stash.get(_SAVED_TERMINAL, None)
    if terminal is not None:
        heartbeat.follow_terminal(terminal[0], column_unknown=terminal[1])
    shim = config.stash.get(_SESSION_SHIM, None)
    if shim is not None:
        shim.close()
    warm = config.stash.get(_SAVED_WARM, None)
    if warm is not None:
        from megatron_testkit import warm_start

        warm_start.restore_settings(warm)


def _terminal_writer(config: pytest.Config) -> Any:
    """pytest's terminal writer (where its progress dots go), or None without a terminal reporter."""
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    return getattr(reporter, "_tw", None)


def _configure_per_test(config: pytest.Config) -> None:
    """Per-test ranks (`megatron_testkit.per_test`) when asked for; else, with ``kit_cpu_shim``, the
    CPU layer for the whole session (collection included), as in each per-test rank's session."""
    ranks = per_test.ranks_setting(config)
    if ranks:
        config.pluginmanager.register(per_test.PerTestRanks(config, ranks), "kit-per-test")
    elif config.getini(per_test.SHIM_INI):
        from megatron_testkit.megatron_cpu import cpu_shim

        stack = contextlib.ExitStack()
        stack.enter_context(cpu_shim(import_megatron=False))
        config.stash[_SESSION_SHIM] = stack
