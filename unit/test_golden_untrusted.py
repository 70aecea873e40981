"""Golden files, the reports `golden update` reads and the values tests record are untrusted.

Each case is one the chaos probe found: a crafted report that made `golden update` write anywhere,
a dangling link it followed, a `KIT_GOLDEN_PLATFORM` with ``..``, a golden value that switched a
comparison off, a NaN that passed, a metric name that stopped the session, a FIFO that hung the
golden tool, malformed golden files that gave tracebacks, escapes printed raw by `golden diff`.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from fixtures.inner_session import WITHOUT_HYPOTHESIS, run_inner_session
from megatron_testkit import golden_plugin
from megatron_testkit.metrics import (
    EXACT,
    Comparison,
    MetricSeries,
    MetricsRecorder,
    TestMetrics,
    at_least,
    at_most,
    relative,
)

pytestmark = pytest.mark.L0

ROOT = Path(__file__).resolve().parent.parent
LOSS = relative(1e-4, "test")
SENTINEL = '{"series": {"keep": "me"}}'


def _report(path: Path, rows: list[dict]) -> Path:
    path.write_text(json.dumps({"version": 2, "session": {"torch": "2.9"}, "tests": rows}))
    return path


def _row(nodeid: str, platform: str = "cpu-gloo") -> dict:
    found = TestMetrics(platform, "0.19.2", {"flops": MetricSeries(EXACT, {"1": 7})})
    return {"nodeid": nodeid, "outcome": "passed", "metrics": found.to_json()}


def _update(report: Path, root: Path, capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    from ci.cli import main

    rc = main(["golden", "update", str(report), "--root", str(root)])
    captured = capsys.readouterr()
    return rc, captured.out + captured.err


def _files_under(path: Path) -> set[str]:
    return {str(p.relative_to(path)) for p in path.rglob("*")}


@pytest.mark.parametrize(
    ("nodeid", "platform"),
    [
        ("../outside/test_x.py::t", "cpu-gloo"),  # a node id with ..
        ("{abs}/test_x.py::t", "cpu-gloo"),  # an absolute node id
        ("functional/test_x.py::t", "../../../outside/x"),  # a platform with ..
        ("functional/test_x.py::t", "cpu-gloo/../../x"),
        ("functional/../../outside/test_x.py::t", "cpu-gloo"),
    ],
)
def test_golden_update_on_a_crafted_report_writes_nothing_outside_the_tests_golden_folder(
    nodeid: str, platform: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root, outside = tmp_path / "project", tmp_path / "outside"
    root.mkdir()
    outside.mkdir()
    # An existing file with a `series` key where the crafted ids point: the old tool overwrote it.
    for target in (outside / "golden" / "test_x" / "t.cpu-gloo.json", outside / "x.json"):
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(SENTINEL)
    report = _report(tmp_path / "r.json", [_row(nodeid.replace("{abs}", str(outside)), platform)])
    before = _files_under(tmp_path)
    rc, out = _update(report, root, capsys)
    assert rc == 2 and out.count("\n") == 1 and "refused" in out, out
    assert _files_under(tmp_path) == before
    for target in (outside / "golden" / "test_x" / "t.cpu-gloo.json", outside / "x.json"):
        assert target.read_text() == SENTINEL


def test_golden_update_refuses_a_dangling_link_in_the_golden_folder_and_creates_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = tmp_path / "functional" / "golden" / "test_x"
    folder.mkdir(parents=True)
    pointed = tmp_path / "created-through-the-link.json"
    (folder / "t.cpu-gloo.json").symlink_to(pointed)
    report = _report(tmp_path / "r.json", [_row("functional/test_x.py::t")])
    rc, out = _update(report, tmp_path, capsys)
    assert rc == 2 and "is a link" in out and "t.cpu-gloo.json" in out, out
    assert not pointed.exists()


def test_golden_update_refuses_a_golden_folder_that_is_itself_a_link_and_writes_nothing_outside(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A ``golden`` link committed by a pull request points wherever its author chose: the old
    writer resolved it as the allowed folder and wrote through it."""
    root, outside = tmp_path / "project", tmp_path / "outside"
    (root / "functional").mkdir(parents=True)
    outside.mkdir()
    (root / "functional" / "golden").symlink_to(outside)
    report = _report(tmp_path / "r.json", [_row("functional/test_x.py::t")])
    rc, out = _update(report, root, capsys)
    assert rc == 2 and out.count("\n") == 1 and "golden" in out and "link" in out, out
    assert _files_under(outside) == set()


def test_a_linked_golden_file_is_not_read_by_golden_update_nor_by_the_test(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Reading through a link shows (and compares against) a file outside the project."""
    root, outside = tmp_path / "project", tmp_path / "outside"
    folder = root / "functional" / "golden" / "test_x"
    folder.mkdir(parents=True)
    outside.mkdir()
    victim = outside / "victim.json"
    found = TestMetrics("cpu-gloo", "0.19.2", {"flops": MetricSeries(EXACT, {"1": 7})})
    victim.write_text(
        json.dumps({"platform": "cpu-gloo", "series": {"flops": found.series["flops"].to_json()}})
    )
    (folder / "t.cpu-gloo.json").symlink_to(victim)
    report = _report(tmp_path / "r.json", [_row("functional/test_x.py::t")])
    rc, out = _update(report, root, capsys)
    assert rc == 2 and out.count("\n") == 1 and "is a symbolic link" in out, out
    # The test's own comparison refuses it too, in one line, rather than comparing with it.
    with pytest.raises(pytest.fail.Exception, match=r"t\.cpu-gloo\.json is a symbolic link"):
        golden_plugin.check("functional/test_x.py::t", root / "functional" / "test_x.py", found)
    assert json.loads(victim.read_text())["series"]["flops"]["values"] == {"1": 7}


def test_a_platform_with_dotdot_writes_no_candidate_outside_the_tests_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("CI", raising=False)
    monkeypatch.setenv("KIT_GOLDEN_PLATFORM", "../../../escaped")
    test_file = tmp_path / "tests" / "test_x.py"
    test_file.parent.mkdir()
    found = TestMetrics("../../../escaped", None, {"flops": MetricSeries(EXACT, {"1": 7})})
    with pytest.raises(
        pytest.fail.Exception, match=r"KIT_GOLDEN_PLATFORM '\.\./\.\./\.\./escaped' is not a platform key"
    ):
        golden_plugin.check("tests/test_x.py::t", test_file, found)
    assert _files_under(tmp_path) == {"tests"}


def test_kit_golden_platform_with_dotdot_is_a_usage_error_at_start(tmp_path: Path) -> None:
    (tmp_path / "test_a.py").write_text("def test_a():\n    pass\n")
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *WITHOUT_HYPOTHESIS, "test_a.py"],
        cwd=tmp_path, capture_output=True, text=True, timeout=120,
        env={**os.environ, "KIT_GOLDEN_PLATFORM": "../x", "PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    assert result.returncode == 4, result.stdout + result.stderr
    assert "KIT_GOLDEN_PLATFORM '../x' is not a platform key" in result.stderr


def test_no_golden_value_switches_a_comparison_off() -> None:
    huge = 1.7e308  # finite, but x (1 + headroom) overflows to infinity
    assert not at_most(0.25, "t").accepts(huge, 1e308 * 1.5)
    assert not relative(10.0, "t").accepts(huge, 0.0)  # 10 x 1.7e308 is infinite
    assert not at_least(0.5, "t").accepts(-huge, -1e308)  # -1.7e308 x 0.5 is finite: compared
    assert at_least(0.5, "t").accepts(-huge, 0.0)
    for rule in (at_most(0.25, "t"), relative(1e-4, "t"), at_least(0.5, "t")):
        assert not rule.accepts(math.inf, 1.0) and not rule.accepts(1.0, math.inf)
        assert not rule.accepts(2**1100, 2**1100)  # an int too large for a float: no bound


MALFORMED_GOLDEN = {
    "Infinity": (
        '{"series": {"loss": {"compare": %s, "values": {"1": Infinity}}}}',
        "Infinity is not a JSON number",
    ),
    "1e999": ('{"series": {"loss": {"compare": %s, "values": {"1": 1e999}}}}', "overflows a float"),
    "a string value": (
        '{"series": {"loss": {"compare": %s, "values": {"1": "2.5"}}}}',
        "is not an int or a float",
    ),
    "a dict tolerance": (
        '{"series": {"loss": {"compare": {"kind": "relative", "tolerance": {}}, "values": {"1": 2.5}}}}',
        "compare.tolerance is not a finite number",
    ),
    "a non-ASCII step key": (
        '{"series": {"loss": {"compare": %s, "values": {"\u00b2": 2.5}}}}',
        "is not an integer or a label",
    ),
    "deep nesting": ("[" * 5000 + "]" * 5000, "nested deeper than"),
    "a list": ("[1, 2]", "not an object with 'series'"),
}


@pytest.mark.parametrize("case", sorted(MALFORMED_GOLDEN))
def test_a_malformed_golden_file_is_one_line_naming_it_in_the_tool_and_the_plugin(
    case: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    text, says = MALFORMED_GOLDEN[case]
    if "%s" in text:
        text = text % json.dumps(LOSS.to_json())
    path = tmp_path / "functional" / "golden" / "test_x" / "t.cpu-gloo.json"
    path.parent.mkdir(parents=True)
    path.write_text(text)
    rc, out = _update(_report(tmp_path / "r.json", [_row("functional/test_x.py::t")]), tmp_path, capsys)
    assert rc == 2 and out.count("\n") == 1 and says in out and "t.cpu-gloo.json" in out, out
    assert path.read_text() == text  # not overwritten
    found = TestMetrics("cpu-gloo", None, {"loss": MetricSeries(LOSS, {"1": 2.5})})
    with pytest.raises(pytest.fail.Exception) as err:
        golden_plugin.check("functional/test_x.py::t", tmp_path / "functional" / "test_x.py", found)
    assert says in str(err.value) and "\n" not in str(err.value)


def test_the_golden_tool_refuses_a_fifo_instead_of_hanging(tmp_path: Path) -> None:
    fifo = tmp_path / "a.json"
    os.mkfifo(fifo)  # nobody writes: the old reader waited forever
    result = subprocess.run(
        [sys.executable, "-m", "megatron_testkit.golden_tool", "diff", str(fifo), str(fifo)],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 2 and "is not a regular file" in result.stderr, result.stderr
    assert result.stderr.count("\n") == 1


def test_golden_diff_prints_escape_sequences_escaped(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from ci.cli import main

    evil = "loss\x1b]0;owned\x07\x1b[2J"
    a = TestMetrics("cpu-gloo", None, {evil: MetricSeries(LOSS, {"1": 2.5})})
    b = TestMetrics("cpu-gloo", None, {evil: MetricSeries(LOSS, {"1": 2.6})})
    row = {"nodeid": "f.py::t\x1b[31m", "outcome": "passed"}
    pa = _report(tmp_path / "a.json", [{**row, "metrics": a.to_json()}])
    pb = _report(tmp_path / "b.json", [{**row, "metrics": b.to_json()}])
    # A name with escapes is not one a test can record, but a crafted report may hold one.
    assert main(["golden", "diff", str(pa), str(pb)]) in (1, 2)
    out = capsys.readouterr()
    text = out.out + out.err
    assert "\x1b" not in text and "\x07" not in text, text


def test_values_and_names_are_checked_when_recorded_naming_the_metric() -> None:
    from megatron_testkit.metrics import MetricError

    rec = MetricsRecorder()
    for value in (math.nan, math.inf, -math.inf):
        with pytest.raises(MetricError, match=r"metric 'loss\[1\]': value .* is not finite"):
            rec.record("loss", 1, value, LOSS)
    with pytest.raises(TypeError, match="metric name 5 is not a string"):
        rec.record(5, 1, 1)  # type: ignore[arg-type]
    with pytest.raises(MetricError, match="is not one line"):
        rec.record("a\nb", 1, 1)
    with pytest.raises(MetricError, match="step '\u00b2' is not an integer or a label"):
        rec.record("tokens", "\u00b2", 1)
    with pytest.raises(MetricError, match="step True is not an int or a label"):
        rec.record("tokens", True, 1)  # type: ignore[arg-type]
    assert rec.series == {}
    with pytest.raises(MetricError, match=r"comparison\.tolerance is not a finite number"):
        Comparison.from_json({"kind": "relative", "tolerance": "0.1"})


RECORDING = textwrap.dedent(
    """
    import math
    import pytest
    from megatron_testkit import metrics
    from megatron_testkit.ranks import run_ranks

    def nan_in_a_rank(rank, world_size):
        metrics.record("loss", 1, math.nan, metrics.relative(1e-4, "t"))

    @pytest.mark.L0
    def test_a_nan_in_the_test(kit_metrics):
        kit_metrics.record("loss", 1, float("nan"), metrics.relative(1e-4, "t"))

    @pytest.mark.L0
    def test_a_name_that_is_not_text(kit_metrics):
        kit_metrics.record(5, 1, 1)

    @pytest.mark.L0
    def test_a_nan_in_a_rank(kit_metrics):
        run_ranks(nan_in_a_rank, 1, backend="gloo", timeout=120)

    @pytest.mark.L0
    def test_runs_after_them(kit_metrics):
        kit_metrics.record("tokens", 1, 64)
    """
)


def test_a_nan_or_a_bad_name_fails_its_own_test_and_the_session_goes_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("CI", raising=False)
    result = run_inner_session(tmp_path, "test_recording.py", RECORDING)
    rows = result["rows"]
    assert "INTERNALERROR" not in result["output"], result["output"][-3000:]
    for name, says in (
        ("test_a_nan_in_the_test", "value nan is not finite"),
        ("test_a_name_that_is_not_text", "metric name 5 is not a string"),
        ("test_a_nan_in_a_rank", "value nan is not finite"),
    ):
        assert rows[name]["outcome"] == "failed", (name, result["output"][-3000:])
        assert says in rows[name]["failure"]["message"], rows[name]["failure"]
    assert rows["test_runs_after_them"]["outcome"] == "passed"
    text = (result["dir"] / "kit-report.json").read_text()
    assert "NaN" not in text and "Infinity" not in text
    candidates = list(tmp_path.glob("golden/**/*.json"))
    assert [p.name for p in candidates] == ["test_runs_after_them.cpu-gloo.candidate.json"]
