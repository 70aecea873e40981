"""What `TensorInspector` costs per training step: no inspector, an off-step, an inspection step.

A world of one over gloo, the slim megatron-core GPT of the tensor-inspect tests (2 layers, hidden
64, sequence 128, micro batch 1) trained through the shared harness. `python -m ci bench` prints
each inspector step's ratio to the plain step (its wall-time overhead is the ratio minus one) and
compares it run against run. Each step also records its median process CPU time (steadier on a
shared machine: other processes' load does not count) and, once the plain step has run, its CPU
overhead, in ``extra_info``; `test_inspector_off_step_call` times the inspector's own work on an
off-step (``begin_step`` + ``end_step``, no training) directly.
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
                "cpu_ms": {},  # each kind of step's median CPU time, filled in as the benchmarks run
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


def _measure(benchmark: Any, trainer: dict[str, Any], kind: str, step: int | None) -> None:
    """15 rounds of one kind of step (after one warm-up), their median CPU time recorded beside the wall time."""
    cpu: list[float] = []

    def timed() -> Any:
        start = time.process_time()
        result = _steps(trainer, step)
        cpu.append(time.process_time() - start)
        return result

    benchmark.pedantic(timed, rounds=15, warmup_rounds=1)
    median_ms = statistics.median(cpu[1:]) * 1e3  # the first call is the warm-up round
    trainer["cpu_ms"][kind] = median_ms
    benchmark.extra_info["median_cpu_ms"] = median_ms
    plain = trainer["cpu_ms"].get("plain")
    if plain and kind != "plain":
        benchmark.extra_info["cpu_overhead"] = median_ms / plain - 1


@pytest.mark.benchmark(group="inspect-step")
def test_step_without_inspector(benchmark, trainer: dict[str, Any]) -> None:
    benchmark.extra_info["role"] = "baseline"
    _measure(benchmark, trainer, "plain", None)


@pytest.mark.benchmark(group="inspect-step")
def test_step_inspector_off_step(benchmark, trainer: dict[str, Any]) -> None:
    benchmark.extra_info["role"] = "subject"
    before = trainer["jsonl"].stat().st_size if trainer["jsonl"].exists() else 0
    _measure(benchmark, trainer, "off_step", EVERY + 1)
    after = trainer["jsonl"].stat().st_size if trainer["jsonl"].exists() else 0
    assert after == before, "an off-step wrote statistics"


@pytest.mark.benchmark(group="inspect-step")
def test_step_inspector_inspection_step(benchmark, trainer: dict[str, Any]) -> None:
    benchmark.extra_info["role"] = "subject"
    before = trainer["jsonl"].stat().st_size if trainer["jsonl"].exists() else 0
    _measure(benchmark, trainer, "inspection_step", EVERY)
    assert trainer["jsonl"].stat().st_size > before, "an inspection step wrote no statistics"


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
