"""A step's packed microbatches on a device: staged as they come, counted together at resolve.

`add` copies a microbatch's boundaries to int64 (one kernel, two with padded boundaries): no sync,
no host read, and a caller that reuses its buffer cannot change what was staged. `totals` then
counts every staged microbatch with one fixed set of kernels (`seqlen_kernels.row_columns`): one
concatenation and one gather lay the boundaries out as `[sets, microbatches, rows, width]`, a
shorter row extended by repeating its last boundary and a missing row filled with zeros (neither
counts anything), so the kernels per step do not grow with the number of microbatches. The
gather's index depends only on the shapes and pack lengths: it is built on the host once per
layout and moved without blocking (from pinned memory on CUDA), then reused step after step.
"""

from __future__ import annotations

import numpy as np
import torch

from accounting.seqlen_kernels import row_columns

__all__ = ["StagedMicrobatches"]

Window = tuple[int, int]
_NO_LIMIT = 2**63 - 1  # a pack length no boundary passes: the row has none


class StagedMicrobatches:
    """The device path's microbatches of one step: their int64 boundaries and pack lengths."""

    def __init__(self) -> None:
        self._items: list[tuple[torch.Tensor, torch.Tensor | None, int, int, int | None]] = []
        self._plan_key: tuple | None = None
        self._plan: tuple[torch.Tensor, ...] | None = None

    def __len__(self) -> int:
        return len(self._items)

    @property
    def device(self) -> torch.device | None:
        return self._items[0][0].device if self._items else None

    def clear(self) -> None:
        """Forgets the microbatches; keeps the gather index for the next step of the same layout."""
        self._items = []

    def add(
        self, cu: torch.Tensor, padded: torch.Tensor | None, rows: int, width: int, pack_len: int | None
    ) -> None:
        """Stages one microbatch's checked boundaries: an int64 copy of each, nothing else."""
        device = self.device
        if device is not None and cu.device != device:
            raise ValueError(
                f"add_microbatch: cu_seqlens on {cu.device} but this step's microbatches are on {device}"
            )
        real = cu.to(dtype=torch.int64, memory_format=torch.contiguous_format, copy=True)
        if padded is not None:
            padded = padded.to(
                device=cu.device, dtype=torch.int64, memory_format=torch.contiguous_format, copy=True
            )
        self._items.append((real, padded, rows, width, pack_len))

    def totals(self, window: Window | None) -> tuple[torch.Tensor, torch.Tensor]:
        """`([microbatches, fields], [fields])` int64 on the device: each microbatch's vector, and their sum."""
        src, limit, pack_tokens, zero = self._layout()
        flat = [zero] + [real.view(-1) for real, *_ in self._items]
        flat += [padded.view(-1) for _, padded, *_ in self._items if padded is not None]
        bounds = torch.cat(flat)[src]
        per_microbatch = row_columns(bounds, window=window, limit=limit).sum(-1)  # [fields, microbatches]
        # A known pack length counts every slot of the pack, trailing ones included.
        per_microbatch[3] = torch.where(pack_tokens >= 0, pack_tokens, per_microbatch[3])
        return per_microbatch.T, per_microbatch.sum(-1)

    def _layout(self) -> tuple[torch.Tensor, ...]:
        """The gather index and per-row limits on the device, rebuilt only when the layout changes."""
        key = tuple(
            (rows, width, padded is not None, pack_len) for _, padded, rows, width, pack_len in self._items
        )
        device = self.device
        if self._plan is None or self._plan_key != (key, device):
            host = _plan(key)
            on_device = (
                host.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else host.to(device)
            )
            self._plan_key, self._plan = (key, device), _split(on_device, key)
        return self._plan


def _plan(key: tuple) -> torch.Tensor:
    """On the host: `[0, gather index [sets, k, rows, width], limits [k, rows], pack tokens [k]]`.

    The concatenation the index reads starts with that 0 (the plan's own first element), then
    every microbatch's real boundaries, then the padded ones of those that have them; a
    microbatch without padded boundaries reads its real ones for both sets.
    """
    k = len(key)
    rows, width = max(r for r, *_ in key), max(w for _, w, *_ in key)
    sets = 2 if any(has for _, _, has, _ in key) else 1
    offsets, at = [], 1
    for r, w, _, _ in key:
        offsets.append(at)
        at += r * w
    padded_offsets = []
    for (r, w, has, _), real_at in zip(key, offsets, strict=True):
        padded_offsets.append(at if has else real_at)
        at += r * w if has else 0
    index = np.zeros((sets, k, rows, width), dtype=np.int64)
    row, col = np.arange(rows)[:, None], np.arange(width)[None, :]
    for j, (r, w, _, _) in enumerate(key):
        for s, base in enumerate((offsets[j], padded_offsets[j])[:sets]):
            index[s, j, :r] = (base + row * w + np.minimum(col, w - 1))[:r]
    limits = np.full((k, rows), _NO_LIMIT, dtype=np.int64)
    pack_tokens = np.full(k, -1, dtype=np.int64)
    for j, (r, _, _, pack_len) in enumerate(key):
        if pack_len is not None:
            limits[j, :r] = pack_len
            pack_tokens[j] = r * pack_len
    return torch.from_numpy(np.concatenate([[0], index.ravel(), limits.ravel(), pack_tokens]))


def _split(plan: torch.Tensor, key: tuple) -> tuple[torch.Tensor, ...]:
    """Views of the plan: (gather index, limits, pack tokens, the leading 0)."""
    k = len(key)
    rows, width = max(r for r, *_ in key), max(w for _, w, *_ in key)
    sets = 2 if any(has for _, _, has, _ in key) else 1
    n = sets * k * rows * width
    index = plan[1 : 1 + n].view(sets, k, rows, width)
    limits = plan[1 + n : 1 + n + k * rows].view(k, rows)
    return index, limits, plan[1 + n + k * rows :], plan[:1]
