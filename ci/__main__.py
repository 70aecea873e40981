"""`python -m ci job NAME` runs a CI job (what the workflows call); `python -m ci repro ...` reproduces one.

`job` is stdlib-only and runs before the kit is installed; `repro` is imported only when asked for.
"""

from __future__ import annotations

import sys

USAGE = """usage: python -m ci job NAME [--dry-run]     run the CI job NAME (a row of ci/jobs.py)
       python -m ci repro [L0|L1|L2] [options]  run a tier locally the way CI does (--help)"""


def main(argv: list[str] | None = None) -> int:
    """Dispatch to `job` or `repro`; anything else is a one-line error and exit code 2."""
    args = list(sys.argv[1:] if argv is None else argv)
    command = args.pop(0) if args else ""
    if command == "job":
        from ci.jobs import JOBS, run_job

        dry_run = "--dry-run" in args
        names = [arg for arg in args if arg != "--dry-run"]
        if len(names) != 1:
            print(f"ci job: expected one job name ({', '.join(JOBS)}), got {names or 'none'}")
            return 2
        return run_job(names[0], dry_run=dry_run)
    if command == "repro":
        from ci.repro import main as repro_main

        return repro_main(args)
    if command == "merge-reports":
        from ci.merge_reports import main as merge_main

        return merge_main(args)
    if command in ("-h", "--help"):
        print(USAGE)
        return 0
    print(f"python -m ci: unknown command {command!r}: expected 'job' or 'repro' (--help)", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
