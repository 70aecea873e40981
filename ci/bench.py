"""`python -m ci bench [--compare BASELINE] [pytest args]`: run the benchmarks of ci/benchmarks, save, compare.

The one way to run a benchmark: pytest with pytest-benchmark on ``ci/benchmarks`` (everything
in it), the run saved as JSON under reports/benchmarks/, then the ratios printed (`ci.bench_compare`:
the ones each benchmark measured round by round and recorded, and ``median(subject) /
median(baseline)`` of any group of separate tests), with the figures the benchmarks recorded. With ``--compare`` (a run's JSON, or a directory of runs) a ratio that grew
past ``--tolerance`` is a regression and the exit code is 1. Other arguments go to pytest
(``-k inspect``, ``--benchmark-min-rounds=10``). ``--run RUN.json`` prints and compares a saved
run instead of running anything. ``--history DIR`` is the nightly row's: the run is saved into DIR
and compared with the earlier runs there (none on the first night: nothing to compare, exit 0),
keeping the newest 30; ``--markdown PATH`` writes the table for the job summary.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

from ci.bench_compare import DEFAULT_TOLERANCE, HISTORY_KEEP

ROOT = Path(__file__).resolve().parent.parent
BENCHMARKS = "ci/benchmarks"
STORAGE = ROOT / "reports" / "benchmarks"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The arguments of `python -m ci bench` (unknown ones are pytest's)."""
    parser.usage = (
        "%(prog)s [--compare BASELINE | --history DIR] [--tolerance FRACTION] [--json PATH]"
        " [--markdown PATH] [pytest args]\n"
        "       %(prog)s --run RUN [--compare BASELINE | --history DIR] [--tolerance FRACTION]"
    )
    parser.epilog = "Other arguments go to pytest, e.g. -k inspect or --benchmark-min-rounds=10."
    parser.add_argument(
        "--compare",
        type=Path,
        metavar="BASELINE",
        help="a pytest-benchmark JSON run, or a directory of runs, to compare the ratios with",
    )
    parser.add_argument(
        "--history",
        type=Path,
        metavar="DIR",
        help="save the run into DIR and compare it with the earlier runs there, if any "
        f"(the nightly row; keeps the newest {HISTORY_KEEP})",
    )
    parser.add_argument(
        "--markdown",
        type=Path,
        metavar="PATH",
        help="also write the ratio table as Markdown to PATH (the CI job's summary)",
    )
    parser.add_argument(
        "--tolerance",
        type=float,
        default=DEFAULT_TOLERANCE,
        metavar="FRACTION",
        help=f"relative growth of a ratio that is a regression (default {DEFAULT_TOLERANCE:.0%})".replace(
            "%", "%%"
        ),
    )
    parser.add_argument(
        "--json",
        type=Path,
        metavar="PATH",
        help="where to save the run (default reports/benchmarks/<UTC time>.json)",
    )
    parser.add_argument(
        "--run",
        type=Path,
        metavar="RUN",
        help="a saved run to print and compare instead of running the benchmarks",
    )


def own_session_env() -> dict[str, str]:
    """This environment without an enclosing xdist worker's variables: a benchmark session run from
    inside one (a test of this command, under ``ci/test.sh``'s workers) is a session of its own,
    and pytest-benchmark disables itself where ``PYTEST_XDIST_WORKER`` is set."""
    return {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_XDIST_")}


def pytest_command(saved: Path, pytest_args: list[str]) -> list[str]:
    """pytest on every benchmark of ci/benchmarks, the run saved to `saved`, `pytest_args` last."""
    return [
        sys.executable,
        "-m",
        "pytest",
        BENCHMARKS,
        "--benchmark-only",
        f"--benchmark-json={saved}",
        "-p",
        "no:randomly",
        *pytest_args,
    ]


def run(args: argparse.Namespace) -> int:
    """Run the benchmarks; the exit code is pytest's, else the comparison's (1: a ratio regressed)."""
    from ci.cli import UsageError

    if args.compare is not None and not args.compare.exists():
        raise UsageError(f"no baseline at {args.compare}")
    if args.compare is not None and args.history is not None:
        raise UsageError("--compare and --history both name the baseline: give one")
    if args.history is not None and args.history.exists() and not args.history.is_dir():
        raise UsageError(f"--history {args.history} is not a directory")
    if args.run is not None:
        if args.rest or args.json:
            raise UsageError("--run compares a saved run: it takes no --json and no pytest arguments")
        if not args.run.is_file():
            raise UsageError(f"no saved run at {args.run}")
        return _print_run(args.run, args)
    store = args.history or STORAGE
    saved = (args.json or store / time.strftime("%Y%m%dT%H%M%SZ.json", time.gmtime())).resolve()
    saved.parent.mkdir(parents=True, exist_ok=True)
    command = pytest_command(saved, args.rest)
    print(f"ci bench: {' '.join(command[1:])}", flush=True)
    returncode = subprocess.run(command, cwd=ROOT, env=own_session_env()).returncode
    if returncode != 0 or not saved.is_file():
        return returncode or 1
    print(f"ci bench: run saved to {saved}")
    return _print_run(saved, args)


def _print_run(run: Path, args: argparse.Namespace) -> int:
    """The figures the benchmarks recorded, then the ratio table (against the baseline or history, if any)."""
    from ci import bench_compare

    try:
        lines = bench_compare.figures(bench_compare.load(run))
    except (OSError, ValueError) as exc:  # JSONDecodeError is a ValueError
        print(f"{bench_compare.PROG}: error: {exc}", file=sys.stderr)
        return 2
    for line in lines:
        print(f"  {line}")
    history = args.history
    if history is not None:
        history.mkdir(parents=True, exist_ok=True)
    returncode = bench_compare.report(
        run, args.compare or history, args.tolerance, history=history is not None, markdown=args.markdown
    )
    if history is not None and returncode != 2:
        for gone in bench_compare.prune(history):
            print(f"ci bench: history keeps the newest {bench_compare.HISTORY_KEEP} runs: removed {gone}")
    return returncode
