"""`python -m accounting ...`: see accounting/cli.py."""

import sys

from accounting.cli import main

sys.exit(main())
