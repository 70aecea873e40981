"""Which test is running, with what budget, and what its rank launches measured.

`run_ranks` is a plain function: it must not need a fixture argument to know the test it serves.
The plugin opens a `TestContext` around each test; `run_ranks` reads the budget and log root from
it and appends one `Run` (the report schema's launch record) per launch. The launches a fixture's
setup made are also kept by fixture, so a test that only uses a module-scoped fixture's value
still knows which launches (which backend, which device) its numbers came from. Outside pytest (scripts, torchrun jobs) there is no
context and the launcher falls back to ``PYTEST_CURRENT_TEST`` or the function's name.
"""

from __future__ import annotations

import hashlib
import os
import re
from dataclasses import dataclass, field

from megatron_testkit.budgets import MemoryBudget
from megatron_testkit.schema import Run


@dataclass
class TestContext:
    """The test being run: its id, budget, where rank logs go, and the launches so far."""

    nodeid: str
    budget: MemoryBudget | None = None
    log_root: str | None = None
    gpu: bool | None = None  # marked `gpu`; None outside a test (set by the plugin at setup)
    # The test's stall_window marker: seconds, None (off), or "default" (KIT_STALL_WINDOW or 30 s).
    stall_window: float | str | None = "default"
    # Marked `fresh_interpreter`: its launches always spawn their ranks (never warm starts).
    fresh_interpreter: bool = False
    runs: list[Run] = field(default_factory=list)


# A stack, not one slot: pytester runs a test session inside a test.
_contexts: list[TestContext] = []
_log_root: str | None = None


_scratch_root: str | None = None


def set_scratch_root(path: str | None) -> None:
    """Where launches without ``--kit-report`` put their directory (pytest's basetemp, which
    pytest prunes itself); None means the system temp dir. Passing launches delete theirs."""
    global _scratch_root
    _scratch_root = path


def scratch_root() -> str | None:
    """The directory set by `set_scratch_root`, if any."""
    return _scratch_root


def set_log_root(path: str | None) -> None:
    """Session-wide directory for rank logs (``--kit-report DIR`` gives ``DIR/logs``)."""
    global _log_root
    _log_root = path


def log_root() -> str | None:
    """The directory set by `set_log_root`, if any."""
    return _log_root


def begin_test(nodeid: str, budget: MemoryBudget | None) -> TestContext:
    """Open the context for one test (called by the plugin before setup)."""
    context = TestContext(nodeid=nodeid, budget=budget, log_root=_log_root)
    _contexts.append(context)
    return context


def end_test() -> TestContext | None:
    """Close and return the current context (called by the plugin after teardown)."""
    return _contexts.pop() if _contexts else None


def current() -> TestContext | None:
    """The open context, or None outside a test run by the plugin."""
    return _contexts[-1] if _contexts else None


def current_test_id() -> str | None:
    """The running test's node id, from the plugin or else from ``PYTEST_CURRENT_TEST``."""
    if _contexts:
        return _contexts[-1].nodeid
    env = os.environ.get("PYTEST_CURRENT_TEST")
    if env:
        # "path::name (call)": drop the phase suffix so every phase gives the same id.
        return env.rsplit(" (", 1)[0]
    return None


def record_run(summary: Run) -> None:
    """Attribute one launch to the current test (dropped outside a test)."""
    if _contexts:
        _contexts[-1].runs.append(summary)


# The launches made while each live fixture was set up, by the fixture's key (the plugin's
# fixture definition) with its name: a module- or session-scoped fixture's launches are recorded
# on the test that happened to set it up, and every later test using its value came from them too.
_fixture_runs: dict[object, tuple[str, list[Run]]] = {}


def record_fixture_runs(key: object, name: str, runs: list[Run]) -> None:
    """Remember the launches a fixture's setup made (replacing its previous setup's)."""
    _fixture_runs[key] = (name, list(runs))


def forget_fixture(key: object) -> None:
    """The fixture was torn down: its launches no longer stand behind any value."""
    _fixture_runs.pop(key, None)


def fixture_runs(names: list[str]) -> list[Run]:
    """The launches behind the live fixtures called ``names`` (a test's fixture closure)."""
    wanted = set(names)
    return [run for name, runs in _fixture_runs.values() if name in wanted for run in runs]


def seed_for(test_id: str) -> int:
    """A deterministic 31-bit seed from a test id, so a rerun of the same id draws the same data.

    ``KIT_SEED`` overrides it (the report's `seed` column, replayed by a repro command).
    """
    override = os.environ.get("KIT_SEED", "").strip()
    if override:
        if not (override.isdigit() and int(override) < 2**31):
            raise ValueError(
                f"KIT_SEED={override!r}: expected a whole number from 0 to 2**31-1 (a report's seed)"
            )
        return int(override)
    return int.from_bytes(hashlib.sha256(test_id.encode()).digest()[:4], "big") & 0x7FFFFFFF


def sanitise(test_id: str, limit: int = 120) -> str:
    """A file-system-safe directory name for a test id, unique even when truncated."""
    name = re.sub(r"[^A-Za-z0-9._-]+", "_", test_id).strip("_.") or "test"
    if len(name) > limit:
        digest = hashlib.sha256(test_id.encode()).hexdigest()[:10]
        name = f"{name[: limit - 11]}-{digest}"
    return name
