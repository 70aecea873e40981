"""The per-stage memory estimate against real megatron-core models: parameters and static bytes.

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
