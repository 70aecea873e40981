"""Declared skips (`megatron_testkit.skips`): a skip names a capability, a job says which it lacks.

The rules restated: under ``KIT_ALLOWED_SKIPS`` a skip for any capability not listed, or a skip
that declares none, fails and names the test and the capability; unset, skips stand as pytest's,
and the summary and the report group them by capability. The plugin is exercised in real inner
pytest sessions (`pytester`); the repository check reads every test module's syntax tree.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from megatron_testkit import skips

pytestmark = pytest.mark.L0
pytest_plugins = ["pytester"]

ROOT = Path(__file__).resolve().parent.parent

INNER = """
import pytest
from megatron_testkit import skips

@pytest.mark.L0
def test_needs_cuda():
    skips.skip("cuda", "no device here")

@pytest.mark.L0
def test_needs_te():
    skips.skip("te", "not installed")

@pytest.mark.L0
def test_free_text():
    pytest.skip("some reason nobody can check")

@pytest.mark.L0
def test_runs():
    assert True

@pytest.mark.L0
@pytest.mark.xfail(strict=True, reason="an xfail is not a skip")
def test_expected_failure():
    assert False
"""


def _outcomes(pytester: pytest.Pytester) -> dict[str, str]:
    report = json.loads((pytester.path / "reports" / "kit-report.json").read_text())
    return {row["nodeid"].split("::")[-1]: row["outcome"] for row in report["tests"]}


def _run(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, allowed: str | None, summary: bool = True
) -> pytest.RunResult:
    pytester.makepyfile(test_inner=INNER)
    if summary:  # the project opts in to the skip summary, as this repository's pyproject does
        pytester.makeini("[pytest]\nkit_skip_summary = true\n")
    if allowed is None:
        monkeypatch.delenv(skips.ALLOWED_SKIPS_ENV, raising=False)
    else:
        monkeypatch.setenv(skips.ALLOWED_SKIPS_ENV, allowed)
    return pytester.runpytest_subprocess("-p", "no:cacheprovider", "--kit-report=reports", "-rs")


def test_unset_skips_stand_and_the_summary_groups_them_by_capability(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    result = _run(pytester, monkeypatch, None)
    result.assert_outcomes(passed=1, skipped=3, xfailed=1)
    result.stdout.fnmatch_lines(
        [
            "*skips by capability*",
            "cuda *1 *a CUDA device*",
            "te *1 *Transformer Engine*",
            "undeclared *1 *no capability declared*",
            "KIT_ALLOWED_SKIPS unset*",
        ]
    )
    report = json.loads((pytester.path / "reports" / "kit-report.json").read_text())
    declared = {row["nodeid"].split("::")[-1]: row["skip_capability"] for row in report["tests"]}
    assert declared["test_needs_cuda"] == "cuda" and declared["test_needs_te"] == "te"
    assert declared["test_free_text"] == "undeclared" and declared["test_runs"] is None
    assert report["session"]["allowed_skips"] is None
    assert (
        "skips by capability: cuda 1, te 1, undeclared 1"
        in (pytester.path / "reports" / "kit-report.md").read_text()
    )


def test_a_project_that_did_not_opt_in_sees_nothing_of_the_skip_policy(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A user's plain `pytest.skip` printed this repository's policy ("skips by capability ...
    # KIT_ALLOWED_SKIPS unset ...") before: neither KIT_ALLOWED_SKIPS nor the ini option is set.
    result = _run(pytester, monkeypatch, None, summary=False)
    result.assert_outcomes(passed=1, skipped=3, xfailed=1)
    text = result.stdout.str() + result.stderr.str()
    assert "skips by capability" not in text and "KIT_ALLOWED_SKIPS" not in text
    assert "capabilit" not in (pytester.path / "reports" / "kit-report.md").read_text()
    report = json.loads((pytester.path / "reports" / "kit-report.json").read_text())
    assert report["session"]["skip_summary"] is False and report["session"]["allowed_skips"] is None


def test_under_a_declared_set_only_the_listed_capabilities_may_skip(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    result = _run(pytester, monkeypatch, "cuda")
    result.assert_outcomes(passed=1, skipped=1, failed=2, xfailed=1)
    result.stdout.fnmatch_lines(
        [
            "*test_inner.py::test_needs_te: skipped for 'te', which this job has (KIT_ALLOWED_SKIPS=cuda)*",
            "*test_inner.py::test_free_text: a skip must declare the capability it needs*",
        ]
    )
    outcomes = _outcomes(pytester)
    assert outcomes["test_needs_cuda"] == "skipped"
    assert outcomes["test_needs_te"] == outcomes["test_free_text"] == "failed"
    assert outcomes["test_expected_failure"] == "skipped"  # xfail keeps pytest's own counting


def test_an_empty_set_allows_no_skip_at_all(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    result = _run(pytester, monkeypatch, "")
    result.assert_outcomes(passed=1, failed=3, xfailed=1)
    result.stdout.fnmatch_lines(
        ["*test_needs_cuda: skipped for 'cuda', which this job has (KIT_ALLOWED_SKIPS=(empty))*"]
    )


def test_a_typo_in_the_declared_set_is_a_usage_error(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    result = _run(pytester, monkeypatch, "cuda,tee")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*KIT_ALLOWED_SKIPS='cuda,tee': unknown capability 'tee'*"])


def test_a_release_bound_is_allowed_alone_or_with_its_capability() -> None:
    bound = skips.capability_of(skips.reason("megatron>=0.19", "0.16.1 lacks the field"))
    assert bound == "megatron>=0.19"
    assert skips.verdict(bound, frozenset({"megatron>=0.19"})) is None
    assert skips.verdict(bound, frozenset({"megatron"})) is None
    # Allowing an older release's gaps is not allowing megatron-core to be missing.
    missing = skips.capability_of(skips.reason("megatron", "not installed"))
    assert "which this job has" in (skips.verdict(missing, frozenset({"megatron>=0.19"})) or "")


@given(st.sampled_from(sorted(skips.CAPABILITIES)), st.text(min_size=1).filter(lambda t: t.strip() == t))
def test_every_capability_round_trips_through_its_reason(capability: str, why: str) -> None:
    text = skips.reason(capability, why)
    assert skips.capability_of(text) == capability
    assert skips.capability_of("Skipped: " + text) == capability


@pytest.mark.parametrize("text", ["needs CUDA", "no GPU here", "needs cudaa: x", "needs: x", ""])
def test_free_text_declares_nothing(text: str) -> None:
    assert skips.capability_of(text) is None


def test_an_unknown_capability_is_refused_where_the_skip_is_written() -> None:
    with pytest.raises(skips.UnknownCapability, match="unknown capability 'gpu'"):
        skips.reason("gpu", "typo of gpus")


def test_importorskip_skips_only_a_missing_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(pytest.skip.Exception, match=r"^needs te: "):
        skips.importorskip("kit_no_such_module_here", "te")
    (tmp_path / "kit_broken_module.py").write_text("raise RuntimeError('broken install')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(RuntimeError, match="broken install"):  # a broken install fails, never skips
        skips.importorskip("kit_broken_module", "te")


# ---- the repository: no bare pytest skip in the tests -------------------------------------------
_BARE = {("pytest", "skip"), ("pytest", "importorskip"), ("mark", "skipif"), ("mark", "skip")}


def bare_skips(source: str, filename: str) -> list[str]:
    """Every call or mark of pytest's own skip functions in ``source`` (not inside strings)."""
    tree = ast.parse(source, filename)
    # `pytest.skip.Exception` names the exception (to catch it in a test), it does not skip.
    caught = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Attribute) and n.attr == "Exception"}
    found = []
    for node in ast.walk(tree):
        if id(node) in caught:
            continue
        if isinstance(node, ast.Attribute) and isinstance(node.value, (ast.Name, ast.Attribute)):
            owner = node.value.id if isinstance(node.value, ast.Name) else node.value.attr
            if (owner, node.attr) in _BARE:
                found.append(f"{filename}:{node.lineno}: {owner}.{node.attr}")
    return found


def test_the_check_finds_each_bare_form_and_ignores_strings() -> None:
    source = (
        "import pytest\n"
        "pytest.skip('x')\n"
        "pytest.importorskip('y')\n"
        "@pytest.mark.skipif(True, reason='z')\ndef f(): pass\n"
        "@pytest.mark.skip(reason='w')\ndef g(): pass\n"
        "TEXT = 'pytest.skip(\"inside a generated test file\")'\n"
        "with pytest.raises(pytest.skip.Exception): pass\n"
    )
    assert [line.split(": ")[1] for line in bare_skips(source, "t.py")] == [
        "pytest.skip",
        "pytest.importorskip",
        "mark.skipif",
        "mark.skip",
    ]


def test_no_test_module_skips_without_declaring_a_capability() -> None:
    found = []
    for folder in ("unit", "functional"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            found += bare_skips(path.read_text(), str(path.relative_to(ROOT)))
    assert found == [], "use megatron_testkit.skips (skip, skip_if, importorskip, require_megatron)"


# ---- the point of it all: a missing megatron-core turns L0 red, naming the capability ----------
BLOCK_MEGATRON = """
import sys

sys.modules["megatron"] = None  # `import megatron...` now raises ModuleNotFoundError, as when absent
"""


def _flops_tests_without_megatron(tmp_path: Path, allowed: str | None) -> subprocess.CompletedProcess[str]:
    (tmp_path / "kit_block_megatron.py").write_text(BLOCK_MEGATRON)
    env = {k: v for k, v in os.environ.items() if k != skips.ALLOWED_SKIPS_ENV}
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), str(ROOT), env.get("PYTHONPATH", "")])
    if allowed is not None:
        env[skips.ALLOWED_SKIPS_ENV] = allowed
    args = ["-m", "pytest", "-p", "kit_block_megatron", "-p", "no:cacheprovider", "-q", "-rs"]
    test = "unit/test_flops.py::test_from_megatron_reads_a_real_transformer_config"
    return subprocess.run(
        [sys.executable, *args, test], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )


def test_with_megatron_core_missing_the_cpu_rows_set_fails_and_names_it(tmp_path: Path) -> None:
    from ci.jobs import CPU_ALLOWED_SKIPS

    declared = _flops_tests_without_megatron(tmp_path, ",".join(CPU_ALLOWED_SKIPS))
    assert declared.returncode == 1, declared.stdout + declared.stderr
    assert "skipped for 'megatron', which this job has" in declared.stdout
    # Control: the same run unchecked only skips (what every job did before skips were declared).
    unchecked = _flops_tests_without_megatron(tmp_path, None)
    assert unchecked.returncode == 0, unchecked.stdout + unchecked.stderr
    assert (
        "1 skipped" in unchecked.stdout
        and "needs megatron: megatron.core is not installed" in unchecked.stdout
    )
