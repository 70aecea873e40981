"""Per-microbatch cost of `FlopsAccumulator.add_microbatch` vs a syncing `.tolist()` loop.

Run: `.venv/bin/python ci/bench_accounting.py [--repeat N] [--rows R]`. For packs of 8, 512 and
8192 documents (a 2-D `[rows, n+1]` cu_seqlens with a -1 tail), prints side by side:

- ours on CPU tensors: a fixed number of vectorised kernels per call whatever the number of
  documents, so the Python/dispatcher part is constant and only the C++ kernels' time grows;
- a straightforward syncing implementation: `.tolist()` then a Python loop over the lengths,
  whose Python time grows linearly with the documents.
(`meta` tensors prove sync-freedom in the unit tests but are no timing baseline: their shape
kernels run much slower than real CPU kernels.)

Timings are the minimum of 5 runs (a shared, loaded machine only ever adds time); the `ops` column
counts the torch calls one `add_microbatch` makes (counted with a TorchFunctionMode, attribute
reads and views included), `kernels` the ATen operators among them that are not views (counted
with a TorchDispatchMode): on a GPU, one launch each. Load moves neither figure. To compare two
trees, run the script with `PYTHONPATH=<other tree>`.

On a GPU the syncing version would also stall the CPU until the device catches up, every
microbatch; that cost is not shown here. This is a benchmark, not a timed test.
"""

from __future__ import annotations

import argparse
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import accounting
from accounting import FlopsAccumulator


def syncing_stats(cu_seqlens: torch.Tensor) -> tuple[int, int, int]:
    """The straightforward version: read the boundaries back and loop over the lengths in Python."""
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


def make_pack(docs: int, rows: int, pack_len: int = 8192 * 8) -> torch.Tensor:
    """`rows` rows of `docs` random-length documents each, plus a -1 tail of 2 entries."""
    gen = torch.Generator().manual_seed(docs)
    lengths = torch.randint(1, max(2, pack_len // docs), (rows, docs), generator=gen)
    cu = torch.cat([torch.zeros(rows, 1, dtype=torch.int64), lengths.cumsum(-1)], dim=-1)
    return torch.cat([cu, torch.full((rows, 2), -1, dtype=torch.int64)], dim=-1).to(torch.int32)


def per_call_us(fn, repeat: int) -> float:
    """Min-of-5 mean time per call, in microseconds."""
    fn()  # warm-up
    runs = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(repeat):
            fn()
        runs.append((time.perf_counter() - start) / repeat * 1e6)
    return min(runs)


class _CountOps(torch.overrides.TorchFunctionMode):
    """Counts the torch functions and tensor methods called inside the mode."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


class _CountKernels(TorchDispatchMode):
    """Counts the ATen operators that are not views (each one a kernel launch on a GPU)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += not func.is_view
        return func(*args, **(kwargs or {}))


def ops_per_call(fn) -> int:
    with _CountOps() as counter:
        fn()
    return counter.count


def kernels_per_call(fn) -> int:
    with _CountKernels() as counter:
        fn()
    return counter.count


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=200)
    parser.add_argument("--rows", type=int, default=4, help="micro-batch rows of the 2-D cu_seqlens")
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(
        f"add_microbatch per call, 2-D cu_seqlens [{args.rows}, docs+3], int32, -1 tail; torch {torch.__version__}"
    )
    print(f"accounting from {accounting.__file__}")
    print(
        f"{'docs/row':>9} {'ops':>5} {'kernels':>8} {'ours (us)':>10} {'tolist loop (us)':>17} {'loop/ours':>10}"
    )
    for docs in (8, 512, 8192):
        cu = make_pack(docs, args.rows)
        acc = FlopsAccumulator(packed=True)
        add = lambda cu=cu, a=acc: a.add_microbatch(cu_seqlens=cu, seq_len=8192 * 8)  # noqa: E731
        add()  # counted from the second call on, the steady state (which adds to the running sum)
        ops, kernels = ops_per_call(add), kernels_per_call(add)
        ours = per_call_us(add, args.repeat)
        loop = per_call_us(lambda cu=cu: syncing_stats(cu), max(1, args.repeat // (1 + docs // 512)))
        expected = syncing_stats(cu)
        got = FlopsAccumulator(packed=True)
        got.add_microbatch(cu_seqlens=cu)
        stats = got.resolve().to_dict()
        assert (stats["num_sequences"], stats["tokens"], stats["squared"]) == expected, (stats, expected)
        print(f"{docs:>9} {ops:>5} {kernels:>8} {ours:>10.1f} {loop:>17.1f} {loop / ours:>10.1f}")


if __name__ == "__main__":
    main()
