"""Golden values: the comparison itself, the metrics' place in the report, the plugin's verdicts
(an inner pytest session) and ``golden update|diff`` (``python -m megatron_testkit golden``, also
``python -m ci golden``) on real report files.

Expected verdicts are worked out by hand from the stated rules (exact; |got - golden| <= tol x
|golden|; golden x (1 + headroom); golden x (1 - margin)), not by calling the rule under test.
"""

from __future__ import annotations

import json
import math
import textwrap
from pathlib import Path

import pytest

from fixtures.inner_session import run_inner_session
from megatron_testkit import golden, platforms
from megatron_testkit.metrics import (
    EXACT,
    NOT_COMPARED,
    Comparison,
    MetricSeries,
    MetricsRecorder,
    TestMetrics,
    at_least,
    at_most,
    relative,
)

pytestmark = pytest.mark.L0

LOSS = relative(1e-4, "test")


def metrics(platform: str = "cpu-gloo", core: str | None = "0.19.2", **series: MetricSeries) -> TestMetrics:
    return TestMetrics(platform, core, dict(series))


def test_exact_counts_a_flops_counter_off_by_one_and_an_int_turned_float() -> None:
    flops = 123_456_789_012
    assert EXACT.accepts(flops, flops)
    assert not EXACT.accepts(flops, flops + 1) and not EXACT.accepts(flops, flops - 1)
    assert not EXACT.accepts(4, 4.0)  # a counter that became a float changed what it counts


def test_relative_catches_a_two_percent_loss_change_and_passes_within_its_tolerance() -> None:
    golden_loss = 5.4321
    assert not LOSS.accepts(golden_loss, golden_loss * 1.02)
    assert not LOSS.accepts(golden_loss, golden_loss * 0.98)
    assert LOSS.accepts(golden_loss, golden_loss * (1 + 0.9e-4))
    assert not LOSS.accepts(golden_loss, golden_loss * (1 + 1.1e-4))
    assert not LOSS.accepts(golden_loss, math.nan) and not LOSS.accepts(math.nan, golden_loss)


def test_bounds_are_one_sided_with_their_headroom() -> None:
    peak = at_most(0.25, "test")  # 1000 -> at most 1250
    assert peak.accepts(1000, 1) and peak.accepts(1000, 1250) and not peak.accepts(1000, 1251)
    tput = at_least(0.5, "test")  # 10 -> at least 5
    assert tput.accepts(10.0, 1e9) and tput.accepts(10.0, 5.0) and not tput.accepts(10.0, 4.99)
    assert NOT_COMPARED.accepts(1.0, -7.0)


@pytest.mark.parametrize(
    ("kind", "tol", "says"), [("close", 0.1, "expected one of"), ("relative", -1, ">= 0")]
)
def test_a_bad_comparison_is_refused_naming_it(kind: str, tol: float, says: str) -> None:
    with pytest.raises(ValueError, match=says):
        Comparison(kind, tol)


def test_compare_lists_every_value_out_of_its_rule_and_every_missing_one() -> None:
    want = metrics(
        loss=MetricSeries(LOSS, {"1": 10.0, "2": 9.0, "3": 8.0}),
        flops=MetricSeries(EXACT, {"1": 100, "2": 100}),
        gone=MetricSeries(EXACT, {"1": 1}),
        tflops=MetricSeries(at_least(0.5, "t"), {"1": 10.0}),
    )
    got = metrics(
        loss=MetricSeries(LOSS, {"1": 10.0, "2": 9.18, "3": 8.0005}),  # step 2: +2%; step 3: +6e-5 rel
        flops=MetricSeries(EXACT, {"1": 100, "2": 101, "3": 100}),  # step 2: +1; step 3: new
        new=MetricSeries(EXACT, {"1": 1}),
        tflops=MetricSeries(at_least(0.5, "t"), {"1": 1.0}),  # 10x slower
    )
    rows = golden.compare(want, got, platform="cpu-gloo")
    assert [(r.metric, r.step) for r in rows] == [
        ("flops", "2"),
        ("flops", "3"),
        ("gone", "*"),
        ("loss", "2"),
        ("new", "*"),
    ]  # throughput bounds are not compared on CPU
    assert rows[0].cells() == ("flops", "2", "100", "101", "== 100")
    assert rows[3].cells() == ("loss", "2", "9.0", "9.18", "9.0 ± 0.0001 rel")
    on_gpu = golden.compare(want, got, platform="h100-nccl")
    assert [r.cells() for r in on_gpu if r.metric == "tflops"] == [("tflops", "1", "10.0", "1.0", ">= 5")]


def test_the_mismatch_message_is_a_table_with_the_five_columns() -> None:
    rows = [golden.Mismatch("pretrain/loss", "2", 9.0, 9.18, "9.0 ± 0.0001 rel")]
    text = golden.mismatch_message("f.py::t", Path("g.json"), rows)
    lines = text.splitlines()
    assert lines[0] == "golden values: 1 value(s) of f.py::t differ from g.json"
    assert lines[1].split() == ["metric", "step", "golden", "got", "allowed"]
    assert lines[3].split() == ["pretrain/loss", "2", "9.0", "9.18", "9.0", "±", "0.0001", "rel"]
    # The shipped command, which exists in any project with the kit (python -m ci does not).
    assert "python -m megatron_testkit golden update reports/kit-report.json" in lines[-1]
    assert "--kit-report=reports" in lines[-1], "without a report folder: how to make one first"
    with_report = golden.mismatch_message("f.py::t", Path("g.json"), rows, report_dir="out dir")
    assert with_report.splitlines()[-1].endswith(
        "python -m megatron_testkit golden update 'out dir/kit-report.json'"
    )


def test_recorder_types_and_refuses_what_would_make_a_series_ambiguous() -> None:
    rec = MetricsRecorder()
    rec.record_steps("tokens", [10, 11])
    assert rec.series["tokens"].compare == EXACT and rec.series["tokens"].values == {"1": 10, "2": 11}
    with pytest.raises(ValueError, match="needs a stated comparison"):
        rec.record("loss", 1, 2.5)
    with pytest.raises(ValueError, match="step 1 recorded twice"):
        rec.record("tokens", 1, 10)
    with pytest.raises(ValueError, match="recorded with exact before, now relative"):
        rec.record("tokens", 3, 1.0, LOSS)
    with pytest.raises(TypeError, match="not an int or a float"):
        rec.record("flag", 1, True)


def test_platform_keys_and_where_golden_files_live(tmp_path: Path) -> None:
    assert platforms.platform_key("gloo") == "cpu-gloo"
    assert platforms.platform_key("nccl", "NVIDIA H100 80GB HBM3") == "h100-nccl"
    assert platforms.platform_key("nccl", "NVIDIA GeForce RTX 4090") == "geforce-nccl"
    assert platforms.platform_key("nccl", None) == "gpu-nccl"
    assert golden.mcore_minor("0.16.1") == "mcore0.16" and golden.mcore_minor(None) is None
    test_file = tmp_path / "functional" / "test_x.py"
    assert golden.golden_stem("functional/test_x.py::C::t[a-b]") == ("functional/test_x.py", "C.t[a-b]")
    base = tmp_path / "functional" / "golden" / "test_x"
    assert golden.golden_paths(test_file, "t[a-b]", "cpu-gloo", "0.16.1") == [
        base / "t[a-b].cpu-gloo.mcore0.16.json",
        base / "t[a-b].cpu-gloo.json",
    ]


def test_report_carries_metrics_and_reads_a_version_1_report() -> None:
    from megatron_testkit.report import ReportCollector, build_report
    from megatron_testkit.schema import Report

    found = metrics(loss=MetricSeries(LOSS, {"1": 2.5}), flops=MetricSeries(EXACT, {"1": 7}))
    collector = ReportCollector()
    for when, kit in (("setup", {}), ("call", {"metrics": found.to_json()}), ("teardown", {})):
        collector.add(_phase("t.py::a", when, kit))
    report = build_report({}, collector.rows_json())
    # 2: metrics; 3: launches as records, admission; 4: cuda_context; 5: cpu_substitutions,
    # warm_preload_dropped
    # (the version this kit writes)
    assert report["version"] == 5
    assert report["tests"][0]["metrics"] == found.to_json()
    assert Report.from_json(json.loads(json.dumps(report))).tests[0].metrics == found
    old = Report.from_json({"version": 1, "session": {}, "tests": [{"nodeid": "a", "outcome": "passed"}]})
    assert old.tests[0].metrics is None


def _phase(nodeid: str, when: str, kit: dict) -> object:
    from types import SimpleNamespace

    return SimpleNamespace(nodeid=nodeid, when=when, outcome="passed", duration=0.1, kit=kit, longrepr=None)


# ------------------------------------------------------------------ the plugin, in an inner session
INNER = textwrap.dedent(
    """
    import pytest
    from megatron_testkit import metrics

    LOSS = metrics.relative(1e-4, "test tolerance")

    @pytest.mark.L0
    def test_run(kit_metrics):
        kit_metrics.record_steps("loss", [2.5, 2.25], LOSS)
        kit_metrics.record_steps("flops", [1000, 1000])
        metrics.record("tokens", 1, 64)  # the module-level function reaches the same recorder

    @pytest.mark.L0
    def test_records_nothing():
        pass
    """
)


def _golden_of(root: Path) -> Path:
    return root / "golden" / "test_inner" / "test_run.cpu-gloo.json"


def test_plugin_writes_a_candidate_locally_then_passes_fails_on_a_perturbed_value_with_kind_golden(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("CI", raising=False)
    monkeypatch.delenv("KIT_GOLDEN_PLATFORM", raising=False)
    first = run_inner_session(tmp_path, "test_inner.py", INNER)
    assert first["rc"] == 0, first["output"]
    candidate = golden.candidate_path(_golden_of(tmp_path))
    assert "GoldenCandidateWarning" in first["output"] and str(candidate) in first["output"]
    row = first["rows"]["test_run"]
    assert row["metrics"]["platform"] == "cpu-gloo"
    assert row["metrics"]["series"]["tokens"]["values"] == {"1": 64}
    assert first["rows"]["test_records_nothing"]["metrics"] is None

    candidate.rename(_golden_of(tmp_path))  # reviewed and accepted
    assert run_inner_session(tmp_path, "test_inner.py", INNER)["rc"] == 0

    content = json.loads(_golden_of(tmp_path).read_text())
    content["series"]["loss"]["values"]["2"] *= 1.02
    content["series"]["flops"]["values"]["1"] += 1
    content["made_with"]["megatron_core"] = "0.1.0"  # made with another release: the message says so
    _golden_of(tmp_path).write_text(json.dumps(content))
    bad = run_inner_session(tmp_path, "test_inner.py", INNER)
    assert bad["rc"] == 1
    failure = bad["rows"]["test_run"]["failure"]
    assert failure["kind"] == "golden" and failure["first_line"].startswith("golden values: 2 value(s)")
    table = failure["message"].splitlines()
    assert table[1].split() == ["metric", "step", "golden", "got", "allowed"]
    assert table[3].split() == ["flops", "1", "1001", "1000", "==", "1001"]
    assert table[4].split()[:4] == ["loss", "2", repr(2.25 * 1.02), "2.25"]
    assert "golden values: 2 value(s)" in bad["output"]
    installed = _installed("megatron-core")
    note = f"the file was made with megatron-core 0.1.0, this run has {installed}"
    assert (note in failure["message"]) == (installed is not None), failure["message"]


def _installed(distribution: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


def test_on_ci_a_test_without_a_golden_file_fails_and_writes_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CI", "true")
    monkeypatch.delenv("KIT_GOLDEN_PLATFORM", raising=False)
    result = run_inner_session(tmp_path, "test_inner.py", INNER)
    assert result["rc"] == 1
    failure = result["rows"]["test_run"]["failure"]
    assert failure["kind"] == "golden" and "no golden file for" in failure["first_line"]
    assert str(_golden_of(tmp_path)) in failure["first_line"]
    assert not list(tmp_path.glob("golden/**/*.json"))
    assert result["rows"]["test_records_nothing"]["outcome"] == "passed"


def test_a_rank_records_through_the_environment_and_its_values_reach_the_report(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("CI", raising=False)  # locally: a candidate, not a failure
    source = textwrap.dedent(
        """
        import pytest
        from megatron_testkit import metrics
        from megatron_testkit.ranks import run_ranks

        def worker(rank, world_size):
            metrics.record("peak_bytes", f"rank{rank}", 1000 + rank, metrics.at_most(0.1, "t"))

        @pytest.mark.L0
        def test_ranks(kit_metrics):
            run_ranks(worker, 2, backend="gloo", timeout=120)
        """
    )
    result = run_inner_session(tmp_path, "test_inner.py", source)
    assert result["rc"] == 0, result["output"]
    series = result["rows"]["test_ranks"]["metrics"]["series"]["peak_bytes"]
    assert series["values"] == {"rank0": 1000, "rank1": 1001}
    assert series["compare"] == {"kind": "at_most", "tolerance": 0.1, "why": "t"}


# ------------------------------------------------------------------------- python -m ci golden
def _report(
    path: Path, nodeid: str, found: TestMetrics, outcome: str = "passed", kind: str | None = None
) -> Path:
    failure = {"rank": None, "kind": kind, "first_line": "x", "message": "x"} if kind else None
    row = {"nodeid": nodeid, "outcome": outcome, "failure": failure, "metrics": found.to_json()}
    path.write_text(json.dumps({"version": 2, "session": {"torch": "2.9"}, "tests": [row]}))
    return path


def _ci(*args: str) -> int:
    from ci.cli import main

    return main(["golden", *args])


def test_update_writes_then_reports_changes_and_keeps_a_release_file_only_where_values_differ(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    nodeid = "functional/test_x.py::test_run[gloo-cpu]"
    base = tmp_path / "functional" / "golden" / "test_x" / "test_run[gloo-cpu].cpu-gloo.json"
    v19 = metrics(core="0.19.2", loss=MetricSeries(LOSS, {"1": 2.5}), flops=MetricSeries(EXACT, {"1": 7}))
    assert _ci("update", str(_report(tmp_path / "a.json", nodeid, v19)), "--root", str(tmp_path)) == 0
    assert "(new file)" in capsys.readouterr().out
    written = json.loads(base.read_text())
    assert written["made_with"] == {"megatron_core": "0.19.2", "torch": "2.9"}
    assert written["series"]["loss"] == {"compare": LOSS.to_json(), "values": {"1": 2.5}}

    # 0.16.1 gives the same values: the platform's file holds, no release file.
    v16 = metrics(core="0.16.1", loss=MetricSeries(LOSS, {"1": 2.5}), flops=MetricSeries(EXACT, {"1": 7}))
    assert _ci("update", str(_report(tmp_path / "b.json", nodeid, v16)), "--root", str(tmp_path)) == 0
    assert "unchanged (the platform's file holds" in capsys.readouterr().out
    assert sorted(p.name for p in base.parent.iterdir()) == [base.name]

    # 0.16.1 differs beyond the tolerance: a release file, the platform's file untouched.
    v16.series["loss"].values["1"] = 2.6
    report = _report(tmp_path / "c.json", nodeid, v16, "failed", "golden")
    assert _ci("update", str(report), "--root", str(tmp_path)) == 0
    out = capsys.readouterr().out
    release = base.with_name("test_run[gloo-cpu].cpu-gloo.mcore0.16.json")
    assert f"wrote {release} (new file)" in out and json.loads(base.read_text()) == written

    # A refresh of the same release prints the value that changed.
    v19.series["flops"].values["1"] = 8
    assert _ci("update", str(_report(tmp_path / "d.json", nodeid, v19)), "--root", str(tmp_path)) == 0
    assert "flops[1]: 7 -> 8" in capsys.readouterr().out
    assert json.loads(base.read_text())["series"]["flops"]["values"] == {"1": 8}


def test_update_skips_a_test_that_failed_for_another_reason(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    found = metrics(flops=MetricSeries(EXACT, {"1": 7}))
    report = _report(tmp_path / "r.json", "f/test_x.py::t", found, "failed", "oom")
    assert _ci("update", str(report), "--root", str(tmp_path)) == 0
    assert "f/test_x.py::t: not refreshed (failed, oom)" in capsys.readouterr().out
    assert not list(tmp_path.glob("f/golden/**/*"))


def test_diff_prints_each_differing_value_and_exits_1_and_0_when_equal(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    a = metrics(loss=MetricSeries(LOSS, {"1": 2.5, "2": 2.0}), flops=MetricSeries(EXACT, {"1": 7}))
    b = metrics(
        loss=MetricSeries(LOSS, {"1": 2.5, "2": 2.04}),
        flops=MetricSeries(EXACT, {"1": 8}),
        tflops=MetricSeries(at_least(0.5, "t"), {"1": 1.0}),
    )
    a.series["tflops"] = MetricSeries(at_least(0.5, "t"), {"1": 3.0})
    pa, pb = _report(tmp_path / "a.json", "f.py::t", a), _report(tmp_path / "b.json", "f.py::t", b)
    assert _ci("diff", str(pa), str(pb)) == 1
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "f.py::t"
    assert lines[3].split() == ["flops", "1", "7", "8", "+0.143", "outside", "exact"]
    assert lines[4].split() == ["loss", "2", "2.0", "2.04", "+0.02", "outside", "relative"]
    assert lines[5].split() == [
        "tflops",
        "1",
        "3.0",
        "1.0",
        "-0.667",
        "not",
        "compared",
        "(at_least",
        "on",
        "cpu-gloo)",
    ]
    assert lines[-1] == "3 value(s) differ in 1 test(s); 2 outside their comparison"
    assert _ci("diff", str(pa), str(pa)) == 0
    assert capsys.readouterr().out == "no differences in recorded metrics\n"


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["diff", "missing.json", "missing.json"], "cannot read missing.json"),
        (["update"], "the following arguments are required: REPORT"),
        (["frobnicate"], "invalid choice: 'frobnicate'"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(
    args: list[str], says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert _ci(*args) == 2
    err = capsys.readouterr().err
    assert err.startswith("python -m ci golden: error: ") and says in err and err.count("\n") == 1
