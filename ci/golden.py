"""`python -m ci golden update REPORT | diff A.json B.json`: golden values from and between kit reports.

The logic ships with the kit (`megatron_testkit.golden_tool`), so a project using the plugin runs
the same commands as ``python -m megatron_testkit.golden_tool``; this is the repository's name for it.
"""

from __future__ import annotations

from megatron_testkit import golden_tool


def main(argv: list[str]) -> int:
    """Parse ``argv`` (after ``golden``) and run the subcommand; usage errors exit 2 with one line."""
    return golden_tool.main(argv, prog="python -m ci golden")
