"""`python -m megatron_testkit COMMAND` (or `megatron-testkit COMMAND`): the kit's CI command line.

Each command works from any project's root on that project's own report (a local file or a
downloaded CI artifact, read as untrusted input): `repro` reruns a tier or a report's failures the
way CI ran them, `golden update|diff` refreshes and compares golden values, `chart` draws the
memory chart, `merge-reports` merges a multi-node job's reports, `summary` writes the job summary
(and the annotations) the composite action shows. A command's module is imported only when it
runs. Usage errors are one line on stderr and exit code 2.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable
from pathlib import Path

PROG = "python -m megatron_testkit"


def _lazy(target: str) -> Callable[..., int]:
    """``module.function``, imported when first called."""
    module, _, name = target.rpartition(".")

    def call(*args: object, **kwargs: object) -> int:
        return getattr(importlib.import_module(module), name)(*args, **kwargs)

    return call


def _repro(argv: list[str]) -> int:
    from megatron_testkit.repro import Project, main

    return main(argv, Project(prog=f"{PROG} repro"))


def _golden(argv: list[str]) -> int:
    from megatron_testkit.golden_tool import main

    return main(argv, prog=f"{PROG} golden")


class _Parser(argparse.ArgumentParser):
    """argparse whose errors are one line on stderr and exit code 2, never a usage block."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise _Usage(message)


class _Usage(Exception):
    pass


SUMMARY_HELP = (
    "A CI job's summary of its report folder: the Markdown of the job summary on stdout (the report's"
    " table, the memory chart, the command that reproduces the job), or the ::error lines of the failed"
    " tests (--annotations), or that command alone on one line (--repro-line)."
)


def _summary_parser() -> _Parser:
    """``summary``'s options: the folder, what to print instead of the Markdown, what to add to it."""
    parser = _Parser(prog=f"{PROG} summary", description=SUMMARY_HELP)
    parser.add_argument("reports", metavar="REPORT_DIR", help="the --kit-report folder (kit-report.json/.md)")
    parser.add_argument("--artifact", metavar="NAME", help="the CI artifact that holds the folder")
    parser.add_argument(
        "--repro-command",
        metavar="CMD",
        default="python -m megatron_testkit repro",
        help="the command that reruns the failures (default: %(default)s)",
    )
    parser.add_argument(
        "--also",
        metavar="FILE",
        action="append",
        default=[],
        help="more Markdown of the report folder to append (if it exists); a file outside it is refused",
    )
    parser.add_argument("--root", metavar="DIR", default=".", help="the project root (default: .)")
    shown = parser.add_mutually_exclusive_group()
    shown.add_argument("--annotations", action="store_true", help="print the ::error lines instead")
    shown.add_argument(
        "--repro-line", action="store_true", help="print only the command that reproduces the job, one line"
    )
    return parser


def _summary(argv: list[str]) -> int:
    """``summary REPORT_DIR``: the job summary's Markdown, the ``::error`` lines or the repro line."""
    import os

    try:
        args = _summary_parser().parse_args(argv)
    except _Usage as exc:
        print(f"{PROG} summary: error: {exc}", file=sys.stderr)
        return 2
    from accounting.json_input import printable
    from megatron_testkit import summary

    reports = Path(args.reports)
    if reports.is_file():  # the report itself, as `chart` and `repro --from-report` take it
        if reports.name not in ("kit-report.json", "kit-report.md"):
            print(
                f"{PROG} summary: error: {reports} is a file; REPORT_DIR is the --kit-report folder",
                file=sys.stderr,
            )
            return 2
        reports = reports.parent
    outside = summary.outside_folder(reports, [Path(p) for p in args.also])
    if outside is not None:
        # The job summary is public: a name like ../../x would publish any file of the runner.
        print(
            f"{PROG} summary: error: --also {printable(str(outside), 200)} is not a file of the report "
            f"folder {printable(str(reports), 200)}",
            file=sys.stderr,
        )
        return 2
    if args.annotations:
        for line in summary.annotations(reports):
            print(line)
        return 0
    # In a GitHub job the run is known: the repro line downloads exactly this run's artifact.
    repro = summary.repro_command(
        args.artifact,
        args.repro_command,
        os.environ.get("GITHUB_RUN_ID"),
        os.environ.get("GITHUB_REPOSITORY"),
        reports=str(reports),
    )
    if args.repro_line:
        print(printable(repro))  # one line: a newline in an input is written as an escape
        return 0
    sys.stdout.write(
        summary.job_summary(
            reports, Path(args.root), artifact=args.artifact, repro=repro, also=[Path(p) for p in args.also]
        )
    )
    return 0


# name -> (one line of help, the function that runs it on the rest of the command line)
COMMANDS: dict[str, tuple[str, Callable[[list[str]], int]]] = {
    "repro": ("rerun a tier, or a CI report's failed tests, the way CI ran them", _repro),
    "golden": ("golden values: update REPORT (write them from a run), diff A.json B.json", _golden),
    "chart": (
        "memory chart of a kit report (Mermaid, and its PNG beside it)",
        lambda argv: _lazy("megatron_testkit.charts.main")(argv, prog=PROG),
    ),
    "merge-reports": (
        "merge the per-node kit reports of a torchrun job: OUT DIR...",
        lambda argv: _lazy("megatron_testkit.torchrun_merge.main")(argv, prog=PROG),
    ),
    "summary": ("a CI job's summary of its kit report (Markdown), or its ::error annotations", _summary),
}


def help_text() -> str:
    """The top-level --help: every command with its line."""
    width = max(len(name) for name in COMMANDS)
    lines = [
        f"usage: {PROG} COMMAND [ARGS]",
        "",
        __doc__.splitlines()[0] if __doc__ else "",
        "",
        "commands:",
        *(f"    {name.ljust(width)}  {line}" for name, (line, _) in COMMANDS.items()),
        "",
        f"'{PROG} COMMAND --help' gives a command's own arguments.",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Run the command `argv` names; a usage error is one line on stderr and exit code 2."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] in (["-h"], ["--help"]):
        print(help_text())
        return 0
    if not args or args[0] not in COMMANDS:
        got = f"unknown command {args[0]!r}" if args else "no command given"
        print(f"{PROG}: error: {got}: expected one of {', '.join(COMMANDS)} (--help)", file=sys.stderr)
        return 2
    return COMMANDS[args[0]][1](args[1:])


def console() -> None:
    """The ``megatron-testkit`` console script."""
    sys.exit(main())
