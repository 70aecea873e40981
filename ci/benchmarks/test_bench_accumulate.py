"""A training step's FLOPs counting against the naive `.tolist()` loop, at 8, 512 and 8192 documents.

One step is 8 microbatches of a 1-D int32 cu_seqlens (random lengths, a -1 tail), then
`resolve`. `test_step` times, round by round in one test (the loop first, then each of ours):

- `loop` (the baseline): `.tolist()` and a Python loop per microbatch (documents, tokens, Σs²
  only: it checks nothing), which on a GPU is also a sync per microbatch;
- `host`: `FlopsAccumulator.add_microbatch` on CPU tensors, counted on the host as they come (a
  Python loop for small packs, numpy on the tensor's buffer for larger ones);
- `device_path`: the same step through the device path (`count_on="device"`), here on CPU
  tensors: each microbatch staged by one copy, the step counted by one fixed set of kernels at
  resolve (what a GPU runs, minus the launches);
- `loader`: `add_microbatch(stats=...)` on statistics the data loader made (`seqlen_stats` in the
  collate function, outside the step and so outside the timing).

Each is timed with the process's CPU clock, from the same cache state (`EVICT_BYTES`), with a
fresh accumulator made outside the timing. The medians are recorded with their ratios to the loop
(`extra_info["ratios"]`, what `ci/bench_compare.py` compares run against run; `loop_over_host` is
the loop's time over ours). Round by round, because a shared machine's speed drifts between tests:
timed each in its own test, the same tree's ratios moved by up to 2x from run to run on a 2-core
machine; round by round, by about 10%.

    python -m ci bench -k accumulate --benchmark-timer=time.process_time

`test_kernels_per_microbatch_and_per_step` prints the kernel counts (host path: none; device path
on `meta` tensors: per microbatch and per step) and asserts their structure.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import numpy as np
import pytest
import torch

from accounting import FlopsAccumulator, SeqlenStats, seqlen_stats
from ci.benchmarks.accounting_packs import PACK_LEN, CountKernels, make_pack, syncing_stats

pytestmark = [pytest.mark.L2]

MICROBATCHES = 8
ROUNDS = {8: 400, 512: 200, 8192: 60}
SUBJECTS = ("host", "device_path", "loader")
# Written (untimed) before each timed step: more than a core's L2 cache, so that every variant starts
# with the packs out of it, as in a training step, where the model's work has evicted them. Without
# it each variant inherits the one before it: the loop's 2 MB of Python ints evicted ours, the
# loop started warm, and the order decided a third of the 8192-document ratio.
EVICT_BYTES = 4 << 20


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _packs(docs: int, device: str = "cpu") -> list[torch.Tensor]:
    """A step's microbatches: 8 different 1-D packs of about `docs` documents each."""
    return [make_pack(docs + i, 0).to(device) for i in range(MICROBATCHES)]


def _step(acc: FlopsAccumulator, packs: list[torch.Tensor]):
    for cu in packs:
        acc.add_microbatch(cu_seqlens=cu, seq_len=PACK_LEN)
    return acc.resolve()


def _loader_step(acc: FlopsAccumulator, made: list):
    for stats in made:
        acc.add_microbatch(stats=stats)
    return acc.resolve()


def _loop_step(packs: list[torch.Tensor]) -> tuple[int, int, int]:
    docs = tokens = squared = 0
    for cu in packs:
        d, t, s = syncing_stats(cu)
        docs, tokens, squared = docs + d, tokens + t, squared + s
    return docs, tokens, squared


def _subjects(packs: list[torch.Tensor]) -> dict[str, Callable[[FlopsAccumulator], SeqlenStats]]:
    """Each of our variants' step on a given accumulator (`_fresh(side)`, made outside any timing)."""
    made = [seqlen_stats(cu, pack_len=PACK_LEN) for cu in packs]
    return {
        "host": lambda acc: _step(acc, packs),
        "device_path": lambda acc: _step(acc, packs),
        "loader": lambda acc: _loader_step(acc, made),
    }


def _fresh(side: str) -> FlopsAccumulator:
    return FlopsAccumulator(packed=True, count_on="device" if side == "device_path" else "auto")


@pytest.mark.benchmark
@pytest.mark.parametrize("docs", [8, 512, 8192])
def test_step(benchmark, docs: int) -> None:
    packs = _packs(docs)
    subjects = _subjects(packs)
    clock = time.process_time
    times: dict[str, list[float]] = {side: [] for side in ("loop", *SUBJECTS)}
    scratch = np.zeros(EVICT_BYTES // 8)

    def one_round() -> None:
        scratch.fill(1.0)  # each variant starts from the same cache state (see EVICT_BYTES)
        start = clock()
        _loop_step(packs)
        times["loop"].append(clock() - start)
        for side in SUBJECTS:
            acc = _fresh(side)
            scratch.fill(1.0)
            start = clock()
            subjects[side](acc)
            times[side].append(clock() - start)

    benchmark.group = f"accounting-step-{docs}docs"
    benchmark.pedantic(one_round, rounds=ROUNDS[docs], warmup_rounds=0)
    medians = {side: statistics.median(values[4:]) for side, values in times.items()}  # past a warm-up
    benchmark.extra_info.update(
        docs=docs,
        microbatches=MICROBATCHES,
        **{f"{side}_us": round(value * 1e6, 2) for side, value in medians.items()},
        loop_over_host=round(medians["loop"] / medians["host"], 2),
        ratios={f"{side} / loop": medians[side] / medians["loop"] for side in SUBJECTS},
    )
    assert all(len(values) == ROUNDS[docs] for values in times.values())
    # What each variant counted: the loop's sums, every slot of every pack, nothing malformed.
    expected = _loop_step(packs)
    assert expected[0] == sum(docs + i for i in range(MICROBATCHES))
    for side in SUBJECTS:
        got = subjects[side](_fresh(side)).to_dict()
        assert (got["num_sequences"], got["tokens"], got["squared"]) == expected, side
        assert got["malformed_rows"] == 0 and got["padded_tokens"] == MICROBATCHES * PACK_LEN, side


def _kernels(docs: int, microbatches: int, device: str, count_on: str) -> tuple[int, int]:
    """(kernels of the heaviest add_microbatch, kernels of the resolve) for one step."""
    acc = FlopsAccumulator(packed=True, count_on=count_on, device=device if device == "meta" else None)
    most = 0
    for cu in _packs(docs, device)[:microbatches]:
        with CountKernels() as counter:
            acc.add_microbatch(cu_seqlens=cu, seq_len=PACK_LEN)
        most = max(most, counter.count)
    with CountKernels() as counter:
        acc.resolve()
    return most, counter.count


@pytest.mark.parametrize("docs", [8, 512, 8192])
def test_kernels_per_microbatch_and_per_step(docs: int, capsys) -> None:
    host = _kernels(docs, MICROBATCHES, "cpu", "auto")
    device = {n: _kernels(docs, n, "meta", "device") for n in (1, 4, 8)}
    with capsys.disabled():
        print(
            f"\n{docs} docs: host path {host[0]} kernels per microbatch, {host[1]} per step; device path "
            f"(meta) {device[8][0]} per microbatch, per step {[device[n][1] for n in (1, 4, 8)]} for 1/4/8"
        )
    assert host == (0, 0)
    assert all(per_microbatch <= 2 for per_microbatch, _ in device.values())
    assert len({per_step for _, per_step in device.values()}) == 1
