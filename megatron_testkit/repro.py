"""`python -m megatron_testkit repro`: run a tier, or the failures of a CI report, the way the CI job ran them.

The job is a row (`megatron_testkit.repro_rows`): one the project declares in its pyproject's
``[tool.megatron_testkit.rows]`` (the CPU row, or the GPU row with `--gpus N`), else the session
the report recorded. The row gives the pytest arguments, the environment and the memory limits,
with the runner's memory applied to the whole run (`megatron_testkit.repro_limit`). pytest's own
progress streams through; afterwards the output leads with one verdict per failed test (rank, oom
| error | crash | hang, first error line, peak memory against the budget). With `--from-report`
it reruns exactly the node ids that failed or were interrupted in a CI report (same ids, so the
launcher derives the same seeds; same tests, so the same world sizes), with the report's recorded
settings, hypothesis seed and runner memory, prints the CI verdict beside the local one ("CI: rank
1 oom at 3.2 s / here: rank 1 oom at 3.0 s") and exits non-zero while any still fails.

Bad arguments (unknown tier, unparsable size, unusable report) are a one-line error and exit 2.
This repository's ``python -m ci repro`` is this command with its rows from ``ci/jobs.py``.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, NoReturn

from megatron_testkit.budgets import format_size, parse_size
from megatron_testkit.child import start as start_child
from megatron_testkit.child import wait_forwarding
from megatron_testkit.nodeids import check as check_nodeids
from megatron_testkit.report_input import printable
from megatron_testkit.repro_limit import METHODS, RANK_CGROUP_ENV, Kill, MemoryLimit, apply_memory_limit
from megatron_testkit.repro_rows import (
    TIERS,
    Row,
    RowError,
    choose,
    default_row,
    pyproject_rows,
    session_row,
    tier_of,
)
from megatron_testkit.repro_settings import restorable
from megatron_testkit.schema import MAX_GPUS
from megatron_testkit.verdicts import (
    ReportError,
    Verdict,
    failed_tests,
    format_comparison,
    format_pairs,
    format_verdicts,
    junit_first_lines,
    junit_key,
    load_report,
    tests_by_id,
    verdict,
)

PROG = "python -m megatron_testkit repro"
HOST_MEMORY_ENV = "KIT_HOST_MEMORY"  # the runner's memory for the whole run, e.g. "7GB"
DEVICE_MEMORY_ENV = "KIT_DEVICE_MEMORY"  # per-GPU cap emulating the CI card, e.g. "40GiB"
# A recorded --hypothesis-seed longer than this is refused: int() of one past 4,300 digits raised
# a traceback, and no seed a run prints or a person types comes near it.
MAX_SEED_DIGITS = 1000


@dataclass(frozen=True)
class Project:
    """Who runs repro: its command (in hints and errors), the prefix of its lines, where its rows
    come from (None: the project root's pyproject.toml) and the root it tests by default (None:
    the working directory)."""

    prog: str = PROG
    name: str = "kit repro"
    rows: Callable[[Path], dict[str, Row]] | None = None
    default_root: Path | None = None

    def rows_of(self, root: Path) -> dict[str, Row]:
        """The rows this project declares."""
        try:
            return self.rows(root) if self.rows is not None else pyproject_rows(root)
        except RowError as exc:
            raise UsageError(str(exc)) from None


_project = Project()  # the one running (set by `main`): its name prefixes every line


class UsageError(Exception):
    """A bad command line or input file: printed as one line, exit code 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise UsageError(message)


def build_parser(project: Project | None = None) -> argparse.ArgumentParser:
    """The command line; `--help` shows it."""
    project = project or _project
    p = _Parser(prog=project.prog, description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("tier", nargs="?", help="L0, L1 or L2 (default: the report's tier, else L0)")
    p.add_argument("-k", dest="keyword", metavar="EXPR", help="pytest -k expression")
    p.add_argument("--job", metavar="NAME", help="the CI row to emulate (a row the project declares)")
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
    p.add_argument(
        "--root",
        metavar="DIR",
        default=str(project.default_root or Path.cwd()),
        help="the project to test (default: %(default)s)",
    )
    p.add_argument("--limit-method", choices=("auto", *METHODS), default="auto", help="how to cap the run")
    p.add_argument("--dry-run", action="store_true", help="print the command and environment, run nothing")
    p.add_argument(
        "--include-untracked",
        action="store_true",
        help="with --from-report: also rerun test files git does not track (never those in a report "
        "folder or a downloaded artifact's folder)",
    )
    p.add_argument(
        "--hypothesis-seed",
        type=int,
        metavar="N",
        help="hypothesis's seed (default: the one the report's run recorded, if any)",
    )
    p.add_argument("pytest_args", nargs="*", help="after --: more pytest arguments")
    return p


def _size(text: str | None, flag: str) -> int | None:
    try:
        return parse_size(text)
    except ValueError as exc:
        raise UsageError(f"{flag}: {exc}") from None


def _gpus_of(session: dict[str, Any]) -> int:
    """The report's GPU count (checked by the loader: an int in [0, MAX_GPUS], or absent)."""
    gpus = session.get("gpus")
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


def job_variables(job: Row, reports: Path, gpus: int, host: str | None, device: str | None) -> dict[str, str]:
    """The variables the run sets: the row's, with the requested limits and the GPUs it has."""
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
    env = {**os.environ}
    env.pop("KIT_SEED", None)  # seeds come from the node ids, as in CI (unless the CI run set one)
    env.update(variables)
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
    print(f"{_project.name}: {text}", flush=True)


@dataclass
class Plan:
    """What a repro runs: the CI row, the pytest command and variables, and what CI saw (if known)."""

    job: Row
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
    stale: list[str] = field(default_factory=list)
    refused: list[tuple[str, str]] = field(default_factory=list)
    from_report: list[str] = field(default_factory=list)  # what the report's session gave the row
    unchecked: str | None = None  # why --dry-run left the tracked-file check to the real run


def _choose_job(
    rows: dict[str, Row], name: str | None, ci: FromReport | None, tier: str | None, gpus: int | None
) -> Row:
    """`--job NAME`, else the report's row (its ``ci_job`` when the project declares it), else the
    tier's CPU or GPU row; with a report and no such row, the report's session is the row."""
    if name is not None:
        if name not in rows:
            expected = f"expected one of {', '.join(rows)}" if rows else "the project declares no rows"
            raise UsageError(f"--job: unknown job {name!r}: {expected}")
        job = rows[name]
        if not job.runs_tests:
            raise UsageError(f"--job {name} runs {job.not_tests or 'something other than tests'}")
        if tier is not None and tier != job.tier:
            raise UsageError(f"--job {name} runs tier {job.tier}, not {tier}")
        return job
    ci_job = ci.ci_job if ci is not None else None
    if ci_job in rows and (tier is None or rows[ci_job].tier == tier):
        return rows[ci_job]  # type: ignore[index]
    found = choose(rows, tier or "L0", gpus or 0)
    if found is not None:
        return found
    if ci is not None:
        try:
            return session_row(ci.session)
        except RowError as exc:
            raise UsageError(str(exc)) from None
    return default_row(tier or "L0", gpus or 0)


def collected_ids(root: Path, nodeids: list[str], variables: dict[str, str]) -> set[str] | None:
    """Which of `nodeids` exist in `root` now: collects their files (not the ids: one stale id
    makes pytest reject the whole command line). None when collection itself failed.

    Only for ids `megatron_testkit.nodeids.check` accepted (test files of the project), given after ``--``."""
    files = sorted({nodeid.split("::", 1)[0] for nodeid in nodeids})
    present = [f for f in files if (root / f).is_file()]
    if not present:
        return set()
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:randomly", "--", *present],
        cwd=root,
        env=environment(variables),
        capture_output=True,
        text=True,
    )
    if out.returncode not in (0, 5):
        return None
    return {line.strip() for line in out.stdout.splitlines() if "::" in line}


def recorded_seed(session: dict[str, Any]) -> int | None:
    """The session's ``hypothesis_seed`` (version 3), else the ``--hypothesis-seed`` among a
    report's recorded pytest arguments (the nightly exploring row's); `UsageError` when that one
    has more than `MAX_SEED_DIGITS` digits."""
    seed = session.get("hypothesis_seed")
    if isinstance(seed, int) and not isinstance(seed, bool):
        return seed
    args = [str(a) for a in session.get("pytest_args") or []]
    for i, arg in enumerate(args):
        value = arg.partition("=")[2] if arg.startswith("--hypothesis-seed=") else None
        if arg == "--hypothesis-seed" and i + 1 < len(args):
            value = args[i + 1]
        if value is not None and re.fullmatch(r"-?[0-9]+", value):
            digits = len(value.lstrip("-"))
            if digits > MAX_SEED_DIGITS:
                raise UsageError(
                    f"the report's recorded --hypothesis-seed has {digits} digits, more than a seed "
                    f"may have ({MAX_SEED_DIGITS}): give one with --hypothesis-seed N"
                )
            return int(value)
    return None


@dataclass
class FromReport:
    """What a CI report asks to rerun: its failed tests, their JUnit first lines, its session header."""

    path: str
    failed: list[dict[str, Any]]
    junit: dict[tuple[str, str], str]
    session: dict[str, Any]

    @property
    def tier(self) -> str | None:
        return tier_of(str(self.session.get("markexpr") or ""))  # "L0" or "L0 and gpu"

    @property
    def ci_job(self) -> str | None:
        """The row the CI job ran (KIT_CI_JOB, recorded by the plugin)."""
        name = self.session.get("ci_job")
        return name if isinstance(name, str) else None


def _read_ci_report(path: str) -> FromReport:
    try:
        report = load_report(path)
    except ReportError as exc:
        raise UsageError(str(exc)) from None
    # The artifact holds junit.xml beside the report: first lines of in-process failures.
    failed = failed_tests(report)
    wanted = {junit_key(test["nodeid"]) for test in failed}
    junit = junit_first_lines(Path(path).with_name("junit.xml"), wanted) if failed else {}
    return FromReport(path, failed, junit, report["session"])


def _check_arguments(args: argparse.Namespace) -> Path:
    """The project root, once the arguments that need no report are known to be usable."""
    if args.tier is not None and args.tier not in TIERS:
        raise UsageError(f"unknown tier {args.tier!r}: expected one of {', '.join(TIERS)}")
    if args.gpus is not None and not 0 <= args.gpus <= MAX_GPUS:
        raise UsageError(f"--gpus must be 0 to {MAX_GPUS}, got {args.gpus}")
    _size(args.host_memory, "--host-memory")
    _size(args.device_memory, "--device-memory")
    root = Path(args.root).resolve()
    if not root.is_dir():
        raise UsageError(f"--root {args.root} is not a directory")
    return root


def _select(p: Plan, report: str, dry_run: bool, include_untracked: bool) -> list[str]:
    """The report's failed ids that may run: checked (refused and stale ones noted on the plan).
    A dry run starts no process and refuses what the real run refuses (git's index read here)."""
    checked = check_nodeids(
        p.root,
        [test["nodeid"] for test in p.ci_failed],
        start_processes=not dry_run,
        include_untracked=include_untracked,
        report_folders=[p.reports, Path(report).resolve().parent],
    )
    if checked.blocked is not None:
        # Collecting or running the test would import it: nothing runs (the dry run says the same).
        raise UsageError(f"{printable(checked.blocked, 400)}: nothing run")
    p.refused, p.stale, p.unchecked = checked.refused, checked.stale, checked.unchecked
    if checked.accepted and not dry_run:
        # A parametrized id whose parameter is gone is found only by collecting its (checked) file.
        present = collected_ids(p.root, checked.accepted, p.variables)
        if present is not None:
            p.stale += [nodeid for nodeid in checked.accepted if nodeid not in present]
            return [nodeid for nodeid in checked.accepted if nodeid in present]
    return checked.accepted


def _recorded(job: Row, ci: FromReport | None) -> tuple[dict[str, str], list[str]]:
    """The report's recorded settings a repro restores beside the row's own (which win), and what
    it says about them (settings applied, settings left out and why)."""
    if ci is None or not ci.session.get("settings"):
        return {}, []
    restored = restorable(ci.session["settings"])
    added = {k: v for k, v in restored.applied.items() if k not in job.env}
    notes = []
    if added:
        notes.append(
            "from the report: " + " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(added.items()))
        )
    for name, why in restored.left_out:
        notes.append(f"not restored: {printable(name, 80)} ({why})")
    return added, notes


def pytest_args(job: Row, reports: Path | str) -> list[str]:
    """The row's pytest arguments with the report folder: its selection, the report options as
    ``--opt=value`` (pytest picks its rootdir before plugins load: a separate value would count as
    a path there), then its other arguments."""
    return [*job.selection, f"--kit-report={reports}", f"--junitxml={reports}/junit.xml", *job.pytest_args]


def plan(args: argparse.Namespace) -> Plan | None:
    """The run the arguments ask for; None when a report has no failures (nothing to rerun)."""
    root = _check_arguments(args)
    if args.include_untracked and not args.from_report:
        raise UsageError("--include-untracked goes with --from-report")
    tier, gpus = args.tier, args.gpus
    seed: int | None = args.hypothesis_seed
    ci = _read_ci_report(args.from_report) if args.from_report else None
    if ci is not None:
        if not ci.failed:
            return None
        tier = tier or ci.tier
        gpus = _gpus_of(ci.session) if gpus is None else gpus
        seed = recorded_seed(ci.session) if seed is None else seed
    job = _choose_job(_project.rows_of(root), args.job, ci, tier, gpus)
    gpus = job.gpus if gpus is None else gpus
    reports = Path(args.reports).resolve() if args.reports else root / "reports" / "repro"
    host = args.host_memory or job.host_memory
    device = args.device_memory or job.device_memory
    recorded, notes = _recorded(job, ci)
    command = [sys.executable, "-m", "pytest", *pytest_args(job, reports)]
    if args.keyword:
        command += ["-k", args.keyword]
    if seed is not None:
        # An exploring row's failure: the same seed draws the same examples (run after run).
        command.append(f"--hypothesis-seed={seed}")
    p = Plan(
        job=job,
        gpus=gpus,
        host=host,
        device=device,
        host_bytes=_size(host, "host memory"),
        reports=reports,
        root=root,
        command=command + args.pytest_args,
        variables={**recorded, **job_variables(job, reports, gpus, host, device)},
        ci_failed=ci.failed if ci else [],
        ci_junit=ci.junit if ci else {},
        source=f"{len(ci.failed)} failed test(s) from {ci.path}" if ci else None,
        from_report=notes,
    )
    if ci is not None:
        # A test renamed or removed since the CI run is reported and skipped; the others rerun.
        selected = _select(p, ci.path, args.dry_run, args.include_untracked)
        p.command += ["--", *selected] if selected else []
    return p


def run_limited(p: Plan, limit: MemoryLimit) -> tuple[int, list[Kill]]:
    """pytest outside the limit, its ranks inside it (moved there as they start); exit code, kills."""
    env = environment(p.variables)
    if limit.cgroup is not None:
        # For a launcher that joins the group itself at rank start (no adoption window) and reads
        # its counters for the verdict; the watcher below does both meanwhile.
        env[RANK_CGROUP_ENV] = str(limit.cgroup)
    proc = start_child(p.command, cwd=p.root, env=env)
    watcher = limit.watch(proc.pid) if limit.limit_bytes is not None else None
    returncode = wait_forwarding(proc)  # a SIGTERM/SIGINT to repro stops pytest, which reports
    kills = watcher.stop() if watcher is not None else []
    for error in watcher.errors if watcher is not None else []:
        _say(f"warning: {error}")
    return returncode, kills


def with_kills(v: Verdict, kills: list[Kill]) -> Verdict:
    """The verdict once the runner's limit is accounted for: a rank it killed is the root cause, `oom`."""
    kill = next((k for k in kills if k.nodeid == v.nodeid), None)
    if kill is None or v.outcome not in ("failed", "error"):
        return v
    return replace(v, rank=kill.rank, kind="oom", first_line=kill.reason)


def _note_in_markdown(md: Path, returncode: int, limit: MemoryLimit, kills: list[Kill], usage: str) -> None:
    """Make the printed report path exist and say what the runner's limit did."""
    lines = []
    if not md.exists():
        lines += [
            "## Kit report",
            "",
            f"pytest exited with {returncode} and wrote no report: see its output and the rank logs.",
            "",
        ]
    if limit.limit_bytes is not None:
        lines += [f"### Runner memory limit ({limit.method})", "", f"- {limit.describe()}", f"- {usage}"]
        lines += [f"- `{k.nodeid}`: rank {k.rank} oom: {k.reason}" for k in kills]
        if limit.leftovers:
            lines.append(f"- {limit.leftovers} process(es) outlived the run in the group and were killed")
    if lines:
        md.parent.mkdir(parents=True, exist_ok=True)
        with open(md, "a") as f:
            f.write("\n" + "\n".join(lines) + "\n")


@dataclass(frozen=True)
class _LimitedRun:
    """What a run under the runner's limit left: pytest's exit code, the ranks it killed, its figures."""

    returncode: int
    kills: list[Kill]
    peak: int | None  # the group's peak memory, where the method measures one
    oom_count: int | None  # the group's kernel OOM kills, where the method counts them


def execute(p: Plan, limit_method: str) -> int:
    """Run the plan with the runner's memory limit on its ranks, then print the verdicts; pytest's exit code."""
    try:
        limit = apply_memory_limit(p.host_bytes, limit_method, owner=_project.prog)
    except (OSError, subprocess.SubprocessError) as exc:
        raise UsageError(f"--limit-method {limit_method}: {exc}") from None
    _say(f"runner memory limit: {limit.describe()}")
    _say(printable(shlex.join(p.command)))
    _clean(p.reports)
    run = _run_and_close(p, limit)
    print(flush=True)
    _say("=" * 30 + " verdicts " + "=" * 30)
    report_path = p.reports / "kit-report.json"
    local = _print_verdicts(p, report_path, run)
    usage = _say_usage(limit, run)
    md = p.reports / "kit-report.md"
    _note_in_markdown(md, run.returncode, limit, run.kills, usage)
    _say(f"report {md}, rank logs {p.reports / 'logs'}")
    if local is not None and failed_tests(local):
        _say(f"again: {_project.prog} --from-report {report_path}")
    return _exit_code(p, run.returncode, local)


def _run_and_close(p: Plan, limit: MemoryLimit) -> _LimitedRun:
    """The plan run under `limit`, whose figures are read before it is closed (also when the run fails)."""
    kills: list[Kill] = []
    try:
        returncode, kills = run_limited(p, limit)
    finally:
        peak, oom_count = limit.peak_bytes(), limit.oom_kills()
        limit.close()
    return _LimitedRun(returncode, kills, peak, oom_count)


def _print_verdicts(p: Plan, report_path: Path, run: _LimitedRun) -> dict[str, Any] | None:
    """The run's verdicts (beside CI's when repeating CI's failures); the report they came from, if usable."""
    try:
        local = load_report(report_path)
    except ReportError as exc:
        _say(f"pytest exited with {run.returncode} and left no usable report ({exc})")
        local = None
    if local is not None:
        wanted = {junit_key(test["nodeid"]) for test in failed_tests(local)}
        junit = junit_first_lines(p.reports / "junit.xml", wanted)
        here = {
            nodeid: with_kills(verdict(test, junit), run.kills) for nodeid, test in tests_by_id(local).items()
        }
        if p.ci_failed:
            _print_against_ci(p, here)
        else:
            failed = [here[test["nodeid"]] for test in failed_tests(local)]
            print(format_verdicts(failed) if failed else f"no failures ({_counts(local)})", flush=True)
    elif run.kills:
        for kill in run.kills:
            _say(f"FAILED {printable(kill.nodeid)}: rank {kill.rank} oom: {printable(kill.reason)}")
    return local


def _print_against_ci(p: Plan, here: dict[str, Verdict]) -> None:
    """CI's failures beside this run's verdicts of the same tests, and how many still fail."""
    ci = [verdict(test, p.ci_junit) for test in p.ci_failed]
    print(format_comparison(ci, here, p.stale, refused=dict(p.refused)), flush=True)
    pairs, still = format_pairs(ci, here, [*p.stale, *dict(p.refused)])
    print(pairs, flush=True)
    ran = len(ci) - len(p.stale) - len(p.refused)
    _say(
        f"{still} of {ran} test(s) CI failed still fail here"
        if still
        else f"none of the {ran} test(s) CI failed fails here"
    )


def _say_usage(limit: MemoryLimit, run: _LimitedRun) -> str:
    """Say what the runner's limit measured and did on the ranks; that line ("" without a limit)."""
    if limit.limit_bytes is None:
        return ""
    if limit.method == "env":
        usage = f"limit {format_size(limit.limit_bytes)} on the ranks' summed RSS, ranks killed over it {len(run.kills)}"
    else:
        measured = f"peak {format_size(run.peak)}" if run.peak is not None else "peak not measured"
        killed = f", kernel OOM kills {run.oom_count}" if run.oom_count is not None else ""
        usage = f"{measured} of {format_size(limit.limit_bytes)}{killed}"
    usage = f"runner memory ({limit.method}, on the ranks): {usage}"
    _say(usage)
    if limit.leftovers:
        _say(f"{limit.leftovers} process(es) outlived the run in the limit's group and were killed")
    return usage


def _exit_code(p: Plan, returncode: int, local: dict[str, Any] | None) -> int:
    """pytest's exit code, but a run that selected nothing or hid a failure fails, as it does in CI."""
    if returncode == 5:
        _say("pytest collected no tests: that is a failure here, as in CI")
        return 1
    if returncode == 0 and local is not None and p.ci_failed and failed_tests(local):
        return 1  # a failure pytest did not count (an interrupted test) still fails here
    return returncode if returncode >= 0 else 128 - returncode


def run(argv: list[str]) -> int:
    """Parse, plan, say what will run, run it (unless --dry-run); the exit code of the run."""
    args = build_parser(_project).parse_args(argv)
    p = plan(args)
    if p is None:
        _say(f"no failed tests in {printable(args.from_report)}: nothing to rerun")
        return 0
    job = p.job
    if not _say_what_is_left_out(p):
        return 1
    _say(f"{job.describe()}{': ' + p.source if p.source else ''}")
    for note in p.from_report:
        _say(note)
    _say(
        f"runner memory {p.host or '-'}; per-GPU memory {p.device or '-'}; GPUs {p.gpus} (visible here: {'not checked (--dry-run)' if args.dry_run else _visible_gpus()})"
    )
    installed = _installed_megatron_core()
    if job.megatron_core is not None and installed != job.megatron_core:
        release = printable(job.megatron_core, 40)
        hint = job.setup_hint or f"pip install megatron-core=={release}"
        _say(
            f"note: row {printable(job.name, 80)} runs megatron-core {release}, this Python has "
            f"{installed or 'none'}; for that release: {hint}"
        )
    if args.dry_run:
        _say("env " + " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(p.variables.items())))
        _say(printable(shlex.join(p.command)))
        return 0
    return execute(p, args.limit_method)


LISTED_IDS = 20  # ids a line names before "and N more": a report may hold 100,000 failed ids


def _first(items: list[str], sep: str, total: int) -> str:
    """The first `LISTED_IDS` of `items` (printable already) joined by `sep`, and how many more of
    `total` there are."""
    shown = sep.join(items[:LISTED_IDS])
    more = total - LISTED_IDS
    return shown + (f" and {more} more" if more > 0 else "")


def _say_what_is_left_out(p: Plan) -> bool:
    """Name the report's ids that are refused or stale; whether any of its failed tests is left to run."""
    if p.refused:
        _say(
            f"{len(p.refused)} id(s) of the report refused, not run (not a test of this project): "
            + _first(
                [f"{printable(nodeid, 200)} ({why})" for nodeid, why in p.refused[:LISTED_IDS]],
                "; ",
                len(p.refused),
            )
        )
    if p.unchecked:
        _say(f"not checked here whether git tracks the files ({p.unchecked}): the real run asks git")
    if p.stale:
        _say(
            f"{len(p.stale)} failed test(s) of the report do not exist here (renamed or removed since "
            "the CI run?), skipped: "
            + _first([printable(nodeid, 200) for nodeid in p.stale[:LISTED_IDS]], ", ", len(p.stale))
        )
    if p.ci_failed and len(p.stale) + len(p.refused) == len(p.ci_failed):
        what = "exists" if not p.refused else "can run"
        _say(f"none of the report's failed tests {what} here: nothing to rerun")
        return False
    return True


def _installed_megatron_core() -> str | None:
    from importlib import metadata

    try:
        return metadata.version("megatron-core")
    except metadata.PackageNotFoundError:
        return None


def _counts(report: dict[str, Any]) -> str:
    counts: dict[str, int] = {}
    for test in tests_by_id(report).values():
        counts[test["outcome"]] = counts.get(test["outcome"], 0) + 1
    return ", ".join(f"{n} {outcome}" for outcome, n in sorted(counts.items())) or "no tests"


def main(argv: list[str] | None = None, project: Project | None = None) -> int:
    """Entry point of `repro` for `project` (default: the project in the working directory, its
    rows from its pyproject); usage errors are one line on stderr and exit code 2."""
    global _project
    previous, _project = _project, project or Project()
    try:
        return run(list(sys.argv[1:] if argv is None else argv))
    except UsageError as exc:
        print(f"{_project.prog}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    finally:
        _project = previous
