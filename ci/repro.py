"""`python -m ci repro`: run a tier, or the failures of a CI report, the way the CI job ran them.

The job is a row of `ci/jobs.py` (the CPU row, or the GPU row with `--gpus N`): its pytest
arguments, its environment and its memory limits, with the runner's memory applied to the whole
run (`ci/limits.py`). pytest's own progress streams through; afterwards the output leads with one
verdict per failed test (rank, oom | error | crash | hang, first error line, peak memory against
the budget). With `--from-report` it reruns exactly the node ids that failed in a CI report (same
ids, so the launcher derives the same seeds; same tests, so the same world sizes) and prints the
CI verdict next to the local one.

Bad arguments (unknown tier, unparsable size, unusable report) are a one-line error and exit 2.
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

from ci.jobs import DEVICE_MEMORY_ENV, HOST_MEMORY_ENV, ROOT, TIERS, Job, job_for, pytest_args
from ci.limits import METHODS, apply_memory_limit
from ci.verdicts import (
    ReportError,
    failed_tests,
    format_comparison,
    format_verdicts,
    junit_first_lines,
    load_report,
    tests_by_id,
    verdict,
)
from fixtures.budgets import format_size, parse_size

PROG = "python -m ci repro"


class UsageError(Exception):
    """A bad command line or input file: printed as one line, exit code 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise UsageError(message)


def build_parser() -> argparse.ArgumentParser:
    """The command line; `--help` shows it."""
    p = _Parser(prog=PROG, description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("tier", nargs="?", help="L0, L1 or L2 (default: the report's tier, else L0)")
    p.add_argument("-k", dest="keyword", metavar="EXPR", help="pytest -k expression")
    p.add_argument("--gpus", type=int, metavar="N", help="emulate the GPU job with N GPUs (default: CPU job)")
    p.add_argument(
        "--host-memory", metavar="SIZE", help="the runner's memory for the whole run (default: the job's)"
    )
    p.add_argument(
        "--device-memory", metavar="SIZE", help="per-GPU memory of the CI card (default: the job's)"
    )
    p.add_argument(
        "--from-report", metavar="JSON", help="rerun the tests that failed in this kit-report.json"
    )
    p.add_argument("--reports", metavar="DIR", help="where the local report goes (default: reports/repro)")
    p.add_argument("--root", metavar="DIR", default=str(ROOT), help="the project to test (default: this one)")
    p.add_argument("--limit-method", choices=("auto", *METHODS), default="auto", help="how to cap the run")
    p.add_argument("--dry-run", action="store_true", help="print the command and environment, run nothing")
    p.add_argument("pytest_args", nargs="*", help="after --: more pytest arguments")
    return p


def _size(text: str | None, flag: str) -> int | None:
    try:
        return parse_size(text)
    except ValueError as exc:
        raise UsageError(f"{flag}: {exc}") from None


def _gpus_of(session: dict[str, Any]) -> int:
    gpus = session.get("gpus")
    if isinstance(gpus, list):
        return len(gpus)
    return gpus if isinstance(gpus, int) and not isinstance(gpus, bool) else 0


def _visible_gpus() -> int:
    if os.environ.get("CUDA_VISIBLE_DEVICES", None) in ("", "-1"):
        return 0
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return 0
    try:
        out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return 0
    return sum(line.startswith("GPU ") for line in out.stdout.splitlines()) if out.returncode == 0 else 0


def job_variables(job: Job, reports: Path, gpus: int, host: str | None, device: str | None) -> dict[str, str]:
    """The variables the run sets: the job's, with the requested limits and the GPUs it has."""
    variables = job.environment(reports)
    if host is not None:
        variables[HOST_MEMORY_ENV] = host
    if device is not None:
        variables[DEVICE_MEMORY_ENV] = device
    if gpus > 0 and not os.environ.get("CUDA_VISIBLE_DEVICES"):
        variables["CUDA_VISIBLE_DEVICES"] = ",".join(str(i) for i in range(gpus))
    return variables


def environment(variables: dict[str, str]) -> dict[str, str]:
    """Ours, overridden by `variables`, less what would make the run differ from a fresh CI shell."""
    env = {**os.environ, **variables}
    env.pop("KIT_SEED", None)  # seeds come from the node ids, as in CI
    for key in [k for k in env if k == "PYTEST_CURRENT_TEST" or k.startswith("PYTEST_XDIST_")]:
        del env[key]  # e.g. a repro started from inside a test session
    return env


def _clean(reports: Path) -> None:
    """Drop the previous run's outputs so a run that writes none is not read as this run's."""
    for name in ("kit-report.json", "kit-report.md", "junit.xml"):
        (reports / name).unlink(missing_ok=True)
    shutil.rmtree(reports / "logs", ignore_errors=True)
    reports.mkdir(parents=True, exist_ok=True)


def _say(text: str) -> None:
    print(f"ci repro: {text}", flush=True)


@dataclass
class Plan:
    """What a repro runs: the CI row, the pytest command and variables, and what CI saw (if known)."""

    job: Job
    gpus: int
    host: str | None
    device: str | None
    host_bytes: int | None
    reports: Path
    root: Path
    command: list[str]
    variables: dict[str, str]
    ci_failed: list[dict[str, Any]] = field(default_factory=list)
    ci_junit: dict[tuple[str, str], str] = field(default_factory=dict)
    source: str | None = None


def plan(args: argparse.Namespace) -> Plan | None:
    """The run the arguments ask for; None when a report has no failures (nothing to rerun)."""
    if args.tier is not None and args.tier not in TIERS:
        raise UsageError(f"unknown tier {args.tier!r}: expected one of {', '.join(TIERS)}")
    if args.gpus is not None and args.gpus < 0:
        raise UsageError(f"--gpus must be 0 or more, got {args.gpus}")
    _size(args.host_memory, "--host-memory")
    _size(args.device_memory, "--device-memory")
    root = Path(args.root).resolve()
    if not root.is_dir():
        raise UsageError(f"--root {args.root} is not a directory")

    tier, gpus = args.tier, args.gpus
    ci_failed: list[dict[str, Any]] = []
    ci_junit: dict[tuple[str, str], str] = {}
    source = None
    if args.from_report:
        try:
            ci_report = load_report(args.from_report)
        except ReportError as exc:
            raise UsageError(str(exc)) from None
        ci_failed = failed_tests(ci_report)
        if not ci_failed:
            return None
        # The artifact holds junit.xml beside the report: first lines of in-process failures.
        ci_junit = junit_first_lines(Path(args.from_report).with_name("junit.xml"))
        session = ci_report.get("session", {})
        if tier is None and session.get("markexpr") in TIERS:
            tier = session["markexpr"]
        if gpus is None:
            gpus = _gpus_of(session)
        source = f"{len(ci_failed)} failed test(s) from {args.from_report}"

    job = job_for(tier or "L0", gpus or 0)
    gpus = job.gpus if gpus is None else gpus
    reports = Path(args.reports).resolve() if args.reports else root / "reports" / "repro"
    host = args.host_memory or job.host_memory
    device = args.device_memory or job.device_memory
    command = [sys.executable, "-m", "pytest", *pytest_args(job, reports)]
    if args.keyword:
        command += ["-k", args.keyword]
    command += [test["nodeid"] for test in ci_failed]
    command += args.pytest_args
    return Plan(
        job=job,
        gpus=gpus,
        host=host,
        device=device,
        host_bytes=_size(host, "host memory"),
        reports=reports,
        root=root,
        command=command,
        variables=job_variables(job, reports, gpus, host, device),
        ci_failed=ci_failed,
        ci_junit=ci_junit,
        source=source,
    )


def execute(p: Plan, limit_method: str) -> int:
    """Run the plan under the runner's memory limit, then print the verdicts; pytest's exit code."""
    try:
        limit = apply_memory_limit(p.host_bytes, limit_method)
    except (OSError, subprocess.SubprocessError) as exc:
        raise UsageError(f"--limit-method {limit_method}: {exc}") from None
    _say(f"runner memory limit: {limit.describe()}")
    _say(shlex.join(p.command))
    _clean(p.reports)
    try:
        returncode = subprocess.run(
            limit.wrap(p.command), cwd=p.root, env=environment(p.variables)
        ).returncode
    finally:
        peak, kills = limit.peak_bytes(), limit.oom_kills()
        limit.close()

    print(flush=True)
    _say("=" * 30 + " verdicts " + "=" * 30)
    report_path = p.reports / "kit-report.json"
    try:
        local = load_report(report_path)
    except ReportError as exc:
        _say(f"pytest exited with {returncode} and left no usable report ({exc})")
        local = None
    if local is not None:
        junit = junit_first_lines(p.reports / "junit.xml")
        here = {nodeid: verdict(test, junit) for nodeid, test in tests_by_id(local).items()}
        if p.ci_failed:
            print(format_comparison([verdict(test, p.ci_junit) for test in p.ci_failed], here), flush=True)
        else:
            failed = [verdict(test, junit) for test in failed_tests(local)]
            print(format_verdicts(failed) if failed else f"no failures ({_counts(local)})", flush=True)
    if limit.limit_bytes is not None:
        usage = f"peak {format_size(peak)}" if peak is not None else "peak not measured"
        killed = f", kernel OOM kills {kills}" if kills is not None else ""
        _say(f"runner memory ({limit.method}): {usage} of {format_size(limit.limit_bytes)}{killed}")
    _say(f"report {p.reports / 'kit-report.md'}, rank logs {p.reports / 'logs'}")
    if local is not None and failed_tests(local):
        _say(f"again: {PROG} --from-report {report_path}")
    if returncode == 5:
        _say("pytest collected no tests: that is a failure here, as in CI")
        return 1
    return returncode if returncode >= 0 else 128 - returncode


def run(argv: list[str]) -> int:
    """Parse, plan, say what will run, run it (unless --dry-run); the exit code of the run."""
    args = build_parser().parse_args(argv)
    p = plan(args)
    if p is None:
        _say(f"no failed tests in {args.from_report}: nothing to rerun")
        return 0
    job = p.job
    _say(
        f"job {job.name} (tier {job.tier}, runs-on {', '.join(job.runs_on)}){': ' + p.source if p.source else ''}"
    )
    _say(
        f"runner memory {p.host or '-'}; per-GPU memory {p.device or '-'}; GPUs {p.gpus} (visible here: {_visible_gpus()})"
    )
    if args.dry_run:
        _say("env " + " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(p.variables.items())))
        _say(shlex.join(p.command))
        return 0
    return execute(p, args.limit_method)


def _counts(report: dict[str, Any]) -> str:
    counts: dict[str, int] = {}
    for test in tests_by_id(report).values():
        counts[test["outcome"]] = counts.get(test["outcome"], 0) + 1
    return ", ".join(f"{n} {outcome}" for outcome, n in sorted(counts.items())) or "no tests"


def main(argv: list[str] | None = None) -> int:
    """Entry point of `python -m ci repro`; usage errors are one line on stderr and exit code 2."""
    try:
        return run(list(sys.argv[1:] if argv is None else argv))
    except UsageError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
