"""The per-stage memory estimate against real megatron-core models: parameters, static bytes, activations.

Each rank builds a real model and optimizer, trains one step (so Adam's moments exist), and
counts from the tensors themselves: the parameters of its model chunks, the bytes of their
weights, of their DDP main gradients and of the optimizer's per-parameter state (Adam's
`exp_avg` and `exp_avg_sq`, and any main-weight copy the optimizer holds). The estimate
(`accounting.stage_memory`) must equal both counts exactly on every rank of every stage.

On CPU the harness trains in fp32 (no bf16 copy of the weights): 4 + 4 + 8 = 16 bytes per
parameter, the estimate's `precision="fp32"`; on CUDA it trains as Megatron-LM does, bf16 with
fp32 main weights (18 bytes), `precision="bf16"`. Layouts: PP=2 (1F1B), PP=2 x VPP=2 (two chunks
per stage), TP=2 (sharded linears and vocabulary, replicated norms), and an MoE model with EP=2
built directly with megatron-core's MoE layer spec (the harness' spec is dense), stepped by its
optimizer alone. Adam's scalar `step` counters (one per tensor, not per parameter) are not part
of the per-parameter convention and are left out of both sides.

Activations: the local spec (megatron-core's unfused attention) at TP = 2 with dropout, each
decoder layer's saved tensors counted by storage at two lengths; the s*s part must be the unfused
formula's score term exactly (in this run's bytes), the rest at least the formula's tensors. The
fused formula (the default) is checked against flash attention by gpu-check's `memory_estimate`
step (ci/gpu_check/memory_estimate.py; its dry run on CPU in unit/test_gpu_check_memory_estimate.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from fixtures.training import ModelConfig
from megatron_testkit.ranks import run_ranks

pytestmark = [pytest.mark.L1, pytest.mark.world_size(2), pytest.mark.memory_budget(host="1GiB")]


@dataclass(frozen=True)
class Layout:
    """One layout of the check; `moe` builds the MoE model with EP = 2 instead of the harness' dense one."""

    name: str
    tp: int = 1
    pp: int = 1
    vpp: int | None = None
    moe: bool = False
    layers: int = 2
    normalization: str = "RMSNorm"


LAYOUTS = [
    Layout("pp2", pp=2, normalization="LayerNorm"),
    Layout("pp2xvpp2", pp=2, vpp=2, layers=4),
    Layout("tp2", tp=2),
    Layout("ep2", moe=True),
]


def _model(layout: Layout) -> ModelConfig:
    return ModelConfig(num_layers=layout.layers, normalization=layout.normalization, max_sequence_length=32)


def _count(chunks: list, optimizer) -> dict[str, int]:
    """Parameters and static bytes held by this rank's chunks and optimizer, from their tensors."""
    params = [p for chunk in chunks for p in chunk.module.parameters()]
    own = {p.data_ptr() for p in params}
    weights = sum(p.numel() * p.element_size() for p in params)
    grads = sum(p.main_grad.numel() * p.main_grad.element_size() for p in params)
    state = 0
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = opt.optimizer
        for group in inner.param_groups:
            for p in group["params"]:
                if p.data_ptr() not in own:  # a main-weight copy (bf16 training)
                    state += p.numel() * p.element_size()
                for key in ("exp_avg", "exp_avg_sq"):
                    tensor = inner.state.get(p, {}).get(key)
                    state += 0 if tensor is None else tensor.numel() * tensor.element_size()
    return {"params": sum(p.numel() for p in params), "static_bytes": weights + grads + state}


def _dense_rank(layout: Layout) -> tuple[dict[str, int], object, int, int]:
    import torch

    from fixtures.training import DenseBatch, ParallelConfig, TrainConfig, Trainer

    trainer = Trainer(
        _model(layout), ParallelConfig(tp=layout.tp, pp=layout.pp, vpp=layout.vpp), TrainConfig(packed=False)
    )
    gen = torch.Generator().manual_seed(7)
    batches = []
    for _ in range(2 * layout.pp):
        tokens = torch.randint(0, 320, (1, 33), generator=gen)
        batches.append(DenseBatch(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous(), torch.ones(1, 32)))
    trainer.step(batches)
    counts = _count(trainer.model, trainer.optimizer)
    ps = trainer.ps
    counts["bf16"] = trainer.bf16
    trainer.close()
    return counts, trainer.config, ps.get_pipeline_model_parallel_rank(), ps.get_tensor_model_parallel_rank()


def _moe_rank(layout: Layout) -> tuple[dict[str, int], object, int, int]:
    """A GPT with 4 experts of width 32, top-2, EP = 2, built and stepped without the harness."""
    import torch
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from fixtures.megatron import call_with_supported_kwargs, init_model_parallel, spec_kwargs
    from fixtures.training import ParallelConfig

    init_model_parallel(1, 1, 1, expert_model_parallel_size=2)
    model = _model(layout)
    config = model.transformer_config(
        ParallelConfig(),
        num_moe_experts=4,
        moe_router_topk=2,
        moe_ffn_hidden_size=32,
        expert_model_parallel_size=2,
        moe_token_dispatcher_type="allgather",
    )
    builder = get_gpt_layer_local_spec
    spec = builder(**spec_kwargs(builder, num_experts=4, moe_grouped_gemm=False, normalization="RMSNorm"))
    gpt = GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=model.vocab_size,
        max_sequence_length=model.max_sequence_length,
        share_embeddings_and_output_weights=False,
        position_embedding_type="rope",
    )
    ddp = call_with_supported_kwargs(
        DistributedDataParallel,
        config=config,
        ddp_config=DistributedDataParallelConfig(use_distributed_optimizer=False),
        module=gpt,
    )
    optimizer = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-3, bf16=False), [ddp])
    for p in ddp.module.parameters():  # a gradient for every weight, so Adam makes every moment
        p.main_grad.fill_(1e-3)
    optimizer.step()
    counts = _count([ddp], optimizer)
    counts["bf16"] = False
    return counts, config, 0, torch.distributed.get_rank()


def memory_rank(rank: int, world_size: int, layout: Layout) -> dict:
    """One rank: build, step, count; and the estimate for its stage from the megatron config."""
    from accounting import ModelShape
    from accounting.stage_memory import ParallelLayout, memory_estimate
    from fixtures.megatron import cpu_shim, destroy_model_parallel

    with cpu_shim():
        counts, config, stage, tp_rank = (_moe_rank if layout.moe else _dense_rank)(layout)
        shape = ModelShape.from_megatron(config, _model(layout).vocab_size)
        destroy_model_parallel()
    parallel = ParallelLayout(
        tp=layout.tp, pp=layout.pp, vpp=layout.vpp, ep=2 if layout.moe else 1,
        dp=world_size // (layout.tp * layout.pp), seq_len=32,
    )  # fmt: skip
    estimate = memory_estimate(
        shape,
        parallel,
        precision="bf16" if counts.pop("bf16") else "fp32",
        normalization=layout.normalization,
    )
    return {"rank": rank, "stage": stage, "tp_rank": tp_rank, "measured": counts, **_stage(estimate, stage)}


def _stage(estimate, stage: int) -> dict:
    row = estimate.stages[stage]
    return {"estimate": {"params": row.params, "static_bytes": row.static_bytes}}


@pytest.mark.parametrize("layout", LAYOUTS, ids=[layout.name for layout in LAYOUTS])
def test_estimate_equals_the_real_models_parameters_and_static_bytes(layout: Layout) -> None:
    results = run_ranks(memory_rank, 2, args=(layout,), timeout=300)
    for res in results:
        print(
            f"[{layout.name}] rank {res['rank']} stage {res['stage']}: estimate {res['estimate']} "
            f"measured {res['measured']}"
        )
    stages = sorted({res["stage"] for res in results})
    assert stages == list(range(layout.pp))  # every stage was measured
    for res in results:
        assert res["estimate"] == res["measured"], res


# ---------------------------------------------------------------- activations, unfused attention

# The unfused formula's score term, 5*a*s*s*b/t bytes per layer, is three tensors of one element per
# (head, query, key): the softmax output (2 bytes in bf16), the dropout mask (1 byte) and the dropout
# output (2 bytes). On CPU this run keeps them in fp32, and CPU dropout keeps its mask as an fp32
# noise tensor: 4 + 4 + 4 = 12 bytes per element instead of 5. Each layer also keeps its s x s bool
# causal mask (b*s*s bytes, not per head), which the formula leaves out (1 / (5a/t) of the term).
SCORE_BYTES_BF16, SCORE_BYTES_HERE = 5, 12
SEQ_LENGTHS = (32, 64)


def _saved_bytes_per_layer(gpt, tokens) -> list[int]:
    """Bytes of the distinct storages each decoder layer saves for its backward (parameters left out)."""
    import torch

    params = {p.untyped_storage().data_ptr() for p in gpt.parameters()}
    seen: set[int] = set()
    per_layer = [0] * len(gpt.decoder.layers)
    current = [None]

    def pack(t):
        storage = t.untyped_storage()
        if current[0] is not None and storage.data_ptr() not in params | seen:
            seen.add(storage.data_ptr())
            per_layer[current[0]] += storage.nbytes()
        return t

    hooks = []
    for i, layer in enumerate(gpt.decoder.layers):
        hooks.append(layer.register_forward_pre_hook(lambda m, a, i=i: current.__setitem__(0, i)))
        hooks.append(layer.register_forward_hook(lambda m, a, o: current.__setitem__(0, None)))
    position = torch.arange(tokens.shape[1]).unsqueeze(0)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        gpt(tokens, position, None, labels=tokens)
    for hook in hooks:
        hook.remove()
    return per_layer


def activation_rank(rank: int, world_size: int) -> dict:
    """TP = 2, the local (unfused) spec with dropout: each layer's saved bytes at two lengths."""
    import torch
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from accounting import ModelShape
    from accounting.stage_memory import ParallelLayout, memory_estimate
    from fixtures.megatron import cpu_shim, destroy_model_parallel, init_model_parallel, spec_kwargs
    from fixtures.training import ParallelConfig

    model = ModelConfig(num_layers=2, num_attention_heads=4, num_query_groups=4, max_sequence_length=64)
    with cpu_shim():
        init_model_parallel(2, 1, 1)
        config = model.transformer_config(ParallelConfig(tp=2), attention_dropout=0.1, hidden_dropout=0.1)
        builder = get_gpt_layer_local_spec
        gpt = GPTModel(
            config=config,
            transformer_layer_spec=builder(**spec_kwargs(builder, normalization="RMSNorm")),
            vocab_size=model.vocab_size,
            max_sequence_length=model.max_sequence_length,
            share_embeddings_and_output_weights=False,
            position_embedding_type="rope",
        ).train()
        gen = torch.Generator().manual_seed(3)
        measured = {
            s: _saved_bytes_per_layer(gpt, torch.randint(0, 320, (1, s), generator=gen)) for s in SEQ_LENGTHS
        }
        shape = ModelShape.from_megatron(config, model.vocab_size)
        destroy_model_parallel()
    formula = {}
    for s in SEQ_LENGTHS:
        rows = {
            attention: memory_estimate(shape, ParallelLayout(tp=2, seq_len=s, attention=attention)).stages[0]
            for attention in ("unfused", "fused")
        }
        logits = 4 * s * model.vocab_size // 2
        formula[s] = {a: (row.activation_bytes - logits) // model.num_layers for a, row in rows.items()}
    return {
        "rank": rank,
        "measured": measured,
        "formula": formula,
        "heads": 4,
        "tp": 2,
        "hidden": model.hidden_size,
    }


def test_unfused_activation_formula_keeps_what_the_local_attention_keeps():
    results = run_ranks(activation_rank, 2, timeout=300)
    s1, s2 = SEQ_LENGTHS
    for res in results:
        print(f"[activations] rank {res['rank']}: measured {res['measured']} formula {res['formula']}")
        a_over_t, h = res["heads"] // res["tp"], res["hidden"]
        unfused, fused = (
            {s: res["formula"][s][kind] - (4 * a_over_t * s if kind == "fused" else 0) for s in SEQ_LENGTHS}
            for kind in ("unfused", "fused")
        )  # fused less its softmax statistics (4*a*s*b/t) is the score-free part both share
        for s in SEQ_LENGTHS:
            assert unfused[s] - fused[s] == 5 * a_over_t * s * s  # the formula's score term, in bf16
        for layer in range(2):
            m1, m2 = res["measured"][s1][layer], res["measured"][s2][layer]
            # Per layer M(s) = A*s + B*s*s (b = 1): B from the two lengths, exactly (integers).
            quadratic, rest = divmod(m2 * s1 - m1 * s2, s1 * s2 * (s2 - s1))
            assert rest == 0
            # 5 bytes per score element in the formula are SCORE_BYTES_HERE here, plus the causal mask.
            assert (
                quadratic == (unfused[s2] - fused[s2]) // (s2 * s2) // SCORE_BYTES_BF16 * SCORE_BYTES_HERE + 1
            )
            # The rest: each tensor the formula counts is kept, here in fp32 (twice its bf16 bytes;
            # its two 1-byte dropout masks, 2*s*h bytes, are fp32 noise here: 4 times), so the
            # formula is a lower bound of the measured bytes (the local spec keeps more: RoPE's
            # tables, the norms' statistics, SwiGLU's intermediate).
            linear = m1 - quadratic * s1 * s1
            assert linear >= 2 * fused[s1] + 2 * 2 * s1 * h, (linear, fused[s1])
