"""The check's runner: the steps in order within a time budget, summary.json written line by line."""

from __future__ import annotations

import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ci.gpu_check import (
    bench,
    environment,
    gpt,
    hang,
    memory,
    memory_estimate,
    pytest_step,
    sync,
    te_inspect,
    te_train,
)
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
    "te_train": te_train.step,
    "te_inspect": te_inspect.step,
    "pytest": pytest_step.step,
}
# What one GPU cannot cover, said at the end of every check (the GPU CI rows run it, on two GPUs).
NOT_COVERED = (
    "the tests that need two GPUs (NCCL between ranks: CP=2 pretrain->SFT with TE, TE attention "
    "against the reference, the 2-rank te-nvdlfw inspector, PP and PP x VPP over NCCL, the NCCL "
    "faults) and their <gpu>-nccl golden files: the L0/L1/L2 GPU rows run them"
)
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

    def not_covered(self) -> list[str]:
        """What this check did not cover: the two-GPU tests, and any step that did not pass."""
        lines = [NOT_COVERED]
        for result in self.results:
            skipped = result.figures.get("not_covered")
            if isinstance(skipped, list) and skipped:
                lines.append(f"skipped here for want of GPUs ({len(skipped)}): {', '.join(skipped)}")
            elif isinstance(skipped, str):
                lines.append(skipped)
            if result.status not in ("ok", "dry-ok"):
                lines.append(f"step {result.step} {result.status}: {result.detail}")
        return lines

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
