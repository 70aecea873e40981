"""`accounting`'s modules import one another one way only: no cycle, not even through type hints.

A cycle that only `if TYPE_CHECKING:` or a function-local import closes still works at run time,
until someone moves one import to the top of a module. So the graph is read statically (ast):
every `import` and `from ... import` anywhere in a module counts, whatever block it sits in.
A package that imports its own submodules is the usual layout; a submodule that imports its own
package back (`from accounting import X` inside `accounting/`) closes a cycle and is reported.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import accounting

pytestmark = pytest.mark.L0


def _module_names(root: Path, package: str) -> dict[str, Path]:
    """Dotted module name -> file, for every .py file under the package directory `root`."""
    names = {}
    for path in sorted(root.rglob("*.py")):
        parts = [package, *path.relative_to(root).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts.pop()
        names[".".join(parts)] = path
    return names


def _targets(node: ast.Import | ast.ImportFrom, module: str, is_package: bool, names: set[str]) -> set[str]:
    """The package's modules that one import statement in `module` loads by name."""
    if isinstance(node, ast.Import):
        return {alias.name for alias in node.names} & names
    if node.level:  # relative: resolved against the importing module's package
        base = module.split(".") if is_package else module.split(".")[:-1]
        base = base[: len(base) - (node.level - 1)]
        stem = ".".join([*base, node.module] if node.module else base)
    else:
        stem = node.module or ""
    # `from a.b import c` loads the module a.b.c when there is one, else takes c from a.b.
    submodules = {f"{stem}.{alias.name}" for alias in node.names} & names
    return submodules or ({stem} & names)


def import_graph(root: Path, package: str) -> dict[str, set[str]]:
    """Module -> the package's modules it imports, read from every import statement in its source."""
    names = _module_names(root, package)
    graph: dict[str, set[str]] = {}
    for module, path in names.items():
        edges = graph.setdefault(module, set())
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import | ast.ImportFrom):
                edges |= _targets(node, module, path.name == "__init__.py", set(names)) - {module}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle as a path that starts and ends at the same module, or None (depth-first search)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: finished
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (found := visit(start)):
            return found
    return None


def _write_package(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / "pkg" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root / "pkg"


def test_accounting_has_no_import_cycle() -> None:
    graph = import_graph(Path(accounting.__file__).parent, "accounting")
    # The graph really was read: flops uses adapters, and the package imports its inspector.
    assert "accounting.adapters" in graph["accounting.flops"]
    assert "accounting.inspector" in graph["accounting"]
    assert len(graph) >= 20
    assert find_cycle(graph) is None, f"import cycle: {' -> '.join(find_cycle(graph) or [])}"


@pytest.mark.parametrize(
    ("package", "edge"),
    [
        ("megatron_testkit", ("megatron_testkit.markers_plugin", "megatron_testkit.skips")),
        ("megatron_testkit", ("megatron_testkit.repro", "megatron_testkit.repro_rows")),
        ("ci", ("ci.gpu_check.check", "ci.gpu_check.bench")),
    ],
)
def test_the_kit_and_the_ci_tooling_have_no_import_cycle(package: str, edge: tuple[str, str]) -> None:
    root = Path(__file__).resolve().parent.parent / package
    graph = import_graph(root, package)
    assert edge[1] in graph[edge[0]]  # the graph really was read
    assert find_cycle(graph) is None, f"import cycle: {' -> '.join(find_cycle(graph) or [])}"


def _reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    """Every module `start` imports, directly or through the modules it imports."""
    seen: set[str] = set()
    stack = [start]
    while stack:
        module = stack.pop()
        if module not in seen:
            seen.add(module)
            stack.extend(graph.get(module, ()))
    return seen - {start}


@pytest.mark.parametrize("launcher", ["ranks", "rank_worker", "torchrun"])
def test_the_launcher_never_imports_a_golden_module(launcher: str) -> None:
    """One way only: the launcher -> platform names <- golden. A rank names its platform through
    `megatron_testkit.platforms`; nothing the launcher loads, at any depth, is a golden module."""
    root = Path(__file__).resolve().parent.parent / "megatron_testkit"
    graph = import_graph(root, "megatron_testkit")
    reached = _reachable(graph, f"megatron_testkit.{launcher}")
    assert "megatron_testkit.platforms" in graph["megatron_testkit.golden"]  # the graph really was read
    assert "megatron_testkit.platforms" in reached or launcher == "ranks"
    golden = sorted(m for m in reached if m.rpartition(".")[2].startswith("golden"))
    assert golden == [], f"megatron_testkit.{launcher} reaches {golden}"


def test_each_plugin_module_imports_only_the_plugin_modules_registered_before_it() -> None:
    """The entry module registers the kit's plugin modules in the order of its `pytest_plugins`;
    pytest rewrites a listed module's asserts only when it was not imported yet (else it warns), so
    a plugin module may import only those listed before it. Every plugin module is registered."""
    from megatron_testkit import plugin

    root = Path(__file__).resolve().parent.parent / "megatron_testkit"
    graph = import_graph(root, "megatron_testkit")
    listed = list(plugin.pytest_plugins)
    on_disk = {f"megatron_testkit.{p.stem}" for p in root.glob("*_plugin.py")}
    # golden_plugin is registered at configuration, under its own name (kit-golden).
    assert set(listed) == on_disk - {"megatron_testkit.golden_plugin"}
    assert "megatron_testkit.leak_guard_plugin" in graph["megatron_testkit.attribution_plugin"]  # read
    for index, module in enumerate(listed):
        later = sorted(graph[module] & set(listed[index + 1 :]))
        assert later == [], f"{module} imports {later}, registered after it"


def _top_level_imports(root: Path) -> dict[str, set[str]]:
    """File -> the top-level packages its import statements name (absolute imports only)."""
    found: dict[str, set[str]] = {}
    for path in sorted(root.rglob("*.py")):
        names = found.setdefault(str(path.relative_to(root.parent)), set())
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                names |= {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
                names.add(node.module.split(".")[0])
    return found


@pytest.mark.parametrize("package", ["megatron_testkit", "accounting"])
def test_what_ships_imports_nothing_of_this_repositorys_own_packages(package: str) -> None:
    """A user's project has no `ci`, `fixtures`, `unit` or `functional`: the CI commands moved into
    the kit, and nothing shipped may reach back into this repository's tooling."""
    root = Path(__file__).resolve().parent.parent / package
    found = _top_level_imports(root)
    assert f"{package}/repro.py" in found or package == "accounting"  # the graph really was read
    repo_only = {"ci", "fixtures", "unit", "functional", "conftest"}
    reaching = {name: sorted(tops & repo_only) for name, tops in found.items() if tops & repo_only}
    assert reaching == {}


def test_a_cycle_closed_only_under_type_checking_is_found(tmp_path: Path) -> None:
    root = _write_package(
        tmp_path,
        {
            "__init__.py": "",
            "shape.py": "from pkg.adapter import Adapter\n",
            "adapter.py": (
                "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.shape import Shape\n"
            ),
        },
    )
    assert find_cycle(import_graph(root, "pkg")) == ["pkg.adapter", "pkg.shape", "pkg.adapter"]


def test_function_local_relative_and_package_imports_are_edges(tmp_path: Path) -> None:
    root = _write_package(
        tmp_path,
        {
            "__init__.py": "from pkg.sub import helper\n",
            "sub/__init__.py": "",
            "sub/helper.py": "def f():\n    from .. import top\n",
            "top.py": "import pkg.sub.helper\n",
        },
    )
    graph = import_graph(root, "pkg")
    assert graph["pkg"] == {"pkg.sub.helper"}
    assert graph["pkg.sub.helper"] == {"pkg.top"}
    assert graph["pkg.top"] == {"pkg.sub.helper"}
    assert find_cycle(graph) == ["pkg.sub.helper", "pkg.top", "pkg.sub.helper"]


def test_a_submodule_importing_its_own_package_is_a_cycle(tmp_path: Path) -> None:
    root = _write_package(tmp_path, {"__init__.py": "from pkg.core import X\n", "core.py": "import pkg\n"})
    assert find_cycle(import_graph(root, "pkg")) == ["pkg", "pkg.core", "pkg"]
