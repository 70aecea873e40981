"""Command line: `python -m accounting flops --preset llama3-8b --docs 4096,2048,1024,1024`.

Prints the FLOPs breakdown of one packed sequence (model vs hardware FLOPs) and how far counting
the pack as one dense sequence (pack_len^2 attention) would over-report. Bad arguments get one
line on stderr and exit code 2: unknown names, malformed boundaries, and any number out of range
(negative, or past what the exact int64 sums hold). Long lists come from a file or stdin:
`--docs @lengths.txt`, `--docs -` or `@-` (integers separated by commas, spaces or newlines; read
within a stated size, see accounting/cli_input.py).
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from dataclasses import dataclass
from typing import Any

from accounting.cli_input import int_list as _int_list
from accounting.cli_models import UsageError as _UsageError
from accounting.cli_models import in_range as _in_range
from accounting.cli_models import model_arguments as _model_arguments
from accounting.cli_models import model_from_args, plural
from accounting.cli_models import squares_fit as _squares_fit
from accounting.flops import flops_from_sums
from accounting.memory_cli import add_memory_parser, memory_command
from accounting.precisions import parse_precision, time_at_peak
from accounting.seqlen_fields import FIELDS
from accounting.seqlen_validate import validate_boundary_list
from accounting.throughput import lookup_peak
from accounting.window import pairs_beyond

__all__ = ["main"]


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # argparse would print the whole usage first
        raise _UsageError(message)


def _build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="python -m accounting", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    flops = sub.add_parser("flops", help="FLOPs of one packed sequence for a preset model or an HF config")
    _model_arguments(flops)
    src = flops.add_mutually_exclusive_group()
    src.add_argument("--docs", type=_int_list, help="document lengths, e.g. 4096,2048,1024,1024")
    src.add_argument("--cu-seqlens", type=_int_list, help="cumulative boundaries, e.g. 0,4096,6144")
    flops.add_argument("--seq-len", type=int, help="pack length (default: the documents' total)")
    flops.add_argument("--recompute", choices=("full", "selective"), help="count the recompute forward")
    flops.add_argument(
        "--device", help="a device name (as torch.cuda.get_device_name() gives it): the time at its peaks"
    )
    flops.add_argument(
        "--precision",
        help="each term's precision: a TE recipe (tensorwise, delayed, mxfp8, blockwise), one precision, "
        "or GROUP=PRECISION pairs (groups: linear, attention, logits, router), e.g. linear=fp8",
    )
    flops.add_argument("--json", action="store_true", help="print one JSON object")
    add_memory_parser(sub)
    return parser


def _stats(args, window: tuple[int, int] | None) -> tuple[dict[str, int], int, int]:
    """Sums of the pack described by the arguments (`SeqlenStats.to_dict()`'s), its pack length
    and document count: Python ints, no tensor, so the command answers without importing torch."""
    if args.seq_len is not None:
        _in_range("--seq-len", [args.seq_len], 0)
    if args.docs is None and args.cu_seqlens is None:
        if args.seq_len is None:
            raise _UsageError("give --docs, --cu-seqlens or --seq-len")
        # --seq-len N alone is one document of N tokens; N = 0 is an empty pack, as --cu-seqlens 0.
        cu = [0, args.seq_len] if args.seq_len else [0]
        _squares_fit("--seq-len", args.seq_len)
    elif args.docs is not None:
        if not args.docs:
            raise _UsageError("--docs: no document length given")
        _in_range("--docs", args.docs, 0)
        if any(d == 0 for d in args.docs):
            raise _UsageError(f"--docs: lengths must be positive (entry {args.docs.index(0)} is 0)")
        cu = [0]
        for d in args.docs:
            cu.append(cu[-1] + d)
        _in_range("--docs: the total", [cu[-1]], 0)
        _squares_fit("--docs", cu[-1])
    else:
        cu = args.cu_seqlens
        _in_range("--cu-seqlens", cu, -1)
    pack_len = args.seq_len if args.seq_len is not None else max(cu) if cu else 0
    try:
        if not cu:
            raise ValueError("cu_seqlens has shape [0]: each row needs at least the leading 0")
        row = validate_boundary_list(cu, pack_len=pack_len)
    except ValueError as err:
        raise _UsageError(f"{'--cu-seqlens' if args.cu_seqlens is not None else '--docs'}: {err}") from None
    sums = _pack_sums([b - a for a, b in itertools.pairwise(row)], pack_len, window)
    return sums, pack_len, sums["num_sequences"]


def _pack_sums(lengths: list[int], pack_len: int, window: tuple[int, int] | None) -> dict[str, int]:
    """`seqlen_stats(cu, pack_len=pack_len, window_size=window).to_dict()` of one validated pack,
    from its segment lengths (zero-length ones count nothing): exact ints, under 2**63 once validated."""
    left, right = window if window is not None else (-1, -1)
    beyond = [sum(pairs_beyond(s, side) for s in lengths) for side in (left, right)]
    squared = sum(s * s for s in lengths)
    sums = dict.fromkeys(FIELDS, 0)
    sums.update(
        num_sequences=sum(1 for s in lengths if s),
        tokens=sum(lengths),
        squared=squared,
        padded_tokens=pack_len,
        padded_squared=squared,
        beyond_left=beyond[0],
        beyond_right=beyond[1],
        padded_beyond_left=beyond[0],
        padded_beyond_right=beyond[1],
    )
    return sums


def _dense_pack_flops(shape, pack_len: int, frozen: bool, adapter) -> int:
    """Model FLOPs if the pack were one document of `pack_len` tokens (exact Python ints, no int64)."""
    window = shape.stats_window
    left, right = (pairs_beyond(pack_len, side) for side in window) if window else (0, 0)
    sums = dict.fromkeys(FIELDS, 0)
    sums.update(
        num_sequences=1 if pack_len else 0,
        tokens=pack_len,
        squared=pack_len * pack_len,
        padded_tokens=pack_len,
        padded_squared=pack_len * pack_len,
        beyond_left=left,
        beyond_right=right,
        padded_beyond_left=left,
        padded_beyond_right=right,
    )
    return flops_from_sums(shape, sums, window=window, frozen_base=frozen, adapter=adapter).total


def _at_peak(args, terms: dict[str, int]) -> dict | None:
    """`time_at_peak` of `--device` and `--precision` (None without `--device`); bad names exit 2."""
    if args.device is None:
        if args.precision is not None:
            raise _UsageError("--precision needs --device (the peak of each precision is the device's)")
        return None
    try:
        spec = None if args.precision is None else parse_precision(args.precision)
        return time_at_peak(terms, spec, "bf16", lambda precision: lookup_peak(args.device, precision))
    except ValueError as err:
        raise _UsageError(str(err)) from None


@dataclass(frozen=True)
class _FlopsAnswer:
    """What `flops` found for one pack, before it is printed as JSON or as a table."""

    name: str  # the model, as the table's first line names it
    docs: int
    pack_len: int
    stats: dict[str, int]
    adapter: Any
    result: Any  # FlopsBreakdown
    dense: int  # model FLOPs if the pack were one document
    at_peak: dict | None

    @property
    def over(self) -> float:
        """How much the pack_len^2 count over-reports model FLOPs."""
        return self.dense / self.result.total - 1 if self.result.total else 0.0


def _flops(args) -> int:
    """`flops`: one pack's model and hardware FLOPs by term, as JSON or as a table."""
    shape, adapter, name = model_from_args(args)
    stats, pack_len, docs = _stats(args, shape.stats_window)
    frozen = adapter is not None
    result = flops_from_sums(
        shape, stats, window=shape.stats_window, recompute=args.recompute, frozen_base=frozen, adapter=adapter
    )
    dense = _dense_pack_flops(shape, pack_len, frozen, adapter)
    answer = _FlopsAnswer(name, docs, pack_len, stats, adapter, result, dense, _at_peak(args, result.terms))
    if args.json:
        print(json.dumps(_flops_json(args, answer)))
    else:
        _print_flops(args, answer)
    return 0


def _flops_json(args, answer: _FlopsAnswer) -> dict[str, Any]:
    """`flops --json`: the answer's figures under their documented keys."""
    result, adapter, at_peak = answer.result, answer.adapter, answer.at_peak
    return {
        "preset": args.preset,
        "hf_config": args.hf_config,
        "num_documents": answer.docs,
        "tokens": answer.stats["tokens"],
        "pack_len": answer.pack_len,
        "squared": answer.stats["squared"],
        "recompute": args.recompute,
        "frozen_base": adapter is not None,
        "adapter": None if adapter is None else {"rank": adapter.rank, "targets": list(adapter.targets)},
        "model_flops": result.total,
        "hardware_flops": result.hardware_total,
        "terms": result.terms,
        "hardware_terms": result.hardware_terms,
        "dense_pack_flops": answer.dense,
        "dense_pack_over_report": answer.over,
        **({} if at_peak is None else {"device": args.device, "at_peak": at_peak}),
    }


def _print_flops(args, answer: _FlopsAnswer) -> None:
    """`flops`: the pack, a table of the terms this architecture has, the exact totals, the peaks."""
    result, adapter, stats = answer.result, answer.adapter, answer.stats
    print(
        f"{answer.name}: {plural(answer.docs, 'document')}, {plural(stats['tokens'], 'real token')} "
        f"in a pack of {answer.pack_len}"
    )
    if adapter is not None:
        print(f"frozen base, LoRA rank {adapter.rank} on {', '.join(adapter.targets)}")
    print(f"{'term':<24}{'model FLOPs':>16}{'hardware FLOPs':>18}")
    for name, value in result.terms.items():
        if not value and not result.hardware_terms[name]:
            continue  # a term this architecture does not have
        print(f"{name:<24}{value:>16.4e}{result.hardware_terms[name]:>18.4e}")
    print(f"{'total':<24}{result.total:>16.4e}{result.hardware_total:>18.4e}")
    print(f"model FLOPs (exact): {result.total}")
    print(f"hardware FLOPs (exact): {result.hardware_total}")
    tokens = stats["tokens"]
    per_token = f"{result.total / tokens:.4e}" if tokens else "n/a"
    print(f"model FLOPs per token: {per_token}")
    print(f"pack_len^2 count: {answer.dense:.4e} (over-reports model FLOPs by {answer.over:+.2%})")
    if answer.at_peak is not None:
        print(_at_peak_line(args.device, answer.at_peak))


def _at_peak_line(device: str, at_peak: dict) -> str:
    """The time the step takes at `device`'s peaks: by each term's precision, and at the bf16 peak."""
    by = at_peak["seconds_at_peak"]
    single = at_peak["seconds_at_single_peak"]
    return (
        f"at {device}'s peaks: "
        + (
            f"{by:.4e} s by precision"
            if by is not None
            else f"no time by precision ({at_peak['seconds_at_peak_unavailable']})"
        )
        + (f", {single:.4e} s at the single bf16 peak" if single is not None else "")
    )


def main(argv: list[str] | None = None) -> int:
    """Runs the CLI; returns the exit code (2 for bad arguments, with one line on stderr)."""
    parser = _build_parser()
    try:
        args = parser.parse_args(argv)
        return memory_command(args) if args.command == "memory" else _flops(args)
    except _UsageError as err:
        print(f"python -m accounting: error: {err}", file=sys.stderr)
        return 2
