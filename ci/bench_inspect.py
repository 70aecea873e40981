"""Measure what `TensorInspector` costs per training step: off-step, inspection step, none at all.

Single process (a world of one over gloo), the slim tensor-inspect model of
`functional/test_tensor_inspect.py` (megatron-core GPT, 2 layers, hidden 64, sequence 128,
micro batch 1), trained through the shared harness. The three kinds of step are interleaved
round by round (plain, inspector off-step, inspector inspection step, in a rotating order) so
that drift in machine load and order effects hit all three alike; medians are reported, of wall
time and of the process's CPU time (steadier on a shared machine: other processes' load does not
count). `inspector_off_step_call_us` times the inspector's own work on an off-step
(`begin_step` + `end_step`, no training) directly. Nothing is asserted: this is a figure for
people, printed and optionally written as JSON.

    python -m ci.bench_inspect [--rounds 30] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path


def measure(rounds: int) -> dict[str, float]:
    """Median seconds per step for each kind of step, and the relative overheads."""
    import torch
    import torch.distributed as dist

    from accounting.inspector import TensorInspector
    from fixtures.megatron import cpu_shim, destroy_model_parallel
    from fixtures.training import DenseBatch, ModelConfig, ParallelConfig, TrainConfig, Trainer

    torch.set_num_threads(1)
    store_dir = tempfile.mkdtemp(prefix="bench_inspect_")
    dist.init_process_group(
        "gloo", store=dist.FileStore(os.path.join(store_dir, "store"), 1), rank=0, world_size=1
    )
    model_config = ModelConfig(num_layers=2, hidden_size=64, ffn_hidden_size=192, max_sequence_length=128)
    times: dict[str, list[float]] = {"plain": [], "off_step": [], "inspection_step": []}
    cpu: dict[str, list[float]] = {k: [] for k in times}
    gen = torch.Generator().manual_seed(0)
    try:
        with cpu_shim():
            trainer = Trainer(model_config, ParallelConfig(), TrainConfig(packed=False))
            inspector = TensorInspector(
                trainer.model, every=5, jsonl_path=Path(store_dir) / "stats.jsonl", rank=0
            )

            def batch() -> list[DenseBatch]:
                tokens = torch.randint(0, model_config.vocab_size, (1, 129), generator=gen)
                return [DenseBatch(tokens[:, :-1], tokens[:, 1:], torch.ones(1, 128))]

            for _ in range(3):  # warm-up
                trainer.train_step(batch())
            for r in range(rounds):
                kinds = [("plain", None), ("off_step", 5 * r + 1), ("inspection_step", 5 * r + 5)]
                # Rotate the order each round so that no kind always runs first (cache, allocator).
                for kind, step in kinds[r % 3 :] + kinds[: r % 3]:
                    data = batch()
                    start, start_cpu = time.perf_counter(), time.process_time()
                    if step is None:
                        trainer.train_step(data)
                    else:
                        with inspector.step(step):
                            trainer.train_step(data)
                    times[kind].append(time.perf_counter() - start)
                    cpu[kind].append(time.process_time() - start_cpu)
            off_call = _off_step_call_seconds(inspector)
            inspector.close()
            trainer.close()
            destroy_model_parallel()
    finally:
        dist.destroy_process_group()
    med = {k: statistics.median(v) for k, v in times.items()}
    med_cpu = {k: statistics.median(v) for k, v in cpu.items()}
    return {
        **{f"median_{k}_ms": v * 1e3 for k, v in med.items()},
        "off_step_overhead": med["off_step"] / med["plain"] - 1,
        "inspection_step_overhead": med["inspection_step"] / med["plain"] - 1,
        **{f"median_{k}_cpu_ms": v * 1e3 for k, v in med_cpu.items()},
        "off_step_cpu_overhead": med_cpu["off_step"] / med_cpu["plain"] - 1,
        "inspection_step_cpu_overhead": med_cpu["inspection_step"] / med_cpu["plain"] - 1,
        "inspector_off_step_call_us": off_call * 1e6,
        "rounds": rounds,
    }


def _off_step_call_seconds(inspector, calls: int = 20_000, repeats: int = 5) -> float:
    """Median over `repeats` of the mean time of one off-step `begin_step` + `end_step` pair."""
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        for step in range(1, calls + 1):
            if step % 5 == 0:
                step += 1  # never an inspection step (every=5)
            inspector.begin_step(step)
            inspector.end_step()
        samples.append((time.perf_counter() - start) / calls)
    return statistics.median(samples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    result = measure(args.rounds)
    print(json.dumps(result, indent=2))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
