"""A training step's FLOPs counting against the naive `.tolist()` loop, at 8, 512 and 8192 documents.

One step is 8 microbatches of a 1-D int32 cu_seqlens (random lengths, a -1 tail), then
`resolve`. In each group, side by side in one run:

- `step_host` (subject): `FlopsAccumulator.add_microbatch` on CPU tensors, counted on the host as
  they come (a Python loop for small packs, numpy on the tensor's buffer for larger ones);
- `step_device_path` (subject): the same step through the device path (`count_on="device"`),
  here on CPU tensors: each microbatch staged by one copy, the step counted by one fixed set of
  kernels at resolve (what a GPU runs, minus the launches);
- `step_loop` (baseline): `.tolist()` and a Python loop per microbatch (documents, tokens, Σs²
  only: it checks nothing), which on a GPU is also a sync per microbatch.

`ci/bench_compare.py` compares subject/baseline medians run against run. Those groups time each
variant in its own test, one after the other; a machine whose speed drifts between tests (a
shared runner) moves their ratio. `test_step_interleaved` times ours and the loop alternately,
round by round, in one test, and records their medians and ratios (`loop_over_host`, and
`loop_over_loader` for statistics made in the data loader): the figures to quote. On a loaded machine use a CPU-time timer, and read medians:

    python -m pytest ci/benchmarks/test_bench_accumulate.py --benchmark-only \\
        --benchmark-timer=time.process_time --benchmark-columns=median,iqr,rounds -p no:cacheprovider

`test_kernels_per_microbatch_and_per_step` prints the kernel counts (host path: none; device path
on `meta` tensors: per microbatch and per step) and asserts their structure.
"""

from __future__ import annotations

import statistics
import time

import pytest
import torch

from accounting import FlopsAccumulator, seqlen_stats
from ci.benchmarks.accounting_packs import PACK_LEN, CountKernels, make_pack, syncing_stats

pytestmark = [pytest.mark.L2]

MICROBATCHES = 8
ROUNDS = {8: 400, 512: 200, 8192: 50}


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


def _loop_step(packs: list[torch.Tensor]) -> tuple[int, int, int]:
    docs = tokens = squared = 0
    for cu in packs:
        d, t, s = syncing_stats(cu)
        docs, tokens, squared = docs + d, tokens + t, squared + s
    return docs, tokens, squared


def _bench_step(benchmark, docs: int, count_on: str):
    packs = _packs(docs)
    benchmark.group = f"accounting-step-{docs}docs"
    benchmark.extra_info.update(role="subject", docs=docs, microbatches=MICROBATCHES, count_on=count_on)
    # A fresh accumulator per round (not timed): each round is one step from its first microbatch.
    stats = benchmark.pedantic(
        _step,
        setup=lambda: ((FlopsAccumulator(packed=True, count_on=count_on), packs), {}),
        rounds=ROUNDS[docs],
        warmup_rounds=2,
    )
    got = stats.to_dict()
    assert (got["num_sequences"], got["tokens"], got["squared"]) == _loop_step(packs)
    assert got["malformed_rows"] == 0 and got["padded_tokens"] == MICROBATCHES * PACK_LEN


@pytest.mark.benchmark
@pytest.mark.parametrize("docs", [8, 512, 8192])
def test_step_host(benchmark, docs: int) -> None:
    _bench_step(benchmark, docs, "auto")


@pytest.mark.benchmark
@pytest.mark.parametrize("docs", [8, 512, 8192])
def test_step_device_path(benchmark, docs: int) -> None:
    _bench_step(benchmark, docs, "device")


@pytest.mark.benchmark
@pytest.mark.parametrize("docs", [8, 512, 8192])
def test_step_loop(benchmark, docs: int) -> None:
    packs = _packs(docs)
    benchmark.group = f"accounting-step-{docs}docs"
    benchmark.extra_info.update(role="baseline", docs=docs, microbatches=MICROBATCHES)
    docs_seen, _tokens, _squared = benchmark.pedantic(
        _loop_step, args=(packs,), rounds=ROUNDS[docs], warmup_rounds=2
    )
    assert docs_seen == sum(docs + i for i in range(MICROBATCHES))


@pytest.mark.benchmark
@pytest.mark.parametrize("docs", [8, 512, 8192])
def test_step_interleaved(benchmark, docs: int) -> None:
    # One round = one step each of: ours on the boundaries (`host`), ours on statistics the data
    # loader made (`loader`: `seqlen_stats` in the collate function, outside the step, so outside
    # the timing), and the loop; in rotating order, each timed with the process's CPU clock, a fresh
    # accumulator made outside the timing.
    packs = _packs(docs)
    made = [seqlen_stats(cu, pack_len=PACK_LEN) for cu in packs]
    times: dict[str, list[float]] = {"host": [], "loader": [], "loop": []}
    clock = time.process_time

    def host() -> None:
        acc = FlopsAccumulator(packed=True)
        start = clock()
        _step(acc, packs)
        times["host"].append(clock() - start)

    def loader() -> None:
        acc = FlopsAccumulator(packed=True)
        start = clock()
        for stats in made:
            acc.add_microbatch(stats=stats)
        acc.resolve()
        times["loader"].append(clock() - start)

    def loop() -> None:
        start = clock()
        _loop_step(packs)
        times["loop"].append(clock() - start)

    sides = (host, loader, loop)

    def one_round() -> None:
        first = len(times["loop"]) % len(sides)
        for side in sides[first:] + sides[:first]:
            side()

    benchmark.group = f"accounting-step-{docs}docs-interleaved"
    benchmark.pedantic(one_round, rounds=ROUNDS[docs], warmup_rounds=0)
    medians = {side: statistics.median(times[side][4:]) for side in times}  # past a warm-up
    benchmark.extra_info.update(
        docs=docs,
        microbatches=MICROBATCHES,
        **{f"{side}_us": round(value * 1e6, 2) for side, value in medians.items()},
        loop_over_host=round(medians["loop"] / medians["host"], 2),
        loop_over_loader=round(medians["loop"] / medians["loader"], 2),
    )
    assert all(len(times[side]) == ROUNDS[docs] for side in times)


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
