"""Check that the interpreter's ``megatron`` package comes from one megatron-core release.

``megatron`` is a namespace package: without an ``__init__.py`` Python merges every ``megatron/``
directory on ``sys.path`` into it. ``ci/setup.sh``'s overlay venv puts one release's megatron-core
in front of the base venv's site directory (the newest release's), so a namespace ``megatron``
there would show the base release's ``megatron/training`` to the overlay's ``megatron/core``:
0.19.2's ``megatron.training`` over 0.16.1's core fails with ``No module named
megatron.core.tokenizers.utils``. Every directory of ``megatron``, and every subpackage found in
it, must lie where the installed megatron-core distribution (the one ``importlib.metadata``
reports) lives.

    python -m ci one-release

Exit 0 with one line naming the release and its folder, 1 with one line per foreign directory on
stderr. Standard library only: setup.sh runs it with the interpreter it just made.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import pkgutil
import sys
from pathlib import Path

PROG = "python -m ci one-release"


def foreign_parts() -> tuple[str, Path, list[str]]:
    """The installed megatron-core release, its folder, and what of ``megatron`` lies elsewhere."""
    dist = importlib.metadata.distribution("megatron-core")
    home = Path(str(dist.locate_file(""))).resolve()
    spec = importlib.util.find_spec("megatron")
    if spec is None or spec.submodule_search_locations is None:
        return dist.version, home, ["no importable `megatron` package"]
    problems = []
    portions = [Path(p).resolve() for p in spec.submodule_search_locations]
    for portion in portions:
        if portion.parent != home:
            problems.append(f"`megatron` spans {portion}, outside megatron-core {dist.version}'s {home}")
    for module in pkgutil.iter_modules([str(p) for p in portions]):
        where = Path(module.module_finder.path).resolve()  # type: ignore[union-attr]
        if where.parent != home:
            problems.append(
                f"megatron.{module.name} comes from {where / module.name}, not from megatron-core "
                f"{dist.version}'s {home / 'megatron'}"
            )
    return dist.version, home, problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    parser.parse_args(argv)
    try:
        version, home, problems = foreign_parts()
    except importlib.metadata.PackageNotFoundError:
        print(f"{PROG}: megatron-core is not installed for {sys.executable}", file=sys.stderr)
        return 1
    for line in problems:
        print(f"{PROG}: {line}", file=sys.stderr)
    if not problems:
        print(f"megatron-core {version}: every part of `megatron` is in {home}")
    return 1 if problems else 0
