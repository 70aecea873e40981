"""fixtures.megatron: the CPU shim is narrow, does what it documents, and never leaks; spec choice.

A real GPTModel trains under the shim in functional/test_cp_pretrain_sft.py; here each patched
behaviour is checked on its own, single process.
"""

from __future__ import annotations

import importlib.abc
import sys

import pytest
import torch

from fixtures import megatron as fm

pytestmark = [
    pytest.mark.L0,
    pytest.mark.skipif(torch.cuda.is_available(), reason="the shim is a no-op where CUDA exists"),
]


def _originals() -> dict[str, object]:
    import torch.cuda.random as cuda_random
    from megatron.core.tensor_parallel import random as mcore_random

    return {
        "current_device": torch.cuda.current_device,
        "synchronize": torch.cuda.synchronize,
        "manual_seed": torch.cuda.manual_seed,
        "get_rng_state": torch.cuda.get_rng_state,
        "random.set_rng_state": cuda_random.set_rng_state,
        "mcore._get": mcore_random._get_cuda_rng_state,
        "mcore._set": mcore_random._set_cuda_rng_state,
    }


def test_cuda_placements_land_on_the_cpu_inside_the_shim() -> None:
    with fm.cpu_shim():
        assert fm.shim_active()
        assert torch.cuda.current_device() == "cpu"
        assert torch.empty(3, device="cuda").device.type == "cpu"
        assert torch.zeros(2, device=torch.device("cuda", 0)).device.type == "cpu"
        t = torch.ones(2)
        assert t.cuda() is t
        assert t.to("cuda").device.type == "cpu"
        assert t.type() == "torch.cuda.FloatTensor"
        assert t.type(torch.float64).dtype == torch.float64  # a conversion still converts
        torch.cuda.synchronize()
    assert not fm.shim_active()


def test_cuda_rng_calls_drive_the_cpu_generator() -> None:
    with fm.cpu_shim():
        torch.cuda.manual_seed(7)
        a = torch.rand(4)
        state = torch.cuda.get_rng_state()
        b = torch.rand(4)
        torch.cuda.set_rng_state(state)
        assert torch.equal(torch.rand(4), b)
        torch.manual_seed(7)  # calls cuda.manual_seed_all: must not recurse
        assert torch.equal(torch.rand(4), a)


def test_megatron_rng_tracker_seeds_under_the_shim() -> None:
    from megatron.core.tensor_parallel import random as mcore_random

    with fm.cpu_shim():
        tracker = mcore_random.get_cuda_rng_tracker()
        tracker.reset()
        tracker.add("kit-test", 123)
        with tracker.fork("kit-test"):
            first = torch.rand(3)
        tracker.reset()
        tracker.add("kit-test", 123)
        with tracker.fork("kit-test"):
            assert torch.equal(torch.rand(3), first)
        tracker.reset()


def test_everything_is_restored_on_exit_even_after_an_error() -> None:
    before = _originals()
    with pytest.raises(RuntimeError, match="boom"), fm.cpu_shim():
        assert torch.cuda.current_device() == "cpu"
        raise RuntimeError("boom")
    assert _originals() == before
    assert not fm.shim_active()
    with pytest.raises((RuntimeError, AssertionError)):
        torch.empty(1, device="cuda")  # the mode is gone too


def test_nested_use_keeps_the_outer_shim_in_charge() -> None:
    before = _originals()
    with fm.cpu_shim():
        with fm.cpu_shim():
            assert torch.empty(1, device="cuda").device.type == "cpu"
        assert fm.shim_active()
        assert torch.empty(1, device="cuda").device.type == "cpu"
    assert _originals() == before


def test_fixture_form(use_cpu_shim: None) -> None:
    assert fm.shim_active()
    assert torch.empty(1, device="cuda").device.type == "cpu"


def test_te_status_says_why_not_on_cpu() -> None:
    ok, reason = fm.te_status()
    assert not ok and "CUDA" in reason


class _RaisingFinder(importlib.abc.MetaPathFinder):
    """Imports of transformer_engine fail as they do on a machine without CUDA libraries."""

    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "transformer_engine":
            raise RuntimeError("cudnn shared object not found.")
        return None


def test_te_runtime_error_on_import_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for name in [m for m in sys.modules if m.split(".")[0] == "transformer_engine"]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setattr(sys, "meta_path", [_RaisingFinder(), *sys.meta_path])
    ok, reason = fm.te_status()
    assert not ok
    assert "RuntimeError" in reason and "cudnn" in reason


def test_local_spec_carries_the_reference_attention_and_te_request_fails_clearly() -> None:
    from fixtures.attention import ReferenceCoreAttention

    spec = fm.gpt_layer_spec()
    assert spec.submodules.self_attention.submodules.core_attention is ReferenceCoreAttention
    with pytest.raises(RuntimeError, match="Transformer Engine spec was requested but no CUDA"):
        fm.gpt_layer_spec(use_te=True)


def test_version_guard_drops_keywords_the_installed_signature_lacks() -> None:
    def old(a, b=1):
        return (a, b)

    def new(a, b=1, **kw):
        return (a, b, kw)

    assert fm._call_with_supported_kwargs(old, a=1, b=2, c=3) == (1, 2)
    assert fm._call_with_supported_kwargs(new, a=1, c=3) == (1, 1, {"c": 3})
