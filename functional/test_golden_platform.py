"""The golden platform comes from the launches a test's numbers came from, fixture launches included.

A GPU runner's first run showed why: the CP pretrain->SFT golden test took its platform from its
own launches only; its NCCL launches ran in a module-scoped fixture (recorded on the
first test that used it), so the golden test named its platform ``cpu-gloo`` on a GPU runner:
the wrong file was looked for, ``golden update`` wrote the wrong one and the GPU-only
throughput bound was dropped. Here the same shape runs on gloo in an inner session: a
module-scoped fixture launches two ranks, and two tests record metrics from its value. The ranks
name their platform through the same path an NCCL launch takes (the rank records it, the launch
carries it, the plugin reads the launches behind the test); on gloo it is forced by giving the
ranks ``KIT_GOLDEN_PLATFORM`` (their environment only, not the pytest process').
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from fixtures.inner_session import run_inner_session

pytestmark = pytest.mark.L0

INNER = textwrap.dedent(
    """
    import pytest
    from megatron_testkit import metrics
    from megatron_testkit.ranks import run_ranks

    RANKS_ENV = {RANKS_ENV!r}

    def worker(rank, world_size):
        return rank

    @pytest.fixture(scope="module")
    def launched():
        return run_ranks(worker, 2, backend="gloo", timeout=120, env=RANKS_ENV or None)

    @pytest.mark.L0
    def test_sets_the_fixture_up(launched, kit_metrics):
        kit_metrics.record("ranks", 1, len(launched))

    @pytest.mark.L0
    def test_uses_the_fixtures_value_only(launched, kit_metrics):
        kit_metrics.record("ranks", 1, len(launched))

    @pytest.mark.L0
    def test_launches_itself(kit_metrics):
        kit_metrics.record("ranks", 1, len(run_ranks(worker, 2, backend="gloo", timeout=120)))
    """
)


def _platforms(tmp_path: Path, ranks_env: dict[str, str]) -> dict[str, str]:
    result = run_inner_session(tmp_path, "test_inner.py", INNER.replace("{RANKS_ENV!r}", repr(ranks_env)))
    assert result["rc"] == 0, result["output"][-3000:]
    return {name: row["metrics"]["platform"] for name, row in result["rows"].items()}


def test_a_module_fixtures_launch_names_the_platform_of_every_test_using_its_value(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("CI", raising=False)  # candidates, not failures: the platform is what is read
    monkeypatch.delenv("KIT_GOLDEN_PLATFORM", raising=False)
    platforms = _platforms(tmp_path, {"KIT_GOLDEN_PLATFORM": "h200-nvl-nccl"})
    # Both tests that use the fixture's value, not only the one it was set up in (the old code
    # gave cpu-gloo to both: the first's own launches were read as a gloo launch, the second had none).
    assert platforms["test_sets_the_fixture_up"] == "h200-nvl-nccl"
    assert platforms["test_uses_the_fixtures_value_only"] == "h200-nvl-nccl"
    # A test that launched its own gloo ranks (without the fixture) is a CPU test.
    assert platforms["test_launches_itself"] == "cpu-gloo"
    # The candidate files were written under the platform the launches named.
    names = sorted(p.name for p in tmp_path.glob("golden/test_inner/*.candidate.json"))
    assert names == [
        "test_launches_itself.cpu-gloo.candidate.json",
        "test_sets_the_fixture_up.h200-nvl-nccl.candidate.json",
        "test_uses_the_fixtures_value_only.h200-nvl-nccl.candidate.json",
    ]


def worker(rank: int, world_size: int) -> int:
    return rank


def test_the_launch_records_the_platform_and_device_its_ranks_named(monkeypatch: pytest.MonkeyPatch) -> None:
    from megatron_testkit import attribution
    from megatron_testkit.ranks import run_ranks

    monkeypatch.delenv("KIT_GOLDEN_PLATFORM", raising=False)
    context = attribution.current()
    assert context is not None
    run_ranks(worker, 1, backend="gloo", timeout=120)
    forced = {"KIT_GOLDEN_PLATFORM": "b200-nccl"}
    run_ranks(worker, 1, backend="gloo", timeout=120, env=forced)
    plain, named = context.runs[-2:]
    # CPU ranks: no device of their own, cpu-gloo; the ranks' environment names their platform.
    assert (plain.platform, plain.device, plain.backend) == ("cpu-gloo", None, "gloo")
    assert (named.platform, named.device) == ("b200-nccl", None)
