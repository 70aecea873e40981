"""`python -m ci COMMAND ...`: the CI tooling's one command line (the commands are listed in `ci.cli`)."""

from __future__ import annotations

import sys

from ci.cli import main

__all__ = ["main"]

if __name__ == "__main__":
    sys.exit(main())
