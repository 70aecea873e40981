"""Every tier selects real tests: `ci/test.sh L1` with nothing in L1 would fail at 3 a.m., so it fails here.

One collection of the whole suite (in a subprocess, as `pytest --co -m <tier>` would collect it,
shared with the other checks that read it: `fixtures.suite_collection`) counts the tests of each
tier. The collection-time check that every test has exactly one tier is the plugin's; this checks
that no tier has gone empty and that the longer scenarios are in L1.
"""

from __future__ import annotations

import pytest

from ci.jobs import TIERS
from fixtures.suite_collection import whole_suite

pytestmark = pytest.mark.L0


@pytest.fixture(scope="module")
def by_tier(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[str]]:
    return whole_suite(tmp_path_factory).by_tier()


@pytest.mark.parametrize("tier", ["L0", "L1", "L2"])
def test_every_tier_selects_tests(by_tier: dict[str, list[str]], tier: str) -> None:
    assert tier in TIERS
    assert by_tier.get(tier), f"`pytest -m {tier}` collects nothing: ci/test.sh {tier} would fail in CI"


def test_the_longer_scenarios_are_in_l1(by_tier: dict[str, list[str]]) -> None:
    l1 = by_tier.get("L1", [])
    assert any("dp2xpp2" in nodeid for nodeid in l1), "DP2xPP2"
    assert any(nodeid.startswith("functional/test_repro.py::") for nodeid in l1), "the runner-limit runs"


def test_the_fault_campaign_is_in_l2(by_tier: dict[str, list[str]]) -> None:
    assert any(nodeid.startswith("functional/test_fault_campaign.py::") for nodeid in by_tier.get("L2", []))


def test_no_test_is_in_two_tiers(by_tier: dict[str, list[str]]) -> None:
    doubled = {key: ids for key, ids in by_tier.items() if "," in key}
    assert not doubled, doubled
