"""Run level: one tiny model and one global batch as DP=2, CP=2, PP=2, PP=2 x VPP=2 and TP=2 on gloo.

Model FLOPs and tokens per step are properties of the model and the global batch, and the loss of
a step is the global token mean whatever the layout. One 2-rank launch trains the same 4-layer GPT
(`fixtures.training.Trainer`, megatron-core's own schedules) under each layout in turn, from the
same initial weights (the DP=2 model's, saved with `dist_checkpointing` and loaded, resharded, by
every other layout), on the same packed SQuAD-shaped global batch of 4 packs per step (DP=2: two
per replica; the others: four micro batches), for three steps.

Asserted: every rank of every layout counts the same step FLOPs and tokens, exactly, and equal to
Megatron-LM's formula over the packs' real document lengths (`fixtures.oracles`, computed here);
and every layout's losses match DP=2's within the tolerance derived below.

Every layout of the list runs on CPU/gloo here; none had to be left out.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from fixtures.oracles import megatron_lm_step_flops
from fixtures.training import ModelConfig
from megatron_testkit.ranks import run_ranks

pytestmark = [pytest.mark.L1, pytest.mark.world_size(2), pytest.mark.memory_budget(host="1GiB")]

# 4 layers: one per (stage, chunk) under PP=2 x VPP=2. Pipeline p2p without batching: megatron's
# default `batch_p2p_comm=True` posts a send to the previous and a send to the next stage in one
# batch; at PP = 2 both are the same rank, and on gloo the receiving rank matched them the other
# way round under the interleaved schedule (an activation taken for a gradient). Measured here: the
# PP=2 x VPP=2 training loss of step 1 was 3e-4 relative off DP=2's, with identical weights
# (per-layer sums) and an identical forward-only loss; with `batch_p2p_comm=False` (each send and
# receive its own operation, megatron's other supported mode) it is bit-identical. The harness
# keeps megatron's default, so this test sets it for every layout (no effect without a pipeline).
MODEL = ModelConfig(num_layers=4, overrides=(("batch_p2p_comm", False),))
PACK_LEN, STEPS, PACKS_PER_STEP = 256, 3, 4
LAYOUTS = {  # name -> ParallelConfig fields (DP is what remains of the 2 ranks)
    "dp2": {},
    "cp2": {"cp": 2},
    "pp2": {"pp": 2},
    "pp2_vpp2": {"pp": 2, "vpp": 2},
    "tp2": {"tp": 2},
}

# Loss tolerance. fp32 on CPU; the layouts differ only in the order of floating-point sums: TP
# splits each matmul's reduction over two ranks and all-reduces the halves, CP gathers keys and
# sums the two ranks' gradients, PP and VPP move activations unchanged but DDP sums the gradients
# of different micro batch groupings, DP=2 all-reduces the two replicas' gradients. A reordered
# sum of n fp32 terms moves by at most ~n u sum|terms| (u = 2^-24 ~ 6e-8); the loss is a mean of
# ~10^3 token losses of ~5 nats computed through reductions of length <= 320 (the vocabulary),
# so its step-1 difference (identical weights) is bounded by ~1e2 u relative in practice (random
# rounding errors grow with sqrt(n), not n). The gradients differ by the same relative amount;
# Adam's first steps move each weight by ~lr x g / |g|, so a relative gradient perturbation e
# moves the weights by ~lr e and the next losses by <= |dL/dw| lr e per weight, far below e
# itself for lr = 1e-3 (only weights whose gradient is within e of zero can flip, and those barely
# move the loss). The tolerance, 1e-5 relative on every step's loss, is ~10^2 u x 1.7: it allows
# the reordering noise with margin while a real layout error (a micro batch counted twice in the
# loss, a wrong CP split, a missing TP reduction) moves the loss by >= 1e-3 relative
# (functional/test_cp_pretrain_sft.py measured 1e-3 for a wrong CP split). Measured over the three
# steps: CP=2 3.5e-8, TP=2 1.4e-8, PP=2 and PP=2 x VPP=2 0 (bit-identical); the batched-p2p
# mismatch described above (a real layout error) was 3e-4, 30x the tolerance, and failed this test.
# Host memory: ~610 MiB peak per rank measured (five models built in turn); budget 1 GiB.
LOSS_RTOL = 1e-5


def _global_batches() -> list[list[Any]]:
    """STEPS global batches of PACKS_PER_STEP packs, padded for CP = 2 (so every layout takes them)."""
    from fixtures.data import ByteTokenizer, pack_examples, squad_like_dataset, tokenize_dataset

    tok = ByteTokenizer()
    examples = tokenize_dataset(squad_like_dataset(40, seed=0), tok, kind="pretrain", max_len=PACK_LEN - 1)
    packs = pack_examples(examples, PACK_LEN, 2, pad_id=tok.pad_id)
    need = STEPS * PACKS_PER_STEP
    if len(packs) < need:
        raise ValueError(f"40 rows give {len(packs)} packs: fewer than the {need} the run needs")
    return [packs[i * PACKS_PER_STEP : (i + 1) * PACKS_PER_STEP] for i in range(STEPS)]


def _train(name: str, root: Path, batches: list[list[Any]]) -> dict[str, Any]:
    """One layout: build, load the shared initial weights (except DP=2, which saved them), train."""
    from fixtures.megatron import destroy_model_parallel
    from fixtures.training import ParallelConfig, TrainConfig, Trainer

    trainer = Trainer(MODEL, ParallelConfig(**LAYOUTS[name]), TrainConfig(lr=1e-3, log_memory=False))
    if name == "dp2":
        trainer.save(root)
    else:
        trainer.load(root, load_optimizer=False, finetune=True)
    dp, dp_rank = trainer.ps.get_data_parallel_world_size(), trainer.ps.get_data_parallel_rank()
    per_replica = PACKS_PER_STEP // dp
    steps = []
    for batch in batches:
        result = trainer.train_step(batch[dp_rank * per_replica : (dp_rank + 1) * per_replica])
        steps.append({"loss": result.loss, "step_flops": result.step_flops})
    out = {
        "layout": (trainer.parallel.tp, trainer.parallel.pp, trainer.cp_size, trainer.parallel.vpp, dp),
        "chunks": len(trainer.model),
        "steps": steps,
        "total_flops": trainer.flops.total_flops,
        "total_tokens": trainer.flops.total_tokens,
        "hardware_total_flops": trainer.flops.hardware_total_flops,
    }
    trainer.close()
    destroy_model_parallel()
    return out


def layouts_rank(rank: int, world_size: int, root: str) -> dict[str, Any]:
    from fixtures.megatron import cpu_shim

    torch.set_num_threads(1)
    with cpu_shim():
        batches = _global_batches()
        out: dict[str, Any] = {name: _train(name, Path(root) / "init", batches) for name in LAYOUTS}
    out["lengths"] = [[n for pack in batch for n in pack.lengths] for batch in batches]
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    root = tmp_path_factory.mktemp("layout_invariance")
    ranks = run_ranks(layouts_rank, 2, backend="gloo", args=(str(root),), timeout=540)
    base = [s["loss"] for s in ranks[0]["dp2"]["steps"]]
    for name in LAYOUTS:
        worst = max(abs(s["loss"] - b) / abs(b) for s, b in zip(ranks[0][name]["steps"], base, strict=True))
        print(
            f"\nlayout {name}: losses {[round(s['loss'], 6) for s in ranks[0][name]['steps']]}, max rel diff {worst:.2g}"
        )
    return ranks


def test_each_layout_ran_as_named(runs):
    # (tp, pp, cp, vpp, dp) and model chunks per rank, on both ranks.
    expected = {
        "dp2": ((1, 1, 1, None, 2), 1),
        "cp2": ((1, 1, 2, None, 1), 1),
        "pp2": ((1, 2, 1, None, 1), 1),
        "pp2_vpp2": ((1, 2, 1, 2, 1), 2),
        "tp2": ((2, 1, 1, None, 1), 1),
    }
    for r in runs:
        assert {name: (r[name]["layout"], r[name]["chunks"]) for name in LAYOUTS} == expected


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_step_flops_and_tokens_are_identical_and_megatron_lms(runs, name):
    lengths = runs[0]["lengths"]
    expected = [megatron_lm_step_flops(MODEL, step) for step in lengths]
    for r in runs:
        assert [s["step_flops"] for s in r[name]["steps"]] == expected
        assert r[name]["total_flops"] == sum(expected)
        assert r[name]["total_tokens"] == sum(map(sum, lengths))  # real tokens of the global batches
        assert r[name]["hardware_total_flops"] == runs[0]["dp2"]["hardware_total_flops"]


@pytest.mark.parametrize("name", [n for n in LAYOUTS if n != "dp2"])
def test_losses_match_dp2_within_the_reordering_tolerance(runs, name):
    for r in runs:
        for step, (got, base) in enumerate(zip(r[name]["steps"], r["dp2"]["steps"], strict=True), 1):
            assert got["loss"] == pytest.approx(base["loss"], rel=LOSS_RTOL), f"{name} step {step}"
    # Training moved the loss (so a layout that silently skipped its updates would be caught).
    losses = [s["loss"] for s in runs[0][name]["steps"]]
    assert losses[-1] < losses[0]
