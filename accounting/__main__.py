"""`python -m accounting ...`: see accounting/cli.py."""

from accounting.cli import main
from accounting.pipe_exit import run

run(main)
