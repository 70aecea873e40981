"""`FlopsAccumulator.add_microbatch` against a syncing ``.tolist()`` loop, at 8/512/8192 documents.

Each pack is a 2-D ``[4, docs + 3]`` int32 cu_seqlens with a -1 tail. Ours runs a fixed number of
vectorised kernels whatever the number of documents; the loop reads the boundaries back (a host
sync on a GPU) and walks them in Python. One group per size: ``ci/bench_compare.py`` compares
ours/loop within the group, run against run. The loop is also the oracle: both must agree.
"""

from __future__ import annotations

import pytest
import torch

from accounting import FlopsAccumulator

pytestmark = [pytest.mark.L2]

ROWS = 4
PACK_LEN = 8192 * 8


def syncing_stats(cu_seqlens: torch.Tensor) -> tuple[int, int, int]:
    """The straightforward version: documents, tokens, sum of squared lengths, by a Python loop."""
    tokens = squared = docs = 0
    for row in cu_seqlens.tolist():
        last = 0
        for value in row[1:]:
            if value < 0:
                break
            length = value - last
            tokens, squared, docs = tokens + length, squared + length * length, docs + (length > 0)
            last = value
    return docs, tokens, squared


def make_pack(docs: int) -> torch.Tensor:
    """``ROWS`` rows of ``docs`` random-length documents each, plus a -1 tail of 2 entries."""
    gen = torch.Generator().manual_seed(docs)
    lengths = torch.randint(1, max(2, PACK_LEN // docs), (ROWS, docs), generator=gen)
    cu = torch.cat([torch.zeros(ROWS, 1, dtype=torch.int64), lengths.cumsum(-1)], dim=-1)
    return torch.cat([cu, torch.full((ROWS, 2), -1, dtype=torch.int64)], dim=-1).to(torch.int32)


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.benchmark
@pytest.mark.parametrize("docs", [8, 512, 8192])
def test_accumulate_ours(benchmark, docs: int) -> None:
    cu = make_pack(docs)
    acc = FlopsAccumulator(packed=True)
    benchmark.group = f"accumulate-{docs}docs"
    benchmark.extra_info.update(role="subject", docs=docs)
    benchmark(acc.add_microbatch, cu_seqlens=cu, seq_len=PACK_LEN)
    once = FlopsAccumulator(packed=True)
    once.add_microbatch(cu_seqlens=cu, seq_len=PACK_LEN)
    stats = once.resolve().to_dict()
    assert (stats["num_sequences"], stats["tokens"], stats["squared"]) == syncing_stats(cu)


@pytest.mark.benchmark
@pytest.mark.parametrize("docs", [8, 512, 8192])
def test_accumulate_syncing_loop(benchmark, docs: int) -> None:
    cu = make_pack(docs)
    benchmark.group = f"accumulate-{docs}docs"
    benchmark.extra_info.update(role="baseline", docs=docs)
    docs_seen, _tokens, _squared = benchmark(syncing_stats, cu)
    assert docs_seen == ROWS * docs
