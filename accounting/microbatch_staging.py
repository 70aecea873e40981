"""A step's packed microbatches on a device: staged as they come, counted together at resolve.

`StagedMicrobatches` is the accumulator's one structure for them: boundaries staged by `add`,
and statistics vectors made on the device elsewhere (`add_vector`, from a data loader), both
by microbatch index; `total` gives their sum and its high words (`accounting.step_sums`, what
tells a wrapped sum from a true one), `per_microbatch` each one's vector, without a read.

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
from accounting.step_sums import WORD

__all__ = ["StagedMicrobatches"]

Window = tuple[int, int]
_NO_LIMIT = 2**63 - 1  # a pack length no boundary passes: the row has none


class StagedMicrobatches:
    """The device path's microbatches of one step: their int64 boundaries and pack lengths."""

    def __init__(self) -> None:
        self._items: list[tuple[torch.Tensor, torch.Tensor | None, int, int, int | None]] = []
        self._items_at: list[int] = []  # the staged boundaries' microbatch indices
        self._vectors: list[torch.Tensor] = []  # statistics vectors held on the device
        self._vectors_at: list[int] = []
        self._plan_key: tuple | None = None
        self._plan: tuple[torch.Tensor, ...] | None = None

    def __len__(self) -> int:
        return len(self._items) + len(self._vectors)

    @property
    def device(self) -> torch.device | None:
        if self._items:
            return self._items[0][0].device
        return self._vectors[0].device if self._vectors else None

    def clear(self) -> None:
        """Forgets the microbatches; keeps the gather index for the next step of the same layout."""
        self._items, self._items_at, self._vectors, self._vectors_at = [], [], [], []

    def _same_device(self, what: str, device: torch.device) -> None:
        held = self.device
        if held is not None and device != held:
            raise ValueError(f"add_microbatch: {what} on {device} but this step's microbatches are on {held}")

    def add(
        self,
        index: int,
        cu: torch.Tensor,
        padded: torch.Tensor | None,
        rows: int,
        width: int,
        pack_len: int | None,
    ) -> None:
        """Stages microbatch `index`'s checked boundaries: an int64 copy of each, nothing else."""
        self._same_device("cu_seqlens", cu.device)
        real = cu.to(dtype=torch.int64, memory_format=torch.contiguous_format, copy=True)
        if padded is not None:
            padded = padded.to(
                device=cu.device, dtype=torch.int64, memory_format=torch.contiguous_format, copy=True
            )
        self._items.append((real, padded, rows, width, pack_len))
        self._items_at.append(index)

    def add_vector(self, index: int, vector: torch.Tensor) -> None:
        """Microbatch `index` as a statistics vector already on the device (no copy, no read)."""
        self._same_device("stats", vector.device)
        self._vectors.append(vector)
        self._vectors_at.append(index)

    def total(self, window: Window | None) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The step's `[fields]` int64 sum on the device and its addends' high words
        (`accounting.step_sums`), both new tensors, without a read (None: nothing held)."""
        sums = []
        if self._items:
            sums.append(self._staged_totals(window)[1:])
        if self._vectors:
            stacked = torch.stack(self._vectors)
            sums.append((stacked.sum(0), (stacked >> WORD).sum(0)))
        if not sums:
            return None
        if len(sums) == 1:
            return sums[0]
        return sums[0][0] + sums[1][0], sums[0][1] + sums[1][1]

    def per_microbatch(self, window: Window | None) -> dict[int, list[int]]:
        """Each microbatch's own vector, by index (reads them back: one sync, for error messages)."""
        vectors = []
        if self._items:
            vectors.append(self._staged_totals(window)[0])
        if self._vectors:
            vectors.append(torch.stack(self._vectors).to(self.device))
        if not vectors:
            return {}
        read = torch.cat(vectors).tolist()
        return dict(zip(self._items_at + self._vectors_at, read, strict=True))

    def _staged_totals(self, window: Window | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`([microbatches, fields], [fields], [fields])` of the staged boundaries: each one's vector,
        their sum, and the high words of their sum (`accounting.step_sums`)."""
        src, limit, unknown, pack_tokens, zero = self._layout()
        flat = [zero] + [real.view(-1) for real, *_ in self._items]
        flat += [padded.view(-1) for _, padded, *_ in self._items if padded is not None]
        bounds = torch.cat(flat)[src]
        per_microbatch = row_columns(bounds, window=window, limit=limit).sum(-1)  # [fields, microbatches]
        # A known pack length counts every slot of the pack, trailing ones included: the plan holds
        # 0 (known) or 1 (unknown) and the pack's slots (0 when unknown), so two in-place kernels.
        per_microbatch[3].mul_(unknown).add_(pack_tokens)
        return per_microbatch.T, per_microbatch.sum(-1), (per_microbatch >> WORD).sum(-1)

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
    """On the host: `[0, gather index [sets, k, rows, width], limits [k, rows], unknown [k], pack tokens [k]]`.

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
    unknown = np.ones(k, dtype=np.int64)
    pack_tokens = np.zeros(k, dtype=np.int64)
    for j, (r, _, _, pack_len) in enumerate(key):
        if pack_len is not None:
            limits[j, :r] = pack_len
            unknown[j], pack_tokens[j] = 0, r * pack_len
    return torch.from_numpy(np.concatenate([[0], index.ravel(), limits.ravel(), unknown, pack_tokens]))


def _split(plan: torch.Tensor, key: tuple) -> tuple[torch.Tensor, ...]:
    """Views of the plan: (gather index, limits, pack length unknown (1) or not (0), pack tokens, the leading 0)."""
    k = len(key)
    rows, width = max(r for r, *_ in key), max(w for _, w, *_ in key)
    sets = 2 if any(has for _, _, has, _ in key) else 1
    n = sets * k * rows * width
    index = plan[1 : 1 + n].view(sets, k, rows, width)
    limits = plan[1 + n : 1 + n + k * rows].view(k, rows)
    at = 1 + n + k * rows
    return index, limits, plan[at : at + k], plan[at + k :], plan[:1]
