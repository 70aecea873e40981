"""What both `python -m accounting` subcommands share: the model options, the bounds, the usage error.

Its own module so that `cli` (flops) and `memory_cli` (memory) both import it and neither imports
the other. Both take their numbers within the same bounds: an int64 (every sum is exact in one),
and a sequence whose length squared stays below 2**63 (the exact int64 sums of s^2).
"""

from __future__ import annotations

import argparse

from accounting.adapters import LoraAdapter
from accounting.flops import ModelShape
from accounting.presets import PRESETS, preset, preset_adapter

INT64_MAX = 2**63 - 1


class UsageError(Exception):
    """A bad argument: reported in one line, exit code 2."""


def plural(count: int, noun: str) -> str:
    """`1 document`, `2 documents`."""
    return f"{count} {noun}{'' if count == 1 else 's'}"


def in_range(flag: str, values: list[int], low: int) -> None:
    """Every value within [low, 2**63 - 1], else a one-line usage error naming the first offender."""
    for i, value in enumerate(values):
        if not low <= value <= INT64_MAX:
            where = f" (entry {i})" if len(values) > 1 else ""
            raise UsageError(f"{flag} {value}{where} is out of range: expected {low} <= value <= 2**63 - 1")


def squares_fit(flag: str, total: int) -> None:
    """The exact sums are int64; Σs² is bounded by the pack's token total squared, kept below 2**63."""
    if total * total > INT64_MAX:
        raise UsageError(
            f"{flag}: {total} tokens in one pack; {total}**2 >= 2**63 is past the exact int64 sums of s²"
        )


def model_arguments(parser: argparse.ArgumentParser) -> None:
    """`--preset NAME` or `--hf-config FILE`, exactly one."""
    model = parser.add_mutually_exclusive_group(required=True)
    model.add_argument("--preset", choices=sorted(PRESETS), help="a published model shape")
    model.add_argument("--hf-config", metavar="FILE", help="a Hugging Face config.json")


def model_from_args(args: argparse.Namespace) -> tuple[ModelShape, LoraAdapter | None, str]:
    """The shape, its adapter and a name for it, from `--preset` or `--hf-config` (bad file: exit 2)."""
    if args.preset is not None:
        return preset(args.preset), preset_adapter(args.preset), args.preset
    try:
        return ModelShape.from_hf_config(args.hf_config), None, args.hf_config
    except ValueError as err:
        raise UsageError(str(err)) from None
