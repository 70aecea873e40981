"""Every CI row of `ci/jobs.py` selects tests: a row whose mark expression collects nothing is red.

`ci/test.sh` turns pytest's "no tests collected" (exit status 5) into a failure, so a row whose
selection is empty fails every night by construction (the L1 and L2 GPU rows did: every `gpu`
test was L0). One collection of the whole suite (in a subprocess, as the rows collect it, shared
with the other checks that read it: `fixtures.suite_collection`) gives each test's markers; each
row's `-m` expression is evaluated on them with pytest's own matcher, the one `-m` uses.
"""

from __future__ import annotations

import pytest

from ci.jobs import JOBS
from fixtures.suite_collection import whole_suite

pytestmark = pytest.mark.L0

TEST_ROWS = {name: job for name, job in JOBS.items() if job.suite == "tests"}
# Controls of the matcher, evaluated in the same collection: no test is in two tiers, so the
# first selects nothing (an empty row cannot hide behind a matcher that says yes to everything).
CONTROLS = {"control: no test": "L0 and L1", "control: L0": "L0"}


@pytest.fixture(scope="module")
def selected(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[str]]:
    suite = whole_suite(tmp_path_factory)
    expressions = {**{name: job.select for name, job in TEST_ROWS.items()}, **CONTROLS}
    return {name: suite.select(expression) for name, expression in expressions.items()}


@pytest.mark.parametrize("row", sorted(TEST_ROWS))
def test_every_row_collects_at_least_one_test(selected: dict[str, list[str]], row: str) -> None:
    job = TEST_ROWS[row]
    assert selected[row], (
        f"row {row}: `pytest -m {job.select!r}` collects nothing; ci/test.sh fails it (rc 5)"
    )


@pytest.mark.parametrize("row", sorted(name for name, job in TEST_ROWS.items() if job.gpus))
def test_every_gpu_row_runs_gpu_tests_of_its_own_tier(selected: dict[str, list[str]], row: str) -> None:
    # The L1/L2 GPU rows: NCCL pipelines (PP, PP x VPP), the 1-rank TE inspector, the NCCL faults.
    expected = {
        "L0-gpu": "functional/test_cp_pretrain_sft.py::",
        "L1-gpu": "functional/test_pp_memory.py::",
        "L2-gpu": "functional/test_fault_campaign.py::",
    }[row]
    assert any(nodeid.startswith(expected) for nodeid in selected[row]), (row, selected[row][:10])


def test_the_matcher_selects_nothing_for_an_impossible_expression(selected: dict[str, list[str]]) -> None:
    assert selected["control: no test"] == [] and selected["control: L0"]
    assert set(selected["L0-cpu"]) == set(selected["control: L0"])  # L0-cpu is `-m L0`
