"""Per-row sequence statistics with torch kernels: the device path, sync-free, any leading dims.

`row_columns` takes int64 boundaries `[sets, *lead, width]` (`sets` 1: real only, 2: real and
padded) and returns `[len(FIELDS), *lead]`: every statistic per row, before the sum over rows.
`seqlen_stats_vector` uses it for one pack (`lead = (rows,)`); the accumulator's staging for all
of a step's microbatches at once (`lead = (microbatches, rows)`), so the number of kernels does
not grow with the number of microbatches. Nothing here reads a value back to the host.
"""

from __future__ import annotations

import torch

from accounting.seqlen_fields import INT64_LIMIT, KINDS

__all__ = ["row_columns"]

Window = tuple[int, int]


def pairs_beyond_tensor(excess: torch.Tensor) -> torch.Tensor:
    """Per document, the (query, key) pairs more than `side` positions apart in one direction.

    `excess` is `length - (1 + side)`: a document of length s has m = s - 1 - side queries with
    keys beyond the window, contributing 1 + 2 + ... + m = m (m + 1) / 2 pairs (m (m + 1) is even).
    """
    m = torch.clamp(excess, min=0)
    return torch.div(m * (m + 1), 2, rounding_mode="floor")


def _faults(bounds: torch.Tensor, lengths: torch.Tensor, last: torch.Tensor, limit) -> list:
    """Per set and row, bool, in `KINDS` order (None: the kind cannot occur).

    A `-1` tail runs to the end of the row, so out of order is a value other than -1 that is below
    the one before it (which catches every negative value but -1) or that follows a -1. The int64
    risk bounds Σs² by Σ over a pack's rows of the row's token total squared (float64, never
    wraps), summed along the rows dimension only.
    """
    prev, nxt = bounds[..., :-1], bounds[..., 1:]
    found = {
        "first": bounds[..., 0] != 0,
        "order": (((nxt < prev) | (prev == -1)) & (nxt != -1)).any(-1),
        "beyond_pack": last > limit if limit is not None else None,
        "int64": last.double().square().cumsum(-1) >= INT64_LIMIT,
        # Set 0 compares the real lengths with themselves: never longer.
        "longer_than_padded": (lengths[:1] > lengths).any(-1) if bounds.shape[0] == 2 else None,
    }
    return [found[kind] for kind in KINDS]


def _window_pairs(lengths: torch.Tensor, window: Window | None) -> list[torch.Tensor | None]:
    """Per set and row, the pairs beyond `[left, right]` (None: that side is unbounded)."""
    if window is None:
        return [None, None]
    sides = [i for i, side in enumerate(window) if side >= 0]
    excess = torch.stack([lengths - (1 + window[i]) for i in sides]) if len(sides) > 1 else None
    pairs = pairs_beyond_tensor(excess if excess is not None else lengths - (1 + window[sides[0]]))
    pairs = pairs.sum(-1)
    columns: list[torch.Tensor | None] = [None, None]
    for j, i in enumerate(sides):
        columns[i] = pairs[j] if excess is not None else pairs
    return columns


def row_columns(bounds: torch.Tensor, *, window: Window | None, limit=None) -> torch.Tensor:
    """`[len(FIELDS), *lead]` int64: each statistic of each row of int64 `bounds[sets, *lead, w]`.

    `limit` is the pack length a row's last boundary may not pass: None, an int, or an int64
    tensor of shape `lead`. `padded_tokens` here is the padded lengths' sum; a caller that knows
    the pack length overwrites it. A row is malformed when either of its boundary sets is.
    """
    running = torch.cummax(bounds, dim=-1).values
    # Segment lengths come from the running maximum, which replaces every `-1` sentinel by the
    # last real boundary, so the tail's differences are 0 (a repeated-value tail is already 0).
    lengths = running.diff(dim=-1)
    flags = _faults(bounds, lengths, running[..., -1], limit)
    tokens, squared = lengths.sum(-1), (lengths * lengths).sum(-1)
    left, right = _window_pairs(lengths, window)
    zero = None
    if left is None or right is None or any(f is None for f in flags):
        zero = bounds.new_zeros(bounds.shape[:-1])
    left, right = (zero if c is None else c for c in (left, right))
    # Set 0 is real, set -1 padded (the same set when there is no padded one).
    sums = [(lengths[0] > 0).sum(-1), tokens[0], squared[0], tokens[-1], squared[-1]]
    sums += [left[0], right[0], left[-1], right[-1]]
    kinds = torch.stack([zero.bool() if f is None else f for f in flags]).any(1)  # [kind, *lead]
    # The int64 sums and the bool flags are stacked apart: on CPU, one stack of mixed dtypes costs
    # several times more than two stacks and one concatenation.
    return torch.cat([torch.stack(sums), kinds.any(0, keepdim=True), kinds])
