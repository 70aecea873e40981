"""What both `python -m accounting` subcommands share: the model options and the usage error.

Its own module so that `cli` (flops) and `memory_cli` (memory) both import it and neither imports
the other.
"""

from __future__ import annotations

import argparse

from accounting.adapters import LoraAdapter
from accounting.flops import ModelShape
from accounting.presets import PRESETS, preset, preset_adapter


class UsageError(Exception):
    """A bad argument: reported in one line, exit code 2."""


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
