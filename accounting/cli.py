"""Command line: `python -m accounting flops --preset llama3-8b --docs 4096,2048,1024,1024`.

Prints the FLOPs breakdown of one packed sequence (model vs hardware FLOPs) and how far counting
the pack as one dense sequence (pack_len^2 attention) would over-report. Bad arguments get one
line on stderr and exit code 2.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from accounting.flops import TERMS, training_flops
from accounting.presets import PRESETS, preset
from accounting.seqlens import SeqlenStats, seqlen_stats, validate_cu_seqlens

__all__ = ["main"]


class _UsageError(Exception):
    """A bad argument: reported in one line, exit code 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # argparse would print the whole usage first
        raise _UsageError(message)


def _int_list(text: str) -> list[int]:
    try:
        return [int(part) for part in text.split(",") if part.strip() != ""]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def _build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="python -m accounting", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    flops = sub.add_parser("flops", help="FLOPs of one packed sequence for a preset model")
    flops.add_argument("--preset", required=True, choices=sorted(PRESETS), help="model shape")
    src = flops.add_mutually_exclusive_group()
    src.add_argument("--docs", type=_int_list, help="document lengths, e.g. 4096,2048,1024,1024")
    src.add_argument("--cu-seqlens", type=_int_list, help="cumulative boundaries, e.g. 0,4096,6144")
    flops.add_argument("--seq-len", type=int, help="pack length (default: the documents' total)")
    flops.add_argument("--recompute", choices=("full", "selective"), help="count the recompute forward")
    flops.add_argument("--json", action="store_true", help="print one JSON object")
    return parser


def _stats(args) -> tuple[SeqlenStats, int, int]:
    """Statistics of the pack described by the arguments, its pack length and document count."""
    if args.docs is None and args.cu_seqlens is None:
        if args.seq_len is None:
            raise _UsageError("give --docs, --cu-seqlens or --seq-len")
        if args.seq_len <= 0:
            raise _UsageError(f"--seq-len {args.seq_len} must be positive")
        return SeqlenStats.dense(1, args.seq_len), args.seq_len, 1
    if args.docs is not None:
        if not args.docs or any(d <= 0 for d in args.docs):
            raise _UsageError(f"--docs {args.docs}: lengths must be positive")
        cu = [0]
        for d in args.docs:
            cu.append(cu[-1] + d)
    else:
        cu = args.cu_seqlens
    cu_tensor = torch.tensor(cu, dtype=torch.int64)
    pack_len = args.seq_len if args.seq_len is not None else max(c for c in cu) if cu else 0
    try:
        validate_cu_seqlens(cu_tensor, pack_len=pack_len)
    except ValueError as err:
        raise _UsageError(str(err)) from None
    stats = seqlen_stats(cu_tensor, pack_len=pack_len)
    return stats, pack_len, int(stats.num_sequences)


def _flops(args) -> int:
    shape = preset(args.preset)
    stats, pack_len, docs = _stats(args)
    result = training_flops(shape, stats, recompute=args.recompute)
    dense = training_flops(shape, SeqlenStats.dense(1, pack_len)).total if pack_len else 0
    over = dense / result.total - 1 if result.total else 0.0
    if args.json:
        print(
            json.dumps(
                {
                    "preset": args.preset,
                    "num_documents": docs,
                    "tokens": int(stats.tokens),
                    "pack_len": pack_len,
                    "squared": int(stats.squared),
                    "recompute": args.recompute,
                    "model_flops": result.total,
                    "hardware_flops": result.hardware_total,
                    "terms": result.terms,
                    "hardware_terms": result.hardware_terms,
                    "dense_pack_flops": dense,
                    "dense_pack_over_report": over,
                }
            )
        )
        return 0
    print(f"{args.preset}: {docs} documents, {int(stats.tokens)} real tokens in a pack of {pack_len}")
    print(f"{'term':<24}{'model FLOPs':>16}{'hardware FLOPs':>18}")
    for name in TERMS:
        print(f"{name:<24}{result.terms[name]:>16.4e}{result.hardware_terms[name]:>18.4e}")
    print(f"{'total':<24}{result.total:>16.4e}{result.hardware_total:>18.4e}")
    print(f"model FLOPs (exact): {result.total}")
    print(f"hardware FLOPs (exact): {result.hardware_total}")
    print(f"pack_len^2 count: {dense:.4e} (over-reports model FLOPs by {over:+.2%})")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Runs the CLI; returns the exit code (2 for bad arguments, with one line on stderr)."""
    parser = _build_parser()
    try:
        args = parser.parse_args(argv)
        return _flops(args)
    except _UsageError as err:
        print(f"python -m accounting: error: {err}", file=sys.stderr)
        return 2
