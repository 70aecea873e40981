"""The kit as a new user meets it: installed into another project, not run from this repository.

A throwaway environment gets the kit's own wheel (built from this tree) and only its hard
dependencies (pytest and psutil, linked from this environment: no torch, no extras, no network).
In it a fresh project with the usual `tests/fixtures/` package, a `ProcessPoolExecutor` kept across
tests, and a package named `fixtures` installed in site-packages (a local stand-in for PyPI's
`fixtures`, the testtools one: same import name, which is what collided) runs its suite exactly as it
does with the plugin disabled. A second throwaway environment adds torch and megatron-core (linked
from this one) to the wheel: there a fresh project does what a user does, a TP=2 megatron-core
GPT trained for one step on CPU through the kit's CPU layer, under a memory budget, with the kit
report. Every process of a throwaway environment gets a scrubbed environment (no PYTHONPATH, no
user site), so a checkout on this environment's path cannot leak in. With the test extra (this
environment), a fresh project calls `run_ranks` as the README shows, and a rank function defined
in a `python script.py` works as with `torch.multiprocessing.spawn`.
"""

from __future__ import annotations

import json
import os
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
# What a user installs beside the kit to test megatron-core models (the README's install section).
# triton: megatron-core 0.17+ imports it in megatron.core.models.gpt without declaring it.
MEGATRON_DEPS = ("torch", "megatron-core")
UNDECLARED_MEGATRON_DEPS = ("triton",)
# Of this environment's variables, a throwaway one keeps only what describes the machine: the
# runner's memory limit (CI rows and `python -m ci repro` set these for every launch) and basics.
FRESH_ENV_KEEP = ("PATH", "HOME", "LANG", "LC_ALL", "TMPDIR", "TERM", "KIT_HOST_MEMORY", "KIT_RANK_CGROUP")
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


def _run(
    *args: str | Path, cwd: Path, timeout: float = 300, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(a) for a in args], cwd=cwd, capture_output=True, text=True, timeout=timeout, env=env
    )


def _fresh_env() -> dict[str, str]:
    """The environment of a process in a throwaway environment: nothing that points at this one.

    PYTHONPATH (a checkout on it shadows the wheel's packages and the project's own), PYTHONHOME,
    VIRTUAL_ENV, PYTEST_ADDOPTS and the like are dropped; the user site is off.
    """
    env = {name: os.environ[name] for name in FRESH_ENV_KEEP if name in os.environ}
    env["PYTHONNOUSERSITE"] = "1"
    return env


def _run_fresh(*args: str | Path, cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """`_run` for a throwaway environment's interpreter, with `_fresh_env()`."""
    return _run(*args, cwd=cwd, timeout=timeout, env=_fresh_env())


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
        try:
            requires = metadata.requires(name) or []
        except metadata.PackageNotFoundError:
            # Declared but not installed here (megatron-core 0.17+ on Python 3.11 is installed
            # with --no-deps): what runs here runs without it, and its import fails loudly if not.
            seen.discard(name.lower())
            continue
        for line in requires:
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
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The kit's wheel, built once for the module's throwaway environments."""
    return _build_wheel(tmp_path_factory.mktemp("wheel"))


def _fresh_venv(
    root: Path, wheel: Path, distributions: set[str], site_files: dict[str, str] | None = None
) -> tuple[Path, Path, list[str]]:
    """A venv without pip holding `distributions` (linked from here), then the kit's wheel.

    `site_files` are written into its site-packages before the wheel goes in (what a project had
    installed already). Returns its interpreter, its site-packages and the wheel's file names.
    """
    venv = root / "venv"
    result = _run(sys.executable, "-m", "venv", "--without-pip", venv, cwd=root)
    assert result.returncode == 0, result.stderr
    python = venv / "bin" / "python"
    purelib = "import sysconfig; print(sysconfig.get_paths()['purelib'])"
    site = Path(_run_fresh(python, "-c", purelib, cwd=root).stdout.strip())
    for name in sorted(distributions):
        _link_distribution(name, site)
    _write(site, site_files or {})
    with zipfile.ZipFile(wheel) as zf:  # a pure wheel's install: its files into site-packages
        names = zf.namelist()
        zf.extractall(site)
    _write_console_scripts(python, site, names)
    return python, site, names


def _write_console_scripts(python: Path, site: Path, names: list[str]) -> None:
    """What an installer does with the wheel's ``[console_scripts]``: a launcher in the venv's bin/."""
    import configparser

    (entry_points,) = (n for n in names if n.endswith(".dist-info/entry_points.txt"))
    parser = configparser.ConfigParser(delimiters=("=",))
    parser.optionxform = str  # type: ignore[assignment,method-assign]  # names keep their case
    parser.read_string((site / entry_points).read_text())
    scripts = parser["console_scripts"] if parser.has_section("console_scripts") else {}
    for name, target in scripts.items():
        module, _, function = target.strip().partition(":")
        launcher = python.parent / name
        launcher.write_text(
            f"#!{python}\nimport sys\nfrom {module} import {function}\nsys.exit({function}())\n"
        )
        launcher.chmod(0o755)


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory, wheel: Path) -> dict[str, Any]:
    """A fresh environment: the kit's wheel, its hard dependencies, PyPI-`fixtures` stand-in."""
    root = tmp_path_factory.mktemp("fresh")
    standin_files = {"fixtures/__init__.py": PYPI_FIXTURES_STANDIN}
    python, site, names = _fresh_venv(root, wheel, _closure(HARD_DEPS), site_files=standin_files)
    standin = site / "fixtures" / "__init__.py"
    project = root / "project"
    _write(project, PROJECT)
    return {"python": python, "site": site, "wheel_names": names, "project": project, "standin": standin}


def test_the_wheel_ships_the_library_and_the_kit_and_no_fixtures_package(env: dict[str, Any]) -> None:
    tops = {name.split("/")[0] for name in env["wheel_names"]}
    assert {t for t in tops if not t.endswith(".dist-info")} == {"accounting", "megatron_testkit"}
    (dist_info,) = (t for t in tops if t.endswith(".dist-info"))
    entry_points = (env["site"] / dist_info / "entry_points.txt").read_text()
    assert "[pytest11]\nmegatron_testkit.plugin = megatron_testkit.plugin" in entry_points
    from packaging.requirements import Requirement

    requires = [
        Requirement(line.split(":", 1)[1].strip())
        for line in (env["site"] / dist_info / "METADATA").read_text().splitlines()
        if line.startswith("Requires-Dist:") and "extra ==" not in line
    ]
    here = [r.name for r in requires if r.marker is None or r.marker.evaluate({"extra": ""})]
    assert sorted(here) == (
        ["psutil", "pytest"] if sys.version_info >= (3, 11) else ["psutil", "pytest", "tomli"]
    )
    # tomli only where tomllib is missing (the repro's pyproject rows); nothing else is conditional.
    assert sorted(r.name for r in requires if r.marker is not None) == ["tomli"]
    # Installing the kit left the other `fixtures` package as it was.
    assert env["standin"].read_text() == PYPI_FIXTURES_STANDIN


def test_the_environment_has_no_extras_and_the_plugin_loads_from_its_entry_point(env: dict[str, Any]) -> None:
    no_torch = _run_fresh(env["python"], "-c", "import torch", cwd=env["project"])
    assert no_torch.returncode != 0 and "No module named 'torch'" in no_torch.stderr
    markers = _run_fresh(
        env["python"], "-m", "pytest", "--markers", "-p", "no:cacheprovider", cwd=env["project"]
    )
    assert markers.returncode == 0, markers.stdout + markers.stderr
    assert "@pytest.mark.memory_budget(host=None, device=None)" in markers.stdout
    standin = _run_fresh(env["python"], "-c", "import fixtures; print(fixtures.__file__)", cwd=env["project"])
    assert standin.stdout.strip() == str(env["standin"])


def test_a_throwaway_environment_sees_nothing_of_this_ones_path(
    env: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    # This checkout on PYTHONPATH, as when the suite runs from a worktree over a shared venv.
    monkeypatch.setenv("PYTHONPATH", str(REPO))
    where = "import fixtures, megatron_testkit; print(fixtures.__file__); print(megatron_testkit.__file__)"
    fixtures_file, kit_file = _run_fresh(env["python"], "-c", where, cwd=env["project"]).stdout.split()
    assert fixtures_file == str(env["standin"])
    assert Path(kit_file).parent == env["site"] / "megatron_testkit"  # the wheel's, not the checkout's
    # Negative control: inheriting this environment, the checkout shadows both.
    leaked = _run(env["python"], "-c", where, cwd=env["project"]).stdout.split()
    assert leaked == [str(REPO / "fixtures" / "__init__.py"), str(REPO / "megatron_testkit" / "__init__.py")]


def test_a_fresh_projects_suite_runs_as_it_does_without_the_plugin(env: dict[str, Any]) -> None:
    args = (env["python"], "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:randomly")
    with_kit = _run_fresh(*args, cwd=env["project"])
    without = _run_fresh(*args, "-p", "no:megatron_testkit.plugin", cwd=env["project"])
    assert without.returncode == 0, without.stdout + without.stderr
    assert with_kit.returncode == 0, with_kit.stdout + with_kit.stderr
    assert "3 passed" in with_kit.stdout and "3 passed" in without.stdout
    assert "kit leak guard" not in with_kit.stdout
    # Negative control: guarding every test (the old default) kills the pool's workers after the
    # first test, and the suite breaks (a project's own long-lived workers must be left alone).
    guard_all = _run_fresh(*args, "-o", "kit_leak_guard=all", cwd=env["project"])
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
def test_in_this_repo_each_kit_module_has_one_name(name: str) -> None:
    # No `fixtures.<module>` alias of a kit module: a monkeypatch through a second name would
    # silently miss the module the code uses. The kit's own name imports.
    import importlib

    assert importlib.import_module(f"megatron_testkit.{name}").__name__ == f"megatron_testkit.{name}"
    assert not (REPO / "fixtures" / f"{name}.py").exists()
    with pytest.raises(ModuleNotFoundError, match=f"fixtures.{name}"):
        importlib.import_module(f"fixtures.{name}")


MEGATRON_PROJECT = {
    "pyproject.toml": '[tool.pytest.ini_options]\ntestpaths = ["tests"]\n',
    # A user's own test, as docs/megatron-on-cpu.md shows it: the kit's CPU layer inside the rank
    # function, run_ranks, a memory budget, and accounting's FLOPs counter.
    "tests/test_gpt_tp2.py": textwrap.dedent(
        """
        import pytest

        from megatron_testkit import RankFailure, run_ranks
        from megatron_testkit.megatron_compat import gpt_layer_spec
        from megatron_testkit.megatron_cpu import cpu_shim, destroy_model_parallel, init_model_parallel

        LAYERS, HIDDEN, HEADS, VOCAB, SEQ, BATCH = 2, 32, 4, 64, 16, 2


        def one_step(rank, world_size):
            import torch
            from megatron.core.models.gpt import GPTModel
            from megatron.core.transformer.transformer_config import TransformerConfig

            from accounting import FlopsAccumulator, ModelShape

            init_model_parallel(tensor_model_parallel_size=2)
            config = TransformerConfig(
                num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS,
                normalization="RMSNorm", tensor_model_parallel_size=2,
                hidden_dropout=0.0, attention_dropout=0.0, use_cpu_initialization=True,
            )
            model = GPTModel(
                config=config, transformer_layer_spec=gpt_layer_spec(),
                vocab_size=VOCAB, max_sequence_length=SEQ,
            )
            optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
            flops = FlopsAccumulator(packed=False, dp_size=1)
            batch = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(0))
            inputs, labels = batch[:, :-1], batch[:, 1:]  # the same batch on both TP ranks
            positions = torch.arange(SEQ).expand(BATCH, SEQ)

            before = model(inputs, positions, None, labels=labels).mean()
            before.backward()
            optimizer.step()
            flops.add_microbatch(micro_batch_size=BATCH, seq_len=SEQ)
            flops.step(ModelShape.from_megatron(config, vocab_size=VOCAB))
            with torch.no_grad():
                after = model(inputs, positions, None, labels=labels).mean()
            destroy_model_parallel()
            return before.item(), after.item(), flops.total_flops


        def train_on_cpu(rank, world_size):
            with cpu_shim():  # megatron-core's CUDA calls land on the CPU; a no-op where CUDA exists
                return one_step(rank, world_size)


        # Measured peak ~0.47 GiB per rank (torch + megatron-core imports, a tiny model): 2x room.
        @pytest.mark.memory_budget(host="1GiB")
        def test_tp2_gpt_trains_one_step_on_cpu():
            (before0, after0, flops0), (before1, after1, flops1) = run_ranks(train_on_cpu, 2, timeout=300)
            assert before0 == before1 and after0 == after1  # the TP ranks compute one loss
            assert after0 < before0
            # By hand, per token and layer: QKV 6h^2, attention output 2h^2, MLP (4h) 16h^2, causal
            # attention 2sh (s^2/2 pairs per sequence, QK^T and AV); logits 2hV; training 3x forward.
            per_token = LAYERS * (24 * HIDDEN**2 + 2 * SEQ * HIDDEN) + 2 * HIDDEN * VOCAB
            assert flops0 == flops1 == 3 * BATCH * SEQ * per_token


        @pytest.mark.memory_budget(host="1GiB")
        def test_without_the_cpu_layer_megatron_core_needs_cuda():
            # A CPU build of torch says this; a CUDA build with no GPU visible, "No CUDA GPUs ...".
            needs_cuda = "Torch not compiled with CUDA enabled|No CUDA GPUs are available"
            with pytest.raises(RankFailure, match=needs_cuda) as failure:
                run_ranks(one_step, 2, timeout=300)
            assert failure.value.kind == "error"
            with open(f"{failure.value.log_dir}/rank0.log") as log:
                assert "model_parallel_cuda_manual_seed" in log.read()
        """
    ),
}


@pytest.fixture(scope="module")
def megatron_env(tmp_path_factory: pytest.TempPathFactory, wheel: Path) -> dict[str, Any]:
    """A fresh environment with the kit's wheel, torch and megatron-core (as a user installs them)."""
    root = tmp_path_factory.mktemp("fresh-megatron")
    undeclared = {name for name in UNDECLARED_MEGATRON_DEPS if _installed(name)}
    python, site, _ = _fresh_venv(root, wheel, _closure(HARD_DEPS + MEGATRON_DEPS) | undeclared)
    project = root / "project"
    _write(project, MEGATRON_PROJECT)
    return {"python": python, "site": site, "project": project}


def _installed(name: str) -> bool:
    try:
        metadata.distribution(name)
    except metadata.PackageNotFoundError:
        return False
    return True


def test_a_fresh_project_trains_a_tp2_megatron_gpt_on_cpu_through_the_kit(
    megatron_env: dict[str, Any],
) -> None:
    python, project, site = megatron_env["python"], megatron_env["project"], megatron_env["site"]
    where = "import megatron_testkit, accounting; print(megatron_testkit.__file__, accounting.__file__)"
    kit_file, accounting_file = _run_fresh(python, "-c", where, cwd=project).stdout.split()
    assert Path(kit_file).parent.parent == Path(accounting_file).parent.parent == site  # the wheel's
    reports = project / "reports"
    result = _run_fresh(
        python,
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        f"--kit-report={reports}",
        cwd=project,
        timeout=900,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    assert "2 passed" in result.stdout
    # The report as documented: one row per test that launched ranks, in the terminal and in JSON.
    report = json.loads((reports / "kit-report.json").read_text())
    rows = {entry["nodeid"]: entry for entry in report["tests"]}
    trained = rows["tests/test_gpt_tp2.py::test_tp2_gpt_trains_one_step_on_cpu"]
    assert (trained["outcome"], trained["world_size"], trained["backend"]) == ("passed", 2, "gloo")
    assert trained["budget_host_bytes"] == 2**30
    assert 0 < trained["peak_host_bytes"] <= trained["budget_host_bytes"]
    assert [rank["rank"] for rank in trained["ranks"]] == [0, 1]
    table_row = next(
        line for line in result.stdout.splitlines() if "test_tp2_gpt_trains_one_step_on_cpu" in line
    )
    assert "host 1.00 GiB" in table_row and table_row.rstrip().endswith("passed")
    assert (reports / "kit-report.md").is_file()
    assert (Path(trained["log_dir"]) / "rank1.log").is_file()


def _python_block(path: Path, after: str) -> str:
    """The first ```python block of `path` that follows the line containing `after`."""
    text = path.read_text()
    start = text.index("```python\n", text.index(after)) + len("```python\n")
    return text[start : text.index("\n```", start)] + "\n"


def test_the_readmes_example_runs_in_a_fresh_project(megatron_env: dict[str, Any], tmp_path: Path) -> None:
    # The README's example as a test file, with the model and data its companion page writes out.
    project = tmp_path / "readme-project"
    _write(
        project,
        {
            "pyproject.toml": MEGATRON_PROJECT["pyproject.toml"],
            "tests/test_tp2.py": _python_block(REPO / "README.md", "## Use it in your own tests"),
            "tests/my_project.py": _python_block(
                REPO / "docs" / "megatron-on-cpu.md", "`tests/my_project.py`:"
            ),
        },
    )
    python = megatron_env["python"]
    result = _run_fresh(python, "-m", "pytest", "-q", "-p", "no:cacheprovider", cwd=project, timeout=900)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    assert "1 passed" in result.stdout
    assert "test_tp2_gpt_on_cpu" in result.stdout  # its row in the kit's table


# ---- the CI half, as a new user meets it ---------------------------------------------------------
# A user's own project: rank tests (one passes, one crosses its memory budget on rank 1, one
# catches the RankFailure of a launch whose rank 1 runs out of memory), a golden-values test whose
# committed file no longer matches, and a plain pytest.skip.
USER_PROJECT = {
    "pyproject.toml": '[tool.pytest.ini_options]\ntestpaths = ["tests"]\n',
    "tests/test_user.py": textwrap.dedent(
        """
        import pytest

        from megatron_testkit import RankFailure, metrics, run_ranks


        def total(rank, world_size):
            import torch
            import torch.distributed as dist

            t = torch.tensor([rank + 1.0])
            dist.all_reduce(t)
            return t.item()


        def hog(rank, world_size, mib):
            import torch

            if rank == 1:
                x = torch.ones(mib * 2**20 // 4)  # touched pages: resident
                return float(x[0])
            return 0.0


        def impossible(rank, world_size):
            import torch
            import torch.distributed as dist

            if rank == 1:
                torch.empty(2**50, dtype=torch.uint8)  # 1 PiB: the allocator refuses it
            dist.barrier()


        @pytest.mark.memory_budget(host="2GiB")
        def test_all_reduce():
            assert run_ranks(total, 2, timeout=120) == [3.0, 3.0]


        @pytest.mark.memory_budget(host="600MiB")
        def test_budget_oom():
            run_ranks(hog, 2, timeout=120, args=(900,))


        def test_caught():
            with pytest.raises(RankFailure) as failure:
                run_ranks(impossible, 2, timeout=120)
            assert (failure.value.rank, failure.value.kind) == (1, "oom")


        def test_loss(kit_metrics):
            kit_metrics.record_steps("loss", [2.5, 2.25], metrics.relative(1e-6, "the same arithmetic"))


        def test_not_today():
            pytest.skip("not on this runner")
        """
    ),
    # The committed golden file, from before the intended change (step 2 was 2.0).
    "tests/golden/test_user/test_loss.cpu-gloo.json": json.dumps(
        {
            "test": "tests/test_user.py::test_loss",
            "platform": "cpu-gloo",
            # Made on this release (the throwaway environment links this one's megatron-core): a
            # file made on another minor would get a release file of its own beside it instead.
            "made_with": {"megatron_core": metadata.version("megatron-core"), "torch": None},
            "series": {
                "loss": {
                    "compare": {"kind": "relative", "tolerance": 1e-6, "why": "the same arithmetic"},
                    "values": {"1": 2.5, "2": 2.0},
                }
            },
        },
        indent=2,
    )
    + "\n",
}
OOM, CAUGHT, LOSS = (
    f"tests/test_user.py::{name}" for name in ("test_budget_oom", "test_caught", "test_loss")
)


def _as_typed(line: str, python: Path) -> list[str]:
    """A printed command line as a person runs it in the throwaway environment (its python)."""
    import shlex

    return [str(python) if word == "python" else word for word in shlex.split(line)]


def test_a_new_users_ci_session_runs_command_by_command_with_only_the_wheel(
    megatron_env: dict[str, Any], tmp_path: Path
) -> None:
    python = megatron_env["python"]
    project = tmp_path / "user-project"
    _write(project, USER_PROJECT)
    # The kit's command line and its console script list the CI commands.
    for argv in (
        [python, "-m", "megatron_testkit", "--help"],
        [python.parent / "megatron-testkit", "--help"],
    ):
        shown = _run_fresh(*argv, cwd=project)
        assert shown.returncode == 0, shown.stderr
        listed = [line.split()[0] for line in shown.stdout.splitlines() if line.startswith("    ")]
        assert listed == ["repro", "golden", "chart", "merge-reports", "summary"], shown.stdout
    # Their suite, with the kit report.
    ran = _run_fresh(
        python, "-m", "pytest", "-p", "no:cacheprovider", "--kit-report=reports", cwd=project, timeout=900
    )
    assert ran.returncode == 1, ran.stdout[-4000:] + ran.stderr[-4000:]
    rows = {
        row["nodeid"]: row for row in json.loads((project / "reports/kit-report.json").read_text())["tests"]
    }
    assert (rows[OOM]["failure"]["rank"], rows[OOM]["failure"]["kind"]) == (1, "oom")
    # What the report records is the user's run: no variable the kit set for its own processes.
    report = json.loads((project / "reports/kit-report.json").read_text())
    assert not [s for s in report["session"]["settings"] if s["name"] == "KIT_ADMISSION_DIR"]
    # Its paths are relative to the report folder: a copy of the folder elsewhere (a downloaded
    # artifact) resolves the rank logs from the row and from the failure's "Rank logs:" line.
    artifact = tmp_path / "downloaded" / "kit-reports-tests"
    shutil.copytree(project / "reports", artifact)
    logs = rows[OOM]["rank_logs"]
    assert (artifact / logs / "rank1.log").is_file(), logs
    assert f"Rank logs: {logs} (in the --kit-report folder)" in rows[OOM]["failure"]["message"]
    assert f"rank logs: `{logs}`" in (artifact / "kit-report.md").read_text()
    # Each rank's memory over time, sampled by the launcher's poll: both ranks, budget or not.
    for row in (rows[OOM], rows[CAUGHT]):
        (launch,) = row["launches"]
        assert sorted(series["rank"] for series in launch["memory"]) == [0, 1], row["nodeid"]
    # The caught launch keeps its verdict: passed, and the launch failed on rank 1 (oom), caught.
    assert rows[CAUGHT]["outcome"] == "passed" and rows[CAUGHT]["failure"] is None
    (launch,) = rows[CAUGHT]["launches"]
    assert (launch["rank"], launch["kind"], launch["caught"]) == (1, "oom", True)
    caught_line = next(line for line in ran.stdout.splitlines() if "test_caught" in line)
    assert caught_line.rstrip().endswith("passed (1 launch failed: rank 1 oom, caught)"), caught_line
    # An ordinary skip prints nothing of the kit's skip policy.
    assert "capabilit" not in ran.stdout + ran.stderr and "KIT_ALLOWED_SKIPS" not in ran.stdout
    # The golden hint, run as printed, refreshes the file.
    hint = next(line for line in ran.stdout.splitlines() if "refresh with: " in line)
    command = hint.split("refresh with: ", 1)[1].strip()
    assert command == "python -m megatron_testkit golden update reports/kit-report.json", hint
    refreshed = _run_fresh(*_as_typed(command, python), cwd=project)
    assert refreshed.returncode == 0, refreshed.stdout + refreshed.stderr
    golden_file = project / "tests/golden/test_user/test_loss.cpu-gloo.json"
    assert json.loads(golden_file.read_text())["series"]["loss"]["values"] == {"1": 2.5, "2": 2.25}
    # Repro from the report: the failed tests rerun; the OOM's verdict is reproduced (rank, kind).
    repro = _run_fresh(
        python,
        "-m",
        "megatron_testkit",
        "repro",
        "--from-report",
        "reports/kit-report.json",
        cwd=project,
        timeout=900,
    )
    assert repro.returncode != 0, "it still fails"
    out = repro.stdout
    assert "kit repro: the session (tier -, the report's recorded session): 2 failed test(s)" in out, out[
        -3000:
    ]
    oom = next(line for line in out.splitlines() if line.startswith(f"{OOM}: CI: "))
    assert oom.startswith(f"{OOM}: CI: rank 1 oom at ") and " / here: rank 1 oom at " in oom, oom
    assert f"{LOSS}: CI: golden / here: passed" in out, "refreshed, the golden test passes here"
    assert "kit repro: 1 of 2 test(s) CI failed still fail here" in out
    # chart draws their report (the Mermaid block; the PNG needs the charts extra, not installed).
    chart = _run_fresh(python, "-m", "megatron_testkit", "chart", "reports/kit-report.json", cwd=project)
    assert chart.returncode == 0, chart.stderr
    assert "```mermaid\nxychart-beta" in chart.stdout and '"test_budget_oom"' in chart.stdout
    # A bar per rank, the test without a budget too; memory over time, a line per rank.
    assert '"test_budget_oom r0", "test_budget_oom r1"' in chart.stdout
    assert '"test_caught r0", "test_caught r1"' in chart.stdout  # no budget: in the ranks' chart
    assert "Host RSS over time" in chart.stdout
    assert "matplotlib is not installed, PNG skipped" in chart.stdout
    # summary takes the report folder, or the report file as chart and repro take it.
    kit = (python, "-m", "megatron_testkit", "summary", "--annotations")
    by_folder = _run_fresh(*kit, "reports", cwd=project)
    by_file = _run_fresh(*kit, "reports/kit-report.json", cwd=project)
    assert by_folder.returncode == by_file.returncode == 0, by_folder.stderr + by_file.stderr
    assert by_file.stdout == by_folder.stdout and "test_budget_oom%3A rank 1 oom::" in by_file.stdout
    # --repro-line: the command alone, on one line, as the action prints it.
    line = _run_fresh(python, "-m", "megatron_testkit", "summary", "--repro-line", "reports", cwd=project)
    assert line.returncode == 0 and line.stdout == (
        "python -m megatron_testkit repro --from-report reports/kit-report.json\n"
    ), line.stdout
    other = _run_fresh(*kit, "tests/test_user.py", cwd=project)
    assert other.returncode == 2 and "REPORT_DIR is the --kit-report folder" in other.stderr, other.stderr


def test_the_composite_actions_steps_run_against_a_fresh_project(
    megatron_env: dict[str, Any], tmp_path: Path
) -> None:
    from fixtures.github_action import run_action

    python = megatron_env["python"]
    project = tmp_path / "action-project"
    _write(project, USER_PROJECT)
    run = run_action(
        REPO / "action.yml",
        # The kit is installed already (no network here); a runner's memory limit for the ranks.
        {"pytest-args": "-p no:cacheprovider -k 'oom or skip'", "install": "false", "python": str(python),
         "runner-memory": "7GB"},
        cwd=project,
        env=_fresh_env(),
        github={"job": "tests", "run_id": "7", "repository": "user/project"},
        timeout=900,
    )  # fmt: skip
    assert run.returncode == 1, run.log[-4000:]
    session = json.loads((project / "reports/kit-report.json").read_text())["session"]
    assert (session["ci_job"], session["runner_memory_bytes"], session["runner_memory_source"]) == (
        "tests", 7 * 10**9, "KIT_HOST_MEMORY",
    )  # fmt: skip
    errors = [line for line in run.step("Job summary, memory chart and annotations").output.splitlines()
              if line.startswith("::error")]  # fmt: skip
    # line=: the test function's (its decorator's, as pytest locates it), counted in the file as written.
    source = USER_PROJECT["tests/test_user.py"].splitlines()
    line = source.index("def test_budget_oom():")  # 1-based: the memory_budget line above it
    assert source[line - 1].startswith("@pytest.mark.memory_budget")
    assert errors and errors[0].startswith(
        f"::error file=tests/test_user.py,line={line},title=tests/test_user.py%3A%3Atest_budget_oom%3A rank 1 oom::"
    ), errors
    assert run.summary.count("## Kit report") == 1 and "```mermaid\nxychart-beta" in run.summary
    assert "capabilit" not in run.summary + run.log
    repro = (
        "gh run download 7 --repo user/project --name kit-reports-tests --dir kit-reports-tests && "
        "python -m megatron_testkit repro --from-report kit-reports-tests/kit-report.json"
    )
    assert repro in run.summary and repro in run.step("The command that reproduces this job").output
    upload = run.step("Upload the report folder")
    assert (upload.given["name"], upload.given["path"]) == ("kit-reports-tests", "reports")
