"""What the accounting benchmarks (and the GPU check) count with: packs, the naive loop, a kernel counter.

- `make_pack(docs, rows)`: `rows` rows of `docs` random-length documents, then a -1 tail of 2
  (int32, as data loaders make them); `rows=0` gives the 1-D `[docs + 3]` form.
- `syncing_stats(cu)`: the straightforward way, `.tolist()` then a Python loop over the lengths
  (documents, tokens, Σs²): what the accumulator must never lose to, and an oracle for those sums.
- `CountKernels`: counts the ATen operators that are not views (one kernel launch each on a GPU).
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["PACK_LEN", "CountKernels", "make_pack", "syncing_stats"]

PACK_LEN = 8192 * 8


def make_pack(docs: int, rows: int, pack_len: int = PACK_LEN) -> torch.Tensor:
    """`rows` rows (0: one row, 1-D) of `docs` random-length documents each, plus a -1 tail of 2."""
    gen = torch.Generator().manual_seed(docs)
    lengths = torch.randint(1, max(2, pack_len // docs), (max(rows, 1), docs), generator=gen)
    cu = torch.cat([torch.zeros(max(rows, 1), 1, dtype=torch.int64), lengths.cumsum(-1)], dim=-1)
    cu = torch.cat([cu, torch.full((max(rows, 1), 2), -1, dtype=torch.int64)], dim=-1).to(torch.int32)
    return cu if rows else cu[0].clone()


def syncing_stats(cu_seqlens: torch.Tensor) -> tuple[int, int, int]:
    """The straightforward version: read the boundaries back and loop over the lengths in Python."""
    tokens = squared = docs = 0
    bounds = cu_seqlens.tolist()
    for row in bounds if cu_seqlens.dim() == 2 else [bounds]:
        last = 0
        for value in row[1:]:
            if value < 0:
                break
            length = value - last
            tokens, squared, docs = tokens + length, squared + length * length, docs + (length > 0)
            last = value
    return docs, tokens, squared


class CountKernels(TorchDispatchMode):
    """Counts the ATen operators that are not views (each one a kernel launch on a GPU)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += not func.is_view
        return func(*args, **(kwargs or {}))
