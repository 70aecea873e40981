"""`python -m accounting memory`: the per-stage memory estimate of a preset or an HF config.

Prints a table (or `--json`: `{"stages": [...], "max_stage": k, "attention": ...}`) of each
pipeline stage's most loaded rank: parameters, static bytes, activation bytes and their total,
set against `--device-memory` when given, and says which attention the activations assume
(`--attention fused`, the default, or `unfused`). See `accounting.stage_memory` for the
conventions. A size always carries its unit (`80GiB`, `80GB`, `81920MiB`): a bare number is
refused rather than read as bytes. The numbers take the flops command's bounds (cli_models).
"""

from __future__ import annotations

import argparse
import json
import re
from fractions import Fraction

from accounting.cli_models import (
    INT64_MAX,
    UsageError,
    in_range,
    model_arguments,
    model_from_args,
    squares_fit,
)
from accounting.hf_config import load_hf_config, tied_embeddings
from accounting.stage_memory import ATTENTION, MemoryEstimate, ParallelLayout, memory_estimate

__all__ = ["add_memory_parser", "memory_command", "parse_size"]

_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
_UNITS.update({"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40})
_SIZE = re.compile(r"\s*([0-9]{1,30}(?:\.[0-9]{1,30})?)\s*([A-Za-z]{0,8})\s*")
# What each integer option may be, at least (the upper bound is the flops command's: 2**63 - 1).
_AT_LEAST = {
    "tp": 1, "pp": 1, "cp": 1, "ep": 1, "dp": 1, "micro_batch_size": 1, "seq_len": 1, "vpp": 1,
    "num_microbatches": 1, "first_stage_layers": 0, "last_stage_layers": 0,
}  # fmt: skip


def parse_size(text: str, flag: str = "--device-memory") -> int:
    """Bytes from a size with its unit (`80GiB`, `141GB`, `1.5TiB`, `512B`); ValueError otherwise.

    A bare number is refused: `80` meant as GiB would otherwise be read as 80 bytes.
    """
    match = _SIZE.fullmatch(text)
    if match is None:
        raise ValueError(f"{flag} {text!r}: expected a size with its unit, such as 80GiB, 141GB or 81920MiB")
    number, unit = match.groups()
    if not unit:
        raise ValueError(f"{flag} `{number}`: give a unit, for example `{number}GiB`")
    if unit.upper() not in _UNITS:
        raise ValueError(
            f"{flag} {text!r}: unknown unit {unit!r} (expected one of B, KB, MB, GB, TB, KiB, MiB, GiB, TiB)"
        )
    size = Fraction(number) * _UNITS[unit.upper()]
    if size.denominator != 1 and size > 1:  # a fraction of a byte is rounded down, exactly
        size = Fraction(int(size))
    if not 1 <= size <= INT64_MAX:
        raise ValueError(f"{flag} {text!r} is out of range: expected 1 byte <= size <= 2**63 - 1 bytes")
    return int(size)


def add_memory_parser(sub) -> None:
    """Adds the `memory` subcommand to the CLI's subparsers."""
    mem = sub.add_parser("memory", help="per-stage memory estimate (parameters, static, activations)")
    model_arguments(mem)
    for flag, help_text in (
        ("--tp", "tensor-parallel size"),
        ("--pp", "pipeline stages"),
        ("--cp", "context-parallel size"),
        ("--ep", "expert-parallel size"),
        ("--dp", "data-parallel size"),
        ("--micro-batch-size", "sequences per microbatch"),
    ):
        mem.add_argument(flag, type=int, default=1, help=f"{help_text} (default 1)")
    mem.add_argument("--seq-len", type=int, required=True, help="sequence length")
    mem.add_argument("--vpp", type=int, help="model chunks per stage (interleaved 1F1B)")
    mem.add_argument("--num-microbatches", type=int, help="microbatches per step (default: enough to fill)")
    mem.add_argument("--first-stage-layers", type=int, help="layers on the first stage (uneven pipeline)")
    mem.add_argument("--last-stage-layers", type=int, help="layers on the last stage (uneven pipeline)")
    mem.add_argument("--sequence-parallel", action="store_true")
    mem.add_argument("--recompute", choices=("full", "selective"), help="activation recomputation")
    mem.add_argument(
        "--attention",
        choices=ATTENTION,
        default="fused",
        help="fused (default: TE / flash attention, no s x s scores kept) or unfused (local attention)",
    )
    mem.add_argument(
        "--distributed-optimizer", action="store_true", help="optimizer state sharded over DP x CP"
    )
    mem.add_argument("--precision", choices=("bf16", "fp32"), default="bf16", help="bf16: 18 B/param")
    mem.add_argument("--normalization", choices=("RMSNorm", "LayerNorm"), default="RMSNorm")
    mem.add_argument("--device-memory", help="per-rank memory to compare with, with its unit: 80GiB, 80GB")
    mem.add_argument("--json", action="store_true", help="print one JSON object")


def _check_bounds(args: argparse.Namespace) -> None:
    """The flops command's bounds: every size an int64, the sequence's square too."""
    for name, low in _AT_LEAST.items():
        value = getattr(args, name)
        if value is not None:
            in_range(f"--{name.replace('_', '-')}", [value], low)
    squares_fit("--seq-len", args.seq_len)


def _estimate(args) -> tuple[MemoryEstimate, str]:
    _check_bounds(args)
    shape, _, name = model_from_args(args)
    tied = args.hf_config is not None and tied_embeddings(load_hf_config(args.hf_config)[0])
    layout = ParallelLayout(
        tp=args.tp,
        pp=args.pp,
        vpp=args.vpp,
        cp=args.cp,
        ep=args.ep,
        dp=args.dp,
        micro_batch_size=args.micro_batch_size,
        seq_len=args.seq_len,
        num_microbatches=args.num_microbatches,
        sequence_parallel=args.sequence_parallel,
        recompute=args.recompute,
        attention=args.attention,
        distributed_optimizer=args.distributed_optimizer,
        first_stage_layers=args.first_stage_layers,
        last_stage_layers=args.last_stage_layers,
    )
    estimate = memory_estimate(
        shape, layout, precision=args.precision, normalization=args.normalization, tied_embeddings=tied
    )
    return estimate, name


def _gib(value: int) -> str:
    return f"{value / 2**30:.2f} GiB"


def _attention_line(estimate: MemoryEstimate) -> str:
    if estimate.attention == "fused":
        return (
            "attention: fused (TE / flash attention: no s x s scores kept; "
            "--attention unfused counts megatron-core's local attention)"
        )
    return "attention: unfused (s x s scores kept for the backward: megatron-core's local attention)"


def _print_table(estimate: MemoryEstimate, name: str, device: int | None) -> None:
    print(f"{name}: per-rank memory of each pipeline stage (most loaded rank)")
    print(f"{'stage':<7}{'params':>16}{'static':>14}{'activations':>14}{'total':>14}")
    for row in estimate.stages:
        print(
            f"{row.stage:<7}{row.params:>16,}{_gib(row.static_bytes):>14}"
            f"{_gib(row.activation_bytes):>14}{_gib(row.total_bytes):>14}"
        )
    print(_attention_line(estimate))
    peak = estimate.stages[estimate.max_stage]
    print(f"max: stage {estimate.max_stage}, {_gib(peak.total_bytes)} per rank ({peak.total_bytes} bytes)")
    if device is not None:
        verdict = "fits" if peak.total_bytes <= device else "does not fit"
        print(f"device memory {_gib(device)}: {verdict} ({peak.total_bytes / device:.1%} of it)")


def memory_command(args: argparse.Namespace) -> int:
    """Runs `memory`; bad values raise the CLI's usage error (exit 2)."""
    try:
        device = None if args.device_memory is None else parse_size(args.device_memory)
        estimate, name = _estimate(args)
    except ValueError as err:
        raise UsageError(str(err)) from None
    if args.json:
        out = estimate.to_dict()
        if device is not None:
            out["device_memory"] = device
        print(json.dumps(out))
        return 0
    _print_table(estimate, name, device)
    return 0
