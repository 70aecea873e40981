"""fixtures.attention on one process: THD attention vs the per-sequence oracle, the oracle vs torch,
and the bf16 error bounds that are the TE-vs-reference tolerance.

The CP path (a real 2-rank gloo group) is in functional/test_attention_cp.py.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from fixtures.attention import (
    BF16_UNIT_ROUNDOFF,
    ReferenceCoreAttention,
    bf16_attention_error_bounds,
    naive_attention,
    thd_attention,
)

pytestmark = pytest.mark.L0


def _qkv(t: int, heads: int, groups: int, dim: int, seed: int, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(t, heads, dim, generator=g, dtype=dtype, requires_grad=True)
    k = torch.randn(t, groups, dim, generator=g, dtype=dtype, requires_grad=True)
    v = torch.randn(t, groups, dim, generator=g, dtype=dtype, requires_grad=True)
    return q, k, v


@st.composite
def packs(draw):
    lengths = draw(st.lists(st.integers(1, 24), min_size=1, max_size=6))
    groups = draw(st.sampled_from([1, 2]))
    heads = groups * draw(st.sampled_from([1, 2]))
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    return cu, heads, groups, draw(st.sampled_from([4, 8])), draw(st.integers(0, 2**16))


def test_oracle_matches_torch_sdpa_per_sequence() -> None:
    cu = torch.tensor([0, 5, 17, 20], dtype=torch.int32)
    q, k, v = _qkv(20, 4, 2, 8, seed=0)
    out = naive_attention(q, k, v, cu)
    for s, e in zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True):
        ref = F.scaled_dot_product_attention(
            q[s:e].transpose(0, 1),
            k[s:e].repeat_interleave(2, 1).transpose(0, 1),
            v[s:e].repeat_interleave(2, 1).transpose(0, 1),
            is_causal=True,
        ).transpose(0, 1)
        torch.testing.assert_close(out[s:e], ref, rtol=1e-10, atol=1e-10)


@settings(max_examples=40)  # autograd per example; 40 random packs cover the shapes drawn
@given(packs())
def test_thd_attention_matches_the_oracle_in_outputs_and_gradients(pack) -> None:
    cu, heads, groups, dim, seed = pack
    q, k, v = _qkv(int(cu[-1]), heads, groups, dim, seed)
    out = thd_attention(q, k, v, cu)
    ref = naive_attention(q, k, v, cu)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
    w = torch.randn(out.shape, dtype=out.dtype, generator=torch.Generator().manual_seed(seed + 1))
    grads = torch.autograd.grad((out * w).sum(), (q, k, v))
    grads_ref = torch.autograd.grad((ref * w).sum(), (q, k, v))
    for a, b in zip(grads, grads_ref, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-10)


def test_attention_never_crosses_a_sequence_boundary() -> None:
    cu = torch.tensor([0, 6, 12], dtype=torch.int32)
    q, k, v = _qkv(12, 2, 2, 4, seed=1)
    out = thd_attention(q, k, v, cu)
    v2 = v.detach().clone()
    v2[6:] += 100.0  # change only the second sequence's values
    out2 = thd_attention(q, k, v2, cu)
    torch.testing.assert_close(out[:6], out2[:6], rtol=0, atol=0)
    assert not torch.allclose(out[6:], out2[6:])


def test_fp32_inputs_use_an_fp32_softmax_and_keep_their_dtype() -> None:
    cu = torch.tensor([0, 16], dtype=torch.int32)
    q, k, v = _qkv(16, 2, 1, 8, seed=2, dtype=torch.float32)
    out = thd_attention(q, k, v, cu)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, naive_attention(q.double(), k.double(), v.double(), cu).float())


def test_thd_attention_rejects_a_pack_that_does_not_match_the_tokens() -> None:
    q, k, v = _qkv(8, 2, 1, 4, seed=0)
    with pytest.raises(ValueError, match="cu_seqlens_padded\\[-1\\] = 10"):
        thd_attention(q, k, v, torch.tensor([0, 10]))
    q3, k3, v3 = _qkv(8, 3, 2, 4, seed=0)
    with pytest.raises(ValueError, match="not a multiple"):
        thd_attention(q3, k3, v3, torch.tensor([0, 8]))


# --------------------------------------------------------------- the megatron ModuleSpec module
def _config(**kw):
    from megatron.core.transformer.transformer_config import TransformerConfig

    base = dict(
        num_layers=1, hidden_size=32, num_attention_heads=4, num_query_groups=2, attention_dropout=0.0
    )
    base.update(kw)
    return TransformerConfig(**base)


class _Group:
    """A pg_collection stand-in whose CP group is absent (single process)."""

    cp = None


def test_module_refuses_dropout_and_non_causal_masks() -> None:
    from megatron.core.transformer.enums import AttnMaskType

    with pytest.raises(ValueError, match=r"attention_dropout = 0\.1"):
        ReferenceCoreAttention(_config(attention_dropout=0.1), 1, AttnMaskType.causal, "self")
    with pytest.raises(ValueError, match="causal mask only, not padding"):
        ReferenceCoreAttention(_config(), 1, AttnMaskType.padding, "self")


def test_module_thd_and_sbhd_forward_match_the_oracle(monkeypatch: pytest.MonkeyPatch) -> None:
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer.enums import AttnMaskType

    module = ReferenceCoreAttention(_config(), 1, AttnMaskType.causal, "self", pg_collection=_Group())
    monkeypatch.setattr(module, "_cp_group", lambda: None)  # no process group in a unit test
    assert module.sharded_state_dict() == {} and not list(module.parameters())
    cu = torch.tensor([0, 8, 20], dtype=torch.int32)
    q, k, v = _qkv(20, 4, 2, 8, seed=3)
    psp = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=cu)
    out = module(q, k, v, None, packed_seq_params=psp)
    assert out.shape == (20, 32)
    torch.testing.assert_close(out, naive_attention(q, k, v, cu).reshape(20, 32))
    # sbhd [s, b, h, d]: each batch row is one causal sequence
    qs, ks, vs = (x.detach().reshape(10, 2, *x.shape[1:]) for x in (q, k, v))
    out_s = module(qs, ks, vs, None)
    assert out_s.shape == (10, 2, 32)
    for b in range(2):
        row = naive_attention(qs[:, b], ks[:, b], vs[:, b], torch.tensor([0, 10]))
        torch.testing.assert_close(out_s[:, b], row.reshape(10, 32))


# ------------------------------------------------------------ bf16 tolerance (TE vs reference)
def _bf16(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.bfloat16).double()


def _emulated_bf16_kernel(q, k, v, do, cu, steps: int):
    """A bf16 flash-style kernel written out step by step, in float64 with explicit roundings.

    Independent of `bf16_attention_error_bounds`: keys (forward, dq) and queries (dk, dv) are
    split into `steps` blocks as TE's CP steps split them; each block's normalised partial
    output and each partial gradient is rounded to bf16, P is rounded before P @ V and P^T @ dO,
    dS before dS @ K and dS^T @ Q, D comes from the rounded output, every result is rounded.
    """
    rep = q.shape[1] // k.shape[1]
    scale = 1.0 / q.shape[-1] ** 0.5
    outs = {n: torch.zeros_like(x) for n, x in (("out", q), ("dq", q), ("dk", k), ("dv", v))}
    for s, e in zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True):
        qs, dos = q[s:e].transpose(0, 1), do[s:e].transpose(0, 1)
        ks = k[s:e].repeat_interleave(rep, 1).transpose(0, 1)
        vs = v[s:e].repeat_interleave(rep, 1).transpose(0, 1)
        n = e - s
        logits = (qs @ ks.transpose(-1, -2) * scale).masked_fill(
            ~torch.tril(torch.ones(n, n, dtype=torch.bool)), float("-inf")
        )
        lse = torch.logsumexp(logits, -1, keepdim=True)
        blocks = [b for b in torch.arange(n).tensor_split(steps) if len(b)]
        out = torch.zeros_like(qs)
        for b in blocks:  # forward: one partial per key block, combined with its LSE weight
            lb = logits[..., b]
            lse_b = torch.logsumexp(lb, -1, keepdim=True)
            w = torch.exp(lse_b - lse).nan_to_num(0.0)
            pb = _bf16(torch.exp(lb - lse_b).nan_to_num(0.0))
            out += w * _bf16(pb @ vs[:, b])
        out = _bf16(out)
        p = torch.exp(logits - lse)
        p16 = _bf16(p)
        ds = _bf16(p * (dos @ vs.transpose(-1, -2) - (dos * out).sum(-1, keepdim=True)))
        dq = sum(_bf16(scale * ds[..., b] @ ks[:, b]) for b in blocks)
        dk = sum(_bf16(scale * ds[:, b].transpose(-1, -2) @ qs[:, b]) for b in blocks)
        dv = sum(_bf16(p16[:, b].transpose(-1, -2) @ dos[:, b]) for b in blocks)

        def group(x):
            return _bf16(x.transpose(0, 1).unflatten(1, (-1, rep)).sum(2))

        outs["out"][s:e], outs["dq"][s:e] = out.transpose(0, 1), _bf16(dq).transpose(0, 1)
        outs["dk"][s:e], outs["dv"][s:e] = group(dk), group(dv)
    return outs


def _exact(q, k, v, do, cu):
    q, k, v = (x.detach().clone().requires_grad_() for x in (q, k, v))
    out = naive_attention(q, k, v, cu)
    dq, dk, dv = torch.autograd.grad((out * do).sum(), (q, k, v))
    return {"out": out.detach(), "dq": dq, "dk": dk, "dv": dv}


@pytest.mark.parametrize("cp", [1, 2])
def test_bf16_bounds_hold_for_an_emulated_bf16_kernel_and_are_not_vacuous(cp: int) -> None:
    assert BF16_UNIT_ROUNDOFF == 2.0**-8
    worst: dict[str, float] = {}
    for seed, (lengths, heads, groups, dim) in enumerate(
        [([60, 4, 28], 4, 2, 16), ([256], 2, 1, 32), ([12, 8, 40], 2, 2, 16)]
    ):
        cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
        q, k, v = (_bf16(x) for x in _qkv(int(cu[-1]), heads, groups, dim, seed))
        do = _bf16(torch.randn(q.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64))
        exact = _exact(q, k, v, do, cu)
        kernel = _emulated_bf16_kernel(q, k, v, do, cu, steps=cp)
        bounds = bf16_attention_error_bounds(q, k, v, do, cu, cp_size=cp)
        for name in ("out", "dq", "dk", "dv"):
            ratio = ((kernel[name] - exact[name]).abs() / bounds[name].clamp_min(1e-300)).max().item()
            worst[name] = max(worst.get(name, 0.0), ratio)
    for name, ratio in worst.items():
        # First-order bound: the emulated kernel stays inside it, and uses a visible part of it
        # (a bound 1000x too loose would also pass the first check and catch nothing).
        assert ratio <= 1.0, f"{name}: emulated bf16 error is {ratio:.3g} x the bound"
        assert ratio >= 0.01, f"{name}: the bound is {1 / ratio:.3g} x the emulated error"


def test_bf16_bounds_catch_real_tokens_treated_as_padding() -> None:
    # The tail-only pack misread by TE (cu_seqlens // cp): of 115 real tokens, queries past 57
    # lose the keys past 57. Every such output is off by far more than twice its bound.
    cu_pad = torch.tensor([0, 128])
    q, k, v = (_bf16(x) for x in _qkv(128, 2, 1, 16, seed=7))
    bounds = bf16_attention_error_bounds(q, k, v, torch.ones_like(q), cu_pad, cp_size=2)
    right = naive_attention(q, k, v, cu_pad).detach()
    cut = torch.cat([naive_attention(q[:57], k[:57], v[:57], torch.tensor([0, 57])).detach(), right[57:]])
    keys_lost = naive_attention(q[57:115], k[57:115], v[57:115], torch.tensor([0, 58])).detach()
    cut[57:115] = keys_lost  # queries 57..114 attend only to 57..itself: the misread split
    ratio = ((cut - right).abs() / bounds["out"])[60:115]
    assert ratio.amax(dim=(1, 2)).min().item() > 2.0, "a token with missing keys passed a 2x-bound check"
