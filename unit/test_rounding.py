"""The per-token loss tolerance (`fixtures.rounding`): its arithmetic, and a negative control on CPU.

The control runs a tiny GPT-shaped model (the functional test's shape: RMSNorm, GQA attention,
SwiGLU, 2 layers, vocab 320, no RoPE) over a packed batch in plain torch: an fp64 oracle, the
same model with every intermediate rounded to bf16 (attention as flash/TE compute it: bf16
probabilities, per-CP-rank partial results rounded and then combined), and two wrong CP
splits. The tolerance the functional test applies must pass the bf16 noise and fail both
wrong splits, which the mean loss cannot tell apart from noise.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass
from fractions import Fraction

import pytest
import torch
import torch.nn.functional as F

from fixtures.attention import naive_attention
from fixtures.data import cp_partition_index
from fixtures.rounding import (
    BF16_UNIT_ROUNDOFF,
    FP32_UNIT_ROUNDOFF,
    logit_abs_sum,
    per_token_loss_tolerance,
    unit_roundoff,
)

pytestmark = pytest.mark.L0

VOCAB, HIDDEN, FFN, HEADS, GROUPS, LAYERS, CP = 320, 64, 192, 4, 2, 2, 2
LENGTHS = [61, 47, 90, 35, 13]  # real lengths; each padded to a multiple of 2 * CP, the pack to 256


# ------------------------------------------------------------------------------- the arithmetic


@pytest.mark.parametrize(("dtype", "u"), [(torch.bfloat16, 2**-8), (torch.float32, 2**-24)])
def test_unit_roundoff_is_the_largest_relative_rounding_error(dtype: torch.dtype, u: float) -> None:
    assert unit_roundoff(dtype) == u
    # Round to nearest: 1 + 1.01 u goes up to the next value, 1 + 0.99 u back to 1.
    one = torch.tensor(1.0, dtype=torch.float64)
    assert (one + 1.01 * u).to(dtype).double().item() == 1 + 2 * u
    assert (one + 0.99 * u).to(dtype).double().item() == 1.0
    assert BF16_UNIT_ROUNDOFF == 2**-8 and FP32_UNIT_ROUNDOFF == 2**-24
    with pytest.raises(ValueError, match="int32"):
        unit_roundoff(torch.int32)


def test_logit_abs_sum_bounds_every_logit_and_is_reached_without_cancellation() -> None:
    g = torch.Generator().manual_seed(0)
    h, w = torch.randn(5, 7, 16, generator=g), torch.randn(40, 16, generator=g)
    a = logit_abs_sum(h, w)
    assert a.shape == (5, 7)
    assert ((h @ w.t()).abs().amax(-1) <= a * (1 + 1e-6)).all()
    assert torch.allclose(logit_abs_sum(h.abs(), w.abs()), (h.abs() @ w.abs().t()).amax(-1))


def test_tolerance_is_twice_four_u_a_plus_the_fp32_loss_arithmetic() -> None:
    a, ce, z = torch.tensor([1.25, 0.5]), torch.tensor([5.5, 0.25]), torch.tensor([1.0, 0.125])
    got = per_token_loss_tolerance(a, ce, z, unit=2**-8, vocab_size=320)
    for i in range(2):
        # ceil(log2 320) = 9 -> 13 roundings of the loss arithmetic.
        ai, ci, zi = (Fraction(float(x[i])) for x in (a, ce, z))
        want = 2 * (4 * Fraction(1, 2**8) * ai + 13 * Fraction(1, 2**24) * (ci + 2 * zi))
        assert got[i].item() == pytest.approx(float(want), rel=1e-12)
    with pytest.raises(ValueError, match="vocab_size = 1"):
        per_token_loss_tolerance(a, ce, z, unit=2**-8, vocab_size=1)


# ----------------------------------------------------------------- the model of the control


def _cu(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0, *itertools.accumulate(lengths)])


def _pack() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`cu_seqlens_padded` of the pack (256 tokens) and which tokens are real."""
    padded = [-(-n // (2 * CP)) * 2 * CP for n in LENGTHS]
    padded[-1] += 256 - sum(padded)
    cu_pad = _cu(padded)
    real = torch.zeros(256, dtype=torch.bool)
    for s, n in zip(cu_pad[:-1].tolist(), LENGTHS, strict=True):
        real[s : s + n] = True
    owner = torch.empty(256, dtype=torch.long)  # the CP rank that holds each token
    for r in range(CP):
        owner[cp_partition_index(cu_pad, CP, r)] = r
    return cu_pad, real, owner


@dataclass(frozen=True)
class Precision:
    """How a run computes: its working dtype and the rounding applied after every operation."""

    dtype: torch.dtype
    round: Callable[[torch.Tensor], torch.Tensor]


FP64 = Precision(torch.float64, lambda x: x)
FP32 = Precision(torch.float32, lambda x: x)
BF16 = Precision(torch.float32, lambda x: x.bfloat16().float())  # fp32 arithmetic, bf16 tensors


def _attention(q, k, v, cu_pad, p: Precision, parts: torch.Tensor | None, visible: torch.Tensor | None):
    """Causal THD attention as flash/TE compute it: per key partition (a CP rank's keys) a softmax
    with its own max and sum, probabilities and partial result rounded, then the partials combined
    with their log-sum-exp weights and rounded. `parts=None`: one partition (CP=1)."""
    rep, scale = q.shape[1] // k.shape[1], 1 / math.sqrt(q.shape[-1])
    r, out = p.round, []
    for s, e in itertools.pairwise(cu_pad.tolist()):
        qs = q[s:e].transpose(0, 1)
        ks, vs = (x[s:e].repeat_interleave(rep, 1).transpose(0, 1) for x in (k, v))
        mask = torch.tril(torch.ones(e - s, e - s, dtype=torch.bool))
        if visible is not None:
            mask &= visible[s:e, s:e]
        scores = qs @ ks.transpose(-1, -2) * scale
        owners = parts[s:e] if parts is not None else torch.zeros(e - s, dtype=torch.long)
        maxes, sums, partials = [], [], []
        for part in owners.unique().tolist():
            m = mask & (owners == part)[None, :]
            sp = scores.masked_fill(~m, float("-inf"))
            mp = sp.amax(-1, keepdim=True).nan_to_num(neginf=0.0)  # rows without keys here: weight 0
            ep = torch.exp(sp - mp)
            lp = ep.sum(-1, keepdim=True)
            partials.append(r(r(ep / lp.clamp_min(1e-30)) @ vs))
            maxes.append(mp.masked_fill(lp == 0, float("-inf")))
            sums.append(lp)
        top = torch.stack(maxes).amax(0)
        weights = [lp * torch.exp(mp - top) for mp, lp in zip(maxes, sums, strict=True)]
        o = sum(w * o for w, o in zip(weights, partials, strict=True)) / sum(weights)
        out.append((r(o) if len(partials) > 1 else o).transpose(0, 1))
    return torch.cat(out)


def _weights(seed: int) -> dict[str, torch.Tensor]:
    """megatron's init (normal, std 0.02), bf16-representable: both runs share the same weights."""
    g = torch.Generator().manual_seed(seed)
    kv = HIDDEN // HEADS

    def w(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=g, dtype=torch.float64) * 0.02).bfloat16().double()

    out = {"embedding": w(VOCAB, HIDDEN), "output": w(VOCAB, HIDDEN)}
    for i in range(LAYERS):
        out |= {f"qkv{i}": w(kv * (HEADS + 2 * GROUPS), HIDDEN), f"proj{i}": w(HIDDEN, HIDDEN)}
        out |= {f"fc1{i}": w(2 * FFN, HIDDEN), f"fc2{i}": w(HIDDEN, FFN)}
    return out


@dataclass
class Run:
    loss: torch.Tensor  # per token
    abs_sum: torch.Tensor
    abs_max: torch.Tensor


def _model(tokens, labels, weights, cu_pad, p: Precision, parts=None, visible=None) -> Run:
    """The tiny GPT over one pack: every intermediate rounded by `p` (fp32 loss, as megatron's)."""
    r, w = p.round, {k: v.to(p.dtype) for k, v in weights.items()}
    kv = HIDDEN // HEADS

    def norm(x: torch.Tensor) -> torch.Tensor:
        return r(x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5))

    x = w["embedding"][tokens]
    for i in range(LAYERS):
        qkv = r(norm(x) @ w[f"qkv{i}"].t())
        q = qkv[:, : HEADS * kv].unflatten(1, (HEADS, kv))
        k, v = qkv[:, HEADS * kv :].unflatten(1, (2 * GROUPS, kv)).split(GROUPS, dim=1)
        att = _attention(q, k, v, cu_pad, p, parts, visible).flatten(1)
        x = r(x + r(att @ w[f"proj{i}"].t()))
        gate, up = r(norm(x) @ w[f"fc1{i}"].t()).split(FFN, dim=-1)
        x = r(x + r(r(r(F.silu(gate)) * up) @ w[f"fc2{i}"].t()))
    h = norm(x)
    logits = r(h @ w["output"].t())
    loss = F.cross_entropy(
        logits.to(torch.float64 if p.dtype == torch.float64 else torch.float32), labels, reduction="none"
    )
    return Run(loss.double(), logit_abs_sum(h, w["output"]).double(), logits.abs().amax(-1).double())


# ------------------------------------------------------------------------------ the control


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_per_token_tolerance_passes_bf16_noise_and_fails_a_wrong_cp_split(seed: int) -> None:
    cu_pad, real, owner = _pack()
    g = torch.Generator().manual_seed(100 + seed)
    tokens, labels = (
        torch.randint(0, VOCAB, (256,), generator=g),
        torch.randint(0, VOCAB, (256,), generator=g),
    )
    weights = _weights(seed)

    def ratio(a: Run, b: Run, unit: float) -> float:
        """max over real tokens of |loss diff| / tolerance (> 1: the check fails)."""
        tol = per_token_loss_tolerance(
            torch.maximum(a.abs_sum, b.abs_sum),
            torch.maximum(a.loss, b.loss),
            torch.maximum(a.abs_max, b.abs_max),
            unit=unit,
            vocab_size=VOCAB,
        )
        return ((a.loss - b.loss).abs() / tol)[real].max().item()

    oracle = _model(tokens, labels, weights, cu_pad, FP64)
    bf16_cp1 = _model(tokens, labels, weights, cu_pad, BF16)
    bf16_cp2 = _model(tokens, labels, weights, cu_pad, BF16, parts=owner)
    # The fp64 oracle is the naive reference attention: the emulation's attention is exact at fp64.
    q, k, v = (torch.randn(256, n, 16, generator=g, dtype=torch.float64) for n in (HEADS, GROUPS, GROUPS))
    assert torch.allclose(_attention(q, k, v, cu_pad, FP64, owner, None), naive_attention(q, k, v, cu_pad))

    u = BF16_UNIT_ROUNDOFF
    noise = {"bf16 cp1 vs fp64": ratio(bf16_cp1, oracle, u), "bf16 cp2 vs cp1": ratio(bf16_cp2, bf16_cp1, u)}

    # Wrong split 1: the ranks get contiguous halves of the pack, while attention (like RoPE and
    # TE) assumes the load-balanced layout. The model then sees the pack permuted: the token at
    # believed offset idx_r[j] is contig_r[j]. The probe's gather (same wrong index) gives each
    # token its own loss back, computed in the wrong context.
    perm = torch.empty(256, dtype=torch.long)
    for r in range(CP):
        perm[cp_partition_index(cu_pad, CP, r)] = torch.arange(r * 128, (r + 1) * 128)
    shuffled = _model(tokens[perm], labels[perm], weights, cu_pad, BF16, parts=owner)
    contiguous = Run(*(torch.empty_like(x).index_copy_(0, perm, x) for x in vars(shuffled).values()))
    # Wrong split 2: K/V not gathered, each rank attends to its own tokens only.
    alone = _model(
        tokens, labels, weights, cu_pad, BF16, parts=owner, visible=owner[:, None] == owner[None, :]
    )
    wrong = {"contiguous split": ratio(contiguous, bf16_cp1, u), "no K/V gather": ratio(alone, bf16_cp1, u)}
    print(f"\nseed {seed}: |diff| / tolerance, noise {noise}, wrong splits {wrong}")

    # Each bf16 run is within half the two-run tolerance of the exact result; two runs within it.
    assert noise["bf16 cp1 vs fp64"] <= 0.5 and noise["bf16 cp2 vs cp1"] <= 1.0, noise
    assert min(wrong.values()) > 1.0, f"a wrong CP split passed the per-token check: {wrong}"
    # ... which the mean loss would have let through under the bf16 mean-loss tolerance (2e-2).
    mean = lambda run: run.loss[real].mean().item()  # noqa: E731
    for name, run in (("contiguous split", contiguous), ("no K/V gather", alone)):
        assert abs(mean(run) - mean(bf16_cp1)) < 2e-2 * mean(bf16_cp1), name

    # The fp32 path (gloo): the same derivation with fp32's unit roundoff.
    fp32_cp1 = _model(tokens, labels, weights, cu_pad, FP32)
    fp32_cp2 = _model(tokens, labels, weights, cu_pad, FP32, parts=owner)
    uf = FP32_UNIT_ROUNDOFF
    assert ratio(fp32_cp1, oracle, uf) <= 0.5 and ratio(fp32_cp2, fp32_cp1, uf) <= 1.0
    fp32_alone = _model(
        tokens, labels, weights, cu_pad, FP32, parts=owner, visible=owner[:, None] == owner[None, :]
    )
    assert ratio(fp32_alone, fp32_cp1, uf) > 1.0
