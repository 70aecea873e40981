"""Warm starts: `run_ranks` warm, `run_ranks` cold and a bare fork from a warm parent, side by side.

Round by round (the order rotated every round), the same work three ways: `run_ranks` forking its
ranks from the warm parent (`megatron_testkit.warm_start`), `run_ranks` spawning them
(``KIT_WARM_START=0``), and the floor: a process that imported torch once and forks the ranks
itself, with nothing of the kit around them. Two works, each on 2 ranks with a gloo process group
on a FileStore: one all_reduce, and a TP=2 megatron-core GPT built and run forward (its warm parent
preloads megatron-core too; so does the bare fork's). ``extra_info`` holds each way's median wall time (seconds) and the
ratios ``run_ranks warm / bare fork`` and ``run_ranks cold / bare fork``, which `python -m ci
bench` prints and compares run against run, and ``warm_speedup`` (cold / warm).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time

import pytest

from megatron_testkit import skips, warm_start
from megatron_testkit.ranks import run_ranks

pytestmark = [pytest.mark.L2]

ROUNDS = int(os.environ.get("KIT_BENCH_LAUNCH_ROUNDS", "5"))


def all_reduce_rank(rank: int, world_size: int) -> float:
    import torch
    import torch.distributed as dist

    t = torch.ones(1)
    dist.all_reduce(t)
    return float(t)


def gpt_forward_rank(rank: int, world_size: int) -> tuple[int, ...]:
    """A TP=2 megatron-core GPT (2 layers, hidden 32) built and run forward on one batch."""
    import torch
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_testkit.megatron_compat import gpt_layer_spec
    from megatron_testkit.megatron_cpu import cpu_shim, destroy_model_parallel, init_model_parallel

    with cpu_shim():
        init_model_parallel(tensor_model_parallel_size=2)
        config = TransformerConfig(
            num_layers=2,
            hidden_size=32,
            num_attention_heads=4,
            normalization="RMSNorm",
            tensor_model_parallel_size=2,
            hidden_dropout=0.0,
            attention_dropout=0.0,
            use_cpu_initialization=True,
        )
        model = GPTModel(
            config=config, transformer_layer_spec=gpt_layer_spec(), vocab_size=64, max_sequence_length=16
        )
        inputs = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
        positions = torch.arange(16).expand(2, 16)
        with torch.no_grad():
            logits = model(inputs, positions, None)
        destroy_model_parallel()
    return tuple(logits.shape)  # each TP rank holds its half of the vocabulary's logits


# The floor: import torch (and megatron-core) once, then per round fork 2 ranks that each init gloo
# on a FileStore, run the function and leave; the parent waits for both. Prints each round's wall
# time (seconds). argv: rounds, module, function, preload (comma-separated).
BARE_FORK = """
import importlib, json, os, sys, tempfile, time
from datetime import timedelta
rounds, module, name, preload, world = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4], 2
for m in preload.split(","):
    importlib.import_module(m)
import torch.distributed as dist
fn = getattr(importlib.import_module(module), name)
times = []
for _ in range(rounds):
    folder = tempfile.mkdtemp()
    start = time.perf_counter()
    pids = []
    for rank in range(world):
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                store = dist.FileStore(os.path.join(folder, "store"), world)
                dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=120))
                fn(rank, world)
                dist.barrier()
                dist.destroy_process_group()
                code = 0
            finally:
                os._exit(code)
        pids.append(pid)
    codes = [os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) for pid in pids]
    times.append(time.perf_counter() - start)
    assert codes == [0] * world, codes
print(json.dumps(times))
"""


def _bare_fork_times(rounds: int, fn, preload: tuple[str, ...]) -> list[float]:
    env = {**os.environ, **warm_start.PARENT_ENV}
    command = [sys.executable, "-c", BARE_FORK, str(rounds), fn.__module__, fn.__name__, ",".join(preload)]
    out = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def _timed(fn, *args) -> float:
    start = time.perf_counter()
    fn(*args)
    return time.perf_counter() - start


def _side_by_side(
    benchmark, monkeypatch: pytest.MonkeyPatch, fn, preload: tuple[str, ...], what: str
) -> None:
    """Time run_ranks warm and cold round by round, then the bare fork; record and print them."""

    def launch(cold: bool) -> None:
        with monkeypatch.context() as m:
            if cold:
                m.setenv("KIT_WARM_START", "0")
            assert len(run_ranks(fn, 2, timeout=600)) == 2

    warm_start.parent_for(preload)  # the warm parent is up (its imports done) before anything is timed
    launch(cold=False)
    times: dict[str, list[float]] = {"warm": [], "cold": []}

    def one_round() -> None:
        order = ["warm", "cold"] if len(times["warm"]) % 2 == 0 else ["cold", "warm"]
        for name in order:
            times[name].append(_timed(launch, name == "cold"))

    benchmark.pedantic(one_round, rounds=ROUNDS, iterations=1)
    bare = _bare_fork_times(ROUNDS, fn, preload)
    medians = {
        "run_ranks warm": statistics.median(times["warm"]),
        "run_ranks cold": statistics.median(times["cold"]),
        "bare fork": statistics.median(bare),
    }
    benchmark.extra_info["median_s"] = {k: round(v, 4) for k, v in medians.items()}
    benchmark.extra_info["ratios"] = {
        "run_ranks warm / bare fork": round(medians["run_ranks warm"] / medians["bare fork"], 3),
        "run_ranks cold / bare fork": round(medians["run_ranks cold"] / medians["bare fork"], 3),
    }
    # Higher is better here, so it is a figure, not a ratio compared run against run.
    benchmark.extra_info["warm_speedup"] = round(medians["run_ranks cold"] / medians["run_ranks warm"], 2)
    benchmark.extra_info["cpu_count"] = os.cpu_count()
    benchmark.extra_info["load_1m"] = round(os.getloadavg()[0], 2)
    print(
        f"\n{what} (median s of {ROUNDS}): "
        + ", ".join(f"{k} {v:.3f}" for k, v in medians.items())
        + "; "
        + ", ".join(f"{k} {v}x" for k, v in benchmark.extra_info["ratios"].items())
        + f"; cold / warm {benchmark.extra_info['warm_speedup']}x; load {benchmark.extra_info['load_1m']}"
    )


def test_warm_start_two_rank_all_reduce(benchmark, monkeypatch: pytest.MonkeyPatch) -> None:
    """2 ranks, one gloo all_reduce: run_ranks warm, run_ranks cold, a bare fork from a warm parent."""
    _side_by_side(benchmark, monkeypatch, all_reduce_rank, warm_start.BASE_PRELOAD, "2 ranks, one all_reduce")


def test_warm_start_tp2_gpt_forward(benchmark, monkeypatch: pytest.MonkeyPatch) -> None:
    """A TP=2 megatron-core GPT built and run forward: the warm parent preloads megatron-core, as the
    function's module imports it (`warm_start.imports_megatron`)."""
    skips.importorskip("megatron.core", "megatron")
    preload = (*warm_start.BASE_PRELOAD, warm_start.MEGATRON_PRELOAD)
    _side_by_side(benchmark, monkeypatch, gpt_forward_rank, preload, "TP=2 GPT forward")
