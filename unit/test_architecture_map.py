"""ARCHITECTURE.md's map of what ships names every module of the two shipped packages, and only those.

The map is the first code block of ARCHITECTURE.md: a package's row (``accounting/  SHIPS``) is
followed by its modules' rows, each indented and naming one or more files (``cli.py, __main__.py``)
or a subpackage (``inspector/``). A module added without its row, or a row left behind by a move or
a rename, is a map that no longer matches the tree.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.L0

ROOT = Path(__file__).resolve().parent.parent
SHIPPED = ("accounting", "megatron_testkit")
_NAME = re.compile(r"(?<![\w/.])(\w+\.py|\w+/)(?=[\s,]|$)")


def _map_rows() -> dict[str, set[str]]:
    """Package -> the file and subpackage names its rows in the map name."""
    text = (ROOT / "ARCHITECTURE.md").read_text()
    block = text.split("```", 2)[1]
    rows: dict[str, set[str]] = {}
    current: str | None = None
    for line in block.splitlines():
        head = re.match(r"^(\w+)/\s", line)
        if head:
            current = head.group(1) if head.group(1) in SHIPPED else None
            if current:
                rows[current] = set()
            continue
        if current is None or not line.startswith("  ") or line.startswith("   " * 9):
            continue  # another row's package, or a description's continuation line
        first = line.strip().split("  ")[0]  # the names column, before the description
        rows[current].update(_NAME.findall(first))
    return rows


def _tree(package: str) -> set[str]:
    """The package's modules (``__init__.py`` aside) and subpackages, as the map names them."""
    root = ROOT / package
    modules = {p.name for p in root.glob("*.py") if p.name != "__init__.py"}
    subpackages = {f"{p.name}/" for p in root.iterdir() if (p / "__init__.py").is_file()}
    return modules | subpackages


@pytest.mark.parametrize("package", SHIPPED)
def test_the_map_names_every_module_of_the_package_and_no_other(package: str) -> None:
    named = _map_rows()[package]
    tree = _tree(package)
    assert sorted(tree - named) == [], f"ARCHITECTURE.md's map lacks these modules of {package}/"
    assert sorted(named - tree) == [], f"ARCHITECTURE.md's map names modules {package}/ does not have"


def test_the_map_reader_sees_a_missing_and_a_stale_row() -> None:
    # The reader itself: the names it takes from the map are the tree's today, so a module
    # missing from either side is seen (the test above compares whole sets, not a sample).
    rows = _map_rows()
    assert {"ranks.py", "plugin.py", "cli.py", "__main__.py"} <= rows["megatron_testkit"]
    assert {"flops.py", "inspector/", "cli_models.py"} <= rows["accounting"]
    assert "(fused" not in " ".join(rows["accounting"])  # descriptions are not names
