"""What `TensorInspector` costs per training step: no inspector, an off-step, an inspection step.

A world of one over gloo, the slim megatron-core GPT of the tensor-inspect tests (2 layers, hidden
64, sequence 128, micro batch 1) trained through the shared harness. ``ci/bench_compare.py``
compares each inspector step with the plain step within the group, run against run.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

# The one import of the inspector (it is becoming a package: a one-line change at merge).
from accounting.inspect import TensorInspector

pytestmark = [pytest.mark.L2, pytest.mark.benchmark]

EVERY = 5


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
            yield {"trainer": tr, "inspector": inspector, "batch": batch, "jsonl": Path(tmp) / "stats.jsonl"}
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


@pytest.mark.benchmark(group="inspect-step")
def test_step_without_inspector(benchmark, trainer: dict[str, Any]) -> None:
    benchmark.extra_info["role"] = "baseline"
    benchmark.pedantic(_steps, args=(trainer, None), rounds=15, warmup_rounds=1)


@pytest.mark.benchmark(group="inspect-step")
def test_step_inspector_off_step(benchmark, trainer: dict[str, Any]) -> None:
    benchmark.extra_info["role"] = "subject"
    before = trainer["jsonl"].stat().st_size if trainer["jsonl"].exists() else 0
    benchmark.pedantic(_steps, args=(trainer, EVERY + 1), rounds=15, warmup_rounds=1)
    after = trainer["jsonl"].stat().st_size if trainer["jsonl"].exists() else 0
    assert after == before, "an off-step wrote statistics"


@pytest.mark.benchmark(group="inspect-step")
def test_step_inspector_inspection_step(benchmark, trainer: dict[str, Any]) -> None:
    benchmark.extra_info["role"] = "subject"
    before = trainer["jsonl"].stat().st_size if trainer["jsonl"].exists() else 0
    benchmark.pedantic(_steps, args=(trainer, EVERY), rounds=15, warmup_rounds=1)
    assert trainer["jsonl"].stat().st_size > before, "an inspection step wrote no statistics"
