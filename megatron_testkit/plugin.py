"""pytest plugin entry point: registers the kit's plugin modules, one job each, as pytest registers
its own (``_pytest``'s modules).

Loaded through the `pytest11` entry point (or the root conftest.py). Every module it registers
imports hard dependencies only (pytest, psutil): torch, megatron and datasets are imported lazily
inside the hooks and fixtures that need them.

What they do for every test:

- `env_check_plugin`: parses every ``KIT_*`` variable the kit reads at configuration (a bad value
  is a usage error);
- `markers_plugin`: registers the kit's markers (the one list of them), checks every test's tier
  (``kit_require_tier``), reads each test's markers into its launches (``memory_budget``,
  ``stall_window``, ``fresh_interpreter``; ``gpu`` tests skipped without CUDA or enough GPUs, failed
  instead when ``KIT_REQUIRE_GPUS`` promises the GPUs: `devices.gpu_gate`), and applies the declared
  skips (`megatron_testkit.skips`);
- `leak_guard_plugin`: guards the shared session (`kit_leak_guard`, autouse) on tests that launched
  ranks, are marked ``world_size`` or ``leak_guard``, or on every test with ``kit_leak_guard = all``
  (ini; ``off`` disables it): no child process and no initialised default process group may outlive
  the test. Other tests are left alone, so a project's own long-lived workers (a
  ProcessPoolExecutor kept across tests) survive;
- `attribution_plugin`: opens a `megatron_testkit.attribution` context (test id, ``memory_budget``),
  so a plain `run_ranks` call is attributed to the test and enforces its budget, and attaches what
  it measured to the test's reports (``report.kit``; the pytest process' RSS growth for every
  test), which xdist carries to the controller;
- `stop_signals_plugin`: turns SIGTERM (a CI cancel, torchrun's agent) and SIGHUP (a closed terminal
  or SSH session) into a KeyboardInterrupt, as Ctrl-C, and SIGQUIT too after dumping every thread's
  stack: the ranks and their helpers are killed, the test is recorded as ``interrupted`` with the
  session's exit status (one stopped while its fixtures launched ranks as well), and the report and
  junit are written;
- `session_plugin`: keeps one memory-admission ledger for the whole session
  (`megatron_testkit.admission`), made by the controller (in the session's log folder under
  ``--kit-report``, else a temporary folder) and named to the xdist workers and nested sessions in
  ``KIT_ADMISSION_DIR`` (the report holds the session's peak of admitted memory against the
  runner's); keeps rank logs under ``--kit-report DIR`` in a folder of this session's
  (`report_dir`); builds the session table and the ``--kit-report DIR`` files
  (`megatron_testkit.report`);
- `launch_plugin`: warm starts' preloads, the heartbeat's terminal, per-test ranks or the CPU layer
  for the whole session (the `use_cpu_shim` fixture);
- `golden_plugin`: the ``kit_metrics`` fixture and golden values, registered at configuration as
  ``kit-golden``.

Order: pytest calls a hook's implementations from the last registered to the first, so the
modules' ``pytest_configure`` run in the reverse of the list below, except where a hook says
otherwise: the ``KIT_*`` check runs first (``tryfirst``: everything after it reads those values),
the session is made last and closed last (``trylast``: once every check has passed, its table
printed above the skip policy's). A module imports only the modules listed before it: pytest
rewrites a listed module's asserts only when it is not imported yet. ``-p no:megatron_testkit.plugin``
turns the whole kit off.
"""

from __future__ import annotations

import pytest

from megatron_testkit import golden_plugin

pytest_plugins = [
    "megatron_testkit.env_check_plugin",
    "megatron_testkit.markers_plugin",
    "megatron_testkit.leak_guard_plugin",
    "megatron_testkit.attribution_plugin",
    "megatron_testkit.stop_signals_plugin",
    "megatron_testkit.session_plugin",
    "megatron_testkit.launch_plugin",
]


def pytest_configure(config: pytest.Config) -> None:
    """The golden-value plugin, registered after the skip policy and before the session as it
    always was (its report hook is outermost either way: ``tryfirst``)."""
    if not config.pluginmanager.has_plugin("kit-golden"):
        config.pluginmanager.register(golden_plugin, "kit-golden")
