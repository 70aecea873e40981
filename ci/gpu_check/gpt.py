"""Step ``gpt``: a 1-rank megatron-core GPT with the kit's reference attention, trained, saved, loaded.

On CUDA over NCCL: bf16 training steps, save, load into a fresh model, the same loss after the
load. The dry run runs the same function on the CPU over gloo (fp32): the harness calls hold; the
GPU run differs only in device and precision.
Rank functions are module-level so `run_ranks` can import them by name in fresh processes.
"""

from __future__ import annotations

import random
import time
from typing import TYPE_CHECKING, Any

from ci.gpu_check.summary import expect

if TYPE_CHECKING:
    from ci.gpu_check.summary import CheckState


def gpt_rank(rank: int, world_size: int, root: str, steps: int, use_te: bool = False) -> dict[str, Any]:
    """The 1-rank megatron-core GPT run (the one call into the training harness)."""
    return train_save_load(root, steps, use_te=use_te)


def _packs(max_sequence_length: int) -> list[Any]:
    """24 random examples (seed 0) packed to the model's sequence length."""
    from fixtures.data import Example, pack_examples

    rng = random.Random(0)
    examples = []
    for _ in range(24):
        n = rng.randint(20, 120)
        tokens = [rng.randrange(1, 256) for _ in range(n + 1)]
        examples.append(Example(tuple(tokens[:-1]), tuple(tokens[1:]), (1,) * n))
    return pack_examples(examples, max_sequence_length, 1, pad_id=0)


def train_save_load(root: str, steps: int, *, use_te: bool = False) -> dict[str, Any]:
    """Train `steps` steps with `fixtures.training.Trainer`, save, load into a fresh model, compare.

    The only place the check uses the harness's public API (Trainer, ModelConfig, ParallelConfig,
    TrainConfig; train_step, forward_loss, save, load, close), so a change there is one edit here.
    ``use_te=False``: megatron's local layers with the kit's reference attention (step ``gpt``);
    ``use_te=True``: Transformer Engine's layer spec, which raises with the reason where TE cannot
    be used (step ``te_train``). Also names the rank's own device, the golden platform and the
    peak FLOP/s key it gives (the keys the kit takes from a rank's device).
    """
    import torch

    from fixtures.megatron import cpu_shim, destroy_model_parallel
    from fixtures.training import ModelConfig, ParallelConfig, TrainConfig, Trainer

    model = ModelConfig()
    packs = _packs(model.max_sequence_length)
    batches = [packs[i : i + 2] for i in range(0, 2 * steps, 2)]
    probe = packs[2 * steps : 2 * steps + 2] or packs[:2]
    out: dict[str, Any] = {}
    with cpu_shim():
        trainer = Trainer(model, ParallelConfig(), TrainConfig(use_te=use_te, lr=3e-3))
        params = list(trainer.model[0].module.parameters())
        out["te_modules"] = sorted(
            {
                type(m).__name__
                for m in trainer.model[0].modules()
                if "transformer_engine" in type(m).__module__
            }
        )
        out["param_dtypes"] = sorted({str(p.dtype) for p in params})
        out["param_device"] = str(params[0].device)
        t0 = time.perf_counter()
        results = [trainer.train_step(b) for b in batches]
        out["train_s"] = time.perf_counter() - t0
        out["losses"] = [r.loss for r in results]
        out["tflops_per_gpu"] = results[-1].tflops_per_gpu
        out["memory"] = results[-1].memory or results[-1].local_memory
        out["total_flops"] = trainer.flops.total_flops
        out["loss_before_save"] = trainer.forward_loss(probe)
        trainer.save(root)
        trainer.close()
        fresh = Trainer(model, ParallelConfig(), TrainConfig(use_te=use_te, lr=3e-3, seed=99))
        out["loss_fresh"] = fresh.forward_loss(probe)
        out["loaded_iteration"] = fresh.load(root)
        out["loss_after_load"] = fresh.forward_loss(probe)
        out["flops_after_load"] = fresh.flops.total_flops
        fresh.close()
        destroy_model_parallel()
    out["bf16"] = torch.cuda.is_available()
    out.update(device_keys(torch.distributed.get_backend()))
    return out


def device_keys(backend: str) -> dict[str, Any]:
    """This rank's own device and the keys the kit derives from it: golden platform, peak FLOP/s."""
    from accounting.throughput import lookup_peak
    from megatron_testkit.devices import rank_device_name
    from megatron_testkit.platforms import launch_platform

    device = rank_device_name()
    peak, key_or_reason = lookup_peak(device) if device else (None, "no CUDA device in this rank")
    return {
        "device": device,
        "platform": launch_platform(backend, device),
        "peak_key": key_or_reason if peak else None,
        "peak_bf16_flops": peak,
        "peak_missing": None if peak else key_or_reason,
    }


def step(check: CheckState) -> dict[str, Any]:
    """One step on the CPU in a dry run, three in bf16 on CUDA; the load restores loss and FLOPs."""
    from megatron_testkit.ranks import run_ranks

    root = str(check.out / "gpt_checkpoint")
    if check.dry:
        got = run_ranks(gpt_rank, 1, backend="gloo", args=(root, 1), timeout=min(300, check.remaining()))[0]
    else:
        got = run_ranks(gpt_rank, 1, backend="nccl", args=(root, 3), timeout=min(200, check.remaining()))[0]
        expect(got["param_dtypes"] == ["torch.bfloat16"], f"parameters are {got['param_dtypes']}, not bf16")
        expect(got["param_device"].startswith("cuda"), f"parameters on {got['param_device']}")
    expect(
        got["loss_after_load"] == got["loss_before_save"],
        f"loss after load {got['loss_after_load']} != before save {got['loss_before_save']}",
    )
    expect(got["loss_fresh"] != got["loss_before_save"], "a fresh model already had the trained loss")
    expect(got["flops_after_load"] == got["total_flops"], "FLOPs counter not restored by load")
    return got
