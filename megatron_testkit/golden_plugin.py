"""The golden-value part of the pytest plugin: the `kit_metrics` fixture, the comparison when a test
body returns, and the recorded series in the kit report (``report.kit["metrics"]``).

Registered by `megatron_testkit.plugin`. A test that records nothing is untouched. A golden
mismatch fails the test in its call phase with a table (metric, step, golden, got, allowed); the
report names the failure kind ``golden``. With no golden file for the platform, a CI run
(``CI=true``) fails the same way; a local run writes a candidate beside where the file belongs
and passes with a warning.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from megatron_testkit import attribution, golden, metrics, platforms
from megatron_testkit.metrics import MetricsRecorder, TestMetrics
from megatron_testkit.safe_write import WriteRefused

PLATFORM_ENV = platforms.PLATFORM_ENV  # overrides the platform key (a runner the kit cannot name)
_RECORDER = pytest.StashKey[MetricsRecorder]()
_METRICS = pytest.StashKey[TestMetrics]()


class GoldenMismatch(pytest.fail.Exception):  # type: ignore[misc,name-defined]
    """The recorded series left their golden values (or, on CI, have none): failure kind ``golden``."""

    def __init__(self, message: str) -> None:
        super().__init__(message, pytrace=False)


class GoldenCandidateWarning(UserWarning):
    """No golden file for this platform: a candidate was written (local runs only)."""


@pytest.fixture
def kit_metrics(request: pytest.FixtureRequest) -> Iterator[MetricsRecorder]:
    """Records the test's metric series (`MetricsRecorder.record`); ranks record with
    `megatron_testkit.metrics.record`. Compared with the golden file when the test body returns."""
    directory = tempfile.mkdtemp(prefix="kit-metrics-")
    recorder = MetricsRecorder(directory)
    request.node.stash[_RECORDER] = recorder
    saved = os.environ.get(metrics.METRICS_DIR_ENV)
    os.environ[metrics.METRICS_DIR_ENV] = directory  # spawned ranks inherit it
    metrics.activate(recorder)
    try:
        yield recorder
    finally:
        metrics.activate(None)
        if saved is None:
            os.environ.pop(metrics.METRICS_DIR_ENV, None)
        else:
            os.environ[metrics.METRICS_DIR_ENV] = saved
        shutil.rmtree(directory, ignore_errors=True)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Iterator[None]:
    """After the test body: collect what ranks recorded; compare when the body passed."""
    recorder = item.stash.get(_RECORDER, None)
    refused: ValueError | None = None
    try:
        result = yield
    finally:
        if recorder is not None:
            try:
                recorder.collect_ranks()
            except (ValueError, TypeError) as exc:  # a rank's line the kit refuses (named in it)
                refused = ValueError(str(exc))
            item.stash[_METRICS] = TestMetrics(_platform(item), _version("megatron-core"), recorder.series)
    if refused is not None:
        pytest.fail(f"kit metrics: {refused}", pytrace=False)
    if recorder is not None and recorder.series:
        check(item.nodeid, item.path, item.stash[_METRICS], item.config.getoption("--kit-report", None))
    return result


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[Any]:
    """Add the series (and a golden failure's kind) to the call phase's ``report.kit``; outermost,
    so it adds to what the kit's own hook attached."""
    report = yield
    found = item.stash.get(_METRICS, None)
    if call.when != "call" or found is None:
        return report
    kit = dict(getattr(report, "kit", None) or {})
    kit["metrics"] = found.to_json()
    if call.excinfo is not None and isinstance(call.excinfo.value, GoldenMismatch):
        message = str(call.excinfo.value)
        kit["failure"] = {
            "rank": None,
            "kind": "golden",
            "first_line": message.splitlines()[0],
            "message": message,
        }
    report.kit = kit
    return report


def check(
    nodeid: str, test_file: str | os.PathLike, found: TestMetrics, report_dir: str | None = None
) -> None:
    """Compare ``found`` with the test's golden file; raises `GoldenMismatch`, or writes a candidate.
    `report_dir` (``--kit-report``) is where the refresh command finds this run's report.

    A platform key that is not one (``KIT_GOLDEN_PLATFORM=../x``), a malformed golden file or a
    candidate path the writer refuses (a link) fails the test in one line naming it."""
    _, name = golden.golden_stem(nodeid)
    try:
        source = PLATFORM_ENV if os.environ.get(PLATFORM_ENV) else "platform"
        platforms.check_platform(found.platform, source)
        paths = golden.golden_paths(Path(test_file), name, found.platform, found.megatron_core)
        path = golden.find_golden(paths)
        if path is None:
            _missing(nodeid, paths[-1], found, report_dir)
            return
        want = golden.read_golden(path)
    except (golden.GoldenFileError, platforms.PlatformKeyError, WriteRefused) as exc:
        pytest.fail(f"golden values: {exc}", pytrace=False)
    rows = golden.compare(want, found, platform=found.platform)
    if rows:
        raise GoldenMismatch(
            golden.mismatch_message(nodeid, path, rows, _release_note(want, found), report_dir)
        )


def _release_note(want: TestMetrics, found: TestMetrics) -> str:
    """Said when the file was made with another megatron-core minor than this run's (a fallback)."""
    made, now = golden.mcore_minor(want.megatron_core), golden.mcore_minor(found.megatron_core)
    if made == now or now is None:
        return ""
    return (
        f"the file was made with megatron-core {want.megatron_core}, this run has {found.megatron_core}: "
        f"if the release explains the difference, golden update writes this release's own file ({now})"
    )


def _missing(nodeid: str, path: Path, found: TestMetrics, report_dir: str | None = None) -> None:
    if os.environ.get("CI", "").lower() == "true":
        raise GoldenMismatch(
            f"golden values: no golden file for {nodeid} on platform {found.platform}: expected {path}; "
            f"make it from this run's report: {golden.refresh_command(report_dir)}"
        )
    candidate = golden.candidate_path(path)
    golden.write_golden(candidate, golden.golden_json(nodeid, found, _version("torch")))
    warnings.warn(
        GoldenCandidateWarning(
            f"no golden file for platform {found.platform}; wrote a candidate to {candidate} "
            f"(review it and rename it to {path.name}, or run {golden.refresh_command(report_dir)})"
        ),
        stacklevel=1,
    )


@pytest.hookimpl(wrapper=True)
def pytest_fixture_setup(fixturedef: pytest.FixtureDef[Any], request: pytest.FixtureRequest) -> Iterator[Any]:
    """Keep the launches a fixture's setup makes, for the tests that use its value (`_platform`)."""
    context = attribution.current()
    before = len(context.runs) if context is not None else 0
    try:
        return (yield)
    finally:
        if context is not None:
            attribution.record_fixture_runs(fixturedef, fixturedef.argname, context.runs[before:])


def pytest_fixture_post_finalizer(fixturedef: pytest.FixtureDef[Any], request: pytest.FixtureRequest) -> None:
    attribution.forget_fixture(fixturedef)


def _launches_behind(item: pytest.Item) -> list[Any]:
    """The launches the test's numbers can have come from: its own, then its fixtures' (any scope)."""
    context = attribution.current()
    own = list(context.runs) if context is not None else []
    seen = {id(run) for run in own}
    names = list(getattr(item, "fixturenames", ()))
    return own + [run for run in attribution.fixture_runs(names) if id(run) not in seen]


def _platform(item: pytest.Item | None = None) -> str:
    """The platform key of the running test, from the launches its metrics came from.

    ``KIT_GOLDEN_PLATFORM`` first; else what the ranks of those launches named (their backend and
    their own device, `torch.cuda.get_device_name()` in the rank), the fixtures' launches included:
    a module-scoped fixture's NCCL launch makes its tests ``<gpu>-nccl`` too.
    """
    override = platforms.platform_override()
    if override:
        return override
    runs = _launches_behind(item) if item is not None else []
    return platforms.platform_of_runs(runs, unnamed_gpu=_gpu_name)


def _gpu_name() -> str | None:
    """The first visible GPU's model from nvidia-smi (which ignores CUDA_VISIBLE_DEVICES, so it is
    asked for that one): only for a launch recorded without its ranks' own device."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")[0].strip()
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader", "-i", visible or "0"],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    lines = out.stdout.strip().splitlines()
    return lines[0].strip() if lines else None


def _version(distribution: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None
