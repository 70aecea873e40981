"""The session report: folding pytest's phase reports into rows, and rendering them.

Reports are plain namespaces with the attributes pytest's (and xdist's deserialised) reports
carry; the ``kit`` dict is what the plugin attaches.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from megatron_testkit.report import ReportCollector, build_report, format_markdown, format_table, write_report

pytestmark = pytest.mark.L0

TEST_KEYS = {
    "nodeid",
    "outcome",
    "duration_s",
    "world_size",
    "backend",
    "seed",
    "budget_host_bytes",
    "budget_device_bytes",
    "peak_host_bytes",
    "peak_device_bytes",
    "ranks",
    "failure",
    "pytest_rss_before_bytes",
    "pytest_rss_after_bytes",
    "leaked_processes",
    "log_dir",
}


def phase(
    nodeid: str, when: str, outcome: str = "passed", duration: float = 0.1, **kit: Any
) -> SimpleNamespace:
    return SimpleNamespace(
        nodeid=nodeid, when=when, outcome=outcome, duration=duration, kit=kit, longrepr=None, longreprtext=""
    )


def run(world_size: int, peaks: list[int | None], *, leaked: int = 0, log_dir: str | None = None) -> dict:
    return {
        "world_size": world_size,
        "backend": "gloo",
        "started": 0.0,
        "seed": 7,
        "duration_s": 1.0,
        "log_dir": log_dir,
        "ranks": [
            {"rank": r, "peak_host_bytes": p, "peak_device_bytes": None, "exit_code": 0, "signal": None}
            for r, p in enumerate(peaks)
        ],
        "failure": None,
        "leaked_processes": leaked,
    }


def collect(*reports: SimpleNamespace) -> list[dict]:
    collector = ReportCollector()
    for report in reports:
        collector.add(report)
    return collector.rows_json()


def test_a_row_has_exactly_the_contract_fields() -> None:
    (row,) = collect(phase("t.py::a", "setup"), phase("t.py::a", "call"), phase("t.py::a", "teardown"))
    assert set(row) >= TEST_KEYS
    assert (row["outcome"], row["world_size"], row["ranks"], row["failure"]) == ("passed", 0, [], None)
    assert row["duration_s"] == pytest.approx(0.3)


def test_peaks_are_maxima_over_ranks_and_launches() -> None:
    (row,) = collect(
        phase("t.py::a", "setup", pytest_rss_before_bytes=100, budget_host_bytes=2**30),
        phase("t.py::a", "call", runs=[run(2, [10, 50]), run(3, [40, 20, 30], leaked=1, log_dir="/l")]),
        phase("t.py::a", "teardown", pytest_rss_after_bytes=150, leaked_processes=2),
    )
    assert row["world_size"] == 3
    assert [r["peak_host_bytes"] for r in row["ranks"]] == [40, 50, 30]
    assert row["peak_host_bytes"] == 50
    assert row["peak_device_bytes"] is None
    assert row["leaked_processes"] == 3
    assert (row["pytest_rss_before_bytes"], row["pytest_rss_after_bytes"]) == (100, 150)
    assert (row["budget_host_bytes"], row["log_dir"], row["seed"]) == (2**30, "/l", 7)


@pytest.mark.parametrize(
    ("phases", "outcome"),
    [
        ([("setup", "passed"), ("call", "failed"), ("teardown", "passed")], "failed"),
        ([("setup", "failed"), ("teardown", "passed")], "error"),
        ([("setup", "passed"), ("call", "passed"), ("teardown", "failed")], "error"),
        ([("setup", "passed"), ("call", "failed"), ("teardown", "failed")], "failed"),
        ([("setup", "skipped"), ("teardown", "passed")], "skipped"),
    ],
)
def test_phase_outcomes_combine_as_pytest_counts_them(phases: list[tuple[str, str]], outcome: str) -> None:
    (row,) = collect(*(phase("t.py::a", when, result) for when, result in phases))
    assert row["outcome"] == outcome


def test_rank_failure_is_kept_and_other_failures_get_their_first_line() -> None:
    failure = {"rank": 1, "kind": "oom", "first_line": "rank 1 oom: MemoryError", "message": "..."}
    plain = phase("t.py::b", "call", "failed")
    plain.longrepr = SimpleNamespace(reprcrash=SimpleNamespace(message="assert 1 == 2"))
    plain.longreprtext = "def test_b():\n>   assert 1 == 2\nE   assert 1 == 2"
    rows = collect(phase("t.py::a", "call", "failed", failure=failure), plain)
    assert rows[0]["failure"] == failure
    assert rows[1]["failure"]["first_line"] == "assert 1 == 2"
    assert rows[1]["failure"]["kind"] is None


def report_of(rows: list[dict]) -> dict:
    return build_report({"host": "h", "cpu_count": 2, "gpus": 0, "torch": "2.13.0", "duration_s": 3.0}, rows)


def test_table_and_markdown_show_rank_tests_and_count_the_rest() -> None:
    failure = {"rank": 1, "kind": "oom", "first_line": "rank 1 oom: MemoryError | x", "message": "m"}
    rows = collect(
        phase("t.py::ranks", "call", runs=[run(2, [300 * 2**20, 400 * 2**20])], budget_host_bytes=2**30),
        phase("t.py::bad", "call", "failed", runs=[run(2, [1, 2], log_dir="/logs/bad")], failure=failure),
        phase("t.py::plain", "call"),
    )
    report = report_of(rows)
    assert report["session"]["outcome_counts"] == {"passed": 2, "failed": 1, "skipped": 0, "error": 0}
    table = format_table(report)
    assert "t.py::ranks" in table and "400.00 MiB" in table and "host 1.00 GiB" in table
    assert "failed (rank 1 oom)" in table
    assert "t.py::plain" not in table
    assert "1 test ran no ranks" in table
    markdown = format_markdown(report)
    assert "| t.py::ranks | 2 | gloo |" in markdown
    assert "rank 1 oom: MemoryError \\| x" in markdown  # a pipe cannot break the table
    assert "rank logs: `/logs/bad`" in markdown


def test_rss_growth_is_summed_over_rank_tests() -> None:
    rows = collect(
        phase("t.py::a", "setup", pytest_rss_before_bytes=0),
        phase("t.py::a", "call", runs=[run(2, [1, 1])]),
        phase("t.py::a", "teardown", pytest_rss_after_bytes=3 * 2**20),
        phase("t.py::plain", "setup", pytest_rss_before_bytes=0),
        phase("t.py::plain", "teardown", pytest_rss_after_bytes=100 * 2**20),
    )
    assert "pytest RSS grew 3.0 MiB across 1 rank test" in format_table(report_of(rows)).splitlines()


@pytest.mark.parametrize(
    ("n", "expected"),
    [
        (1, ["1 test ran no ranks", "across 1 rank test", "1 leaked process was killed"]),
        (2, ["2 tests ran no ranks", "across 2 rank tests", "2 leaked processes were killed"]),
    ],
)
def test_the_summary_counts_in_the_singular_and_the_plural(n: int, expected: list[str]) -> None:
    """It said "1 tests ran no ranks", "across 1 rank tests", "1 leaked processes were killed"."""
    rows = collect(
        *(phase(f"t.py::ranks{i}", "setup", pytest_rss_before_bytes=0) for i in range(n)),
        *(phase(f"t.py::ranks{i}", "call", runs=[run(2, [1, 1], leaked=1)]) for i in range(n)),
        *(phase(f"t.py::ranks{i}", "teardown", pytest_rss_after_bytes=2**20) for i in range(n)),
        *(phase(f"t.py::plain{i}", "call") for i in range(n)),
    )
    report = report_of(rows)
    ran_no_ranks, rss, leaked = expected
    footer = format_table(report).splitlines()
    assert f"{ran_no_ranks} (listed in kit-report.json)" in footer
    assert f"pytest RSS grew {n:.1f} MiB {rss}" in footer
    assert f"{leaked} (see leaked_processes per test)" in footer
    markdown = format_markdown(report).splitlines()
    assert f"- {ran_no_ranks} (listed in kit-report.json)" in markdown


def test_write_report_writes_both_files_and_leaves_the_step_summary_to_the_ci_job(
    tmp_path: Any, monkeypatch: Any
) -> None:
    # The CI job appends kit-report.md to the step summary once; the kit appending too showed it twice.
    summary = tmp_path / "summary.md"
    summary.write_text("earlier step\n")
    monkeypatch.setenv("GITHUB_STEP_SUMMARY", str(summary))
    report = report_of(collect(phase("t.py::a", "call", runs=[run(1, [5])])))
    json_path, md_path = write_report(report, tmp_path / "out")
    assert json.loads(json_path.read_text()) == json.loads(json.dumps(report))
    assert md_path.read_text().startswith("## Kit report")
    assert summary.read_text() == "earlier step\n"


def test_the_schema_is_the_report_contract_and_round_trips() -> None:
    from megatron_testkit.schema import REPORT_VERSION, Report, TestEntry

    rows = collect(
        phase("t.py::a", "setup", pytest_rss_before_bytes=1, budget_host_bytes=2**30),
        phase("t.py::a", "call", "failed", runs=[run(2, [10, 50])], failure={"rank": 1, "kind": "oom"}),
        phase("t.py::a", "teardown", pytest_rss_after_bytes=2),
    )
    report = report_of(rows)
    # The field names written are the schema's, the same the contract (TEST_KEYS) lists.
    assert set(report["tests"][0]) == {f for f in TestEntry.__dataclass_fields__}
    assert set(report["tests"][0]) >= TEST_KEYS
    # 2: metrics per test; 3: launches as records, admission; 4: rank_logs, line, memory, cuda_context,
    # start_mode
    assert report["version"] == REPORT_VERSION == 5
    parsed = Report.from_json(json.loads(json.dumps(report)))
    assert parsed.to_json() == report
    assert parsed.tests[0].failure is not None and (
        parsed.tests[0].failure.rank,
        parsed.tests[0].failure.kind,
    ) == (1, "oom")
    assert [r.peak_host_bytes for r in parsed.tests[0].ranks] == [10, 50]


def test_a_rows_json_is_what_dataclasses_asdict_gives_and_shares_no_list_with_the_row() -> None:
    # The row's JSON is built without asdict's deep copy of every scalar (the time of reading and
    # merging large reports): the same JSON, and still a copy.
    import dataclasses

    from megatron_testkit.metrics import Comparison, MetricSeries, TestMetrics
    from megatron_testkit.schema import Report

    rows = collect(
        phase("t.py::a", "setup", pytest_rss_before_bytes=1, budget_host_bytes=2**30),
        phase("t.py::a", "call", "failed", runs=[run(2, [10, 50])], failure={"rank": 1, "kind": "oom"}),
        phase("t.py::a", "teardown", pytest_rss_after_bytes=2),
    )
    entry = Report.from_json(json.loads(json.dumps(report_of(rows)))).tests[0]
    series = {
        "loss": MetricSeries(Comparison("relative", 0.01), {"1": 2.5, "2": 2}),
        "x": MetricSeries(Comparison("exact")),
    }
    entry = dataclasses.replace(entry, metrics=TestMetrics("cpu-gloo", None, series))
    assert entry.launches and entry.failure is not None and entry.ranks  # nested dataclasses to convert
    got = entry.to_json()
    assert got == dataclasses.asdict(entry)
    assert json.dumps(got) == json.dumps(dataclasses.asdict(entry))  # the same key order too
    got["ranks"].append("x")
    got["metrics"]["series"]["loss"]["values"]["3"] = 1.0
    assert len(entry.ranks) == 2 and "3" not in entry.metrics.series["loss"].values


@pytest.mark.parametrize(
    ("broken", "says"),
    [
        ({"version": 6, "session": {}, "tests": []}, "not a version-5 kit report (version: 6)"),
        ({"version": 1, "session": {}, "tests": {}}, "no 'tests' list"),
        ({"version": 1, "session": [], "tests": []}, "'session' is not an object"),
        ({"version": 1, "tests": [{"outcome": "passed"}]}, "tests[0] has no 'nodeid' and 'outcome'"),
        (
            {"version": 1, "tests": [{"nodeid": "a", "outcome": "failed", "ranks": [{"peak": 1}]}]},
            "tests[0].ranks[0] has no integer 'rank'",
        ),
    ],
)
def test_a_report_outside_the_schema_is_refused_saying_where(broken: dict, says: str) -> None:
    from megatron_testkit.schema import Report, SchemaError

    with pytest.raises(SchemaError) as excinfo:
        Report.from_json(broken)
    assert str(excinfo.value) == says


def test_without_a_report_file_the_summary_does_not_point_at_one() -> None:
    report = report_of(
        collect(phase("t.py::ranks", "call", runs=[run(2, [1, 2])]), phase("t.py::plain", "call"))
    )
    assert "1 test ran no ranks (listed in kit-report.json)" in format_table(report, written=True)
    table = format_table(report, written=False)
    assert "1 test ran no ranks (--kit-report DIR lists them)" in table
    assert "kit-report.json" not in table


def test_an_interrupted_session_marks_the_tests_it_cut_short_not_the_finished_or_failed() -> None:
    collector = ReportCollector()
    for report in (
        phase("t.py::done", "setup"),
        phase("t.py::done", "call"),
        phase("t.py::done", "teardown"),
        phase("t.py::cut", "setup"),  # its call was running when the session was stopped
        phase("t.py::failed", "setup"),
        phase("t.py::failed", "call", "failed"),  # failed, then stopped in its teardown
    ):
        collector.add(report)
    collector.interrupt("interrupted (KeyboardInterrupt: signal 15 (SIGTERM))")
    report = report_of(collector.rows_json())
    outcomes = {row["nodeid"]: row["outcome"] for row in report["tests"]}
    assert outcomes == {"t.py::done": "passed", "t.py::cut": "interrupted", "t.py::failed": "failed"}
    assert report["session"]["outcome_counts"] == {
        "passed": 1,
        "failed": 1,
        "skipped": 0,
        "error": 0,
        "interrupted": 1,
    }
    cut = next(row for row in report["tests"] if row["nodeid"] == "t.py::cut")
    assert cut["failure"]["first_line"] == "interrupted (KeyboardInterrupt: signal 15 (SIGTERM))"
    assert "interrupted" in format_table(report)


def test_a_ranks_peak_keeps_the_process_that_held_it() -> None:
    first, second = run(1, [500]), run(1, [900])
    first["ranks"][0]["peak_process"] = "pid 1: small worker held 100 B"
    second["ranks"][0]["peak_process"] = "pid 2: big worker held 600 B"
    rows = collect(phase("t.py::a", "call", runs=[first, second]))
    (rank,) = report_of(rows)["tests"][0]["ranks"]
    assert (rank["peak_host_bytes"], rank["peak_process"]) == (900, "pid 2: big worker held 600 B")


def test_a_golden_failure_is_the_tests_not_a_ranks() -> None:
    session = {"host": "h", "gpus": 0}
    row = {
        "nodeid": "functional/test_x.py::test_golden",
        "outcome": "failed",
        "world_size": 2,
        "failure": {
            "rank": None,
            "kind": "golden",
            "first_line": "golden values: 1 value differs",
            "message": "m",
        },
    }
    table = format_table(build_report(session, [row]))
    assert "failed (golden)" in table and "rank None" not in table


def test_docs_report_md_lists_every_field_of_the_schema_and_its_version() -> None:
    """docs/report.md is the schema's reference: each dataclass's bullet names every one of its
    fields, and the version it states is REPORT_VERSION (it described `launches` as Run objects
    while the JSON held a count)."""
    import re
    from dataclasses import fields
    from pathlib import Path

    from megatron_testkit import schema

    text = (Path(__file__).resolve().parent.parent / "docs" / "report.md").read_text()
    section = text[text.index("## The JSON, field by field") :]
    assert f"(`REPORT_VERSION`, now {schema.REPORT_VERSION};" in section
    bullets = {
        match.group(1): match.group(0)
        for match in re.finditer(r"^- [^\n]*?\(`(\w+)`[^\n]*(?:\n  [^\n]*)*", section, flags=re.MULTILINE)
    }
    for cls in (schema.Session, schema.TestEntry, schema.RankPeak, schema.Failure, schema.Launch, schema.Run):
        assert cls.__name__ in bullets, f"docs/report.md has no bullet for {cls.__name__}"
        named = set(re.findall(r"`(\w+)`", bullets[cls.__name__]))
        missing = [f.name for f in fields(cls) if f.name not in named]
        assert not missing, f"docs/report.md's {cls.__name__} bullet lacks {missing}"


def _failed_run(rank: int, kind: str, first_line: str, peaks: list[int | None]) -> dict:
    failed = run(len(peaks), peaks)
    failed["failure"] = {"rank": rank, "kind": kind, "first_line": first_line, "message": first_line}
    return failed


def test_a_launch_the_test_caught_keeps_its_verdict_and_reads_caught() -> None:
    # A test that catches a RankFailure passed; before, its row had failure null and `launches: 1`,
    # and the launch's verdict (rank 1 oom, its peak over the budget) was lost.
    caught = _failed_run(1, "oom", "rank 1 oom: host RSS 900 MiB > budget 600 MiB", [100, 900 * 2**20])
    rows = collect(
        phase("t.py::catches", "call", runs=[run(2, [10, 20]), caught], budget_host_bytes=600 * 2**20)
    )
    report = report_of(rows)
    first, second = report["tests"][0]["launches"]
    assert (first["rank"], first["kind"], first["caught"]) == (None, None, False)
    assert (second["rank"], second["kind"], second["caught"]) == (1, "oom", True)
    assert second["first_line"].startswith("rank 1 oom: ") and second["peak_host_bytes"] == 900 * 2**20
    assert report["tests"][0]["failure"] is None
    (line,) = [ln for ln in format_table(report).splitlines() if ln.startswith("t.py::catches")]
    assert line.rstrip().endswith("passed (1 launch failed: rank 1 oom, caught)")
    assert "passed (1 launch failed: rank 1 oom, caught)" in format_markdown(report)


def test_the_launch_a_test_failed_with_is_not_caught_but_the_tries_before_it_are() -> None:
    tried = _failed_run(0, "hang", "rank 0 hang: no rank finished within 5 s", [10, 20])
    fatal = _failed_run(1, "oom", "rank 1 oom: x", [10, 20])
    failure = {"rank": 1, "kind": "oom", "first_line": "rank 1 oom: x", "message": "rank 1 oom: x"}
    rows = collect(phase("t.py::retries", "call", "failed", runs=[tried, fatal], failure=failure))
    report = report_of(rows)
    assert [launch["caught"] for launch in report["tests"][0]["launches"]] == [True, False]
    (line,) = [ln for ln in format_table(report).splitlines() if ln.startswith("t.py::retries")]
    assert line.rstrip().endswith("failed (rank 1 oom; 1 launch failed: rank 0 hang, caught)")


def test_a_version_2_report_with_a_launch_count_still_reads() -> None:
    from megatron_testkit.schema import SchemaError, check_report

    row = {"nodeid": "t.py::a", "outcome": "passed", "launches": 2}
    old = check_report({"version": 2, "session": {}, "tests": [row]})
    assert old.tests[0].launches == []  # a count holds no launch's verdict
    with pytest.raises(SchemaError, match=r"tests\[0\]\.launches is not an integer"):
        check_report({"version": 2, "session": {}, "tests": [{**row, "launches": "2"}]})
    with pytest.raises(SchemaError, match=r"tests\[0\]\.launches is not a list"):
        check_report({"version": 3, "session": {}, "tests": [row]})  # version 3 holds records
    with pytest.raises(SchemaError, match=r"tests\[0\]\.launches\[0\]\.caught is not true or false"):
        launch = {"world_size": 2, "backend": "gloo", "seed": 1, "caught": "yes"}
        check_report({"version": 3, "session": {}, "tests": [{**row, "launches": [launch]}]})


def test_the_session_check_counts_in_the_singular() -> None:
    """It said "over 1 rank tests after the first", "left 1 process(es) behind", "1 tests"."""
    from megatron_testkit.session_check import check_report, summary

    def row(nodeid: str, grew: int, leaked: int = 0) -> dict:
        return {"nodeid": nodeid, "world_size": 2, "pytest_rss_before_bytes": 0,
                "pytest_rss_after_bytes": grew, "leaked_processes": leaked}  # fmt: skip

    problems = check_report({"session": {}, "tests": [row("t.py::a", 0), row("t.py::b", 2**40, leaked=1)]})
    assert any(" MiB over 1 rank test after each process' first (bound " in p for p in problems), problems
    assert "t.py::b left 1 process behind" in problems
    session = {"pytest_rss_start_bytes": 0, "pytest_rss_end_bytes": 0}
    assert summary({"session": session, "tests": [row("t.py::a", 0)]}).startswith("1 test, 1 with ranks; ")


def test_a_version_2_report_reads_with_the_admission_fields_null() -> None:
    from megatron_testkit.schema import Report, Session, check_report

    row = {"nodeid": "t.py::a", "outcome": "passed", "world_size": 2, "ranks": [{"rank": 0}], "launches": 1}
    old = {"version": 2, "session": {"host": "h", "duration_s": 1.0}, "tests": [row]}
    parsed = Report.from_json(old)
    assert (parsed.tests[0].queued_s, parsed.tests[0].admitted_bytes, parsed.tests[0].setup_s) == (
        None,
        None,
        None,
    )
    assert Session.from_json(old["session"]).admission_peak_bytes is None
    assert check_report(old).tests[0].nodeid == "t.py::a"
    # Written now, the fields are there, typed, and a wrong type is refused naming the field.
    with pytest.raises(Exception, match=r"tests\[0\]\.queued_s is not a finite number"):
        check_report({**old, "version": 3, "tests": [{**row, "launches": [], "queued_s": "long"}]})


def test_the_job_summary_of_an_artifact_escapes_the_control_characters_of_its_markdown(tmp_path) -> None:
    """A downloaded artifact's kit-report.md is untrusted: `summary` printed it raw to the CI log."""
    from megatron_testkit.summary import job_summary

    (tmp_path / "kit-report.md").write_text("## Kit report\n\n| t.py::x\x1b]0;pwn\x07 | failed |\n")
    text = job_summary(tmp_path, tmp_path)
    assert all(ch.isprintable() for line in text.splitlines() for ch in line), text
    assert "| t.py::x\\x1b]0;pwn\\x07 | failed |" in text and text.startswith("## Kit report\n\n")


def test_time_spent_queued_for_admission_is_a_column_of_its_own_when_any_test_queued() -> None:
    # A 14.0 s test that waited 31.2 s for admission (inside its call's 45.2 s) beside one that
    # did not wait: each test's own time, and the wait apart.
    def queued(nodeid: str, duration: float, wait: float | None) -> SimpleNamespace:
        return phase(nodeid, "call", duration=duration, runs=[{**run(2, [2**20, 2**20]), "queued_s": wait}])

    report = report_of(collect(queued("t.py::waited", 45.2, 31.2), queued("t.py::prompt", 3.0, 0.0)))
    table = format_table(report).splitlines()
    assert table[0].split() == ["test", "world", "backend", "time", "queued", "peak", "host", "peak", "device",
                                "budget", "outcome"]  # fmt: skip
    waited = next(line for line in table if line.startswith("t.py::waited")).split()
    prompt = next(line for line in table if line.startswith("t.py::prompt")).split()
    assert waited[3:5] == ["14.0s", "31.2s"] and prompt[3:5] == ["3.0s", "-"]
    markdown = format_markdown(report)
    assert "| test | world | backend | time | queued | peak host |" in markdown
    assert "| t.py::waited | 2 | gloo | 14.0s | 31.2s |" in markdown
    # Without a wait (or without admission) the table keeps its columns.
    plain = report_of(collect(queued("t.py::prompt", 3.0, 0.0), queued("t.py::off", 2.0, None)))
    assert "queued" not in format_table(plain).splitlines()[0]
    assert "| test | world | backend | time | peak host |" in format_markdown(plain)


def test_an_annotation_points_at_the_failed_tests_line(tmp_path: Path) -> None:
    from megatron_testkit.report import write_report
    from megatron_testkit.summary import annotations

    own = phase("tests/test_x.py::test_y", "call", "failed")
    own.location = ("tests/test_x.py", 11, "test_y")  # pytest's location: 0-based
    own.longrepr = SimpleNamespace(reprcrash=SimpleNamespace(message="assert 1 == 2"))
    inherited = phase("tests/test_x.py::TestB::test_z", "call", "failed")
    inherited.location = ("tests/base.py", 3, "TestB.test_z")  # its line is in another file
    rows = collect(own, inherited)
    assert [row["line"] for row in rows] == [12, None]
    write_report(report_of(rows), tmp_path)
    lines = annotations(tmp_path)
    assert lines[0].startswith(
        "::error file=tests/test_x.py,line=12,title=tests/test_x.py%3A%3Atest_y%3A error::"
    )
    assert lines[1].startswith("::error file=tests/test_x.py,title=")  # no line known: none given
    # A report from before the field (version 3) has no line: the annotation names the file only.
    old = json.loads((tmp_path / "kit-report.json").read_text())
    old["version"] = 3
    for row in old["tests"]:
        del row["line"], row["rank_logs"]
    (tmp_path / "kit-report.json").write_text(json.dumps(old))
    assert annotations(tmp_path)[0].startswith("::error file=tests/test_x.py,title=")
