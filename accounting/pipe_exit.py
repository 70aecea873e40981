"""Run a command-line ``main`` so that a reader that went away (``| head``) ends it quietly.

Shared by ``python -m accounting`` and ``python -m megatron_testkit``: without it, the first write
after the reader closed its end ended in a BrokenPipeError traceback."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import NoReturn


def run(main: Callable[[], int]) -> NoReturn:
    """``sys.exit(main())``; 1, silently, when standard output's reader went away."""
    try:
        code = main()
        sys.stdout.flush()
    except BrokenPipeError:
        # Nothing more can be said there; pointing stdout at /dev/null keeps the interpreter's own
        # flush at exit from raising again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        code = 1
    sys.exit(code)
