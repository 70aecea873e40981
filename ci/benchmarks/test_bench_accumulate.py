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
from ci import bench_accounting
from ci.bench_accounting import syncing_stats  # the loop is also the oracle

pytestmark = [pytest.mark.L2]

ROWS = 4
PACK_LEN = 8192 * 8


def make_pack(docs: int) -> torch.Tensor:
    """``ROWS`` rows of ``docs`` random-length documents each, plus a -1 tail of 2 entries."""
    return bench_accounting.make_pack(docs, ROWS, PACK_LEN)


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
