"""The kit's markers and what they decide: the one list of the markers (registered here, so a
project that installs the kit gets them under ``--strict-markers``), the tier check
(``kit_require_tier``), each test's markers read into its launches (`megatron_testkit.marker_context`),
and the declared-skip policy (`megatron_testkit.skips`: ``KIT_ALLOWED_SKIPS``, ``kit_skip_summary``).
A plugin module registered by `megatron_testkit.plugin`.
"""

from __future__ import annotations

import pytest

from megatron_testkit import per_test, skips
from megatron_testkit.marker_context import apply_test_markers

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
_ALLOWED_SKIPS = pytest.StashKey["frozenset[str] | None"]()


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addini(
        "kit_skip_summary",
        "group skips by their declared capability in the terminal summary and the report, as under "
        "KIT_ALLOWED_SKIPS (megatron_testkit.skips); off by default, so a project's plain skips print nothing",
        type="bool",
        default=False,
    )
    parser.addini(
        "kit_require_tier",
        "make a test without exactly one tier marker (L0, L1, L2) a collection error",
        type="bool",
        default=False,
    )


def pytest_configure(config: pytest.Config) -> None:
    # Registered here too, so a repository that pip-installs the plugin gets them under
    # --strict-markers without copying our pyproject.
    for line in _MARKERS:
        config.addinivalue_line("markers", line)
    _register_skip_policy(config)


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
    apply_test_markers(item)


def _register_skip_policy(config: pytest.Config) -> None:
    """Declared skips (`megatron_testkit.skips`): ``KIT_ALLOWED_SKIPS`` is read once, here."""
    try:
        allowed = skips.allowed_skips()
    except ValueError as exc:
        raise pytest.UsageError(str(exc)) from None
    config.stash[_ALLOWED_SKIPS] = allowed
    config.pluginmanager.register(skips.SkipPolicy(allowed, summary=skip_summary(config)), "kit-skip-policy")


def allowed_skips(config: pytest.Config) -> list[str] | None:
    """The capabilities ``KIT_ALLOWED_SKIPS`` allows this session to skip, sorted; None when unset."""
    allowed = config.stash.get(_ALLOWED_SKIPS, None)
    return None if allowed is None else sorted(allowed)


def skip_summary(config: pytest.Config) -> bool:
    """The skip policy's summary: under KIT_ALLOWED_SKIPS, or with the ini option ``kit_skip_summary``."""
    return config.stash.get(_ALLOWED_SKIPS, None) is not None or bool(config.getini("kit_skip_summary"))
