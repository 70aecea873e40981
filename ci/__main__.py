"""`python -m ci job NAME` runs a CI job (what the workflows call); `python -m ci repro ...` reproduces one.

`job` is stdlib-only and runs before the kit is installed; `repro` is imported only when asked for.
`merge-reports OUT DIR...` merges per-node reports of a torchrun job.
`chart [REPORT]` prints the memory chart of a kit report (Mermaid) and writes its PNG beside it.
Usage errors are one line on stderr and exit code 2, for every command.
"""

from __future__ import annotations

import sys
from pathlib import Path

USAGE = """usage: python -m ci job NAME [--dry-run|--setup] run the CI job NAME (a row of ci/jobs.py)
       python -m ci repro [L0|L1|L2] [options]  run a tier locally the way CI does (--help)
       python -m ci chart [REPORT]              memory chart of a kit-report.json (default reports/)
       python -m ci merge-reports OUT DIR...    merge per-node kit reports (torchrun) into one
       python -m ci.gpu_check OUTDIR [--dry-run] the single-GPU check (figures and logs in OUTDIR)"""


def _usage_error(text: str) -> int:
    print(f"python -m ci: error: {text}", file=sys.stderr)
    return 2


def _job(args: list[str]) -> int:
    from ci.jobs import JOBS, run_job, run_setup

    flags = {"--dry-run", "--setup"}
    names = [arg for arg in args if arg not in flags]
    options = [name for name in names if name.startswith("-")]
    if options:
        return _usage_error(f"job: unknown option {options[0]!r} (expected --dry-run or --setup)")
    if len(names) != 1:
        return _usage_error(f"job: expected one job name ({', '.join(JOBS)}), got {names or 'none'}")
    if "--setup" in args:
        return run_setup(names[0])
    return run_job(names[0], dry_run="--dry-run" in args)


def _chart(args: list[str]) -> int:
    from ci.charts import memory_charts_markdown, write_png

    if len(args) > 1 or any(arg.startswith("-") for arg in args):
        return _usage_error(f"chart: expected at most one report path, got {args}")
    report = Path(args[0]) if args else Path("reports/kit-report.json")
    if not report.is_file():
        return _usage_error(f"chart: no report at {report}")
    print(memory_charts_markdown(report) or "no rank test declares a memory budget: no chart")
    print(write_png(report, report.with_name("kit-memory.png")))
    return 0


def main(argv: list[str] | None = None) -> int:
    """Dispatch to `job`, `repro`, `chart` or `merge-reports`; anything else is a one-line error and exit code 2."""
    args = list(sys.argv[1:] if argv is None else argv)
    command = args.pop(0) if args else ""
    if command == "job":
        return _job(args)
    if command == "repro":
        from ci.repro import main as repro_main

        return repro_main(args)
    if command == "chart":
        return _chart(args)
    if command == "merge-reports":
        from ci.merge_reports import main as merge_main

        return merge_main(args)
    if command in ("-h", "--help"):
        print(USAGE)
        return 0
    return _usage_error(
        f"unknown command {command!r}: expected 'job', 'repro', 'chart' or 'merge-reports' (--help)"
    )


if __name__ == "__main__":
    sys.exit(main())
