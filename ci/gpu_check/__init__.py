"""The single-GPU check: what one GPU can prove about the kit, in one command, under 8 minutes.

    python -m ci gpu-check OUTDIR [--dry-run] [--only STEP[,STEP...]] [--budget-s SECONDS]
    bash ci/gpu_check.sh OUTDIR [...]          (the same, after installing carried wheels, if any)

One module per step (each one line in OUTDIR/summary.json, JSON per line, and printed as it
finishes): ``environment``, ``memory``, ``hang``, ``sync``, ``bench``, ``gpt``, ``te_train``
(Transformer Engine's layers, bf16, save/load, two runs' loss spread), ``te_inspect`` (the
inspector through TE + nvdlfw-inspect), ``pytest`` (`pytest_step`); `check` runs them within the
time budget, `summary` writes what they found. The check ends by saying what it did not cover
(the tests that need two GPUs).

``--dry-run`` runs what the CPU can: the imports, the commands and environments the GPU steps
would use, a real flight-recorder dump of a two-rank gloo desync (the CPU build writes the same
format) parsed and diagnosed, the accounting calls, the benchmark's code on CPU tensors, the TE
steps' harness calls and test without TE (which needs a GPU), and the pytest selection
collected. Exit status 0 when every step passed (or dry-ran), 1 otherwise.

Importing this package is stdlib-only: torch and the kit are imported by the steps as they run.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ci.gpu_check.check import STEP_FUNCTIONS, Check

ROOT = Path(__file__).resolve().parents[2]
STEPS = tuple(STEP_FUNCTIONS)
# The whole check must end within 8 minutes on one H200; the budget leaves a margin for start-up.
DEFAULT_BUDGET_S = 450.0

__all__ = ["DEFAULT_BUDGET_S", "STEPS", "Check", "add_arguments", "run"]


def _steps(text: str) -> list[str]:
    """``--only``'s value: known step names, comma-separated (empty: every step)."""
    names = [s for s in text.split(",") if s] or list(STEPS)
    unknown = [s for s in names if s not in STEPS]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown step(s) {unknown}: expected some of {', '.join(STEPS)}")
    return names


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The arguments of `python -m ci gpu-check`."""
    parser.add_argument(
        "outdir", type=Path, metavar="OUTDIR", help="folder for summary.json, figures and logs"
    )
    parser.add_argument("--dry-run", action="store_true", help="run the CPU-side steps only")
    parser.add_argument(
        "--only",
        type=_steps,
        default=list(STEPS),
        metavar="STEP[,STEP...]",
        help=f"comma-separated steps out of {','.join(STEPS)}",
    )
    parser.add_argument(
        "--budget-s",
        type=float,
        default=DEFAULT_BUDGET_S,
        metavar="SECONDS",
        help="time budget for all steps",
    )


def run(args: argparse.Namespace) -> int:
    """Run the steps and return the exit status: 0 when every step passed (or dry-ran), 1 otherwise."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    check = Check(args.outdir.resolve(), dry_run=args.dry_run, budget_s=args.budget_s)
    mode = "dry run (CPU side only)" if args.dry_run else "on the GPU"
    print(f"[gpu-check] {mode}: steps {', '.join(args.only)}; results in {check.summary}", flush=True)
    status = check.run(args.only)
    for line in check.not_covered():
        print(f"[gpu-check] not covered: {line}", flush=True)
    print(f"[gpu-check] {'passed' if status == 0 else 'FAILED'}: {check.summary}", flush=True)
    return status
