"""The counting step of two versions of `accounting`, side by side in one process: loop / ours.

    KIT_BENCH_OLD_REV=387dd98 python -m ci bench -k versions -s

The old version (the git revision `KIT_BENCH_OLD_REV`, default `HEAD`: the tree against its last
commit) is checked out into a temporary folder as the package `accounting_old` (its `accounting`
imports renamed), so both versions run in the same process, round by round, on the same packs
and from the same cache state: each round times the naive `.tolist()` loop, then the old and the
new `FlopsAccumulator` on one step (8 microbatches of a 1-D int32 cu_seqlens, then `resolve`), in
alternating order. It prints, at 8, 512 and 8192 documents, the median `loop / ours` of each
version (above 1: ours is faster than the loop) and the new one's change against the old, and
records them (`extra_info`). The step and the packs are `test_bench_accumulate`'s.
"""

from __future__ import annotations

import importlib
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from ci.benchmarks.accounting_packs import PACK_LEN, make_pack, syncing_stats

pytestmark = [pytest.mark.L2]

ROOT = Path(__file__).resolve().parents[2]
MICROBATCHES = 8
ROUNDS = {8: 400, 512: 200, 8192: 60}
# Rounds x this: the two versions are closer than one round's spread on a shared 2-core machine
# (the same tree against itself moved by up to 8% at x1, by under 3% at x4).
ROUNDS_SCALE = 4
EVICT_BYTES = 4 << 20  # more than a core's L2 cache: each variant starts with the packs out of it


def load_old(rev: str, into: Path):
    """`accounting` at `rev` as the package `accounting_old` (its absolute imports renamed)."""
    archive = subprocess.run(
        ["git", "-C", str(ROOT), "archive", rev, "accounting"], check=True, capture_output=True
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    (into / "accounting").rename(into / "accounting_old")
    for path in (into / "accounting_old").rglob("*.py"):
        text = path.read_text()
        path.write_text(re.sub(r"\baccounting(?=[. ])", "accounting_old", text))
    sys.path.insert(0, str(into))
    return importlib.import_module("accounting_old")


def _step(module, packs: list[torch.Tensor]):
    acc = module.FlopsAccumulator(packed=True)
    start = time.process_time()
    for cu in packs:
        acc.add_microbatch(cu_seqlens=cu, seq_len=PACK_LEN)
    acc.resolve()
    return time.process_time() - start


def _loop(packs: list[torch.Tensor]) -> float:
    start = time.process_time()
    for cu in packs:
        syncing_stats(cu)
    return time.process_time() - start


def measure(docs: int, versions: dict, scale: float = ROUNDS_SCALE) -> dict[str, float]:
    """Median loop / ours of each version over the rounds (the first 4 rounds are a warm-up)."""
    packs = [make_pack(docs + i, 0) for i in range(MICROBATCHES)]
    scratch = np.zeros(EVICT_BYTES // 8)
    times: dict[str, list[float]] = {name: [] for name in ("loop", *versions)}
    for i in range(max(8, int(ROUNDS[docs] * scale))):
        scratch.fill(1.0)
        times["loop"].append(_loop(packs))
        order = list(versions) if i % 2 == 0 else list(reversed(versions))
        for name in order:
            scratch.fill(1.0)
            times[name].append(_step(versions[name], packs))
    medians = {name: statistics.median(values[4:]) for name, values in times.items()}
    return {name: medians["loop"] / medians[name] for name in versions}


@pytest.mark.benchmark
def test_old_and_new_counting_step_side_by_side(benchmark, tmp_path, capsys) -> None:
    rev = os.environ.get("KIT_BENCH_OLD_REV", "HEAD")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        old, new = load_old(rev, tmp_path), importlib.import_module("accounting")
        table = benchmark.pedantic(
            lambda: {docs: measure(docs, {"old": old, "new": new}, 1.0) for docs in ROUNDS},
            rounds=1,
            iterations=1,
        )
    finally:
        torch.set_num_threads(threads)
        sys.path.remove(str(tmp_path))
        for name in [m for m in sys.modules if m == "accounting_old" or m.startswith("accounting_old.")]:
            del sys.modules[name]
    lines = [f"loop / ours, median over rounds (old = {rev}, new = the working tree)"]
    lines.append(f"{'docs':>6}{'old':>10}{'new':>10}{'change':>10}")
    for docs, ratios in table.items():
        lines.append(
            f"{docs:>6}{ratios['old']:>10.3f}{ratios['new']:>10.3f}{ratios['new'] / ratios['old'] - 1:>+10.1%}"
        )
    with capsys.disabled():
        print("\n" + "\n".join(lines))
    benchmark.extra_info.update(
        old_rev=rev, loop_over_ours={f"{docs}docs": ratios for docs, ratios in table.items()}
    )
    assert all(ratios["old"] > 0 and ratios["new"] > 0 for ratios in table.values())
