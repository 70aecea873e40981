"""What `TensorInspector` costs per training step: no inspector, an off-step, an inspection step.

A world of one over gloo, the slim megatron-core GPT of the tensor-inspect tests (2 layers, hidden
64, sequence 128, micro batch 1) trained through the shared harness. `test_step` runs the three
kinds of step round by round (a plain step, an off-step, an inspection step, then again), each
timed in process CPU time (other processes' load does not count; the steps run on one thread) and
wall time. It records the medians and each inspector step's ratio to the plain step in CPU time
(`extra_info["ratios"]`, what `python -m ci bench` compares run against run; the overhead is the
ratio minus one). Round by round, because timed in separate tests the same tree's ratios moved by
up to 37% from run to run on a 2-core machine. `test_inspector_off_step_call` times the
inspector's own work on an off-step (``begin_step`` + ``end_step``, no training) directly.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from accounting.inspector import TensorInspector

pytestmark = [pytest.mark.L2, pytest.mark.benchmark]

EVERY = 5
ROUNDS = 20  # of the three kinds of step, about 70 ms a round


@pytest.fixture(scope="module")
def trainer(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """A 1-rank gloo group, the slim model's trainer and an inspector on it (torn down after)."""
    import torch.distributed as dist

    from fixtures.megatron import cpu_shim, destroy_model_parallel
    from fixtures.training import DenseBatch, ModelConfig, ParallelConfig, TrainConfig, Trainer

    tmp = tmp_path_factory.mktemp("bench-inspect")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(os.fspath(tmp / "store"), 1), rank=0, world_size=1)
    config = ModelConfig(num_layers=2, hidden_size=64, ffn_hidden_size=192, max_sequence_length=128)
    gen = torch.Generator().manual_seed(0)

    def batch() -> list[Any]:
        tokens = torch.randint(0, config.vocab_size, (1, 129), generator=gen)
        return [DenseBatch(tokens[:, :-1], tokens[:, 1:], torch.ones(1, 128))]

    try:
        with cpu_shim():
            tr = Trainer(config, ParallelConfig(), TrainConfig(packed=False))
            inspector = TensorInspector(tr.model, every=EVERY, jsonl_path=Path(tmp) / "stats.jsonl", rank=0)
            for _ in range(3):  # warm-up
                tr.train_step(batch())
            yield {
                "trainer": tr,
                "inspector": inspector,
                "batch": batch,
                "jsonl": Path(tmp) / "stats.jsonl",
            }
            inspector.close()
            tr.close()
            destroy_model_parallel()
    finally:
        dist.destroy_process_group()
        torch.set_num_threads(threads)


def _steps(trainer: dict[str, Any], step: int | None) -> Any:
    """One training step, inside ``inspector.step(step)`` unless ``step`` is None."""
    tr, inspector, batch = trainer["trainer"], trainer["inspector"], trainer["batch"]
    data = batch()
    if step is None:
        return tr.train_step(data)
    with inspector.step(step):
        return tr.train_step(data)


def _size(path: Path) -> int:
    return path.stat().st_size if path.exists() else 0


@pytest.mark.benchmark(group="inspect-step")
def test_step(benchmark, trainer: dict[str, Any]) -> None:
    kinds = {"plain": None, "off_step": EVERY + 1, "inspection_step": EVERY}
    cpu: dict[str, list[float]] = {kind: [] for kind in kinds}
    wall: dict[str, list[float]] = {kind: [] for kind in kinds}
    wrote: dict[str, list[int]] = {kind: [] for kind in kinds}

    def one_round() -> None:
        for kind, step in kinds.items():
            before = _size(trainer["jsonl"])
            start_cpu, start_wall = time.process_time(), time.perf_counter()
            _steps(trainer, step)
            cpu[kind].append(time.process_time() - start_cpu)
            wall[kind].append(time.perf_counter() - start_wall)
            wrote[kind].append(_size(trainer["jsonl"]) - before)

    benchmark.pedantic(one_round, rounds=ROUNDS, warmup_rounds=1)
    cpu_ms = {kind: statistics.median(values[1:]) * 1e3 for kind, values in cpu.items()}  # past the warm-up
    benchmark.extra_info.update(
        {f"{kind}_median_cpu_ms": round(value, 3) for kind, value in cpu_ms.items()},
        **{
            f"{kind}_median_wall_ms": round(statistics.median(values[1:]) * 1e3, 3)
            for kind, values in wall.items()
        },
        ratios={
            f"{kind} / plain": cpu_ms[kind] / cpu_ms["plain"] for kind in ("off_step", "inspection_step")
        },
    )
    assert not any(wrote["plain"]) and not any(wrote["off_step"]), (
        "a step without an inspection wrote statistics"
    )
    assert all(size > 0 for size in wrote["inspection_step"]), "an inspection step wrote no statistics"


@pytest.mark.benchmark(group="inspect-call")
def test_inspector_off_step_call(benchmark, trainer: dict[str, Any]) -> None:
    """One off-step ``begin_step`` + ``end_step`` pair, no training: the inspector's own cost per step."""
    inspector = trainer["inspector"]
    before = trainer["jsonl"].stat().st_size if trainer["jsonl"].exists() else 0

    def off_step_call() -> None:
        inspector.begin_step(EVERY + 1)  # never an inspection step (every=EVERY)
        inspector.end_step()

    benchmark(off_step_call)
    after = trainer["jsonl"].stat().st_size if trainer["jsonl"].exists() else 0
    assert after == before, "an off-step call wrote statistics"
