"""The kit's session and its report: ``--kit-report``, the session's admission ledgers and log
folder, what it shares with its xdist workers (log root, ledgers, warm parents) and with nested
sessions (``KIT_ADMISSION_DIR``), the rows folded from every test's reports and the header, the
kit report written at the end and its table in the terminal summary.

On the reporting process (the controller under xdist) a `_KitSession` is registered as the plugin
``kit-session-report``; a worker takes the controller's folders from ``workerinput``. A plugin module
registered by `megatron_testkit.plugin`.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import platform
import shutil
import socket
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from megatron_testkit import admission, attribution, cuda_context, machine_ledger, per_test
from megatron_testkit.attribution_plugin import rss, taken_substitutions
from megatron_testkit.markers_plugin import allowed_skips, skip_summary
from megatron_testkit.report import ReportCollector, build_report, format_table, plural, write_report
from megatron_testkit.report_dir import SessionLogs
from megatron_testkit.safe_write import WriteRefused
from megatron_testkit.schema import Session

_SAVED_ROOTS = pytest.StashKey[tuple]()
_WORKER_LOG_ROOT = "kit_log_root"  # this session's log folder, handed to xdist workers
_WORKER_LEDGER = "kit_admission_dir"  # this session's admission ledger, handed to xdist workers
_WORKER_MACHINE_LEDGER = "kit_machine_ledger"  # and the machine's, when the session is top-level
_WORKER_WARM_BROKER = "kit_warm_broker"  # where workers ask for this session's warm parents


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("kit", "multi-rank test kit")
    group.addoption(
        "--kit-report",
        metavar="DIR",
        default=None,
        help="write DIR/kit-report.json and DIR/kit-report.md (per-test rank peaks, budgets, "
        "outcomes) and keep every rank's log under DIR/logs/<session>/<test>/rank<N>.log",
    )


@pytest.hookimpl(trylast=True)
def pytest_configure(config: pytest.Config) -> None:
    """Last of the kit's configuration: the session (its ledgers, folders and environment) is made
    once every check has passed, and after the skip policy, whose summary prints below its table."""
    from megatron_testkit import warm_start

    # Saved and restored: a pytester session run in-process must not redirect the outer one's logs.
    config.stash[_SAVED_ROOTS] = (attribution.log_root(), attribution.scratch_root())
    if is_xdist_worker(config):
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


def pytest_sessionstart(session: pytest.Session) -> None:
    # Launch directories of failed runs outside --kit-report go to pytest's basetemp, which
    # pytest prunes (keeps the last few sessions), instead of piling up in /tmp.
    factory = getattr(session.config, "_tmp_path_factory", None)
    if factory is not None:
        with contextlib.suppress(Exception):
            attribution.set_scratch_root(str(factory.getbasetemp() / "kit-ranks"))


@pytest.hookimpl(trylast=True)
def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    """A session that selected no test says which selection and which markers the project
    declares, in one line (the kit's action fails the job on pytest's exit 5)."""
    if exitstatus == pytest.ExitCode.NO_TESTS_COLLECTED and not is_xdist_worker(config):
        from megatron_testkit.empty_selection import explain

        terminalreporter.write_line(explain(config), red=True)


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config: pytest.Config) -> None:
    """Last of the kit's end (its other parts put their state back first): the log roots back,
    the session's broker, ledgers and log folder closed."""
    saved = config.stash.get(_SAVED_ROOTS, None)
    if saved is not None:
        attribution.set_log_root(saved[0])
        attribution.set_scratch_root(saved[1])
    kit_session = config.pluginmanager.get_plugin("kit-session-report")
    if kit_session is not None:
        from megatron_testkit import last_words

        last_words.set_writer(None)
        if kit_session.warm_broker is not None:
            kit_session.warm_broker.close()
        kit_session.close_ledger()
        if kit_session.logs is not None:
            kit_session.logs.close()


class _KitSession:
    """Per-session state on the process that reports (the controller under xdist)."""

    def __init__(self, config: pytest.Config) -> None:
        self.config = config
        self.collector = ReportCollector()
        self.started = time.time()
        self.rss_start = rss()
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
            pytest_rss_end_bytes=rss(),
            allowed_skips=allowed_skips(self.config),
            exit_status=exit_status,
            cuda_context=_cuda_context_note(),
            cpu_substitutions=self.collector.cpu_substitutions(taken_substitutions()),
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
        "skip_summary": skip_summary(config),
    }


def _cuda_context_note() -> str | None:
    """The header's note on a CUDA context in this process that no test's own code created."""
    cuda_context.observe(cuda_context.OUTSIDE)  # one made after the last test (a session hook)
    return cuda_context.header_note(cuda_context.origin())


def _warm_dropped(mark: int) -> list[str] | None:
    """The modules this session dropped from the warm preload set, one line each; None when none."""
    from megatron_testkit import warm_start

    return warm_start.dropped_since(mark) or None


def _version(distribution: str) -> str | None:
    """The installed version of ``distribution``, without importing it; None when not installed."""
    from importlib import metadata

    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


def is_xdist_worker(config: pytest.Config) -> bool:
    """Whether this process is an xdist worker (the controller reports; workers hand it their rows)."""
    return hasattr(config, "workerinput")


class _CollectError:
    """A failed collection as a report row (a module that fails to import is part of the story)."""

    def __init__(self, report: pytest.CollectReport) -> None:
        self.nodeid = report.nodeid or "<collection>"
        self.when = "collect"
        self.outcome = "failed"
        self.duration = 0.0
        self.longrepr = report.longrepr
        self.longreprtext = report.longreprtext
