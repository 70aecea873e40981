"""pytest plugin entry point: fixtures, marker handling and the session report.

Loaded through the `pytest11` entry point (or the root conftest.py). Keep imports here light:
torch, megatron and datasets are imported lazily inside the fixtures that need them.

What it does for every test:

- opens a `megatron_testkit.attribution` context (test id, ``memory_budget``), so a plain `run_ranks`
  call is attributed to the test and enforces its budget;
- skips ``gpu`` tests without CUDA and ``gpu`` + ``world_size(n)`` tests with fewer than n GPUs
  (fails them instead when ``KIT_REQUIRE_GPUS`` promises the GPUs: `devices.gpu_gate`);
- guards the shared session (`kit_leak_guard`, autouse) on tests that launched ranks, are marked
  ``world_size`` or ``leak_guard``, or on every test with ``kit_leak_guard = all`` (ini; ``off``
  disables it): no child process and no initialised default process group may outlive the test;
- turns SIGTERM (a CI cancel, torchrun's agent) and SIGHUP (a closed terminal or SSH session) into
  a KeyboardInterrupt, as Ctrl-C, and SIGQUIT too after dumping every thread's stack: the ranks and
  their helpers are killed, the test is recorded as ``interrupted`` with the session's exit status
  (one stopped while its fixtures launched ranks as well), and the report and junit are written;
- parses every ``KIT_*`` variable the kit reads at configuration (a bad value is a usage error);
- keeps one memory-admission ledger for the whole session (`megatron_testkit.admission`), made by
  the controller (in the session's log folder under ``--kit-report``, else a temporary folder) and
  named to the xdist workers and nested sessions in ``KIT_ADMISSION_DIR``; the report holds the
  session's peak of admitted memory against the runner's;
- keeps rank logs under ``--kit-report DIR`` in a folder of this session's (`report_dir`).
  Other tests are left alone, so a project's own long-lived workers (a ProcessPoolExecutor kept
  across tests) survive; the pytest process' RSS growth is recorded for every test;
- attaches what it measured to the test's reports (``report.kit``), which xdist carries to the
  controller, where `megatron_testkit.report` builds the session table and ``--kit-report DIR`` files.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import platform
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any

import psutil
import pytest

from megatron_testkit import (
    admission,
    attribution,
    cuda_context,
    golden_plugin,
    heartbeat,
    library_helpers,
    machine_ledger,
    per_test,
    skips,
    stall,
)
from megatron_testkit.marker_context import apply_test_markers
from megatron_testkit.megatron_cpu import use_cpu_shim  # noqa: F401  (a fixture; imports no torch)
from megatron_testkit.report import ReportCollector, build_report, format_table, plural, write_report
from megatron_testkit.report_dir import SessionLogs
from megatron_testkit.safe_write import WriteRefused
from megatron_testkit.schema import Session

# The one list of the kit's markers (registered below; pyproject keeps no copy).
TIERS = ("L0", "L1", "L2")
_MARKERS = (
    "L0: runs on every pull request; must finish on a 2-core CPU-only runner",
    "L1: the longer set: pushes to main and the needs-more-tests label",
    "L2: nightly and manual dispatch",
    "gpu: needs CUDA; skips with a reason without it (fails instead when KIT_REQUIRE_GPUS promises the GPUs)",
    "world_size(n): the number of ranks the test launches (skips when a GPU test needs more GPUs than exist)",
    "memory_budget(host=None, device=None): per-rank peak limits, e.g. host='1.5GiB', device='4GiB'",
    "leak_guard: apply the kit's leak guard to this test although it launches no ranks",
    "stall_window(seconds): a launch whose ranks wait for each other in collectives this long is a hang "
    "(None: off; default KIT_STALL_WINDOW or 30 s)",
    "fresh_interpreter: the test's launches spawn every rank as a fresh interpreter, never forked from "
    "the warm parent",
    per_test.MARKER,
)
_LEAK_GUARD_MODES = ("ranks", "all", "off")
_ALLOWED_SKIPS = pytest.StashKey["frozenset[str] | None"]()


_SAVED_ROOTS = pytest.StashKey[tuple]()
_SAVED_TERMINAL = pytest.StashKey[tuple]()
_SAVED_WARM = pytest.StashKey[tuple]()
_WORKER_LOG_ROOT = "kit_log_root"  # this session's log folder, handed to xdist workers
_WORKER_LEDGER = "kit_admission_dir"  # this session's admission ledger, handed to xdist workers
_WORKER_MACHINE_LEDGER = "kit_machine_ledger"  # and the machine's, when the session is top-level
_WORKER_WARM_BROKER = "kit_warm_broker"  # where workers ask for this session's warm parents
_SAVED_SIGNALS = pytest.StashKey[dict]()
_SAVED_LIBRARY_HELPERS = pytest.StashKey[tuple]()
_SIGNAL_WATCH = pytest.StashKey[list]()  # under torchrun: `last_words.SignalWatch`, one or none
_SESSION_SHIM = pytest.StashKey[contextlib.ExitStack]()


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("kit", "multi-rank test kit")
    group.addoption(
        "--kit-report",
        metavar="DIR",
        default=None,
        help="write DIR/kit-report.json and DIR/kit-report.md (per-test rank peaks, budgets, "
        "outcomes) and keep every rank's log under DIR/logs/<session>/<test>/rank<N>.log",
    )
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
    parser.addini(
        "kit_skip_summary",
        "group skips by their declared capability in the terminal summary and the report, as under "
        "KIT_ALLOWED_SKIPS (megatron_testkit.skips); off by default, so a project's plain skips print nothing",
        type="bool",
        default=False,
    )
    parser.addini(
        "kit_warm_preload",
        "modules the warm parent imports besides torch and torch.distributed, one per line (ranks "
        "forked from it find them imported; KIT_WARM_PRELOAD adds more, comma-separated)",
        type="linelist",
        default=[],
    )
    parser.addini(
        "kit_require_tier",
        "make a test without exactly one tier marker (L0, L1, L2) a collection error",
        type="bool",
        default=False,
    )
    per_test.add_options(parser, group)


class _KitSession:
    """Per-session state on the process that reports (the controller under xdist)."""

    def __init__(self, config: pytest.Config) -> None:
        self.config = config
        self.collector = ReportCollector()
        self.started = time.time()
        self.rss_start = _rss()
        # A per-test rank's session writes no report: the test's one row is the launching session's.
        option = None if per_test.inside_rank() else config.getoption("--kit-report")
        self.report_dir = Path(config.invocation_params.dir, option).resolve() if option else None
        try:
            self.logs = SessionLogs(self.report_dir) if self.report_dir is not None else None
        except WriteRefused as exc:  # a file, a read-only folder, a link below it
            raise pytest.UsageError(f"--kit-report={option}: {exc}") from None
        self.report: dict[str, Any] | None = None
        self.written: Any = None  # the ReportFiles written, or the one-line reason they were not
        self.interrupted_by = "interrupted"
        self.session_id = uuid.uuid4().hex
        self.saved_machine_env = {
            name: os.environ.get(name)
            for name in (machine_ledger.MACHINE_LEDGER_ENV, machine_ledger.OUTER_SESSION_ENV)
        }
        self.machine: machine_ledger.MachineLedger | None = None
        self.warm_broker: Any = None  # made for the first xdist worker (`megatron_testkit.warm_broker`)
        from megatron_testkit import warm_start

        self.warm_dropped_mark = warm_start.dropped_mark()  # preloads dropped before it are not its own
        try:
            self.ledger, self.own_ledger_dir, self.saved_ledger_env = self.open_ledger()
            if self.ledger is not None:
                self.ledger.join_session(self.session_id)
        except WriteRefused as exc:  # a full disk, a ledger folder that is a file or a link
            if hasattr(self, "own_ledger_dir"):
                self.close_ledger()  # made, then refused on joining: nothing is left behind
            raise pytest.UsageError(f"kit admission ledger: {exc}") from None
        try:
            self.open_machine_ledger()
        except WriteRefused as exc:
            self.close_ledger()
            raise pytest.UsageError(f"kit machine admission ledger: {exc}") from None

    def open_ledger(self) -> tuple[admission.Ledger | None, Path | None, str | None]:
        """The session's admission ledger: an enclosing session's (named in KIT_ADMISSION_DIR), else a
        new one in this session's log folder or a temporary folder; named to every process started
        from here on. Returns it, the folder this session made (removed at the end, if temporary)
        and the variable's previous value."""
        saved = os.environ.get(admission.LEDGER_ENV)
        self.joined_ledger = False
        if not admission.enabled():
            return None, None, saved
        joined = admission.session_ledger()
        self.joined_ledger = joined is not None
        if joined is not None:
            return joined, None, saved
        if self.logs is not None:
            folder, made = self.logs.path / "admission", None
        else:
            folder = Path(tempfile.mkdtemp(prefix="kit-admission-"))
            made = folder
        try:
            ledger = admission.Ledger.create(folder, admission.capacity())
        except WriteRefused:
            if made is not None:  # nothing of a refused session is left behind
                shutil.rmtree(made, ignore_errors=True)
            raise
        os.environ[admission.LEDGER_ENV] = str(folder)
        return ledger, made, saved

    def open_machine_ledger(self) -> None:
        """A session that made its own ledger: when it is top-level, it joins the machine's ledger
        too (`megatron_testkit.machine_ledger`) and names it, and itself as the top-level session,
        to every process it starts; when it is nested, its launches keep to its private ledger."""
        top_level = machine_ledger.is_top_level()
        if top_level:  # named whether or not it admits: sessions below it know they are nested
            os.environ[machine_ledger.OUTER_SESSION_ENV] = machine_ledger.session_marker()
        if self.ledger is None or self.joined_ledger:
            return  # no admission, or it joined an enclosing session's ledger (and its machine's)
        self.machine = machine_ledger.open_for_session() if top_level else None
        if self.machine is not None:
            os.environ[machine_ledger.MACHINE_LEDGER_ENV] = str(self.machine.folder)
        else:
            os.environ.pop(machine_ledger.MACHINE_LEDGER_ENV, None)  # nested: private only

    def close_ledger(self) -> None:
        """Put KIT_ADMISSION_DIR back (a pytester session runs inside another) and remove a temporary ledger."""
        for name, value in self.saved_machine_env.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        if self.saved_ledger_env is None:
            os.environ.pop(admission.LEDGER_ENV, None)
        else:
            os.environ[admission.LEDGER_ENV] = self.saved_ledger_env
        if self.own_ledger_dir is not None:
            shutil.rmtree(self.own_ledger_dir, ignore_errors=True)
            self.own_ledger_dir = None

    def admission_figures(self) -> dict[str, Any]:
        """The session's admission figures for its header (empty without admission)."""
        if self.ledger is None:
            return {}
        with contextlib.suppress(OSError, ValueError):
            figures = self.ledger.leave_session(self.session_id)
            return {
                "admission_limit_bytes": figures["limit_bytes"],
                "admission_peak_bytes": figures["peak_bytes"],
                "admission_source": figures["source"],
                "admission_default_rank_bytes": admission.default_rank_bytes(),
            }
        return {}

    @pytest.hookimpl(optionalhook=True)
    def pytest_configure_node(self, node: Any) -> None:
        """xdist: the workers' launches keep their logs in this session's folder too, and go
        through this session's admission ledger."""
        if self.logs is not None:
            node.workerinput[_WORKER_LOG_ROOT] = str(self.logs.path)
        if self.ledger is not None:
            node.workerinput[_WORKER_LEDGER] = str(self.ledger.folder)
        machine = os.environ.get(machine_ledger.MACHINE_LEDGER_ENV)
        if machine:
            node.workerinput[_WORKER_MACHINE_LEDGER] = machine
        # The workers fork their ranks from this process' warm parents (one per preload set).
        if self.warm_broker is None and os.environ.get("KIT_WARM_START", "1").strip() != "0":
            from megatron_testkit.warm_broker import Broker

            with contextlib.suppress(OSError):
                self.warm_broker = Broker()
        if self.warm_broker is not None:
            node.workerinput[_WORKER_WARM_BROKER] = self.warm_broker.path

    def pytest_keyboard_interrupt(self, excinfo: pytest.ExceptionInfo[BaseException]) -> None:
        self.interrupted_by = f"interrupted ({excinfo.exconly().strip()})"

    # Hooks: this object is registered as a plugin on the reporting process only.
    def pytest_runtest_logstart(self, nodeid: str, location: Any) -> None:
        # A test stopped before its first phase reported (a signal while a fixture launches
        # ranks) has a row to be marked `interrupted`; without one, repro read it as "not run".
        self.collector.start(nodeid)

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self.collector.add(report)

    def pytest_collectreport(self, report: pytest.CollectReport) -> None:
        if report.failed:
            self.collector.add(_CollectError(report))

    def pytest_sessionfinish(self, session: pytest.Session, exitstatus: int) -> None:
        if exitstatus == pytest.ExitCode.INTERRUPTED:
            self.collector.interrupt(self.interrupted_by)
        self.report = build_report(self.session_header(int(exitstatus)), self.collector.rows_json())
        if self.report_dir is not None:
            try:
                self.written = write_report(self.report, self.report_dir)
            except (
                WriteRefused,
                ValueError,
            ) as exc:  # a full disk, a link: the previous report is left whole
                self.written = f"kit: the report was not written: {exc}"
                sys.stderr.write(self.written + "\n")

    def write_now(self, why: str, failure: Any, exitstatus: int) -> None:
        """The report as it stands, written from a thread of the kit's while the main thread cannot
        (a torchrun rank blocked in a collective, `megatron_testkit.last_words`): the running test
        fails with ``failure`` (None: it is ``interrupted``), the session's exit status is ``exitstatus``.
        ``why`` goes to the terminal or CI log, past the running test's captured output."""
        capman = self.config.pluginmanager.getplugin("capturemanager")
        uncaptured = capman.global_and_fixture_disabled() if capman else contextlib.nullcontext()
        with contextlib.suppress(Exception), uncaptured:
            sys.stderr.write(f"kit: {why}\n")
            sys.stderr.flush()
        if failure is None:
            self.collector.interrupt(f"interrupted ({why})")
        else:
            self.collector.fail_running(failure)
        self.report = build_report(self.session_header(exitstatus), self.collector.rows_json())
        if self.report_dir is not None:
            self.written = write_report(self.report, self.report_dir)

    def pytest_terminal_summary(self, terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
        if self.report is None:
            return
        if not any(row["world_size"] for row in self.report["tests"]) and self.report_dir is None:
            return  # no ranks and no --kit-report: nothing worth a table
        terminalreporter.write_sep("=", "kit report: ranks, peaks, budgets")
        written = not isinstance(self.written, str)
        terminalreporter.write_line(
            format_table(self.report, written=self.report_dir is not None and written)
        )
        if self.report_dir is None:
            return
        if not written:
            terminalreporter.write_line(self.written, red=True)
            return
        for note in self.written.notes:
            terminalreporter.write_line(f"kit: {note}", yellow=True)
        merged = ""
        if self.written.sessions > 1:
            merged = (
                f" (with {plural(self.written.sessions - 1, 'earlier session')} of the folder, every row kept; "
                "delete kit-report.json to start afresh)"
            )
        terminalreporter.write_line(f"kit report written to {self.report_dir}/kit-report.{{json,md}}{merged}")

    def session_header(self, exit_status: int | None = None) -> dict[str, Any]:
        from megatron_testkit.ranks import cuda_device_count

        try:
            gpus = cuda_device_count()
        except Exception:
            gpus = 0
        return Session(
            started=datetime.datetime.fromtimestamp(self.started, datetime.timezone.utc).isoformat(),
            duration_s=round(time.time() - self.started, 3),
            pytest_args=[str(a) for a in self.config.invocation_params.args],
            markexpr=self.config.getoption("markexpr", "") or "",
            host=socket.gethostname(),
            platform=platform.platform(),
            python=sys.version.split()[0],
            cpu_count=os.cpu_count(),
            gpus=gpus,
            torch=_version("torch"),
            # Read from the installed metadata: importing megatron here would cost seconds.
            megatron_core=_version("megatron-core"),
            ci_job=os.environ.get("KIT_CI_JOB") or None,  # the CI job (the kit's action sets it)
            pytest_rss_start_bytes=self.rss_start,
            pytest_rss_end_bytes=_rss(),
            allowed_skips=_allowed_list(self.config.stash.get(_ALLOWED_SKIPS, None)),
            exit_status=exit_status,
            cuda_context=_cuda_context_note(),
            cpu_substitutions=self.collector.cpu_substitutions(_taken_substitutions()),
            warm_preload_dropped=_warm_dropped(self.warm_dropped_mark),
            **repro_settings(self.config),
            **self.admission_figures(),
        ).to_json()


def repro_settings(config: pytest.Config) -> dict[str, Any]:
    """What a repro of this session restores: its recorded settings, hypothesis's seed, the
    runner's memory limit (and where it came from), whether the skip summary was asked for."""
    from megatron_testkit.repro_settings import hypothesis_seed, recorded_settings, runner_memory

    limit, source = runner_memory()
    return {
        "settings": recorded_settings(),
        "hypothesis_seed": hypothesis_seed(config),
        "runner_memory_bytes": limit,
        "runner_memory_source": source,
        "skip_summary": _skip_summary(config),
    }


def _skip_summary(config: pytest.Config) -> bool:
    """The skip policy's summary: under KIT_ALLOWED_SKIPS, or with the ini option ``kit_skip_summary``."""
    return config.stash.get(_ALLOWED_SKIPS, None) is not None or bool(config.getini("kit_skip_summary"))


def _allowed_list(allowed: frozenset[str] | None) -> list[str] | None:
    return None if allowed is None else sorted(allowed)


def _cuda_context_note() -> str | None:
    """The header's note on a CUDA context in this process that no test's own code created."""
    cuda_context.observe(cuda_context.OUTSIDE)  # one made after the last test (a session hook)
    return cuda_context.header_note(cuda_context.origin())


def _warm_dropped(mark: int) -> list[str] | None:
    """The modules this session dropped from the warm preload set, one line each; None when none."""
    from megatron_testkit import warm_start

    return warm_start.dropped_since(mark) or None


def _rss() -> int:
    return psutil.Process().memory_info().rss


def _version(distribution: str) -> str | None:
    """The installed version of ``distribution``, without importing it; None when not installed."""
    from importlib import metadata

    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


def _is_xdist_worker(config: pytest.Config) -> bool:
    return hasattr(config, "workerinput")


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_load_initial_conftests(early_config: pytest.Config) -> Iterator[None]:
    """Before pytest captures output (its own wrapper of this hook starts it): keep the terminal's
    stderr for the launches' progress lines (`megatron_testkit.heartbeat`)."""
    heartbeat.save_terminal()
    return (yield)


def pytest_configure(config: pytest.Config) -> None:
    # Registered here too, so a repository that pip-installs the plugin gets them under
    # --strict-markers without copying our pyproject.
    for line in _MARKERS:
        config.addinivalue_line("markers", line)
    _leak_guard_mode(config)  # a bad value is a usage error now, not in the first test's teardown
    _declare_library_helpers(config)
    _register_skip_policy(config)
    _check_kit_environment()
    from megatron_testkit import warm_start

    # Saved and restored with the roots below: an in-process pytester session has its own ini.
    config.stash[_SAVED_WARM] = warm_start.settings()
    warm_start.set_ini_preload(config.getini("kit_warm_preload"))
    if not config.pluginmanager.has_plugin("kit-golden"):  # kit_metrics, golden values (its module)
        config.pluginmanager.register(golden_plugin, "kit-golden")
    # Saved and restored: a pytester session run in-process must not redirect the outer one's logs.
    config.stash[_SAVED_ROOTS] = (attribution.log_root(), attribution.scratch_root())
    # The heartbeat starts its lines on a new line when pytest's dots left this one unfinished.
    config.stash[_SAVED_TERMINAL] = heartbeat.followed_terminal()
    if _is_xdist_worker(config):
        heartbeat.follow_terminal(None, column_unknown=True)
    else:
        heartbeat.follow_terminal(lambda: _terminal_writer(config))
    if _is_xdist_worker(config):
        root = config.workerinput.get(_WORKER_LOG_ROOT)  # type: ignore[attr-defined]
        if root:
            attribution.set_log_root(root)
        ledger = config.workerinput.get(_WORKER_LEDGER)  # type: ignore[attr-defined]
        if ledger:
            os.environ[admission.LEDGER_ENV] = ledger
        machine = config.workerinput.get(_WORKER_MACHINE_LEDGER)  # type: ignore[attr-defined]
        if machine:
            os.environ[machine_ledger.MACHINE_LEDGER_ENV] = machine
        warm_start.set_broker(config.workerinput.get(_WORKER_WARM_BROKER))  # type: ignore[attr-defined]
    else:
        kit_session = _KitSession(config)
        config.pluginmanager.register(kit_session, "kit-session-report")
        from megatron_testkit.ranks import in_torchrun

        if in_torchrun():
            from megatron_testkit import last_words

            last_words.set_writer(kit_session.write_now)
        if kit_session.logs is not None:
            attribution.set_log_root(str(kit_session.logs.path))
    config.stash[_SAVED_SIGNALS] = _stop_signals_as_interrupt(config)
    _configure_per_test(config)


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


def _taken_substitutions() -> dict[str, int]:
    """The CPU layer's substitutions of this process not yet given to a test's report (none in a
    per-test rank's session: the rank's record carries them to the launching session)."""
    shim = sys.modules.get("megatron_testkit.megatron_cpu")
    if per_test.inside_rank():
        return {}
    return shim.take_substitutions() if shim is not None else {}


def _register_skip_policy(config: pytest.Config) -> None:
    """Declared skips (`megatron_testkit.skips`): ``KIT_ALLOWED_SKIPS`` is read once, here."""
    try:
        allowed = skips.allowed_skips()
    except ValueError as exc:
        raise pytest.UsageError(str(exc)) from None
    config.stash[_ALLOWED_SKIPS] = allowed
    summary = allowed is not None or bool(config.getini("kit_skip_summary"))
    config.pluginmanager.register(skips.SkipPolicy(allowed, summary=summary), "kit-skip-policy")


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


# The signals that stop a session the way Ctrl-C does: a CI cancel or torchrun's agent (SIGTERM), a
# closed terminal or SSH session (SIGHUP), and SIGQUIT (Ctrl-\\), which dumps every thread's stack first.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)


def _stop_signals_as_interrupt(config: pytest.Config) -> dict[int, Any]:
    """SIGTERM, SIGHUP and SIGQUIT as Ctrl-C. As a KeyboardInterrupt, the launcher kills the ranks
    and their helpers and pytest ends the session, writing the report and junit. After the first
    stop signal, Ctrl-C included, the later ones are ignored while that cleanup runs: a CI cancel
    sends SIGINT, then SIGTERM, and a second KeyboardInterrupt inside the cleanup killed pytest,
    at times after a report that called the stopped test passed, exit status 0. Only a default
    handler is replaced (never one the project set, nor an ignored signal: ``nohup``'s SIGHUP);
    returns the handlers to restore."""
    from megatron_testkit.ranks import in_torchrun

    if threading.current_thread() is not threading.main_thread():
        return {}
    source = " from the torchrun agent" if in_torchrun() else ""
    saved: dict[int, Any] = {}
    watch: list[Any] = []  # under torchrun: the thread that ends a rank whose main thread cannot

    def interrupt(signum: int, frame: Any) -> None:
        for taken in watch:
            taken.taken()
        # A Python handler, not SIG_IGN: an ignored signal would stay ignored in processes spawned later.
        for stop in saved:
            signal.signal(stop, lambda *_: None)
        name = signal.Signals(signum).name
        if signum == signal.SIGQUIT:
            import faulthandler

            # To the terminal or the CI log, not into the running test's captured output.
            capman = config.pluginmanager.getplugin("capturemanager")
            uncaptured = capman.global_and_fixture_disabled() if capman else contextlib.nullcontext()
            with contextlib.suppress(Exception), uncaptured:
                sys.stderr.write(f"kit: {name}: the stack of every thread, then the session stops\n")
                sys.stderr.flush()
                faulthandler.dump_traceback(all_threads=True)
        if signum == signal.SIGINT:
            raise KeyboardInterrupt  # as Python's own handler raises it: pytest's message is unchanged
        raise KeyboardInterrupt(f"signal {signum} ({name}){source if signum == signal.SIGTERM else ''}")

    for signum in STOP_SIGNALS:
        if signal.getsignal(signum) is signal.SIG_DFL:
            saved[signum] = signal.signal(signum, interrupt)
    # Ctrl-C stops the session as before; taken here so that it, too, silences the later ones.
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        saved[signal.SIGINT] = signal.signal(signal.SIGINT, interrupt)
    if in_torchrun() and saved.get(signal.SIGTERM) is not None:
        # A rank blocked in a collective never runs the handler above: a thread writes its report.
        from megatron_testkit.last_words import SignalWatch

        try:
            watch.append(SignalWatch(tuple(s for s in STOP_SIGNALS if s in saved), source))
        except (OSError, ValueError) as exc:
            sys.stderr.write(f"kit: no signal watch for this torchrun rank: {exc}\n")
        config.stash[_SIGNAL_WATCH] = watch
    return saved


@pytest.hookimpl(trylast=True)
def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    """A session that selected no test says which selection and which markers the project
    declares, in one line (the kit's action fails the job on pytest's exit 5)."""
    if exitstatus == pytest.ExitCode.NO_TESTS_COLLECTED and not _is_xdist_worker(config):
        from megatron_testkit.empty_selection import explain

        terminalreporter.write_line(explain(config), red=True)


def _terminal_writer(config: pytest.Config) -> Any:
    """pytest's terminal writer (where its progress dots go), or None without a terminal reporter."""
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    return getattr(reporter, "_tw", None)


def pytest_unconfigure(config: pytest.Config) -> None:
    terminal = config.stash.get(_SAVED_TERMINAL, None)
    if terminal is not None:
        heartbeat.follow_terminal(terminal[0], column_unknown=terminal[1])
    shim = config.stash.get(_SESSION_SHIM, None)
    if shim is not None:
        shim.close()
    saved = config.stash.get(_SAVED_ROOTS, None)
    if saved is not None:
        attribution.set_log_root(saved[0])
        attribution.set_scratch_root(saved[1])
    warm = config.stash.get(_SAVED_WARM, None)
    if warm is not None:
        from megatron_testkit import warm_start

        warm_start.restore_settings(warm)
    for signum, previous in config.stash.get(_SAVED_SIGNALS, {}).items():
        signal.signal(signum, previous)
    for watch in config.stash.get(_SIGNAL_WATCH, []):
        watch.close()
    declared = config.stash.get(_SAVED_LIBRARY_HELPERS, None)
    if declared is not None:
        library_helpers.set_declared(declared)
    kit_session = config.pluginmanager.get_plugin("kit-session-report")
    if kit_session is not None:
        from megatron_testkit import last_words

        last_words.set_writer(None)
        if kit_session.warm_broker is not None:
            kit_session.warm_broker.close()
        kit_session.close_ledger()
        if kit_session.logs is not None:
            kit_session.logs.close()


def pytest_sessionstart(session: pytest.Session) -> None:
    # Launch directories of failed runs outside --kit-report go to pytest's basetemp, which
    # pytest prunes (keeps the last few sessions), instead of piling up in /tmp.
    factory = getattr(session.config, "_tmp_path_factory", None)
    if factory is not None:
        with contextlib.suppress(Exception):
            attribution.set_scratch_root(str(factory.getbasetemp() / "kit-ranks"))


# ---- markers -------------------------------------------------------------------------------
@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(
    session: pytest.Session, config: pytest.Config, items: list[pytest.Item]
) -> None:
    """With ``kit_require_tier``: every collected test carries exactly one of L0, L1, L2.

    Checked before ``-m`` deselects anything, so a test without a tier cannot hide from every
    tier's run. A test marked twice with the same tier (module and function) has one tier.
    """
    if not config.getini("kit_require_tier"):
        return
    problems = []
    for item in items:
        tiers = sorted({m.name for m in item.iter_markers() if m.name in TIERS})
        if len(tiers) != 1:
            problems.append(f"{item.nodeid}: {', '.join(tiers) if tiers else 'no tier'}")
    if problems:
        raise pytest.UsageError(
            f"kit_require_tier: every test needs exactly one tier marker of {', '.join(TIERS)}; "
            f"{len(problems)} do not:\n  " + "\n  ".join(problems)
        )


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    if _SESSION_SHIM in item.config.stash:  # kit_cpu_shim: megatron-core imported since is covered too
        from megatron_testkit.megatron_cpu import cover_late_imports

        cover_late_imports()
    apply_test_markers(item)


# ---- attribution and per-test measurements -----------------------------------------------------
@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    attribution.begin_test(item.nodeid, None)
    item.stash[_RSS_BEFORE] = _rss()
    cuda_context.observe(cuda_context.OUTSIDE)  # a context before the test: not its code's
    try:
        return (yield)
    finally:
        attribution.end_test()
        cuda_context.observe(cuda_context.TEST, item.nodeid)


_RSS_BEFORE = pytest.StashKey[int]()
_LEAKED = pytest.StashKey[int]()
_SENT = pytest.StashKey[int]()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[Any]:
    report = yield
    context = attribution.current()
    kit: dict[str, Any] = {}
    if context is not None:
        sent = item.stash.get(_SENT, 0)
        kit["runs"] = [run.to_json() for run in context.runs[sent:]]
        item.stash[_SENT] = len(context.runs)
        if context.budget is not None:
            kit["budget_host_bytes"] = context.budget.host_bytes
            kit["budget_device_bytes"] = context.budget.device_bytes
    if call.excinfo is not None:
        from megatron_testkit.diagnosis import RankFailure

        exc = call.excinfo.value
        if isinstance(exc, RankFailure):
            kit["failure"] = asdict(exc.to_failure(limit=20000))
    if call.when == "setup":
        kit["pytest_rss_before_bytes"] = item.stash.get(_RSS_BEFORE, None)
    if call.when == "teardown":
        kit["pytest_rss_after_bytes"] = _rss()
        kit["leaked_processes"] = item.stash.get(_LEAKED, 0)
    kit["worker"] = os.environ.get("PYTEST_XDIST_WORKER")
    substituted = _taken_substitutions()
    if substituted:  # the CPU layer's, in this process and the test's ranks: the report's header
        kit["cpu_substitutions"] = substituted
    report.kit = kit
    return report


# ---- the leak guard ------------------------------------------------------------------------------
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
    request.node.stash[_LEAKED] = len(leaked)
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


# ---- the session report ----------------------------------------------------------------------
class _CollectError:
    """A failed collection as a report row (a module that fails to import is part of the story)."""

    def __init__(self, report: pytest.CollectReport) -> None:
        self.nodeid = report.nodeid or "<collection>"
        self.when = "collect"
        self.outcome = "failed"
        self.duration = 0.0
        self.longrepr = report.longrepr
        self.longreprtext = report.longreprtext
