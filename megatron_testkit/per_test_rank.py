"""Inside one rank of a per-test launch: run one test id in a pytest session of this rank's own.

`megatron_testkit.per_test` launches `run_node` on N fresh ranks through `run_ranks` without the
kit's process group, with the environment torchrun gives (``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``), so the suite's own
``init_process_group`` (``env://``, or megatron-core's ``Utils.initialize_distributed``) runs as under
torchrun. The session has the outer session's rootdir, ini file, conftests and plugins; the per-test
option is off in it (``KIT_PER_TEST_NODE`` is set) and it writes no kit report. What the test did is
this rank's result: passed, skipped or xfailed (with the reason); a failure is raised as
`RankTestFailure` carrying the test's own report (its assertion and traceback), which is this
rank's error in the launch's verdict.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any

# Set in every rank of a per-test launch (the test id): the rank's session runs that test itself.
NODE_ENV = "KIT_PER_TEST_NODE"


class RankTestFailure(Exception):
    """The test failed in this rank's session; the message is pytest's report of it."""


class _Outcome:
    """What the rank's session reported for the test (a plugin of that session)."""

    def __init__(self) -> None:
        self.failures: list[str] = []
        self.skipped: str | None = None
        self.xfailed: str | None = None
        self.ran = False

    def pytest_runtest_logreport(self, report: Any) -> None:
        self.ran = True
        if report.failed:
            self.failures.append(_failure_text(report))
        elif report.skipped and hasattr(report, "wasxfail"):
            self.xfailed = str(report.wasxfail or "xfailed")
        elif report.skipped:
            from megatron_testkit.skips import skip_reason

            # The test's own reason, so the launching session reads the capability it declares.
            self.skipped = skip_reason(report)

    def pytest_collectreport(self, report: Any) -> None:
        if report.failed:
            self.failures.append(_failure_text(report, "collect"))


def _failure_text(report: Any, when: str | None = None) -> str:
    """The test's own failure, its one-line cause first (``AssertionError: assert 1 == 2``)."""
    crash = getattr(getattr(report, "longrepr", None), "reprcrash", None)
    first = str(crash.message).splitlines()[0] if crash is not None and crash.message else ""
    phase = when or getattr(report, "when", "call")
    where = f" (in {phase})" if phase != "call" else ""
    return f"{first or 'the test failed'}{where}\n{report.longreprtext}".rstrip()


def run_node(rank: int, world_size: int, request: dict[str, Any]) -> dict[str, Any]:
    """Run ``request["nodeid"]`` in a pytest session of this rank's own; its outcome, or
    `RankTestFailure` with the test's report."""
    import pytest

    os.chdir(request["invocation_dir"])
    outcome = _Outcome()
    code = pytest.main(list(request["args"]), plugins=[outcome])
    if outcome.failures:
        raise RankTestFailure("\n\n".join(outcome.failures))
    if not outcome.ran:
        raise RankTestFailure(
            f"rank {rank}'s pytest session ran no test for {request['nodeid']} (exit status {int(code)})"
        )
    if outcome.xfailed is not None:
        return {"outcome": "xfailed", "reason": outcome.xfailed}
    if outcome.skipped is not None:
        return {"outcome": "skipped", "reason": outcome.skipped}
    return {"outcome": "passed"}


def run_node_megatron(rank: int, world_size: int, request: dict[str, Any]) -> dict[str, Any]:
    """`run_node` for a test whose module imports megatron: its ranks fork from a warm parent that
    preloaded megatron-core as well (the import below is how a launch declares it)."""
    with contextlib.suppress(ImportError):  # not installed: the test's own import says so
        import megatron.core  # noqa: F401

    return run_node(rank, world_size, request)
