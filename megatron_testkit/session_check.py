"""Checks a session's kit report for the shared-session contract: a flat pytest process, no leaks.

The rank code runs in spawned processes, so across rank tests the pytest process should not grow,
and no process should outlive its test. From a kit report (``--kit-report``) this checks that

- across the rank tests after the first (which pays one-time imports) the pytest process' RSS
  grows by less than `RANK_TEST_GROWTH_BOUND` in total (``pytest_rss_after_bytes -
  pytest_rss_before_bytes`` summed),
- from the first rank test to the end of the session it grows by less than `SPAN_BOUND`, and
- every test ends with ``leaked_processes == 0``.

Under xdist the report holds every worker's rows (``worker``); each worker is a pytest process of
its own, so the growth and span bounds apply to each worker's rows (each pays its first rank
test's imports once), checked once over the whole session's report. The summary also shows what
memory admission did (`megatron_testkit.admission`): the session's peak of admitted memory against
the runner's, the tests that queued, and the default share of a rank without a ``memory_budget``.

``python -m megatron_testkit.session_check REPORT [BOUND_MIB [SPAN_BOUND_MIB]]`` prints a summary
and exits 1 on a violation (CI runs it after a green tier).
"""

from __future__ import annotations

import sys
from typing import Any

from megatron_testkit.schema import ReportError, read_report

MiB = 2**20
# Per-session bound on the pytest process' growth over rank tests, excluding the first rank test
# (which imports torch.distributed pickling paths and tensorboard readers once).
RANK_TEST_GROWTH_BOUND = 48 * MiB
# From the first rank test to the end of the session (rank tests and everything between them).
SPAN_BOUND = 64 * MiB


def by_worker(rows: list[dict[str, Any]]) -> dict[str | None, list[dict[str, Any]]]:
    """The rows of each pytest process (the xdist worker; None without xdist), in session order."""
    out: dict[str | None, list[dict[str, Any]]] = {}
    for row in rows:
        out.setdefault(row.get("worker"), []).append(row)
    return out


def rank_test_growth(rows: list[dict[str, Any]]) -> list[tuple[str, int]]:
    """(nodeid, pytest RSS after - before) of every test that launched ranks, in session order."""
    out = []
    for row in rows:
        before, after = row.get("pytest_rss_before_bytes"), row.get("pytest_rss_after_bytes")
        if row.get("world_size") and before is not None and after is not None:
            out.append((row["nodeid"], after - before))
    return out


def steady_growth(rows: list[dict[str, Any]]) -> list[tuple[str, int]]:
    """`rank_test_growth` without each worker's first rank test (which pays the one-time imports)."""
    return [g for worker_rows in by_worker(rows).values() for g in rank_test_growth(worker_rows)[1:]]


def _span(rows: list[dict[str, Any]]) -> int:
    starts = [r for r in rows if r.get("world_size") and r.get("pytest_rss_before_bytes") is not None]
    ends = [r for r in rows if r.get("pytest_rss_after_bytes") is not None]
    if not starts or not ends:
        return 0
    return ends[-1]["pytest_rss_after_bytes"] - starts[0]["pytest_rss_before_bytes"]


def span_growth(rows: list[dict[str, Any]]) -> int:
    """pytest RSS from before the first rank test to after the last test (0 without rank tests), in
    the worker where it grew most (each worker is its own process).

    Covers whatever runs in between (tests without ranks, fixtures, report hooks) as well."""
    return max((_span(worker_rows) for worker_rows in by_worker(rows).values()), default=0)


def check_report(
    report: dict[str, Any], bound: int = RANK_TEST_GROWTH_BOUND, span_bound: int = SPAN_BOUND
) -> list[str]:
    """Violations of the shared-session contract in a kit report (empty when it holds)."""
    problems = []
    span = span_growth(report["tests"])
    if span > span_bound:
        problems.append(
            f"pytest RSS grew {span / MiB:.1f} MiB from the first rank test to the end of the session "
            f"(bound {span_bound / MiB:.0f} MiB)"
        )
    growth = steady_growth(report["tests"])
    steady = sum(delta for _, delta in growth)
    if steady > bound:
        worst = sorted(growth, key=lambda g: -g[1])[:3]
        problems.append(
            f"pytest RSS grew {steady / MiB:.1f} MiB over {len(growth)} rank tests after each worker's first "
            f"(bound {bound / MiB:.0f} MiB); largest: "
            + ", ".join(f"{n} +{d / MiB:.1f} MiB" for n, d in worst)
        )
    for row in report["tests"]:
        if row.get("leaked_processes"):
            problems.append(f"{row['nodeid']} left {row['leaked_processes']} process(es) behind")
    return problems


def summary(report: dict[str, Any]) -> str:
    """One line of figures for the session: growth, per-test maximum, leaks, RSS start/end; and a
    second with admission's, when the session had it."""
    from megatron_testkit.report import admission_line

    growth = rank_test_growth(report["tests"])
    workers = by_worker(report["tests"])
    session = report["session"]
    first = sum(d for rows in workers.values() for _, d in rank_test_growth(rows)[:1])
    steady = sum(d for _, d in steady_growth(report["tests"]))
    worst = max((d for _, d in growth), default=0)
    leaks = sum(row.get("leaked_processes") or 0 for row in report["tests"])
    where = f" in {len(workers)} workers" if len(workers) > 1 else ""
    line = (
        f"{len(report['tests'])} tests{where}, {len(growth)} with ranks; pytest RSS "
        f"{session['pytest_rss_start_bytes'] / MiB:.0f} -> {session['pytest_rss_end_bytes'] / MiB:.0f} MiB; "
        f"first rank test +{first / MiB:.1f} MiB, the others +{steady / MiB:.1f} MiB in total "
        f"(largest single test +{worst / MiB:.1f} MiB); from the first rank test to the end "
        f"+{span_growth(report['tests']) / MiB:.1f} MiB; leaked processes {leaks}"
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
