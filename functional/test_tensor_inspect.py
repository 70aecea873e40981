"""Slim tensor-inspect run: megatron-core GPT on 2 ranks, statistics every 5 steps, checked for real.

Upstream's `test_tensor_inspect` (Megatron-Bridge) was trimmed because the shared L0 job ran out
of memory, and it only checked that training finished. This one keeps the slim configuration
(1-2 layers, hidden 64-128, sequence 128, global batch 2, 10 iterations, inspection every 5 steps,
no distributed optimizer, no overlap, synchronous checkpoint) and asserts what the inspector wrote:

- statistics exist for exactly the `.*(fc1|fc2)` layers, the three tensors, and steps 5 and 10,
  in each rank's JSON lines file and in rank 0's TensorBoard events (read back);
- every value equals the statistic recomputed with numpy from the tensor the test captured with
  its own hooks at that step (not the inspector's);
- the gradient statistics are non-zero;
- each rank's peak RSS stays inside the stated budget (the plugin's watchdog also enforces it).

The off-step cost is measured, not asserted: each rank then trains 20 more steps alternating
plain steps and the inspector's non-inspection steps, and the test prints both medians against
the stated bound (`OFF_STEP_TARGET`). `ci/bench_inspect.py` gives steadier figures.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from fixtures.ranks import run_ranks
from fixtures.tensorboard import read_scalars
from unit.test_inspect import reference_stats  # numpy float64, independent of the inspector

LAYERS = r".*(fc1|fc2)"
TENSORS = ("activation", "weight", "gradient")
STEPS = 10
EVERY = 5
NUM_LAYERS = 2
SEQ = 128
# Measured peak ~400-480 MiB per rank on the 2-core CPU runner; upstream's failure was memory.
HOST_BUDGET = "768MiB"
HOST_BUDGET_BYTES = 768 * 1024**2
NEVER_INSPECTED = 1  # a step number that is not a multiple of EVERY
# The stated bound for the cost of a non-inspection step over a plain one (reported, not asserted:
# wall time on a shared machine is a figure, not a pass/fail criterion).
OFF_STEP_TARGET = 0.05
# nvdlfw-inspect's layer names: root `model`, the trainer's model list walked chunk by chunk, the
# DDP wrapper's `module`, decoder layers by their 1-based megatron `layer_number`.
EXPECTED_LAYERS = sorted(
    f"model.module.decoder.layers.{n}.mlp.linear_{fc}"
    for n in range(1, NUM_LAYERS + 1)
    for fc in ("fc1", "fc2")
)


class IndependentCapture:
    """The test's own hooks on each decoder layer's fc1/fc2, found by walking megatron's modules."""

    def __init__(self, ddp_model: Any) -> None:
        self.tensors: dict[tuple[str, str], np.ndarray] = {}
        self.handles = []
        for layer in ddp_model.module.decoder.layers:
            for fc in ("fc1", "fc2"):
                name = f"model.module.decoder.layers.{layer.layer_number}.mlp.linear_{fc}"
                module = getattr(layer.mlp, f"linear_{fc}")
                self.handles.append(module.register_forward_hook(self._hook(name)))

    def _hook(self, name: str):
        def hook(module, args, output):
            out = output[0] if isinstance(output, tuple) else output
            self.tensors[(name, "activation")] = args[0].detach().cpu().numpy().copy()
            self.tensors[(name, "weight")] = module.weight.detach().cpu().numpy().copy()

            def grad_hook(g):
                self.tensors[(name, "gradient")] = g.detach().cpu().numpy().copy()

            out.register_hook(grad_hook)

        return hook

    def close(self) -> None:
        for h in self.handles:
            h.remove()


def _batch(step: int, dp_rank: int, vocab: int):
    import torch

    from fixtures.training import DenseBatch

    gen = torch.Generator().manual_seed(10_000 * step + dp_rank)
    tokens = torch.randint(0, vocab, (1, SEQ + 1), generator=gen)
    return DenseBatch(tokens=tokens[:, :-1], labels=tokens[:, 1:], loss_mask=torch.ones(1, SEQ))


def tensor_inspect_rank(rank: int, world_size: int, out: str) -> dict:
    """Train 10 steps with the inspector (and the test's own capture on steps 5 and 10), then 10
    without it for the overhead figure, then save a synchronous checkpoint."""
    from megatron.core import parallel_state as ps

    from accounting.inspector import TensorInspector
    from fixtures.megatron import cpu_shim, destroy_model_parallel
    from fixtures.rank_worker import peak_rss_bytes  # VmHWM: this rank's own high-water mark
    from fixtures.training import ModelConfig, ParallelConfig, TrainConfig, Trainer

    out_dir = Path(out)
    model_config = ModelConfig(
        num_layers=NUM_LAYERS, hidden_size=64, ffn_hidden_size=192, max_sequence_length=SEQ
    )
    with cpu_shim():
        trainer = Trainer(model_config, ParallelConfig(), TrainConfig(packed=False))
        dp_rank = ps.get_data_parallel_rank()
        writer = None
        if rank == 0:
            from torch.utils.tensorboard import SummaryWriter

            writer = SummaryWriter(str(out_dir / "tb"))
        inspector = TensorInspector(
            trainer.model,
            layers=LAYERS,
            tensors=TENSORS,
            every=EVERY,
            writer=writer,
            jsonl_path=out_dir / f"stats_rank{rank}.jsonl",
        )
        references: list[dict] = []
        with_inspector: dict[int, float] = {}
        for step in range(1, STEPS + 1):
            capture = IndependentCapture(trainer.model[0]) if step % EVERY == 0 else None
            start = time.perf_counter()
            with inspector.step(step):
                trainer.train_step([_batch(step, dp_rank, model_config.vocab_size)])
            with_inspector[step] = time.perf_counter() - start
            if capture is not None:
                capture.close()
                for (layer, tensor), array in capture.tensors.items():
                    references.append(
                        {"step": step, "layer": layer, "tensor": tensor, **reference_stats(array)}
                    )
        # The overhead figure: plain steps and the inspector's non-inspection steps interleaved
        # (same data, same machine load), so the comparison is not skewed by load drift.
        without: dict[int, float] = {}
        off_step: dict[int, float] = {}
        for step in range(STEPS + 1, 3 * STEPS + 1):
            batch = [_batch(step, dp_rank, model_config.vocab_size)]
            start = time.perf_counter()
            if step % 2:
                trainer.train_step(batch)
                without[step] = time.perf_counter() - start
            else:
                with inspector.step(NEVER_INSPECTED):
                    trainer.train_step(batch)
                off_step[step] = time.perf_counter() - start
        inspector.close()
        if writer is not None:
            writer.close()
        checkpoint = trainer.save(out_dir / "ckpt")
        trainer.close()
        peak = peak_rss_bytes()
        destroy_model_parallel()
    return {
        "rank": rank,
        "references": references,
        "with_inspector": with_inspector,
        "without": without,
        "off_step": off_step,
        "checkpoint": str(checkpoint),
        "peak_rss_bytes": peak,
        "hooks_left": inspector.hooks_attached,
    }


def _close(got: float, want: float) -> bool:
    return got == pytest.approx(want, rel=1e-5, abs=1e-7)


@pytest.mark.L0
@pytest.mark.world_size(2)
@pytest.mark.memory_budget(host=HOST_BUDGET)
def test_slim_tensor_inspect_records_exact_stats_on_steps_5_and_10(tmp_path: Path) -> None:
    results = run_ranks(tensor_inspect_rank, 2, args=(str(tmp_path),))
    stats = ("min", "max", "mean", "std", "l1_norm", "l2_norm", "nan_count", "inf_count")
    expected_keys = {(s, layer, t) for s in (5, 10) for layer in EXPECTED_LAYERS for t in TENSORS}
    for res in results:
        rank = res["rank"]
        records = [json.loads(x) for x in (tmp_path / f"stats_rank{rank}.jsonl").read_text().splitlines()]
        got = {(r["step"], r["layer"], r["tensor"]): r for r in records}
        assert len(got) == len(records) and set(got) == expected_keys, rank
        refs = {(r["step"], r["layer"], r["tensor"]): r for r in res["references"]}
        assert set(refs) == expected_keys, "the test's own capture saw other layers/steps"
        for key, want in refs.items():
            for stat in stats:
                if stat.endswith("_count"):
                    assert got[key][stat] == want[stat] == 0, (rank, key, stat)
                else:
                    assert _close(got[key][stat], want[stat]), (rank, key, stat, got[key][stat], want[stat])
            if key[2] == "gradient":
                assert got[key]["l2_norm"] > 0 and got[key]["max"] > got[key]["min"], (rank, key)
        assert not res["hooks_left"]
        assert res["peak_rss_bytes"] < HOST_BUDGET_BYTES
        assert (Path(res["checkpoint"]) / "metadata.json").exists()

    tb = {tag: dict(events) for tag, events in read_scalars(tmp_path / "tb").items()}
    rank0 = {
        (r["step"], r["layer"], r["tensor"]): r
        for r in map(json.loads, (tmp_path / "stats_rank0.jsonl").open())
    }
    assert set(tb) == {
        f"inspect/{layer}/{t}/{s}" for layer in EXPECTED_LAYERS for t in TENSORS for s in stats
    }
    for (step, layer, tensor), rec in rank0.items():
        for stat in stats:
            assert tb[f"inspect/{layer}/{tensor}/{stat}"][step] == float(np.float32(rec[stat]))
        assert set(tb[f"inspect/{layer}/{tensor}/min"]) == {5, 10}

    _report_overhead(results)


def _report_overhead(results: list[dict]) -> None:
    """Median step times: the inspector's off-steps vs plain steps, interleaved (measured, not asserted)."""
    for res in results:
        on = {int(k): v for k, v in res["with_inspector"].items()}
        inspect_steps = [v for s, v in on.items() if s % EVERY == 0]
        first_off = [v for s, v in on.items() if s % EVERY != 0 and s > 1]  # step 1 warms up
        plain = statistics.median(res["without"].values())
        off = statistics.median(res["off_step"].values())
        print(
            f"[tensor_inspect] rank {res['rank']}: off-step {off * 1e3:.1f} ms vs plain {plain * 1e3:.1f} ms"
            f" ({off / plain - 1:+.1%}, stated bound {OFF_STEP_TARGET:.0%}; interleaved medians of 10);"
            f" off-steps of the first 10 steps {statistics.median(first_off) * 1e3:.1f} ms;"
            f" inspection steps (with the test's own capture) {[round(v * 1e3, 1) for v in inspect_steps]} ms;"
            f" peak RSS {res['peak_rss_bytes'] / 2**20:.0f} MiB (budget {HOST_BUDGET})"
        )
