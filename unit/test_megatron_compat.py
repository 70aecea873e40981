"""The shipped megatron-core layer: the CPU shim is narrow, does what it documents, never leaks; specs.

`megatron_testkit.megatron_cpu` (the shim) and `megatron_testkit.megatron_compat` (release
differences), as a user imports them; `fixtures.megatron.gpt_layer_spec` adds this repository's
reference attention.

A real GPTModel trains under the shim in functional/test_cp_pretrain_sft.py; here each patched
behaviour is checked on its own, single process, on whichever megatron-core release is installed
(CI runs this file on 0.19.2 and on 0.16.1): the spec keyword set, `PackedSeqParams` with
`pad_between_seqs`, and TE's import probe in a child interpreter.
"""

from __future__ import annotations

import dataclasses
import importlib.abc
import inspect
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from fixtures import megatron as repo_megatron
from megatron_testkit import megatron_compat as mc
from megatron_testkit import megatron_cpu as mcpu
from megatron_testkit import skips

pytestmark = [
    pytest.mark.L0,
    skips.skip_if(torch.cuda.is_available(), "no-cuda", "the shim is a no-op where CUDA exists"),
]


def _originals() -> dict[str, object]:
    import torch.cuda.random as cuda_random
    from megatron.core.tensor_parallel import random as mcore_random

    return {
        "current_device": torch.cuda.current_device,
        "synchronize": torch.cuda.synchronize,
        "current_stream": torch.cuda.current_stream,
        "manual_seed": torch.cuda.manual_seed,
        "get_rng_state": torch.cuda.get_rng_state,
        "random.set_rng_state": cuda_random.set_rng_state,
        "mcore._get": mcore_random._get_cuda_rng_state,
        "mcore._set": mcore_random._set_cuda_rng_state,
    }


def test_cuda_placements_land_on_the_cpu_inside_the_shim() -> None:
    with mcpu.cpu_shim():
        assert mcpu.shim_active()
        assert torch.cuda.current_device() == "cpu"
        assert torch.empty(3, device="cuda").device.type == "cpu"
        assert torch.zeros(2, device=torch.device("cuda", 0)).device.type == "cpu"
        t = torch.ones(2)
        assert t.cuda() is t
        assert t.to("cuda").device.type == "cpu"
        assert t.type() == "torch.cuda.FloatTensor"
        assert t.type(torch.float64).dtype == torch.float64  # a conversion still converts
        torch.cuda.synchronize()
        # megatron-core 0.19's start_grad_sync: current_stream().wait_event/wait_stream.
        stream = torch.cuda.current_stream()
        stream.wait_stream(stream)
        stream.wait_event(torch.Event())
    assert not mcpu.shim_active()


def test_cuda_rng_calls_drive_the_cpu_generator() -> None:
    with mcpu.cpu_shim():
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

    with mcpu.cpu_shim():
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
    with pytest.raises(RuntimeError, match="boom"), mcpu.cpu_shim():
        assert torch.cuda.current_device() == "cpu"
        raise RuntimeError("boom")
    assert _originals() == before
    assert not mcpu.shim_active()
    with pytest.raises((RuntimeError, AssertionError)):
        torch.empty(1, device="cuda")  # the mode is gone too


def test_nested_use_keeps_the_outer_shim_in_charge() -> None:
    before = _originals()
    with mcpu.cpu_shim():
        with mcpu.cpu_shim():
            assert torch.empty(1, device="cuda").device.type == "cpu"
        assert mcpu.shim_active()
        assert torch.empty(1, device="cuda").device.type == "cpu"
    assert _originals() == before


def test_fixture_form(use_cpu_shim: None) -> None:
    assert mcpu.shim_active()
    assert torch.empty(1, device="cuda").device.type == "cpu"


def test_te_status_says_why_not_on_cpu() -> None:
    ok, reason = mc.te_status()
    assert not ok and "CUDA" in reason


class _RaisingFinder(importlib.abc.MetaPathFinder):
    """Imports of transformer_engine fail as they do on a machine without CUDA libraries."""

    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "transformer_engine":
            raise RuntimeError("cudnn shared object not found.")
        return None


def test_te_runtime_error_on_locating_it_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for name in [m for m in sys.modules if m.split(".")[0] == "transformer_engine"]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setattr(sys, "meta_path", [_RaisingFinder(), *sys.meta_path])
    ok, reason = mc.te_status()
    assert not ok
    assert "RuntimeError" in reason and "cudnn" in reason


def _fake_te(root: Path, init: str) -> Path:
    """A `transformer_engine` package on disk whose `__init__` runs `init`, with a `pytorch` module."""
    pkg = root / "transformer_engine"
    pkg.mkdir()
    (pkg / "__init__.py").write_text(textwrap.dedent(init))
    (pkg / "pytorch.py").write_text("class DotProductAttention:\n    pass\n")
    return root


@pytest.fixture
def cuda_claimed(monkeypatch: pytest.MonkeyPatch) -> None:
    """Stands in for a GPU (the only part that cannot be had here) and empties te_status's cache."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(mc, "_te_import_results", {})
    for name in [m for m in sys.modules if m.split(".")[0] == "transformer_engine"]:
        monkeypatch.delitem(sys.modules, name)


def test_te_status_imports_te_in_a_child_never_in_this_process(
    cuda_claimed: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A real package whose import fails as TE's does without CUDA libraries.
    root = _fake_te(tmp_path, 'raise RuntimeError("cudnn shared object not found.")\n')
    monkeypatch.syspath_prepend(str(root))
    monkeypatch.setenv("PYTHONPATH", str(root))
    ok, reason = mc.te_status()
    assert not ok
    assert "RuntimeError" in reason and "cudnn shared object not found" in reason
    assert not any(m.split(".")[0] == "transformer_engine" for m in sys.modules)
    assert list(mc._te_import_results.values()) == [(ok, reason)]  # one child per interpreter + TE


def test_te_status_true_when_the_child_imports_te(
    cuda_claimed: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = _fake_te(tmp_path, "VERSION = 'fake'\n")
    monkeypatch.syspath_prepend(str(root))
    monkeypatch.setenv("PYTHONPATH", str(root))
    assert mc.te_status() == (True, "transformer_engine imports and CUDA is available")
    assert "transformer_engine" not in sys.modules
    # The answer is cached: a second call starts no child (an unrunnable interpreter would fail it).
    monkeypatch.setattr(mc.subprocess, "run", None)
    assert mc.te_status()[0]


def test_te_status_says_when_te_is_not_installed(cuda_claimed: None) -> None:
    ok, reason = mc.te_status()
    assert not ok and reason == "transformer_engine is not installed"


# ------------------------------------------------------------------ spec keywords per release
def _builders() -> dict[str, object]:
    from megatron.core.models.gpt import gpt_layer_specs

    return {
        "te": gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec,
        "local": gpt_layer_specs.get_gpt_layer_local_spec,
    }


def _forwards_kwargs(fn: object) -> bool:
    return any(p.kind is p.VAR_KEYWORD for p in inspect.signature(fn).parameters.values())


def test_te_spec_keyword_set_excludes_normalization_on_this_release() -> None:
    builders = _builders()
    te, local = builders["te"], builders["local"]
    assert "normalization" not in mc.spec_keywords(te)  # TE norms come from TransformerConfig
    assert "normalization" in mc.spec_keywords(local)
    assert {"num_experts", "qk_layernorm"} <= mc.spec_keywords(te)
    assert mc.spec_kwargs(te, normalization="RMSNorm", qk_layernorm=False) == {"qk_layernorm": False}
    if _forwards_kwargs(te):
        # megatron-core >= 0.17: the builder forwards **kwargs to a function without the
        # keyword, so passing it (what the kit did) raises before TE is ever needed.
        with pytest.raises(TypeError, match="normalization"):
            te(normalization="RMSNorm")
    else:
        # 0.16: an explicit signature without it; the old filter dropped it silently.
        assert "normalization" not in inspect.signature(te).parameters
    # What gpt_layer_spec passes binds to the builder's real target: on CPU the TE builder then
    # fails only for want of TE (0.16.1: NameError TESpecProvider; 0.19.2: TESpecProvider is None).
    try:
        te(**mc.spec_kwargs(te, normalization="RMSNorm"))
    except TypeError as exc:
        assert "keyword argument" not in str(exc), f"the TE spec refused the kit's keywords: {exc}"
    except (NameError, ImportError, AssertionError, RuntimeError):
        pass


def test_a_forwarder_without_a_target_is_refused() -> None:
    def get_gpt_layer_mystery_spec(*args, **kwargs):
        return None

    with pytest.raises(TypeError, match="get_gpt_layer_mystery_submodules"):
        mc.spec_keywords(get_gpt_layer_mystery_spec)


# --------------------------------------------------------------------- pad_between_seqs (THD)
def _te_infers_padding_between(p: object) -> bool:
    """TE 2.5-2.13's rule when pad_between_seqs is None (dot_product_attention.py), restated."""
    return not torch.equal(p.cu_seqlens_q_padded[:-1], p.cu_seqlens_q[:-1]) or not torch.equal(
        p.cu_seqlens_kv_padded[:-1], p.cu_seqlens_kv[:-1]
    )


def test_tail_only_padding_is_declared_as_padding_between_sequences() -> None:
    from megatron.core.packed_seq_params import PackedSeqParams

    # The SFT pack shape: one 115-token document padded to 256 after it, nothing in between.
    cu, cu_pad = torch.tensor([0, 115], dtype=torch.int32), torch.tensor([0, 256], dtype=torch.int32)
    p = mc.make_packed_seq_params(
        qkv_format="thd",
        cu_seqlens_q=cu,
        cu_seqlens_kv=cu,
        cu_seqlens_q_padded=cu_pad,
        cu_seqlens_kv_padded=cu_pad,
        max_seqlen_q=256,
        max_seqlen_kv=256,
    )
    assert isinstance(p, PackedSeqParams) and p.qkv_format == "thd" and p.max_seqlen_q == 256
    assert p.pad_between_seqs is True
    assert not _te_infers_padding_between(p)  # what TE would have guessed: wrong for CP
    if "pad_between_seqs" in {f.name for f in dataclasses.fields(PackedSeqParams)}:
        assert dataclasses.asdict(p)["pad_between_seqs"] is True  # megatron-core >= 0.19: a field


def test_packed_seq_params_keeps_an_explicit_flag_and_names_unknown_fields() -> None:
    cu = torch.tensor([0, 4, 8], dtype=torch.int32)
    assert (
        mc.make_packed_seq_params(
            qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_q_padded=cu, pad_between_seqs=False
        ).pad_between_seqs
        is False
    )
    unpadded = mc.make_packed_seq_params(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu)
    assert getattr(unpadded, "pad_between_seqs", None) is None  # nothing padded: TE decides
    with pytest.raises(TypeError, match="cu_seqlens_typo"):
        mc.make_packed_seq_params(qkv_format="thd", cu_seqlens_typo=cu)


class _ForwardsKeptFields:
    """Stand-in for megatron's TEDotProductAttention, whose real class needs TE and a GPU: its
    forward hands TE exactly the `kept_packed_seq_params` fields, read with getattr, as
    megatron-core 0.16.1's does (extensions/transformer_engine.py); `te_call` records them."""

    def __init__(self) -> None:
        self.kept_packed_seq_params = {"qkv_format", "cu_seqlens_q", "cu_seqlens_q_padded"}
        self.te_calls: list[dict[str, object]] = []

    def forward(
        self,
        query,
        key,
        value,
        attention_mask,
        attn_mask_type=None,
        attention_bias=None,
        packed_seq_params=None,
    ):
        self.te_calls.append({k: getattr(packed_seq_params, k) for k in self.kept_packed_seq_params})
        return query


def test_older_releases_forward_pad_between_seqs_to_te_for_one_call_only() -> None:
    from megatron.core.packed_seq_params import PackedSeqParams

    wrapped = mc.with_pad_between_seqs(_ForwardsKeptFields)()
    cu = torch.tensor([0, 115], dtype=torch.int32)
    flagged = mc.make_packed_seq_params(
        qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_q_padded=torch.tensor([0, 256], dtype=torch.int32)
    )
    plain = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_q_padded=cu)
    q = torch.zeros(1)
    wrapped.forward(q, q, q, None, packed_seq_params=flagged)
    wrapped.forward(q, q, q, None, None, None, plain)  # positional, as a caller may pass it
    assert wrapped.te_calls[0]["pad_between_seqs"] is True
    assert "pad_between_seqs" not in wrapped.te_calls[1]  # a params object without the flag
    assert "pad_between_seqs" not in wrapped.kept_packed_seq_params  # restored after the call
    with pytest.raises(TypeError, match="kept_packed_seq_params"):
        mc.with_pad_between_seqs(type("NoKept", (), {"forward": lambda self, **kw: None}))()


def test_local_spec_carries_the_reference_attention_and_te_request_fails_clearly() -> None:
    from fixtures.attention import ReferenceCoreAttention

    spec = repo_megatron.gpt_layer_spec()
    assert spec.submodules.self_attention.submodules.core_attention is ReferenceCoreAttention
    # The shipped spec, without a replacement, keeps megatron's own local core attention.
    from megatron.core.models.gpt import gpt_layer_specs

    megatrons_own = gpt_layer_specs.get_gpt_layer_local_spec().submodules.self_attention.submodules
    shipped = mc.gpt_layer_spec().submodules.self_attention.submodules
    assert shipped.core_attention is megatrons_own.core_attention is not ReferenceCoreAttention
    with pytest.raises(RuntimeError, match="Transformer Engine spec was requested but no CUDA"):
        repo_megatron.gpt_layer_spec(use_te=True)


def test_version_guard_drops_keywords_the_installed_signature_lacks() -> None:
    def old(a, b=1):
        return (a, b)

    def new(a, b=1, **kw):
        return (a, b, kw)

    assert mc.call_with_supported_kwargs(old, a=1, b=2, c=3) == (1, 2)
    assert mc.call_with_supported_kwargs(new, a=1, c=3) == (1, 1, {"c": 3})


def test_checkpoint_common_state_names_both_layouts_when_neither_is_there(tmp_path: Path) -> None:
    # The two real layouts are read in functional/test_cp_pretrain_sft.py on 0.16.1 (common.pt)
    # and 0.19.2 (the common_state object); here: a directory with neither.
    with pytest.raises(FileNotFoundError, match=r"no common\.pt and 0 'common_state' objects"):
        mc.checkpoint_common_state(tmp_path)
    torch.save({"iteration": 3}, tmp_path / "common.pt")
    assert mc.checkpoint_common_state(tmp_path) == {"iteration": 3}


def test_the_shipped_layer_imports_neither_torch_nor_megatron() -> None:
    # The plugin may import it in any project, where torch is not a dependency of the kit.
    probe = (
        "import sys, megatron_testkit.megatron_cpu, megatron_testkit.megatron_compat; "
        "print(sorted(m for m in ('torch', 'megatron') if m in sys.modules))"
    )
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"
