"""Refuse, before pip runs, an install the image's pip constraints make impossible.

NGC's PyTorch containers pin every preinstalled package in a constraint file (``PIP_CONSTRAINT``,
``/etc/pip/constraint.txt``). ``ci/setup.sh`` with ``KIT_SYSTEM_PYTHON=1`` installs the kit under
those pins; a pin older than what the kit needs would stop pip with a resolver dump. Here each such
pin is one line: the package, the pin and the file, and what the kit needs.

Run by ``ci/setup.sh`` with the interpreter it installs into, before the kit is installed there:
standard library and ``packaging`` only (pip's own copy where ``packaging`` is not installed).

    python -m ci pip-constraints --constraint FILE [--constraint FILE] --extras dev,inspect [REQ ...]

Exit 0 when nothing conflicts, 1 with one line per conflict on stderr, 2 for a usage error.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import NoReturn

try:
    from packaging.requirements import InvalidRequirement, Requirement
    from packaging.utils import canonicalize_name
    from packaging.version import InvalidVersion, Version
except ImportError:  # an interpreter without packaging still has pip's (setup.sh uses pip next)
    from pip._vendor.packaging.requirements import InvalidRequirement, Requirement  # type: ignore[no-redef]
    from pip._vendor.packaging.utils import canonicalize_name  # type: ignore[no-redef]
    from pip._vendor.packaging.version import InvalidVersion, Version  # type: ignore[no-redef]

try:
    import tomllib
except ImportError:  # Python 3.10
    from pip._vendor import tomli as tomllib  # type: ignore[no-redef]

ROOT = Path(__file__).resolve().parent.parent
PROG = "python -m ci pip-constraints"
# The largest constraint file read (NGC's holds a few hundred lines).
_MAX_BYTES = 4 * 2**20


def kit_requirements(pyproject: Path, extras: Iterable[str]) -> list[Requirement]:
    """The project's dependencies and those of ``extras``, self-references expanded once each."""
    project = tomllib.loads(pyproject.read_text())["project"]
    name = canonicalize_name(project["name"])
    optional = project.get("optional-dependencies", {})
    out = [Requirement(r) for r in project.get("dependencies", [])]
    todo, seen = list(extras), set()
    while todo:
        extra = todo.pop()
        if extra in seen:
            continue
        if extra not in optional:
            raise ValueError(f"{pyproject}: no extra {extra!r} (it has {', '.join(sorted(optional))})")
        seen.add(extra)
        for line in optional[extra]:
            req = Requirement(line)
            if canonicalize_name(req.name) == name:
                todo.extend(req.extras)
            else:
                out.append(req)
    return out


def constraint_pins(path: Path) -> Iterator[tuple[str, str, Requirement]]:
    """``(name, version, line)`` for each ``name==version`` pin of a constraint file; other lines
    (comments, options, URLs, ranges the resolver alone can weigh) are left to pip."""
    with open(path, "rb") as f:
        text = f.read(_MAX_BYTES + 1)
    if len(text) > _MAX_BYTES:
        raise ValueError(f"{path}: a constraint file over {_MAX_BYTES} bytes")
    for raw in text.decode(errors="replace").splitlines():
        line = raw.split(" #", 1)[0].strip()
        if not line or line.startswith(("#", "-")):
            continue
        try:
            req = Requirement(line)
        except InvalidRequirement:
            continue
        pins = [s for s in req.specifier if s.operator in ("==", "===") and "*" not in s.version]
        if req.url is None and len(pins) == 1 and (req.marker is None or req.marker.evaluate()):
            try:
                Version(pins[0].version)
            except InvalidVersion:  # a legacy version string: pip decides
                continue
            yield canonicalize_name(req.name), pins[0].version, req


def conflicts(requirements: Iterable[Requirement], constraint_files: Iterable[Path]) -> list[str]:
    """One line per requirement that a pin in ``constraint_files`` cannot satisfy."""
    needed = [r for r in requirements if r.marker is None or r.marker.evaluate()]
    lines = []
    for path in constraint_files:
        for name, version, pin in constraint_pins(path):
            for req in needed:
                if canonicalize_name(req.name) == name and not req.specifier.contains(
                    version, prereleases=True
                ):
                    lines.append(
                        f"ci/setup.sh: the image's pip constraint {pin} ({path}) conflicts with what the "
                        f"kit needs: {req}"
                    )
    return lines


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        """A usage error in one line, exit 2 (argparse's own adds the usage first)."""
        print(f"{self.prog}: error: {message}", file=sys.stderr)
        raise SystemExit(2)


def main(argv: list[str] | None = None) -> int:
    """The check on the command line: exit 0 (nothing conflicts), 1 (conflicts on stderr), 2 (usage)."""
    parser = _Parser(prog=PROG, description=__doc__.splitlines()[0])
    parser.add_argument("--constraint", action="append", default=[], type=Path, help="a pip constraint file")
    parser.add_argument("--extras", default="", help="the kit's extras installed, comma-separated")
    parser.add_argument("requirements", nargs="*", help="further requirements installed beside the kit")
    args = parser.parse_args(argv)
    try:
        wanted = kit_requirements(ROOT / "pyproject.toml", [e for e in re.split(r"[,\s]+", args.extras) if e])
        wanted += [Requirement(r) for r in args.requirements]
        found = conflicts(wanted, args.constraint)
    except (OSError, ValueError) as exc:  # InvalidRequirement is a ValueError
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    for line in found:
        print(line, file=sys.stderr)
    return 1 if found else 0
