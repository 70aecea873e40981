"""The kit as a new user meets it: installed into another project, not run from this repository.

A throwaway environment gets the kit's own wheel (built from this tree) and only its hard
dependencies (pytest and psutil, linked from this environment: no torch, no extras, no network).
In it a fresh project with the usual `tests/fixtures/` package, a `ProcessPoolExecutor` kept across
tests, and a package named `fixtures` installed in site-packages (a local stand-in for PyPI's
`fixtures`, the testtools one: same import name, which is what collided) runs its suite exactly as it
does with the plugin disabled. With the test extra (this environment), a fresh project calls
`run_ranks` as the README shows, and a rank function defined in a `python script.py` works as
with `torch.multiprocessing.spawn`.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import textwrap
import zipfile
from importlib import metadata
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.L0

REPO = Path(__file__).resolve().parent.parent
# The kit's hard dependencies (pyproject `dependencies`); their own come from their metadata.
HARD_DEPS = ("pytest", "psutil")
PYPI_FIXTURES_STANDIN = (
    '"""Stand-in for PyPI\'s `fixtures` (testtools): same top-level name."""\n\n\nclass Fixture:\n    pass\n'
)

PROJECT = {
    "tests/fixtures/__init__.py": "SAMPLE = {'answer': 42}\n",
    "tests/test_sample.py": textwrap.dedent(
        """
        from fixtures import SAMPLE  # the project's own tests/fixtures, not anything the kit installs


        def test_sample():
            assert SAMPLE["answer"] == 42
        """
    ),
    "tests/test_pool.py": textwrap.dedent(
        """
        from concurrent.futures import ProcessPoolExecutor

        import pytest

        POOL = ProcessPoolExecutor(2)  # workers start in the first test and serve the next ones


        @pytest.fixture(scope="module", autouse=True)
        def pool():
            yield POOL
            POOL.shutdown()


        def test_first_use_starts_the_workers():
            assert POOL.submit(pow, 2, 5).result() == 32


        def test_the_same_workers_serve_the_next_test():
            assert list(POOL.map(abs, [-1, -2])) == [1, 2]
        """
    ),
}


def _write(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def _run(*args: str | Path, cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(a) for a in args], cwd=cwd, capture_output=True, text=True, timeout=timeout)


def _build_wheel(out: Path) -> Path:
    """The kit's wheel, built from a copy of what ships (the build writes next to its sources)."""
    src = out / "src"
    src.mkdir(parents=True)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, src / name)
    for package in ("accounting", "megatron_testkit"):
        shutil.copytree(REPO / package, src / package, ignore=shutil.ignore_patterns("__pycache__"))
    result = _run(
        sys.executable,
        "-m",
        "pip",
        "wheel",
        "--no-deps",
        "--no-build-isolation",
        "-q",
        "-w",
        out / "dist",
        src,
        cwd=out,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    (wheel,) = (out / "dist").glob("*.whl")
    return wheel


def _closure(names: tuple[str, ...]) -> set[str]:
    """The distributions ``names`` need, with their dependencies (markers evaluated, no extras)."""
    from packaging.requirements import Requirement

    seen: set[str] = set()
    todo = list(names)
    while todo:
        name = todo.pop()
        if name.lower() in seen:
            continue
        seen.add(name.lower())
        for line in metadata.requires(name) or []:
            req = Requirement(line)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name)
    return seen


def _link_distribution(name: str, site: Path) -> None:
    """Make an installed distribution (code and metadata) importable in another site-packages."""
    dist = metadata.distribution(name)
    tops = {Path(str(f)).parts[0] for f in dist.files or [] if not str(f).startswith("..")}
    base = Path(str(dist.locate_file("")))
    for top in tops:
        if top.endswith(".pth") or top == "__pycache__":
            continue
        target = base / top
        if target.exists() and not (site / top).exists():
            (site / top).symlink_to(target)


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A fresh environment: the kit's wheel, its hard dependencies, PyPI-`fixtures` stand-in."""
    root = tmp_path_factory.mktemp("fresh")
    venv = root / "venv"
    result = _run(sys.executable, "-m", "venv", "--without-pip", venv, cwd=root)
    assert result.returncode == 0, result.stderr
    python = venv / "bin" / "python"
    site = Path(
        _run(
            python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])", cwd=root
        ).stdout.strip()
    )
    for name in sorted(_closure(HARD_DEPS)):
        _link_distribution(name, site)
    standin = site / "fixtures" / "__init__.py"
    standin.parent.mkdir()
    standin.write_text(PYPI_FIXTURES_STANDIN)
    wheel = _build_wheel(root / "build")
    with zipfile.ZipFile(wheel) as zf:  # a pure wheel's install: its files into site-packages
        names = zf.namelist()
        zf.extractall(site)
    project = root / "project"
    _write(project, PROJECT)
    return {"python": python, "site": site, "wheel_names": names, "project": project, "standin": standin}


def test_the_wheel_ships_the_library_and_the_kit_and_no_fixtures_package(env: dict[str, Any]) -> None:
    tops = {name.split("/")[0] for name in env["wheel_names"]}
    assert {t for t in tops if not t.endswith(".dist-info")} == {"accounting", "megatron_testkit"}
    (dist_info,) = (t for t in tops if t.endswith(".dist-info"))
    entry_points = (env["site"] / dist_info / "entry_points.txt").read_text()
    assert "[pytest11]\nmegatron_testkit.plugin = megatron_testkit.plugin" in entry_points
    requires = [
        line.split(":", 1)[1].strip()
        for line in (env["site"] / dist_info / "METADATA").read_text().splitlines()
        if line.startswith("Requires-Dist:") and "extra ==" not in line
    ]
    assert sorted(r.split(">")[0].split("=")[0].strip() for r in requires) == ["psutil", "pytest"]
    # Installing the kit left the other `fixtures` package as it was.
    assert env["standin"].read_text() == PYPI_FIXTURES_STANDIN


def test_the_environment_has_no_extras_and_the_plugin_loads_from_its_entry_point(env: dict[str, Any]) -> None:
    no_torch = _run(env["python"], "-c", "import torch", cwd=env["project"])
    assert no_torch.returncode != 0 and "No module named 'torch'" in no_torch.stderr
    markers = _run(env["python"], "-m", "pytest", "--markers", "-p", "no:cacheprovider", cwd=env["project"])
    assert markers.returncode == 0, markers.stdout + markers.stderr
    assert "@pytest.mark.memory_budget(host=None, device=None)" in markers.stdout
    standin = _run(env["python"], "-c", "import fixtures; print(fixtures.__file__)", cwd=env["project"])
    assert standin.stdout.strip() == str(env["standin"])


def test_a_fresh_projects_suite_runs_as_it_does_without_the_plugin(env: dict[str, Any]) -> None:
    args = (env["python"], "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:randomly")
    with_kit = _run(*args, cwd=env["project"])
    without = _run(*args, "-p", "no:megatron_testkit.plugin", cwd=env["project"])
    assert without.returncode == 0, without.stdout + without.stderr
    assert with_kit.returncode == 0, with_kit.stdout + with_kit.stderr
    assert "3 passed" in with_kit.stdout and "3 passed" in without.stdout
    assert "kit leak guard" not in with_kit.stdout
    # Negative control: guarding every test (the old default) kills the pool's workers after the
    # first test, and the suite breaks (a project's own long-lived workers must be left alone).
    guard_all = _run(*args, "-o", "kit_leak_guard=all", cwd=env["project"])
    assert guard_all.returncode != 0
    assert "kit leak guard: 2 child process(es) still alive" in guard_all.stdout


README_PROJECT = {
    "tests/fixtures/__init__.py": "SAMPLE = 1\n",
    # The README's "Using the plugin in another repository" example.
    "tests/test_readme.py": textwrap.dedent(
        """
        import pytest
        from megatron_testkit.ranks import run_ranks


        def body(rank, world_size):
            import torch, torch.distributed as dist

            t = torch.tensor([rank + 1.0])
            dist.all_reduce(t)  # the default process group is ready
            return t.item()


        @pytest.mark.world_size(2)
        @pytest.mark.memory_budget(host="1.5GiB", device="4GiB")
        def test_all_reduce():
            assert run_ranks(body, 2, timeout=120) == [3.0, 3.0]


        def test_own_fixtures_still_import():
            from fixtures import SAMPLE

            assert SAMPLE == 1
        """
    ),
}


def test_run_ranks_in_a_fresh_project_as_the_readme_shows(tmp_path: Path) -> None:
    _write(tmp_path, README_PROJECT)
    result = _run(sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", cwd=tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "2 passed" in result.stdout


SCRIPT = textwrap.dedent(
    """
    import torch.distributed as dist

    from megatron_testkit.ranks import run_ranks


    def total(rank, world_size):
        return rank + 10 * dist.get_world_size(), __name__


    if __name__ == "__main__":
        with open("main_block_runs.txt", "a") as f:
            f.write("ran\\n")
        print("results", run_ranks(total, 2, timeout=120))
    """
)


def test_a_rank_function_in_a_script_run_as_main_works_as_with_mp_spawn(tmp_path: Path) -> None:
    (tmp_path / "script.py").write_text(SCRIPT)
    result = _run(sys.executable, "script.py", cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    # The ranks ran the script as `__mp_main__` (as multiprocessing's spawn does), so its
    # `if __name__ == "__main__"` block ran once, in the launching process only.
    assert "results [(20, '__mp_main__'), (21, '__mp_main__')]" in result.stdout
    assert (tmp_path / "main_block_runs.txt").read_text() == "ran\n"


KIT_MODULES = (
    "ranks",
    "rank_worker",
    "diagnosis",
    "proctree",
    "budgets",
    "report",
    "plugin",
    "torchrun",
    "attribution",
    "collectives",
)


@pytest.mark.parametrize("name", KIT_MODULES)
def test_in_this_repo_fixtures_names_are_the_kit_modules_themselves(name: str) -> None:
    # One module object under both names: a monkeypatch through either is seen by both.
    import importlib

    assert importlib.import_module(f"fixtures.{name}") is importlib.import_module(f"megatron_testkit.{name}")
