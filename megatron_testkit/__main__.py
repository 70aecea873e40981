"""`python -m megatron_testkit COMMAND ...`: the kit's CI command line (the commands are listed in `megatron_testkit.cli`)."""

from __future__ import annotations

import os
import sys

from megatron_testkit.cli import main

if __name__ == "__main__":
    try:
        code = main()
        sys.stdout.flush()
    except BrokenPipeError:
        # The reader went away (`| head`): nothing more to say, and no traceback at exit either.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        code = 1
    sys.exit(code)
