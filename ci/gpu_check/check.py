"""The check's runner: the steps in order within a time budget, summary.json written line by line."""

from __future__ import annotations

import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ci.gpu_check import bench, environment, gpt, hang, memory, memory_estimate, pytest_step, sync
from ci.gpu_check.summary import CheckState, StepFailed, StepResult, exit_status, record

# Each step: a function of the running check giving its figures (or raising StepFailed).
STEP_FUNCTIONS: dict[str, Callable[[CheckState], dict[str, Any]]] = {
    "environment": environment.step,
    "memory": memory.step,
    "memory_estimate": memory_estimate.step,
    "hang": hang.step,
    "sync": sync.step,
    "bench": bench.step,
    "gpt": gpt.step,
    "pytest": pytest_step.step,
}
# A step starts only with this many seconds of the budget left; otherwise it is skipped.
MIN_STEP_S = 10


class Check(CheckState):
    """Runs the steps in order within a time budget, writing summary.json line by line."""

    def __init__(self, outdir: Path, *, dry_run: bool, budget_s: float) -> None:
        super().__init__(outdir, dry_run=dry_run, budget_s=budget_s)
        self.results: list[StepResult] = []

    def pytest_command(self) -> tuple[list[str], dict[str, str]]:
        """The pytest command and environment of the last step (printed by the dry run)."""
        return pytest_step.pytest_command(self.out)

    def run(self, names: list[str]) -> int:
        """Run the steps `names` in order; 0 when every one passed (or dry-ran), 1 otherwise."""
        self.out.mkdir(parents=True, exist_ok=True)
        self.summary.write_text("")
        for name in names:
            start = time.monotonic()
            result = self._run_step(name)
            result.seconds = round(time.monotonic() - start, 2)
            self.results.append(result)
            record(self.summary, result)
        return exit_status(self.results)

    def _run_step(self, name: str) -> StepResult:
        """One step's result: its figures, its failure, or skipped when the budget is spent."""
        if self.remaining() < MIN_STEP_S:
            return StepResult(name, "skipped", detail="out of time: the check's budget is spent")
        try:
            figures = STEP_FUNCTIONS[name](self)
        except StepFailed as exc:
            return StepResult(name, "failed", detail=str(exc))
        except Exception as exc:  # an unexpected error is this step's failure, not the check's
            (self.out / f"{name}.traceback.txt").write_text(traceback.format_exc())
            return StepResult(name, "failed", detail=f"{type(exc).__name__}: {exc}")
        return StepResult(name, "dry-ok" if self.dry else "ok", figures=figures)
