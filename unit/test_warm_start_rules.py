"""The rules that decide warm or cold, without processes: the environment, the settings, megatron."""

from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest

from megatron_testkit import warm_start

pytestmark = pytest.mark.L0


def test_a_variable_outside_the_allow_list_that_differs_sends_the_launch_cold() -> None:
    parent = {"PATH": "/bin", "HOME": "/root", "KIT_WARM_ROOM": "xx", "OMP_NUM_THREADS": "1"}
    same = {
        **parent,
        "RANK": "1",
        "KIT_RANK_SPEC": "/s",
        "TORCH_NCCL_BLOCKING_WAIT": "1",
        "OMP_NUM_THREADS": "4",
    }
    assert warm_start.env_refusal(same, parent) is None
    changed = warm_start.env_refusal({**same, "HOME": "/else"}, parent)
    assert changed is not None and "in HOME " in changed
    added = warm_start.env_refusal({**same, "PYTHONHASHSEED": "3"}, parent)
    assert added is not None and "PYTHONHASHSEED" in added
    removed = warm_start.env_refusal({k: v for k, v in same.items() if k != "PATH"}, parent)
    assert removed is not None and "PATH" in removed
    many = warm_start.env_refusal({**same, **{f"V{i}": "1" for i in range(7)}}, parent)
    assert many is not None and "and 2 more" in many


def test_cold_reasons_in_order(monkeypatch: pytest.MonkeyPatch) -> None:
    assert warm_start.cold_reason(fresh_interpreter=False, environ={}) is None
    assert (
        warm_start.cold_reason(fresh_interpreter=False, environ={"KIT_WARM_START": "0"}) == "KIT_WARM_START=0"
    )
    assert (
        warm_start.cold_reason(fresh_interpreter=True, environ={}) == "the test is marked fresh_interpreter"
    )
    reason = warm_start.cold_reason(fresh_interpreter=False, environ={"KIT_RANK_CGROUP": "/sys/fs/cgroup/x"})
    assert reason is not None and reason.startswith("KIT_RANK_CGROUP")


@pytest.mark.parametrize(
    ("env", "says"),
    [
        ({"KIT_WARM_START": "yes"}, "KIT_WARM_START='yes': expected 0"),
        ({"KIT_WARM_PRELOAD": "numpy, 1bad"}, "KIT_WARM_PRELOAD: '1bad' is not a module name"),
        ({"KIT_WARM_PRELOAD": "numpy,os/path"}, "'os/path' is not a module name"),
    ],
)
def test_a_malformed_warm_setting_is_refused_naming_it(env: dict[str, str], says: str) -> None:
    with pytest.raises(ValueError, match=says.replace("(", r"\(")):
        warm_start.check_settings(env)
    warm_start.check_settings({"KIT_WARM_START": "1", "KIT_WARM_PRELOAD": "numpy, mylib.ops"})


def test_the_preload_set_is_torch_then_the_ini_then_the_variable_once_each(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(warm_start, "_ini_preload", ("numpy", "torch"))
    got = warm_start.preload_set({"KIT_WARM_PRELOAD": "scipy, numpy,"})
    assert got == ("torch", "torch.distributed", "numpy", "scipy")


@pytest.mark.parametrize(
    ("source", "imports"),
    [
        ("import megatron.core\n", True),
        ("from fixtures.megatron import cpu_shim\n", True),
        ("from megatron_testkit.megatron_cpu import cpu_shim\n", True),
        ("def other():\n    from megatron.core.models.gpt import GPTModel\n", False),  # not fn's own
        ("from megatron_testkit.ranks import run_ranks\nimport megatronish\n", False),
        ("x = 'megatron'\n", False),
    ],
)
def test_a_function_importing_megatron_itself_or_at_its_modules_top_is_detected(
    source: str, imports: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    module = _module(tmp_path, source + "\ndef fn(rank, world_size):\n    return rank\n", monkeypatch)
    assert warm_start.imports_megatron(module.fn) is imports


def test_a_function_whose_own_body_imports_megatron_is_detected(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    source = "def plain(rank, world_size):\n    return rank\n\n\ndef fn(rank, world_size):\n    from megatron.core import parallel_state\n"
    module = _module(tmp_path, source, monkeypatch)
    assert warm_start.imports_megatron(module.fn) is True
    assert warm_start.imports_megatron(module.plain) is False


def _module(tmp_path: Path, source: str, monkeypatch: pytest.MonkeyPatch) -> types.ModuleType:
    """``source`` as the module ``kit_probe_module`` in a file, its functions defined from it but
    its imports not run (megatron would take seconds to import here): each import line runs as
    ``pass``, line for line, so the functions' source is read back from the file as written."""
    import re

    path = tmp_path / "kit_probe_module.py"
    path.write_text(source)
    module = types.ModuleType("kit_probe_module")
    module.__file__ = str(path)
    monkeypatch.setitem(sys.modules, "kit_probe_module", module)
    inert = re.sub(r"^([ \t]*)(?:from|import) .*$", r"\1pass", source, flags=re.MULTILINE)
    exec(compile(inert, str(path), "exec"), module.__dict__)
    return module


def test_the_attention_backend_variables_megatron_core_sets_in_process_keep_launches_warm() -> None:
    """Building a megatron-core model in the pytest process (any in-process unit test) sets
    NVTE_FLASH_ATTN, NVTE_FUSED_ATTN and NVTE_UNFUSED_ATTN there, and every later launch of that
    process went cold (seen in a full run); Transformer Engine reads them at each attention call."""
    parent = {"PATH": "/usr/bin"}
    after_a_model = {**parent, "NVTE_FLASH_ATTN": "0", "NVTE_FUSED_ATTN": "0", "NVTE_UNFUSED_ATTN": "0"}
    assert warm_start.env_refusal(after_a_model, parent) is None
    # A variable of Transformer Engine's that is not among them still sends the launch cold.
    assert "NVTE_TORCH_COMPILE" in (
        warm_start.env_refusal({**parent, "NVTE_TORCH_COMPILE": "0"}, parent) or ""
    )
