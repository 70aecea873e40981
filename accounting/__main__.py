"""`python -m accounting ...`: see accounting/cli.py."""

import os
import sys

from accounting.cli import main

try:
    code = main()
    sys.stdout.flush()
except BrokenPipeError:
    # The reader went away (`| head`): nothing more to say, and no traceback at exit either.
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    code = 1
sys.exit(code)
