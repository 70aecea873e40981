"""The reference attention's context-parallel path on a real 2-rank group, and TE against it on GPU.

CPU (gloo, always): random packs; each rank feeds its load-balanced share of Q, K, V through
`thd_attention` with the K/V all-gather; outputs and the gradients of Q, K and V (through the
gather's backward) must equal the unsplit per-sequence oracle's, sliced to that rank. A negative
control (a contiguous split instead of the load-balanced one) must fail the same comparison, so
the test can tell a right layout from a wrong one.

GPU (NCCL, 2 GPUs and Transformer Engine): TE's `TEDotProductAttention` with CP=2 on THD packs
with padding, a tail-only padded pack among them, compared on the real tokens with the reference
run on the same bf16-rounded inputs, within `fixtures.attention.bf16_attention_error_bounds`
(derived per element, pinned on CPU in unit/test_attention.py). The CPU test below checks that
the TE cases are ones TE has a backend for and that they contain the pack TE's own padding
inference misreads.
"""

from __future__ import annotations

import random

import pytest
import torch

from fixtures.attention_te import te_vs_reference_worker
from megatron_testkit import skips
from megatron_testkit.metrics import MetricsRecorder
from megatron_testkit.ranks import run_ranks

# Head dims TE can run THD + CP + padding with. Only cuDNN's fused attention takes that case: TE
# disables UnfusedDotProductAttention for qkv_format "thd" and under context parallelism, and
# FlashAttention for THD with padding between sequences (attention/dot_product_attention/utils.py,
# get_attention_backend, TE 2.6); cuDNN's arbitrary-seqlen backend needs head_dim % 8 == 0 and,
# below cuDNN 9.9 / 9.10, head_dim <= 128 (common/fused_attn/fused_attn.cpp). The CPU test's dims
# 4 and 8 would leave TE with no backend for 4.
TE_HEAD_DIMS = (16, 32)
CPU_HEAD_DIMS = (4, 8)


def _cases(
    n: int, cp: int, seed: int = 0, head_dims: tuple[int, ...] = CPU_HEAD_DIMS
) -> list[tuple[list[int], list[int], int, int, int, int]]:
    """(real lengths, padded lengths, heads, groups, head dim, seed) per random pack."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        real = [rng.randint(1, 60) for _ in range(rng.randint(1, 5))]
        padded = [-(-x // (2 * cp)) * (2 * cp) for x in real]
        groups = rng.choice([1, 2])
        out.append(
            (real, padded, groups * rng.choice([1, 2]), groups, rng.choice(head_dims), seed * 1000 + i)
        )
    return out


def _tail_only_cases(
    cp: int, head_dims: tuple[int, ...]
) -> list[tuple[list[int], list[int], int, int, int, int]]:
    """Packs padded after their last document only, as the SFT packs are ([115] -> 256)."""
    step = 2 * cp
    return [
        ([115], [256], 2, 1, head_dims[-1], 9001),
        ([3 * step, 5 * step, 37], [3 * step, 5 * step, 64], 4, 2, head_dims[0], 9002),
    ]


def te_cases(cp: int = 2) -> list[tuple[list[int], list[int], int, int, int, int]]:
    """The TE-vs-reference cases: random packs with TE's head dims, then the tail-only ones."""
    return _cases(6, cp=cp, seed=2, head_dims=TE_HEAD_DIMS) + _tail_only_cases(cp, TE_HEAD_DIMS)


def _cu(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


# Golden values (functional/golden/test_attention_cp/, docs/golden-values.md), recorded inside
# each rank: per pack, the rank's token count under the load-balanced split (exact: a changed
# split is a changed count) and the mean |output| over its tokens. Tolerance: every output element
# is within 1e-10 of the float64 oracle (asserted below), so two correct runs' means differ by at
# most 2e-10 absolute; the smallest mean |output| of these packs is 0.101 (measured: rank 1, pack
# 12), so 2e-10 / 0.10 = 2e-9 relative bounds every pack. Only the summation order may differ.
GOLDEN_MEAN_RTOL = 2e-9
GOLDEN_MEAN_WHY = "every element within 1e-10 of the float64 oracle; smallest mean |out| 0.101: 2e-10/0.10"


def cp_attention_worker(rank: int, world_size: int, cases: list) -> list[dict[str, float]]:
    """Per case: max abs error of outputs and Q/K/V gradients vs the oracle, plus the control's."""
    import torch.distributed as dist

    from fixtures.attention import naive_attention, thd_attention
    from fixtures.data import cp_partition_index
    from megatron_testkit import metrics

    torch.set_num_threads(1)
    group = dist.group.WORLD
    results = []
    for _real, padded, heads, groups, dim, seed in cases:
        cu = _cu(padded)
        t = int(cu[-1])
        g = torch.Generator().manual_seed(seed)
        q = torch.randn(t, heads, dim, generator=g, dtype=torch.float64, requires_grad=True)
        k = torch.randn(t, groups, dim, generator=g, dtype=torch.float64, requires_grad=True)
        v = torch.randn(t, groups, dim, generator=g, dtype=torch.float64, requires_grad=True)
        w = torch.randn(t, heads, dim, generator=g, dtype=torch.float64)
        ref = naive_attention(q, k, v, cu)
        gq, gk, gv = torch.autograd.grad((ref * w).sum(), (q, k, v))

        def run(idx: torch.Tensor) -> dict[str, float]:
            ql, kl, vl = (x.detach()[idx].requires_grad_() for x in (q, k, v))  # noqa: B023
            out = thd_attention(ql, kl, vl, cu, cp_group=group)  # noqa: B023
            (out * w[idx]).sum().backward()  # noqa: B023
            return {
                "out_abs_mean": out.detach().abs().mean().item(),
                "local_tokens": int(idx.numel()),
                "out": (out - ref[idx]).abs().max().item(),  # noqa: B023
                "dq": (ql.grad - gq[idx]).abs().max().item(),  # noqa: B023
                "dk": (kl.grad - gk[idx]).abs().max().item(),  # noqa: B023
                "dv": (vl.grad - gv[idx]).abs().max().item(),  # noqa: B023
            }

        res = run(cp_partition_index(cu, world_size, rank))
        case = len(results)
        metrics.record(f"rank{rank}/local_tokens", case, res["local_tokens"])
        mean = metrics.relative(GOLDEN_MEAN_RTOL, GOLDEN_MEAN_WHY)
        metrics.record(f"rank{rank}/out_abs_mean", case, res["out_abs_mean"], mean)
        # Negative control: same code, contiguous halves of the pack instead of the 2-chunk layout.
        contiguous = torch.arange(rank * t // world_size, (rank + 1) * t // world_size)
        res["control_out"] = run(contiguous)["out"]
        results.append(res)
    return results


@pytest.mark.L0
@pytest.mark.world_size(2)
@pytest.mark.memory_budget(host="512MiB")  # measured peak ~250 MiB per rank (torch + gloo), 2x margin
def test_cp2_reference_attention_matches_the_unsplit_oracle_on_random_packs(
    kit_metrics: MetricsRecorder,
) -> None:
    cases = _cases(12, cp=2, seed=1) + _tail_only_cases(2, CPU_HEAD_DIMS)
    per_rank = run_ranks(cp_attention_worker, 2, backend="gloo", args=(cases,), timeout=180)
    for rank, results in enumerate(per_rank):
        for case, res in zip(cases, results, strict=True):
            # float64 throughout: only summation order differs from the oracle.
            for key in ("out", "dq", "dk", "dv"):
                assert res[key] < 1e-10, f"rank {rank}, pack {case[1]}: {key} off by {res[key]:.3g}"
    # The control must fail on at least one pack with more than one sequence chunk per rank.
    controls = [res["control_out"] for results in per_rank for res in results]
    assert max(controls) > 1e-3, f"a contiguous split went unnoticed: {max(controls):.3g}"


# ------------------------------------------------------------------------------ GPU: TE vs reference
@pytest.mark.L0
def test_te_cases_have_a_te_backend_and_include_a_pack_te_would_misread() -> None:
    from fixtures.megatron import make_packed_seq_params

    cases = te_cases(cp=2)
    for real, padded, heads, groups, dim, _ in cases:
        assert dim % 8 == 0 and dim <= 128, f"head dim {dim}: no TE backend for THD + CP + padding"
        assert heads % groups == 0 and all(p % 4 == 0 and p >= r for r, p in zip(real, padded, strict=True))
    tail_only = 0
    for real, padded, *_ in cases:
        cu, cu_pad = _cu(real), _cu(padded)
        p = make_packed_seq_params(
            qkv_format="thd",
            cu_seqlens_q=cu,
            cu_seqlens_kv=cu,
            cu_seqlens_q_padded=cu_pad,
            cu_seqlens_kv_padded=cu_pad,
            max_seqlen_q=max(padded),
            max_seqlen_kv=max(padded),
        )
        assert p.pad_between_seqs is True
        # TE's inference (pad_between_seqs=None): padded[:-1] != real[:-1]. False here, with
        # padding present, is the misread that makes TE's CP split real tokens as padding.
        inferred = not torch.equal(cu_pad[:-1], cu[:-1])
        tail_only += (not inferred) and real != padded
    assert tail_only >= 2, "the TE cases lost their tail-only packs"


@pytest.mark.L0
@pytest.mark.gpu
@pytest.mark.world_size(2)
def test_te_attention_matches_the_reference_under_cp2() -> None:
    from fixtures.megatron import te_status

    usable, reason = te_status()
    if not usable:
        skips.skip("te" if torch.cuda.is_available() else "cuda", reason)
    cases = te_cases(cp=2)
    per_rank = run_ranks(te_vs_reference_worker, 2, backend="nccl", args=(cases,), timeout=300)
    for rank, results in enumerate(per_rank):
        for case, res in zip(cases, results, strict=True):
            # Each real-token element within 2x its first-order bf16 bound (the factor covers
            # second-order terms); a wrong CP split or real tokens taken for padding is off by
            # ~1 / ((2 + cp) u) = 64 bounds (unit/test_attention.py pins both on CPU).
            for key in ("out", "dq", "dk", "dv"):
                assert res[f"{key}_ratio"] <= 2.0, (
                    f"rank {rank}, real {case[0]} padded {case[1]}: TE vs reference {key} is "
                    f"{res[f'{key}_ratio']:.3g} x its bf16 bound (max abs error {res[key]:.3g})"
                )
