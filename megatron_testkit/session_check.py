"""Checks a session's kit report for the shared-session contract: a flat pytest process, no leaks.

The rank code runs in spawned processes, so across rank tests the pytest process should not grow,
and no process should outlive its test. From a kit report (``--kit-report``) this checks that

- across the rank tests after the first (which pays one-time imports) the pytest process' RSS
  grows by less than `RANK_TEST_GROWTH_BOUND` in total (``pytest_rss_after_bytes -
  pytest_rss_before_bytes`` summed),
- after the first rank test, over the files that launch ranks, it grows by less than
  `SPAN_BOUND`, and
- every test ends with ``leaked_processes == 0``.

Under xdist the report holds every worker's rows (``worker``), and a report folder several sessions
wrote holds each session's rows (``session.sessions``); each worker of each session is a pytest
process of its own, so the growth and span bounds apply to each one's rows (each pays its first
rank test's imports once), checked once over the whole report. The summary also shows what
memory admission did (`megatron_testkit.admission`): the session's peak of admitted memory against
the runner's, the tests that queued, and the default share of a rank without a ``memory_budget``.

``python -m megatron_testkit.session_check REPORT [BOUND_MIB [SPAN_BOUND_MIB]]`` prints a summary
and exits 1 on a violation (CI runs it after a green tier).
"""

from __future__ import annotations

import sys
from typing import Any

from megatron_testkit.report import plural
from megatron_testkit.schema import ReportError, read_report

MiB = 2**20
# Per-session bound on the pytest process' growth over rank tests, excluding the first rank test
# (which imports torch.distributed pickling paths and tensorboard readers once).
RANK_TEST_GROWTH_BOUND = 48 * MiB
# From the first rank test to the end of the session (rank tests and everything between them).
SPAN_BOUND = 64 * MiB


Process = tuple[int, "str | None"]  # (the session's index in a merged report, the xdist worker)


def by_process(
    rows: list[dict[str, Any]], sessions: list[dict[str, Any]] | None = None
) -> dict[Process, list[dict[str, Any]]]:
    """The rows of each pytest process, in session order: per session of a report several sessions
    wrote (the header's ``sessions``, each with its rows' range), per xdist worker (None without)."""
    ranges = [(r["first_test"], r["tests"]) for r in sessions or []] or [(0, len(rows))]
    out: dict[Process, list[dict[str, Any]]] = {}
    for index, (first, count) in enumerate(ranges):
        for row in rows[first : first + count]:
            out.setdefault((index, row.get("worker")), []).append(row)
    return out


def rank_test_growth(rows: list[dict[str, Any]]) -> list[tuple[str, int]]:
    """(nodeid, pytest RSS after - before) of every test that launched ranks, in session order."""
    out = []
    for row in rows:
        before, after = row.get("pytest_rss_before_bytes"), row.get("pytest_rss_after_bytes")
        if row.get("world_size") and before is not None and after is not None:
            out.append((row["nodeid"], after - before))
    return out


def steady_growth(
    rows: list[dict[str, Any]], sessions: list[dict[str, Any]] | None = None
) -> list[tuple[str, int]]:
    """`rank_test_growth` without each process' first rank test (which pays the one-time imports)."""
    return [g for part in by_process(rows, sessions).values() for g in rank_test_growth(part)[1:]]


def _span(rows: list[dict[str, Any]]) -> int:
    """One process' growth after its first rank test, over the test files that launch ranks."""
    rank_files = {row["nodeid"].split("::")[0] for row in rows if row.get("world_size")}
    total, first_seen = 0, False
    for row in rows:
        before, after = row.get("pytest_rss_before_bytes"), row.get("pytest_rss_after_bytes")
        if before is None or after is None:
            continue
        if not first_seen:
            first_seen = bool(row.get("world_size"))  # the first rank test pays one-time imports
            continue
        if row["nodeid"].split("::")[0] in rank_files:
            total += after - before
    return total


def span_growth(rows: list[dict[str, Any]], sessions: list[dict[str, Any]] | None = None) -> int:
    """pytest RSS growth after the first rank test (0 without rank tests), in the pytest process
    where it grew most (each xdist worker of each session is its own): every later test of the
    files that launch ranks, their module fixtures' set-up and teardown included.

    Summed over those files' tests, not read from the first rank test to the session's end: under
    xdist a worker runs files in no fixed order, so the one-time imports that a session in one
    process pays before its first rank test (unit/ runs first there) land after it: a file without
    ranks importing datasets or matplotlib (90-140 MiB measured), and the first rank test itself
    importing megatron-core into the pytest process (about 210 MiB), which `steady_growth` leaves
    out for the same reason."""
    return max((_span(part) for part in by_process(rows, sessions).values()), default=0)


def check_report(
    report: dict[str, Any], bound: int = RANK_TEST_GROWTH_BOUND, span_bound: int = SPAN_BOUND
) -> list[str]:
    """Violations of the shared-session contract in a kit report (empty when it holds)."""
    problems = []
    sessions = report["session"].get("sessions")
    span = span_growth(report["tests"], sessions)
    if span > span_bound:
        problems.append(
            f"pytest RSS grew {span / MiB:.1f} MiB from the first rank test to the end of the session "
            f"(bound {span_bound / MiB:.0f} MiB)"
        )
    growth = steady_growth(report["tests"], sessions)
    steady = sum(delta for _, delta in growth)
    if steady > bound:
        worst = sorted(growth, key=lambda g: -g[1])[:3]
        problems.append(
            f"pytest RSS grew {steady / MiB:.1f} MiB over {plural(len(growth), 'rank test')} after each process' first "
            f"(bound {bound / MiB:.0f} MiB); largest: "
            + ", ".join(f"{n} +{d / MiB:.1f} MiB" for n, d in worst)
        )
    for row in report["tests"]:
        if row.get("leaked_processes"):
            problems.append(
                f"{row['nodeid']} left {plural(row['leaked_processes'], 'process', 'processes')} behind"
            )
    return problems


def summary(report: dict[str, Any]) -> str:
    """One line of figures for the session: growth, per-test maximum, leaks, RSS start/end; and a
    second with admission's, when the session had it."""
    from megatron_testkit.report import admission_line

    growth = rank_test_growth(report["tests"])
    session = report["session"]
    sessions = session.get("sessions")
    processes = by_process(report["tests"], sessions)
    first = sum(d for rows in processes.values() for _, d in rank_test_growth(rows)[:1])
    steady = sum(d for _, d in steady_growth(report["tests"], sessions))
    worst = max((d for _, d in growth), default=0)
    leaks = sum(row.get("leaked_processes") or 0 for row in report["tests"])
    where = f" in {len(processes)} pytest processes" if len(processes) > 1 else ""
    line = (
        f"{plural(len(report['tests']), 'test')}{where}, {len(growth)} with ranks; pytest RSS "
        f"{session['pytest_rss_start_bytes'] / MiB:.0f} -> {session['pytest_rss_end_bytes'] / MiB:.0f} MiB; "
        f"first rank test +{first / MiB:.1f} MiB, the others +{steady / MiB:.1f} MiB in total "
        f"(largest single test +{worst / MiB:.1f} MiB); from the first rank test to the end "
        f"+{span_growth(report['tests'], sessions) / MiB:.1f} MiB; leaked processes {leaks}"
    )
    admitted = admission_line(report)
    return f"{line}\n{admitted}" if admitted else line


def main(argv: list[str]) -> int:
    """``python -m functional.test_session_leaks REPORT [BOUND_MIB [SPAN_BOUND_MIB]]``: check a report."""
    try:  # the kit's one bounded, checked report reader
        report = read_report(argv[0]).to_json()
    except ReportError as exc:
        print(f"session_check: {exc}", file=sys.stderr)
        return 2
    bound = int(argv[1]) * MiB if len(argv) > 1 else RANK_TEST_GROWTH_BOUND
    span_bound = int(argv[2]) * MiB if len(argv) > 2 else SPAN_BOUND
    print(summary(report))
    problems = check_report(report, bound, span_bound)
    for p in problems:
        print("VIOLATION:", p)
    return 1 if problems else 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
