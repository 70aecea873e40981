"""`python -m ci <command>`: the one command line of this repository's CI tooling, a table of subcommands.

`job`, `gpu-check` and `bench` are this repository's own (its rows, `ci/jobs.py`). `repro`, `chart`,
`merge-reports` and `golden` are the kit's shipped commands (`python -m megatron_testkit ...`,
what a user's project runs), here under this repository's name: `repro` with the rows of
`ci/jobs.py`, the others as they ship. One implementation of each.

Adding a subcommand is one row of `COMMANDS`: its name, one line of help, a function adding its
arguments to its parser and the function that runs it, both usually ``_lazy("ci.module.function")``:
a command's module is imported only when that command runs, so `job` stays stdlib-only and runs
before the kit is installed, and `repro` is imported only when asked for. Usage errors are one
line on stderr and exit code 2, for every command.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

PROG = "python -m ci"


class UsageError(Exception):
    """Bad command-line input: one line on stderr, exit code 2."""


class _Exit(Exception):
    """argparse is done (it printed --help): main returns `status` instead of exiting the process."""

    def __init__(self, status: int) -> None:
        super().__init__(status)
        self.status = status


class _Parser(argparse.ArgumentParser):
    """argparse, but its errors are `UsageError`s (one line, no usage block) and it never exits."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise UsageError(message)

    def exit(self, status: int = 0, message: str | None = None) -> None:  # type: ignore[override]
        if message:
            sys.stderr.write(message)
        raise _Exit(status)


@dataclass(frozen=True)
class Command:
    """One subcommand. `add_arguments` None: the command parses its own arguments (all in `args.rest`).

    `takes_rest`: arguments its parser does not know go to it in `args.rest` (pytest's arguments)
    instead of being a usage error.
    """

    name: str
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None] | None
    run: Callable[[argparse.Namespace], int]
    takes_rest: bool = False


# ----------------------------------------------------------------------------------------- job
def _job_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("names", nargs="*", metavar="NAME", help="a row of ci/jobs.py (exactly one)")
    parser.add_argument("--dry-run", action="store_true", help="print what the job runs, run nothing")
    parser.add_argument(
        "--setup", action="store_true", help="only install the row's environment (ci/setup.sh)"
    )


def _job(args: argparse.Namespace) -> int:
    from ci.jobs import JOBS, run_job, run_setup

    if len(args.names) != 1:
        raise UsageError(f"expected one job name ({', '.join(JOBS)}), got {args.names or 'none'}")
    if args.setup:
        return run_setup(args.names[0])
    return run_job(args.names[0], dry_run=args.dry_run)


# --------------------------------------------------------------------------------------- chart
def _chart_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "reports", nargs="*", metavar="REPORT", help="a kit-report.json (default reports/kit-report.json)"
    )


def _chart(args: argparse.Namespace) -> int:
    if len(args.reports) > 1:
        raise UsageError(f"expected at most one report path, got {args.reports}")
    report = Path(args.reports[0]) if args.reports else Path("reports/kit-report.json")
    if not report.is_file():
        raise UsageError(f"no report at {report}")
    from megatron_testkit.charts import main as chart

    return chart([str(report)], prog=PROG)  # an unusable report: one line, exit 2 (it is untrusted)


# ------------------------------------------------------------------- commands in their own modules
def _lazy(target: str) -> Callable[..., Any]:
    """``module.function``, imported when first called, so a command's module loads only when it runs."""
    module, _, name = target.rpartition(".")

    def call(*args: Any) -> Any:
        return getattr(importlib.import_module(module), name)(*args)

    return call


def _own_parser(target: str, *extra: Any) -> Callable[[argparse.Namespace], int]:
    """A command whose ``main(argv, *extra)`` parses its own arguments: it gets all of them."""
    main = _lazy(target)
    return lambda args: main(args.rest, *extra)


COMMANDS: tuple[Command, ...] = (
    Command(
        "job", "run the CI job NAME, a row of ci/jobs.py (what the workflows call)", _job_arguments, _job
    ),
    Command(
        "repro",
        "run a tier, or a CI report's failures, locally the way CI does",
        None,
        _own_parser("ci.repro.main"),
    ),
    Command(
        "chart",
        "memory chart of a kit-report.json (Mermaid, and its PNG beside it)",
        _chart_arguments,
        _chart,
    ),
    Command(
        "merge-reports",
        "merge per-node kit reports of a torchrun job: OUT DIR...",
        None,
        _own_parser("megatron_testkit.torchrun_merge.main", PROG),
    ),
    Command(
        "gpu-check",
        "the single-GPU check (figures and logs in OUTDIR)",
        _lazy("ci.gpu_check.add_arguments"),
        _lazy("ci.gpu_check.run"),
    ),
    Command(
        "golden",
        "golden values: update REPORT (write them from a run), diff A.json B.json (compare two runs)",
        None,
        _own_parser("megatron_testkit.golden_tool.main", f"{PROG} golden"),
    ),
    Command(
        "bench",
        "run the benchmarks of ci/benchmarks and compare their ratios",
        _lazy("ci.bench.add_arguments"),
        _lazy("ci.bench.run"),
        takes_rest=True,
    ),
    Command(
        "pip-constraints",
        "refuse, before pip runs, a pin of an image's pip constraint file that the kit cannot meet",
        None,
        _own_parser("ci.pip_constraints.main"),
    ),
    Command(
        "l0-bench",
        "L0 serial against L0 on the CPU row's xdist workers: wall, CPU and peak memory side by side; "
        "--against REF: a previous commit's L0 against this tree's, and where the time goes",
        None,
        _own_parser("ci.l0_bench.main"),
    ),
    Command(
        "one-release",
        "check that this interpreter's `megatron` package comes from one megatron-core release",
        None,
        _own_parser("ci.one_release.main"),
    ),
)


def build_parser() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    """The top-level parser (its --help lists every command) and each command's parser, arguments not yet added."""
    parser = _Parser(
        prog=PROG,
        description="The CI tooling: one command line, one subcommand per job.",
        epilog=f"'{PROG} COMMAND --help' gives a command's own arguments.",
        allow_abbrev=False,
    )
    commands = parser.add_subparsers(title="commands", metavar="COMMAND", parser_class=_Parser)
    parsers = {
        command.name: commands.add_parser(
            command.name,
            help=command.help,
            description=command.help,
            add_help=command.add_arguments is not None,
            allow_abbrev=False,
        )
        for command in COMMANDS
    }
    return parser, parsers


def _parse(command: Command, parser: argparse.ArgumentParser, args: list[str]) -> argparse.Namespace:
    """`args` parsed by `command`'s parser; what it does not know is in `.rest` (an error unless it takes it)."""
    if command.add_arguments is None:
        return argparse.Namespace(rest=args)
    command.add_arguments(parser)
    if command.takes_rest:
        namespace, rest = parser.parse_known_args(args)
    else:
        namespace, rest = parser.parse_known_intermixed_args(args)
    if rest and not command.takes_rest:
        raise UsageError(_unexpected(parser, rest[0]))
    namespace.rest = rest
    return namespace


def _unexpected(parser: argparse.ArgumentParser, arg: str) -> str:
    """The one-line error for an argument `parser` does not know, naming the options it does."""
    if not arg.startswith("-"):
        return f"unexpected argument {arg!r} (--help)"
    known = [
        opt for action in parser._actions for opt in action.option_strings if opt not in ("-h", "--help")
    ]
    return f"unknown option {arg!r} (expected {' or '.join(known) if known else 'no options'})"


def _error(prog: str, message: str) -> int:
    print(f"{prog}: error: {message}", file=sys.stderr)
    return 2


def main(argv: list[str] | None = None) -> int:
    """Run the command `argv` names; a usage error is one line on stderr and exit code 2."""
    args = list(sys.argv[1:] if argv is None else argv)
    by_name = {command.name: command for command in COMMANDS}
    parser, parsers = build_parser()
    if args[:1] in (["-h"], ["--help"]):
        parser.print_help()
        return 0
    if not args or args[0] not in by_name:
        got = f"unknown command {args[0]!r}" if args else "no command given"
        return _error(PROG, f"{got}: expected one of {', '.join(by_name)} (--help)")
    command = by_name[args[0]]
    try:
        namespace = _parse(command, parsers[command.name], args[1:])
        return command.run(namespace)
    except UsageError as exc:
        return _error(f"{PROG} {command.name}", str(exc))
    except _Exit as done:
        return done.status
