"""Step ``te_train``: a 1-rank `Trainer` with Transformer Engine's layers, bf16, saved and loaded; run twice.

On the GPU: TE's layer spec (``use_te=True``, which raises with the reason where TE cannot be
used), bf16 parameters, three steps, a save and a load that restores the loss and the FLOPs
counter, then the same steps again in a fresh process. The two runs' losses give the measured
run-to-run spread of bf16 training (``bf16_loss_spread``), the basis the GPU golden tolerances
lack (`functional/test_cp_pretrain_sft.py`'s and `test_pp_memory.py`'s bf16 estimates of 2e-2).
Also the rank's own device and the platform and peak keys the kit derives from it.

The dry run runs the same two launches on the CPU over gloo without TE (which needs a GPU): the
harness calls, the load and the spread, which in fp32 on one machine must be exactly 0.
Rank functions are module-level so `run_ranks` can import them by name in fresh processes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ci.gpu_check.gpt import gpt_rank
from ci.gpu_check.summary import StepFailed, expect

if TYPE_CHECKING:
    from ci.gpu_check.summary import CheckState

GPU_STEPS = 3


def step(check: CheckState) -> dict[str, Any]:
    """Two launches of the TE trainer (CPU trainer in a dry run); the first saves and loads."""
    from megatron_testkit.megatron_compat import te_status
    from megatron_testkit.ranks import run_ranks

    usable, reason = te_status()
    if check.dry:
        backend, steps, use_te = "gloo", 1, False
    else:
        if not usable:
            raise StepFailed(
                f"needs te: {reason}; the TE steps need Transformer Engine (NGC's PyTorch container ships "
                "it): run the others with --only"
            )
        backend, steps, use_te = "nccl", GPU_STEPS, True
    timeout = min(240, check.remaining())
    runs = [
        run_ranks(
            gpt_rank,
            1,
            backend=backend,
            args=(str(check.out / f"te_checkpoint_{i}"), steps, use_te),
            timeout=timeout,
        )[0]
        for i in (0, 1)
    ]
    first = runs[0]
    figures: dict[str, Any] = {
        "te": reason,
        "use_te": use_te,
        **{k: first[k] for k in ("device", "platform", "peak_key", "peak_bf16_flops", "peak_missing")},
        "param_dtypes": first["param_dtypes"],
        "te_modules": first["te_modules"],
        "losses": [run["losses"] for run in runs],
        "bf16_loss_spread": loss_spread(runs[0]["losses"], runs[1]["losses"]),
        "loss_before_save": first["loss_before_save"],
        "loss_after_load": first["loss_after_load"],
    }
    expect(
        first["loss_after_load"] == first["loss_before_save"],
        f"loss after load {first['loss_after_load']} != before save {first['loss_before_save']}",
    )
    expect(first["flops_after_load"] == first["total_flops"], "FLOPs counter not restored by load")
    if check.dry:
        # fp32 on one machine: the same steps in two processes are bit-identical (measured).
        expect(figures["bf16_loss_spread"] == 0.0, f"two fp32 CPU runs differ: {figures['losses']}")
        expect(not first["te_modules"], f"TE modules on the CPU: {first['te_modules']}")
        return figures
    expect(first["param_dtypes"] == ["torch.bfloat16"], f"parameters are {first['param_dtypes']}, not bf16")
    expect(bool(first["te_modules"]), "use_te=True built no Transformer Engine module")
    expect(first["platform"].endswith("-nccl"), f"the rank named platform {first['platform']}")
    return figures


def loss_spread(a: list[float], b: list[float]) -> float:
    """The largest relative difference of two runs' losses, step by step (0.0 when identical)."""
    if len(a) != len(b) or not a:
        raise StepFailed(f"the two runs logged {len(a)} and {len(b)} losses")
    return max(abs(x - y) / abs(x) for x, y in zip(a, b, strict=True))
