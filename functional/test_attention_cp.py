"""The reference attention's context-parallel path on a real 2-rank group, and TE against it on GPU.

CPU (gloo, always): random packs; each rank feeds its load-balanced share of Q, K, V through
`thd_attention` with the K/V all-gather; outputs and the gradients of Q, K and V (through the
gather's backward) must equal the unsplit per-sequence oracle's, sliced to that rank. A negative
control (a contiguous split instead of the load-balanced one) must fail the same comparison, so
the test can tell a right layout from a wrong one.

GPU (NCCL, 2 GPUs and Transformer Engine): TE's `TEDotProductAttention` with CP=2 on THD packs
with padding, compared with the reference on the real tokens (bf16 tolerances).
"""

from __future__ import annotations

import random

import pytest
import torch

from fixtures.ranks import run_ranks


def _cases(n: int, cp: int, seed: int = 0) -> list[tuple[list[int], list[int], int, int, int, int]]:
    """(real lengths, padded lengths, heads, groups, head dim, seed) per random pack."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        real = [rng.randint(1, 60) for _ in range(rng.randint(1, 5))]
        padded = [-(-x // (2 * cp)) * (2 * cp) for x in real]
        groups = rng.choice([1, 2])
        out.append((real, padded, groups * rng.choice([1, 2]), groups, rng.choice([4, 8]), seed * 1000 + i))
    return out


def _cu(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


def cp_attention_worker(rank: int, world_size: int, cases: list) -> list[dict[str, float]]:
    """Per case: max abs error of outputs and Q/K/V gradients vs the oracle, plus the control's."""
    import torch.distributed as dist

    from fixtures.attention import naive_attention, thd_attention
    from fixtures.data import cp_partition_index

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
                "out": (out - ref[idx]).abs().max().item(),  # noqa: B023
                "dq": (ql.grad - gq[idx]).abs().max().item(),  # noqa: B023
                "dk": (kl.grad - gk[idx]).abs().max().item(),  # noqa: B023
                "dv": (vl.grad - gv[idx]).abs().max().item(),  # noqa: B023
            }

        res = run(cp_partition_index(cu, world_size, rank))
        # Negative control: same code, contiguous halves of the pack instead of the 2-chunk layout.
        contiguous = torch.arange(rank * t // world_size, (rank + 1) * t // world_size)
        res["control_out"] = run(contiguous)["out"]
        results.append(res)
    return results


@pytest.mark.L0
@pytest.mark.world_size(2)
@pytest.mark.memory_budget(host="512MiB")  # measured peak ~250 MiB per rank (torch + gloo), 2x margin
def test_cp2_reference_attention_matches_the_unsplit_oracle_on_random_packs() -> None:
    cases = _cases(12, cp=2, seed=1)
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
def te_vs_reference_worker(rank: int, world_size: int, cases: list) -> list[dict[str, float]]:
    """TE's THD + CP attention vs the reference on the same shards; errors on real tokens only."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.extensions.transformer_engine import TEDotProductAttention
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer.enums import AttnMaskType

    from fixtures.attention import thd_attention
    from fixtures.data import cp_partition_index
    from fixtures.megatron import _call_with_supported_kwargs, destroy_model_parallel, init_model_parallel
    from fixtures.training import ModelConfig, ParallelConfig

    torch.cuda.set_device(rank)
    init_model_parallel(1, 1, world_size)
    results = []
    try:
        for real, padded, heads, groups, dim, seed in cases:
            shape = ModelConfig(
                hidden_size=heads * dim,
                num_attention_heads=heads,
                num_query_groups=groups,
                ffn_hidden_size=64,
            )
            config = shape.transformer_config(
                ParallelConfig(cp=world_size), bf16=True, params_dtype=torch.bfloat16, kv_channels=dim
            )
            te = _call_with_supported_kwargs(
                TEDotProductAttention,
                config=config,
                layer_number=1,
                attn_mask_type=AttnMaskType.causal,
                attention_type="self",
                cp_comm_type="p2p",
            )
            cu_real, cu_pad = _cu(real).cuda(), _cu(padded).cuda()
            t = int(cu_pad[-1])
            g = torch.Generator().manual_seed(seed)
            full = [torch.randn(t, n, dim, generator=g) for n in (heads, groups, groups)]
            w = torch.randn(t, heads * dim, generator=g)
            idx = cp_partition_index(cu_pad.cpu(), world_size, ps.get_context_parallel_rank())
            # Which local tokens are real: in-sequence position < real length.
            seq = torch.searchsorted(cu_pad.cpu(), idx, right=True) - 1
            real_mask = (idx - cu_pad.cpu()[seq]) < (cu_real.cpu()[1:] - cu_real.cpu()[:-1])[seq]
            psp = PackedSeqParams(
                qkv_format="thd",
                cu_seqlens_q=cu_real,
                cu_seqlens_kv=cu_real,
                cu_seqlens_q_padded=cu_pad,
                cu_seqlens_kv_padded=cu_pad,
                max_seqlen_q=max(padded),
                max_seqlen_kv=max(padded),
            )
            outs, grads = [], []
            for impl in ("te", "ref"):
                dtype = torch.bfloat16 if impl == "te" else torch.float32
                q, k, v = (x[idx].to("cuda", dtype).requires_grad_() for x in full)
                if impl == "te":
                    out = te(q, k, v, None, attn_mask_type=AttnMaskType.causal, packed_seq_params=psp)
                else:
                    out = thd_attention(q, k, v, cu_pad, cp_group=ps.get_context_parallel_group()).flatten(1)
                out = out.reshape(len(idx), -1)
                (out.float() * w[idx].cuda() * real_mask.cuda()[:, None]).sum().backward()
                outs.append(out.float()[real_mask.cuda()])
                grads.append([x.grad.float()[real_mask.cuda()] for x in (q, k, v)])
            res = {"out": (outs[0] - outs[1]).abs().max().item()}
            for name, a, b in zip(("dq", "dk", "dv"), grads[0], grads[1], strict=True):
                res[name] = (a - b).abs().max().item()
            results.append(res)
            dist.barrier()
    finally:
        destroy_model_parallel()
    return results


@pytest.mark.L0
@pytest.mark.gpu
@pytest.mark.world_size(2)
def test_te_attention_matches_the_reference_under_cp2() -> None:
    from fixtures.megatron import te_status

    usable, reason = te_status()
    if not usable:
        pytest.skip(reason)
    cases = _cases(6, cp=2, seed=2)
    per_rank = run_ranks(te_vs_reference_worker, 2, backend="nccl", args=(cases,), timeout=300)
    for rank, results in enumerate(per_rank):
        for case, res in zip(cases, results, strict=True):
            # bf16 inputs to TE (8 mantissa bits) vs an fp32 reference on the same values:
            # outputs are convex combinations of V, so absolute errors of a few bf16 ulps at |v| ~ 3.
            for key, tol in (("out", 3e-2), ("dq", 6e-2), ("dk", 6e-2), ("dv", 6e-2)):
                assert res[key] < tol, (
                    f"rank {rank}, real {case[0]}: TE vs reference {key} off by {res[key]:.3g}"
                )
