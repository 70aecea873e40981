"""The kit's stop signals: SIGTERM (a CI cancel, torchrun's agent), SIGHUP (a closed terminal or SSH
session) and SIGQUIT become a KeyboardInterrupt, as Ctrl-C, so the ranks and their helpers are
killed and the report and junit are written; SIGQUIT dumps every thread's stack first.

A plugin module registered by `megatron_testkit.plugin`: the handlers are installed at
configuration and the previous ones put back at its end.
"""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
from typing import Any

import pytest

_SAVED_SIGNALS = pytest.StashKey[dict]()
_SIGNAL_WATCH = pytest.StashKey[list]()  # under torchrun: `last_words.SignalWatch`, one or none


def pytest_configure(config: pytest.Config) -> None:
    config.stash[_SAVED_SIGNALS] = _stop_signals_as_interrupt(config)


def pytest_unconfigure(config: pytest.Config) -> None:
    for signum, previous in config.stash.get(_SAVED_SIGNALS, {}).items():
        signal.signal(signum, previous)
    for watch in config.stash.get(_SIGNAL_WATCH, []):
        watch.close()


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
