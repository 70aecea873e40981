"""`python -m megatron_testkit COMMAND ...`: the kit's CI command line (the commands are listed in `megatron_testkit.cli`)."""

from __future__ import annotations

from accounting.pipe_exit import run
from megatron_testkit.cli import main

if __name__ == "__main__":
    run(main)
