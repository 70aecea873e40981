"""The plugin around the launcher: markers, budgets, the leak guard, xdist, torchrun mode.

In-process `pytester` runs where the inner session spawns nothing; a subprocess where it does.
"""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path
from typing import Any

import pytest

# Imported here, before any in-process pytester run: pytester drops modules first imported inside
# an inner session, and torch's C extension cannot be imported a second time.
import torch.distributed  # noqa: F401

from megatron_testkit.ranks import run_ranks

pytest_plugins = ["pytester"]

pytestmark = pytest.mark.L0


def test_markers_are_registered_by_the_plugin_itself(pytester: pytest.Pytester) -> None:
    # No pyproject here: a repository that only pip-installs the kit.
    pytester.makepyfile(
        """
        import pytest

        @pytest.mark.L0
        @pytest.mark.world_size(2)
        @pytest.mark.memory_budget(host="1GiB", device="2GiB")
        def test_marked():
            pass

        @pytest.mark.gpu
        def test_needs_cuda():
            pass

        @pytest.mark.gpu
        @pytest.mark.world_size(64)
        def test_needs_many_gpus():
            pass
        """
    )
    result = pytester.runpytest("--strict-markers", "-rs", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=1, skipped=2)
    from megatron_testkit.ranks import cuda_device_count

    if cuda_device_count() == 0:
        result.stdout.fnmatch_lines(["*needs CUDA (marked gpu); no CUDA device is visible*"])
    else:
        result.stdout.fnmatch_lines(["*needs 64 GPUs (marked gpu, world_size(64))*"])


def test_garbage_budget_is_an_error_naming_the_value(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        """
        import pytest

        @pytest.mark.memory_budget(host="plenty")
        def test_budget():
            pass
        """
    )
    result = pytester.runpytest("-p", "no:cacheprovider")
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(["*cannot parse memory size 'plenty'*"])


def test_leak_guard_kills_a_leftover_child_and_errors(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        """
        import subprocess, sys

        import pytest

        PIDS = []

        @pytest.mark.leak_guard  # launches no ranks: guarded because it opts in
        def test_leaves_a_child():
            PIDS.append(subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"]).pid)

        def test_child_is_gone():
            import psutil
            try:
                status = psutil.Process(PIDS[0]).status()
            except psutil.NoSuchProcess:
                status = "gone"
            assert status in ("gone", psutil.STATUS_ZOMBIE)
        """
    )
    result = pytester.runpytest("-p", "no:cacheprovider", "-p", "no:randomly")
    result.assert_outcomes(passed=2, errors=1)
    result.stdout.fnmatch_lines(["*kit leak guard: 1 child process(es) still alive after the test (killed)*"])


def test_leak_guard_destroys_a_leftover_process_group(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        """
        import pytest
        import torch.distributed as dist

        @pytest.mark.leak_guard
        def test_leaves_a_group(tmp_path):
            dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "s"), 1), rank=0, world_size=1)

        def test_group_is_gone():
            assert not dist.is_initialized()
        """
    )
    result = pytester.runpytest("-p", "no:cacheprovider", "-p", "no:randomly")
    result.assert_outcomes(passed=2, errors=1)
    result.stdout.fnmatch_lines(["*default torch.distributed process group was left initialised*"])


LEAVES_A_CHILD = """
import subprocess, sys

import pytest

PIDS = []

@pytest.mark.leak_guard
def test_leaves_a_child():
    PIDS.append(subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"]).pid)

def test_child_is_still_there():
    import psutil
    proc = psutil.Process(PIDS[0])
    alive = proc.status() != psutil.STATUS_ZOMBIE
    proc.kill()
    assert alive
"""


def test_the_leak_guard_leaves_tests_without_ranks_alone(pytester: pytest.Pytester) -> None:
    # A project's own workers (a process pool kept across tests) are not the kit's business.
    pytester.makepyfile(LEAVES_A_CHILD.replace("@pytest.mark.leak_guard\n", ""))
    result = pytester.runpytest("-p", "no:cacheprovider", "-p", "no:randomly")
    result.assert_outcomes(passed=2)
    assert "kit leak guard" not in result.stdout.str()


def test_the_leak_guard_is_turned_off_by_the_ini_option(pytester: pytest.Pytester) -> None:
    pytester.makeini("[pytest]\nkit_leak_guard = off\n")
    pytester.makepyfile(LEAVES_A_CHILD)
    result = pytester.runpytest("-p", "no:cacheprovider", "-p", "no:randomly")
    result.assert_outcomes(passed=2)


def test_kit_leak_guard_all_guards_every_test(pytester: pytest.Pytester) -> None:
    pytester.makeini("[pytest]\nkit_leak_guard = all\n")
    pytester.makepyfile(LEAVES_A_CHILD.replace("@pytest.mark.leak_guard\n", ""))
    result = pytester.runpytest("-p", "no:cacheprovider", "-p", "no:randomly")
    result.assert_outcomes(passed=1, failed=1, errors=1)
    result.stdout.fnmatch_lines(["*kit leak guard: 1 child process(es) still alive after the test (killed)*"])


def test_an_unknown_kit_leak_guard_value_is_a_usage_error(pytester: pytest.Pytester) -> None:
    pytester.makeini("[pytest]\nkit_leak_guard = sometimes\n")
    pytester.makepyfile("def test_a():\n    pass\n")
    result = pytester.runpytest("-p", "no:cacheprovider")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*kit_leak_guard = 'sometimes'*expected one of ranks, all, off*"])


def test_report_covers_tests_without_ranks_and_skips(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The inner session is a user's project, whose skips are not this job's declared ones.
    monkeypatch.delenv("KIT_ALLOWED_SKIPS", raising=False)
    pytester.makepyfile(
        """
        import pytest

        def test_plain():
            pass

        @pytest.mark.skip(reason="not today")
        def test_skipped():
            pass

        def test_fails():
            assert 1 == 2
        """
    )
    result = pytester.runpytest("-p", "no:cacheprovider", "--kit-report", "out")
    result.assert_outcomes(passed=1, skipped=1, failed=1)
    report = json.loads((pytester.path / "out" / "kit-report.json").read_text())
    rows = {row["nodeid"].split("::")[-1]: row for row in report["tests"]}
    assert {k: r["outcome"] for k, r in rows.items()} == {
        "test_plain": "passed",
        "test_skipped": "skipped",
        "test_fails": "failed",
    }
    assert rows["test_fails"]["failure"]["first_line"] == "assert 1 == 2"
    assert all(r["world_size"] == 0 for r in rows.values())
    assert report["session"]["outcome_counts"] == {"passed": 1, "failed": 1, "skipped": 1, "error": 0}
    assert (pytester.path / "out" / "kit-report.md").exists()


def local_function_holder() -> Any:
    def inner(rank: int, world_size: int) -> int:
        return rank

    return inner


def test_a_local_function_is_refused_before_anything_is_spawned() -> None:
    with pytest.raises(TypeError, match="needs a module-level function"):
        run_ranks(local_function_holder(), 2)
    with pytest.raises(TypeError, match="needs a module-level function"):
        run_ranks(lambda rank, world_size: rank, 2)


def where_am_i(rank: int, world_size: int) -> tuple[int, int, int, bool]:
    import torch.distributed as dist

    return rank, world_size, os.getpid(), dist.is_initialized()


def test_under_torchrun_the_function_runs_in_this_process(monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for key, value in {
        "TORCHELASTIC_RUN_ID": "kit-test",
        "RANK": "0",
        "WORLD_SIZE": "1",
        "LOCAL_RANK": "0",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
    }.items():
        monkeypatch.setenv(key, value)
    assert run_ranks(where_am_i, 1, backend="gloo") == [(0, 1, os.getpid(), True)]
    import torch.distributed as dist

    assert not dist.is_initialized()  # the group it created is gone again
    with pytest.raises(ValueError, match="inside a torchrun job of WORLD_SIZE=1"):
        run_ranks(where_am_i, 2)


def test_two_xdist_workers_run_rank_tests_at_once_without_colliding(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Its own admission ledger (this session's may be holding memory for other workers' launches),
    # with room for both pairs: the controller makes one, in a temporary folder without --kit-report.
    monkeypatch.delenv("KIT_ADMISSION_DIR", raising=False)
    monkeypatch.setenv("KIT_HOST_MEMORY", "8GiB")
    # Cold launches: a warm parent's memory is standing in the ledger too, and the peak asserted
    # below is the two pairs' admitted bytes exactly.
    monkeypatch.setenv("KIT_WARM_START", "0")
    pytester.makepyfile(
        """
        import json, os, time
        import torch
        import torch.distributed as dist
        from megatron_testkit.ranks import run_ranks

        def pair(rank, world_size):
            start = time.time()
            t = torch.ones(1)
            dist.all_reduce(t)
            time.sleep(4)  # long enough for the other worker's pair to be running too
            dist.barrier()
            return start, time.time(), t.item()

        def run_and_record(name):
            results = run_ranks(pair, 2, timeout=120)
            assert [r[2] for r in results] == [2.0, 2.0]
            span = (min(r[0] for r in results), max(r[1] for r in results))
            ledger = os.environ["KIT_ADMISSION_DIR"]  # the controller's, without --kit-report too
            with open(f"{name}.json", "w") as f:
                json.dump({"worker": os.environ["PYTEST_XDIST_WORKER"], "span": span, "ledger": ledger,
                           "peak": json.load(open(os.path.join(ledger, "admission.json")))["peak_bytes"]}, f)

        def test_a():
            run_and_record("a")

        def test_b():
            run_and_record("b")
        """
    )
    result = pytester.runpytest_subprocess("-n", "2", "-p", "no:cacheprovider", timeout=300)
    result.assert_outcomes(passed=2)
    a, b = (json.loads((pytester.path / f"{n}.json").read_text()) for n in "ab")
    assert a["worker"] != b["worker"]
    # The two 2-rank launches overlapped in time, so four ranks rendezvoused at once.
    assert a["span"][0] < b["span"][1] and b["span"][0] < a["span"][1]
    # Both workers went through the controller's one ledger, which was removed with its session.
    assert a["ledger"] == b["ledger"] and not Path(a["ledger"]).exists()
    # Both pairs were admitted before either ended (they overlapped): 2 x 2 ranks x the 1 GiB default.
    assert a["peak"] == b["peak"] == 4 * 2**30


def test_plugin_import_stays_light() -> None:
    # `pytest --help` and in-process pytester runs must not pay for torch.
    import subprocess
    import sys

    # The entry module and every plugin module it registers (pytest imports them on registration).
    code = (
        "import importlib, sys, megatron_testkit.plugin as p; [importlib.import_module(m) for m in p.pytest_plugins]; "
        "print(len(p.pytest_plugins), sorted(m for m in ('torch', 'megatron', 'datasets') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    count, _, heavy = out.strip().partition(" ")
    assert int(count) >= 7 and heavy == "[]"


def test_no_entry_point_no_kit(tmp_path: Path) -> None:
    """``-p no:megatron_testkit.plugin`` turns every one of the kit's plugin modules off: none of
    their options, ini keys or markers is registered (each module registers some)."""
    import subprocess
    import sys

    def help_text(*extra: str) -> str:
        out = ""
        for asked in ("--help", "--markers"):
            args = [sys.executable, "-m", "pytest", asked, "-p", "no:cacheprovider", *extra]
            done = subprocess.run(args, cwd=tmp_path, capture_output=True, text=True, timeout=120)
            assert done.returncode == 0, done.stdout + done.stderr
            out += done.stdout
        return out

    # One name of each module that registers one: session, launch, leak guard, markers.
    names = ("--kit-report", "kit_warm_preload", "kit_leak_guard", "kit_require_tier", "memory_budget(")
    with_kit = help_text()
    assert [n for n in names if n not in with_kit] == []
    without = help_text("-p", "no:megatron_testkit.plugin")
    assert [n for n in names if n in without] == []


TIERED = """
import pytest

pytestmark = pytest.mark.L1

def test_module_tier():
    pass

@pytest.mark.L1
def test_same_tier_twice():
    pass

@pytest.mark.L0
def test_two_tiers():
    pass
"""
UNTIERED = """
import pytest

def test_no_tier():
    pass

@pytest.mark.L2
def test_nightly():
    pass
"""


def test_with_kit_require_tier_a_missing_or_double_tier_is_a_collection_error(
    pytester: pytest.Pytester,
) -> None:
    pytester.makeini("[pytest]\nkit_require_tier = true\n")
    pytester.makepyfile(test_tiered=TIERED, test_untiered=UNTIERED)
    result = pytester.runpytest("--co", "-q", "-p", "no:cacheprovider", "-m", "L2")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    err = result.stderr.str()
    assert "every test needs exactly one tier marker of L0, L1, L2; 2 do not" in err
    assert "test_tiered.py::test_two_tiers: L0, L1" in err
    assert "test_untiered.py::test_no_tier: no tier" in err
    for fine in ("test_module_tier", "test_same_tier_twice", "test_nightly"):
        assert fine not in err


def test_without_kit_require_tier_untiered_tests_are_collected(pytester: pytest.Pytester) -> None:
    # A project that installs the kit keeps its own tier policy (or none).
    pytester.makepyfile(test_untiered=UNTIERED)
    result = pytester.runpytest("-q", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=2)


def test_kit_require_gpus_turns_a_too_few_gpus_skip_into_a_failure(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytester.makepyfile(
        """
        import pytest

        @pytest.mark.gpu
        @pytest.mark.world_size(2)
        def test_needs_two_gpus():
            pass

        @pytest.mark.gpu
        @pytest.mark.world_size(64)
        def test_needs_more_than_promised():
            pass

        def test_cpu():
            pass
        """
    )
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # no GPU visible, on any machine
    plain = pytester.runpytest("-rs", "-p", "no:cacheprovider")
    plain.assert_outcomes(passed=1, skipped=2)
    monkeypatch.setenv("KIT_REQUIRE_GPUS", "2")
    promised = pytester.runpytest("-rs", "-p", "no:cacheprovider")
    # The job promised 2 GPUs and has none: the 2-GPU test fails at setup (an error, so the job
    # is red); a test needing 64 was never promised them and still skips.
    promised.assert_outcomes(passed=1, skipped=1, errors=1)
    promised.stdout.fnmatch_lines(
        [
            "*ERROR at setup of test_needs_two_gpus*",
            "needs CUDA (marked gpu); no CUDA device is visible; but KIT_REQUIRE_GPUS=2 promises 2*",
            "*SKIPPED*needs CUDA (marked gpu); no CUDA device is visible",
        ]
    )


def devices_seen(rank: int, world_size: int) -> tuple[str | None, str | None, str]:
    from pathlib import Path

    spec = json.loads(Path(os.environ["KIT_RANK_SPEC"]).read_text())
    return os.environ.get("CUDA_VISIBLE_DEVICES"), os.environ.get("KIT_PG_TIMEOUT_S"), str(spec["gpu_test"])


def test_ranks_of_a_test_not_marked_gpu_see_no_gpu_and_get_the_group_timeout(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from megatron_testkit import attribution

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")  # what a GPU runner would show
    # Not marked gpu: gloo, devices hidden; the group timeout is min(0.8 * 60 s, 60 s - 10 s) of the launch.
    assert run_ranks(devices_seen, 2, timeout=60) == [("", "48.0", "False")] * 2
    context = attribution.current()
    assert context is not None and context.gpu is False
    context.gpu = True  # as the plugin sets it for a test marked gpu
    try:
        # A gpu test's ranks keep the devices the parent sees (gloo here: fewer GPUs than ranks).
        assert run_ranks(devices_seen, 2, backend="gloo", timeout=60) == [("0,1", "48.0", "True")] * 2
    finally:
        context.gpu = False


def _megatron_core_release() -> str | None:
    """megatron-core's release read from its package_info.py source (no import, no metadata)."""
    import importlib.util
    import re
    from pathlib import Path

    spec = importlib.util.find_spec("megatron")
    if spec is None or not spec.submodule_search_locations:
        return None
    text = (Path(next(iter(spec.submodule_search_locations))) / "core" / "package_info.py").read_text()
    parts = dict(re.findall(r"^(MAJOR|MINOR|PATCH|PRE_RELEASE) = [\"']?(\w*)", text, re.M))
    return f"{parts['MAJOR']}.{parts['MINOR']}.{parts['PATCH']}{parts.get('PRE_RELEASE', '')}"


def test_the_session_header_names_the_ci_job_and_the_megatron_core_release(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    from megatron_testkit.schema import Session

    pytester.makepyfile("def test_plain():\n    pass\n")
    monkeypatch.delenv("KIT_CI_JOB", raising=False)
    pytester.runpytest("-p", "no:cacheprovider", "--kit-report", "local").assert_outcomes(passed=1)
    monkeypatch.setenv("KIT_CI_JOB", "L1-cpu-mcore-0.16.1")
    pytester.runpytest("-p", "no:cacheprovider", "--kit-report", "ci").assert_outcomes(passed=1)
    local = json.loads((pytester.path / "local" / "kit-report.json").read_text())["session"]
    ci = json.loads((pytester.path / "ci" / "kit-report.json").read_text())["session"]
    assert local["ci_job"] is None and ci["ci_job"] == "L1-cpu-mcore-0.16.1"
    release = _megatron_core_release()
    assert ci["megatron_core"] == release and release is not None  # installed in this venv
    assert Session.from_json(ci).ci_job == "L1-cpu-mcore-0.16.1"
    md = (pytester.path / "ci" / "kit-report.md").read_text()
    assert f"megatron-core {release}" in md and "CI job `L1-cpu-mcore-0.16.1`" in md


def hold(rank: int, world_size: int, mib: int) -> int:
    block = b"\x01" * (mib * 2**20)  # written, so resident
    return len(block) // 2**20


def test_a_gpu_tests_rank_gets_the_cuda_host_allowance_on_top_of_its_budget(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from megatron_testkit import attribution
    from megatron_testkit.budgets import MemoryBudget
    from megatron_testkit.diagnosis import RankFailure

    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setenv("KIT_CUDA_HOST_ALLOWANCE", "400MiB")
    # Room for an idle rank, not for 200 MiB more.
    budget = MemoryBudget(host_bytes=max(sizes_of_idle_ranks()) + 100 * 2**20)
    with pytest.raises(RankFailure) as info:
        run_ranks(hold, 1, backend="gloo", timeout=60, args=(200,), budget=budget)
    assert info.value.kind == "oom" and "host memory budget exceeded" in str(info.value)
    context = attribution.current()
    assert context is not None
    context.gpu = True  # marked gpu: its ranks may hold a CUDA context, driver and libraries
    try:
        assert run_ranks(hold, 1, backend="gloo", timeout=60, args=(200,), budget=budget) == [200]
    finally:
        context.gpu = False


def idle_rss(rank: int, world_size: int) -> int:
    from megatron_testkit.procfs import current_rss_bytes

    return current_rss_bytes()


def sizes_of_idle_ranks() -> list[int]:
    return run_ranks(idle_rss, 1, backend="gloo", timeout=60)
