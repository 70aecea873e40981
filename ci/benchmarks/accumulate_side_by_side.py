"""The counting step of two versions of `accounting`, side by side in one process: loop / ours.

    python -m ci.benchmarks.accumulate_side_by_side [--old REV] [--rounds-scale X]

`--old` (a git revision, default `main`) is checked out into a temporary folder as the package
`accounting_old` (its `accounting` imports renamed), so both versions run in the same process,
round by round, on the same packs and from the same cache state: each round times the naive
`.tolist()` loop, then the old and the new `FlopsAccumulator` on one step (8 microbatches of a
1-D int32 cu_seqlens, then `resolve`), in alternating order. It prints, at 8, 512 and 8192
documents, the median `loop / ours` of each version (above 1: ours is faster than the loop) and
the new one's change against the old. The step and the packs are `test_bench_accumulate`'s.
"""

from __future__ import annotations

import argparse
import importlib
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from ci.benchmarks.accounting_packs import PACK_LEN, make_pack, syncing_stats

ROOT = Path(__file__).resolve().parents[2]
MICROBATCHES = 8
ROUNDS = {8: 400, 512: 200, 8192: 60}
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


def measure(docs: int, versions: dict, scale: float) -> dict[str, float]:
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--old", default="main", help="the git revision to compare with (default main)")
    parser.add_argument("--rounds-scale", type=float, default=1.0, help="rounds x this (default 1)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as folder:
        old = load_old(args.old, Path(folder))
        new = importlib.import_module("accounting")
        print(f"loop / ours, median over rounds (old = {args.old}, new = the working tree)")
        print(f"{'docs':>6}{'old':>10}{'new':>10}{'change':>10}")
        for docs in ROUNDS:
            ratios = measure(docs, {"old": old, "new": new}, args.rounds_scale)
            change = ratios["new"] / ratios["old"] - 1
            print(f"{docs:>6}{ratios['old']:>10.3f}{ratios['new']:>10.3f}{change:>+10.1%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
