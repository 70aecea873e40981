"""The shipped multi-rank pytest kit: `run_ranks` launcher, failure diagnosis, memory budgets, report, plugin.

Import names are `megatron_testkit.*` so that nothing installed collides with a project's own
`fixtures`/`tests/fixtures` package or PyPI's `fixtures`; see ARCHITECTURE.md. The names a test
most often needs are here too: `run_ranks` (from `megatron_testkit.ranks`, imported on first
use), `RankFailure` (what a failed launch raises, from `megatron_testkit.diagnosis`),
`MemoryBudget` and `MemoryBudgetExceeded` (from `megatron_testkit.budgets`). Importing the
package imports neither torch nor megatron.
"""

from __future__ import annotations

from typing import Any

from megatron_testkit.budgets import MemoryBudget, MemoryBudgetExceeded
from megatron_testkit.diagnosis import RankFailure

__all__ = ["MemoryBudget", "MemoryBudgetExceeded", "RankFailure", "run_ranks"]


def __getattr__(name: str) -> Any:
    """`run_ranks` on first use: the launcher's module is larger than what the plugin needs."""
    if name == "run_ranks":
        from megatron_testkit.ranks import run_ranks

        return run_ranks
    raise AttributeError(f"module 'megatron_testkit' has no attribute {name!r}")
