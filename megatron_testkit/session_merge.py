"""Sessions that share one ``--kit-report`` folder: their reports merged into one, every row of each kept.

A CI job that runs pytest twice into ``reports/``, or two jobs on one runner sharing a folder, used
to leave only the last session's ``kit-report.json``. Now each session, when it writes, reads the
report already in the folder (under the folder's lock, through the bounded reader) and writes one
that holds the earlier sessions' rows and then its own. Nothing is folded: a test that ran in both
sessions has a row from each (readers such as ``ci repro`` take a failing one first). The header is
the newest session's, with ``sessions`` listing every merged session and the range of its rows,
and outcome counts over all the rows.
"""

from __future__ import annotations

from typing import Any

from megatron_testkit.schema import MAX_TESTS, Session, SessionRef

# pytest's exit statuses, most telling first: interrupted, internal error, tests failed, usage
# error, no tests; a merged header keeps the most telling of its sessions'.
_EXIT_ORDER = (2, 3, 1, 4, 5)


def session_refs(report: dict[str, Any]) -> list[dict[str, Any]]:
    """The sessions a report holds: its ``sessions`` when merged, else one for the whole report."""
    header = report["session"]
    if header.get("sessions"):
        return [dict(ref) for ref in header["sessions"]]
    return [_ref(header, 0, len(report["tests"]))]


def _ref(header: dict[str, Any], first: int, count: int) -> dict[str, Any]:
    return SessionRef(
        started=str(header.get("started") or ""),
        host=str(header.get("host") or ""),
        markexpr=str(header.get("markexpr") or ""),
        pytest_args=[str(a) for a in header.get("pytest_args") or []],
        first_test=first,
        tests=count,
        ci_job=header.get("ci_job") if isinstance(header.get("ci_job"), str) else None,
        exit_status=header.get("exit_status") if isinstance(header.get("exit_status"), int) else None,
        duration_s=float(header.get("duration_s") or 0.0),
    ).__dict__


def merge_sessions(earlier: dict[str, Any], current: dict[str, Any]) -> tuple[dict[str, Any], list[dict]]:
    """`current`'s session header and the rows of `earlier` (a checked kit report) then `current`.

    Returns ``(session header, rows)`` for `megatron_testkit.report.build_report`. Past
    `MAX_TESTS` rows the oldest sessions are dropped whole (the header says how many).
    """
    refs = session_refs(earlier)
    rows = list(earlier["tests"])
    dropped = int(earlier["session"].get("dropped_sessions") or 0)
    while refs and len(rows) + len(current["tests"]) > MAX_TESTS:
        oldest = refs.pop(0)
        rows = rows[oldest["tests"] :]
        for ref in refs:
            ref["first_test"] -= oldest["tests"]
        dropped += 1
    refs.append(_ref(current["session"], len(rows), len(current["tests"])))
    header = {k: v for k, v in current["session"].items() if k in Session.__dataclass_fields__}
    header["sessions"] = refs
    statuses = [r["exit_status"] for r in refs if r["exit_status"]]
    header["exit_status"] = (
        min(statuses, key=_severity) if statuses else current["session"].get("exit_status")
    )
    if dropped:
        header["dropped_sessions"] = dropped
    return header, [*rows, *current["tests"]]


def _severity(status: int) -> int:
    return _EXIT_ORDER.index(status) if status in _EXIT_ORDER else len(_EXIT_ORDER)
