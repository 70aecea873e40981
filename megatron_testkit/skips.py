"""Declared skips: a test skips only for a named capability, and a CI job says which it lacks.

A green job must mean the checks ran. Every skip states the capability it needs from one small
vocabulary (`CAPABILITIES`); the reason reads ``needs <capability>: <why>``. A job lists what its
machine lacks in ``KIT_ALLOWED_SKIPS=a,b`` (set per CI row in ``ci/jobs.py``); under it, a skip for
any other capability, or a skip that names none, becomes a failure that names the test and the
capability. Unset (a developer's machine), skips behave as pytest's; the terminal summary and the
kit report group them by capability only when asked (KIT_ALLOWED_SKIPS set, or the ini option
``kit_skip_summary = true``): a project that did not opt in sees nothing of the policy.

Tests call `skip`, `importorskip`, `skip_if` or `require_megatron` instead of pytest's own
functions (a repository test rejects bare ``pytest.skip``/``importorskip``/``skipif`` in tests).
"""

from __future__ import annotations

import importlib
import os
import re
from collections.abc import Mapping
from types import ModuleType
from typing import Any, NoReturn

import pytest

ALLOWED_SKIPS_ENV = "KIT_ALLOWED_SKIPS"

# The vocabulary: what a test may need that a machine may lack.
CAPABILITIES: dict[str, str] = {
    "cuda": "a CUDA device (torch.cuda.is_available())",
    "gpus": "more than one CUDA device (a gpu test's world_size)",
    "no-cuda": "a machine without CUDA (a CPU-path check that is a no-op where CUDA exists)",
    "te": "Transformer Engine importable",
    "nvdlfw": "nvdlfw-inspect importable",
    "cgroup": "a writable, cappable memory cgroup (root on cgroup v2, or v1)",
    "megatron": "megatron-core importable, at the release the test names",
    "matplotlib": "matplotlib importable (the PNG memory chart)",
}

# "needs <capability>[<bound>]: why", e.g. "needs megatron>=0.19: ...". A job may allow the
# capability as a whole ("megatron") or only with that bound ("megatron>=0.19": an older release).
_TOKEN = r"([a-z][a-z0-9-]*)((?:>=|<=|==|<|>)[0-9][0-9.]*)?"
_REASON = re.compile(rf"^needs {_TOKEN}:\s")
_ALLOWED = re.compile(rf"^{_TOKEN}$")


class UnknownCapability(ValueError):
    """A skip named a capability outside `CAPABILITIES`."""


def _checked(token: str) -> str:
    """``token`` (a capability, optionally with a release bound) if its capability is in the vocabulary."""
    match = _ALLOWED.match(token)
    if match is None or match.group(1) not in CAPABILITIES:
        raise UnknownCapability(
            f"unknown capability {token!r}: expected one of {', '.join(sorted(CAPABILITIES))}"
            " (a release bound may follow, e.g. megatron>=0.19)"
        )
    return token


def reason(capability: str, why: str) -> str:
    """The skip reason for ``capability``: ``needs <capability>: <why>`` (checked against the vocabulary)."""
    return f"needs {_checked(capability)}: {why}"


def capability_of(text: str) -> str | None:
    """The capability a skip reason declares (with its bound, if any), or None for a free-text reason.

    Accepts pytest's rendering too (``Skipped: needs cuda: ...``).
    """
    text = text.strip()
    if text.startswith("Skipped: "):
        text = text[len("Skipped: ") :]
    match = _REASON.match(text)
    if match is None or match.group(1) not in CAPABILITIES:
        return None
    return match.group(1) + (match.group(2) or "")


def base_capability(token: str) -> str:
    """The capability of a declared token without its release bound (``megatron>=0.19`` -> ``megatron``)."""
    match = _ALLOWED.match(token)
    return match.group(1) if match else token


def skip(capability: str, why: str) -> NoReturn:
    """Skip the running test because this machine lacks ``capability``."""
    pytest.skip(reason(capability, why))


def skip_if(condition: bool, capability: str, why: str) -> pytest.MarkDecorator:
    """A ``skipif`` mark whose reason declares ``capability`` (for decorators and ``pytestmark``)."""
    return pytest.mark.skipif(condition, reason=reason(capability, why))


def importorskip(module: str, capability: str, why: str | None = None) -> ModuleType:
    """Import ``module`` or skip for ``capability`` when it is not installed.

    Like pytest's, only `ModuleNotFoundError` skips: a module that is installed but fails to
    import is a broken environment, and that error fails the test.
    """
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as exc:
        skip(capability, why or f"{module} is not installed ({exc})")


def megatron_release() -> tuple[int, ...] | None:
    """The installed megatron-core release as a tuple of ints, or None when it is not installed."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        text = version("megatron-core")
    except PackageNotFoundError:
        return None
    return tuple(int(part) for part in re.findall(r"\d+", text)[:3])


def require_megatron(min_release: str | None = None, why: str = "") -> ModuleType:
    """Import ``megatron.core`` (at least ``min_release``, e.g. ``"0.19"``) or skip for ``megatron``."""
    core = importorskip("megatron.core", "megatron", why or None)
    if min_release is not None:
        wanted = tuple(int(part) for part in min_release.split("."))
        have = megatron_release() or ()
        if have[: len(wanted)] < wanted:
            skip(
                f"megatron>={min_release}",
                why or f"megatron-core {'.'.join(map(str, have))} is older than {min_release}",
            )
    return core


def allowed_skips(environ: Mapping[str, str] | None = None) -> frozenset[str] | None:
    """``KIT_ALLOWED_SKIPS`` as a set of capabilities; None when unset (skips unchecked).

    Set but empty means no skip is allowed. An unknown name is a usage error here, at
    configuration, so a typo cannot allow nothing (or everything) silently.
    """
    environ = os.environ if environ is None else environ
    raw = environ.get(ALLOWED_SKIPS_ENV)
    if raw is None:
        return None
    names = frozenset(part.strip() for part in raw.split(",") if part.strip())
    for name in sorted(names):
        try:
            _checked(name)
        except UnknownCapability as exc:
            raise ValueError(f"{ALLOWED_SKIPS_ENV}={raw!r}: {exc}") from None
    return names


def skip_text(report: Any) -> str:
    """The reason text of a skipped test report (pytest keeps it as (path, line, text))."""
    longrepr = getattr(report, "longrepr", None)
    if isinstance(longrepr, tuple) and len(longrepr) == 3:
        return str(longrepr[2])
    return str(longrepr or "")


def skip_reason(report: Any) -> str:
    """The reason as the test gave it: the report's text without the ``Skipped: `` pytest puts
    before it (a reason handed on to another ``pytest.skip`` would otherwise carry it twice)."""
    text = skip_text(report)
    return text[len("Skipped: ") :] if text.startswith("Skipped: ") else text


def verdict(capability: str | None, allowed: frozenset[str] | None) -> str | None:
    """Why a skip fails the job under ``allowed`` (None: the skip stands)."""
    if allowed is None:
        return None
    if capability is None:
        return "a skip must declare the capability it needs (megatron_testkit.skips)"
    if capability not in allowed and base_capability(capability) not in allowed:
        shown = ",".join(sorted(allowed)) or "(empty)"
        return f"skipped for {capability!r}, which this job has ({ALLOWED_SKIPS_ENV}={shown})"
    return None


class SkipPolicy:
    """The plugin part: reads each test's skip, fails the undeclared ones, counts them by capability."""

    def __init__(self, allowed: frozenset[str] | None, summary: bool = True) -> None:
        self.allowed = allowed
        self.summary = summary  # print the table (KIT_ALLOWED_SKIPS set, or kit_skip_summary)
        self.skipped: dict[str, list[str]] = {}  # capability -> node ids (on the reporting process)

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_makereport(self, item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
        report = yield
        if not report.skipped or hasattr(report, "wasxfail"):
            return report
        text = skip_text(report)
        capability = capability_of(text)
        kit = getattr(report, "kit", None)
        if isinstance(kit, dict):
            kit["skip_capability"] = capability or "undeclared"
        problem = verdict(capability, self.allowed)
        if problem is not None:
            report.outcome = "failed"
            report.longrepr = f"{item.nodeid}: {problem}\n  skip reason: {text.strip()}"
        return report

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if report.skipped and not hasattr(report, "wasxfail"):
            name = capability_of(skip_text(report)) or "undeclared"
            self.skipped.setdefault(name, []).append(report.nodeid)

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        if not self.skipped or not self.summary:
            return
        terminalreporter.write_sep("=", "skips by capability")
        for line in skip_table(self.skipped, self.allowed):
            terminalreporter.write_line(line)


def skip_table(skipped: Mapping[str, list[str]], allowed: frozenset[str] | None) -> list[str]:
    """The terminal's table: one line per capability (count, what it is), then the job's declaration."""
    width = max(len(name) for name in skipped)
    lines = [
        f"{name.ljust(width)}  {len(ids):4d}  {CAPABILITIES.get(base_capability(name), 'no capability declared')}"
        for name, ids in sorted(skipped.items(), key=lambda item: (-len(item[1]), item[0]))
    ]
    if allowed is None:
        lines.append(f"{ALLOWED_SKIPS_ENV} unset: skips are not checked against what this job lacks")
    else:
        lines.append(f"{ALLOWED_SKIPS_ENV}={','.join(sorted(allowed))} (any other skip fails)")
    return lines
