"""What the check reports: one `StepResult` per step, a line of summary.json each, printed as it ends."""

from __future__ import annotations

import json
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

PASSING = ("ok", "dry-ok")


@dataclass
class StepResult:
    """One line of summary.json: a step, its verdict, its figures and what it saw."""

    step: str
    status: str  # ok, failed, skipped, dry-ok
    seconds: float = 0.0
    figures: dict[str, Any] = field(default_factory=dict)
    detail: str = ""


class StepFailed(Exception):
    """A step's check did not hold; the message says what was expected and what was seen."""


def expect(condition: bool, message: str) -> None:
    """Fail the step with `message` unless `condition` holds."""
    if not condition:
        raise StepFailed(message)


def record(summary: Path, result: StepResult) -> None:
    """Append `result` to summary.json (JSON per line) and print it, so a killed check keeps its lines."""
    line = json.dumps(asdict(result), default=str)
    with summary.open("a") as f:
        f.write(line + "\n")
    print(f"[gpu-check] {result.step:<12} {result.status:<8} {result.seconds:7.1f}s  {line}", flush=True)


def exit_status(results: Iterable[StepResult]) -> int:
    """0 when every step passed (or dry-ran), 1 otherwise."""
    return 0 if all(r.status in PASSING for r in results) else 1


class CheckState:
    """What a step reads of the running check: its output folder, dry-run flag and time left.

    The steps are typed against this (not the runner, `check.Check`, which imports every step):
    the imports stay one way.
    """

    def __init__(self, outdir: Path, *, dry_run: bool, budget_s: float) -> None:
        self.out = outdir
        self.dry = dry_run
        self.deadline = time.monotonic() + budget_s
        self.summary = outdir / "summary.json"

    def remaining(self) -> float:
        """Seconds left of the check's budget."""
        return self.deadline - time.monotonic()
