"""Sequence statistics of boundaries in host memory: the kernels' int64 vector without torch.

Packs are born on the host (a data loader builds cu_seqlens before they move to a GPU), and each
torch call costs microseconds of dispatch whatever the pack holds. Here a CPU tensor's boundaries
are read once, from its own buffer, and the vector of `FIELDS` is computed without a kernel:
small packs in a Python loop over `tolist()`, larger ones with numpy on the tensor's memory
(`Tensor.numpy()` shares it). Which is faster depends on the size: `LOOP_LIMIT` is where they
cross (measured with `ci/benchmarks/test_bench_accumulate.py`). Both give exactly what
`seqlen_kernels.row_columns` gives, int64 wrap-around and the float64 rounding of the int64
check included; the unit tests compare the three over drawn packs, malformed ones too.

`HostMicrobatches` is a step's pending host microbatches, the accumulator's one structure for
them: a small pack is read into lists as it comes and all of them are counted in one pass at
`total` (`plain_step`); a larger one, or one with padded boundaries, is counted as it comes.
Either way a caller that refills its buffer afterwards changes nothing.
"""

from __future__ import annotations

from itertools import accumulate
from operator import gt, mul, sub

import numpy as np
import torch

from accounting.seqlen_fields import INT64_LIMIT, KINDS, wrap_int64

__all__ = ["LOOP_LIMIT", "HostMicrobatches", "host_values", "list_values", "plain_step"]

Window = tuple[int, int]

# Boundaries (rows x width) up to which the loop beats numpy's fixed cost per call.
LOOP_LIMIT = 96
# The loop works on exact Python ints; below this spread of a row's values no int64 kernel could
# have wrapped (lengths, their squares and m (m + 1) all stay under 2**63), so the results agree.
_SPREAD = 2**31
_TOP = 2**63
_EXACT_FLOAT = 2**26  # a row total below it has Σs² < 2**53: exact in float64
# Row totals up to this, over at most LOOP_LIMIT rows, square-sum below 2**63 (LOOP_LIMIT * 2**56):
# no int64 counter can trip and no sum of a microbatch wraps, so `plain_step` need not check.
_SMALL = 2**28
_PAST = float("inf")  # `plain_step`'s previous boundary once a row's tail began: any value after it decreases


class _Wide(Exception):
    """A row whose values spread too far for the exact-int loop to mirror int64 kernels."""


def host_values(
    cu: torch.Tensor,
    padded: torch.Tensor | None,
    two_d: bool,
    *,
    window: Window | None,
    pack_len: int | None,
    method: str | None = None,
) -> list[int]:
    """The statistics vector of CPU boundaries (shapes already checked), as Python ints.

    `method` is "loop" or "numpy" to force one (tests compare them); None picks by size.
    """
    if method is None:
        method = "loop" if cu.numel() <= LOOP_LIMIT else "numpy"
    if method == "loop":
        rows, prows = cu.tolist(), None if padded is None else padded.tolist()
        if not two_d:
            rows, prows = [rows], None if prows is None else [prows]
        return list_values(rows, prows, window, pack_len)
    return _array_values(_array(cu), None if padded is None else _array(padded), window, pack_len)


class HostMicrobatches:
    """A step's microbatches counted on the host, by microbatch index: their vectors as exact ints."""

    def __init__(self, window: Window | None) -> None:
        self.window = window
        self.clear()

    def clear(self) -> None:
        self._rows: list[tuple[list[list[int]], int | None]] = []  # small packs: rows, pack length
        self._rows_at: list[int] = []  # their microbatch indices
        self._counted: dict[int, list[int]] = {}  # the others' vectors, counted as they came

    def __bool__(self) -> bool:
        return bool(self._rows or self._counted)

    def add(
        self,
        index: int,
        cu: torch.Tensor,
        padded: torch.Tensor | None,
        two_d: bool,
        size: int,
        pack_len: int | None,
    ) -> None:
        """Microbatch `index`'s checked CPU boundaries (`size` values): read now, never kept."""
        if padded is None and size <= LOOP_LIMIT:
            self._rows.append((cu.tolist() if two_d else [cu.tolist()], pack_len))
            self._rows_at.append(index)
        else:
            method = "loop" if size <= LOOP_LIMIT else "numpy"  # `size` known: no torch call to ask it
            self._counted[index] = host_values(
                cu, padded, two_d, window=self.window, pack_len=pack_len, method=method
            )

    def add_values(self, index: int, values: tuple[int, ...] | list[int]) -> None:
        """Microbatch `index` as a vector made elsewhere (host statistics from a data loader)."""
        self._counted[index] = list(values)

    def total(self) -> list[int] | None:
        """The step's summed vector as int64 sums hold it (None: no host microbatch)."""
        total = self.exact_total()
        if total is not None and (min(total) < -(2**63) or max(total) >= 2**63):  # as int64 sums wrap
            total = [wrap_int64(v) for v in total]
        return total

    def exact_total(self) -> list[int] | None:
        """The step's summed vector as exact ints, before any int64 wrap (None: no host microbatch)."""
        summed = plain_step(self._rows) if self._rows and self.window is None else None
        if summed is not None and not self._counted:
            total = summed  # the common step: small packs only, one pass over them all
        else:
            parts = list(self._counted.values())
            if self._rows:
                parts += [summed] if summed is not None else self._rows_vectors()
            if not parts:
                return None
            total = parts[0] if len(parts) == 1 else list(map(sum, zip(*parts, strict=True)))
        return total

    def per_microbatch(self) -> dict[int, list[int]]:
        """Each microbatch's own vector, by index (the step's error message names them)."""
        return {**self._counted, **dict(zip(self._rows_at, self._rows_vectors(), strict=True))}

    def _rows_vectors(self) -> list[list[int]]:
        return [list_values(rows, None, self.window, pack_len) for rows, pack_len in self._rows]


def list_values(
    rows: list[list[int]], prows: list[list[int]] | None, window: Window | None, pack_len: int | None
) -> list[int]:
    """The statistics vector of boundary rows read into lists (each row a list of ints)."""
    try:
        if prows is None and window is None:
            plain = _plain_values(rows, pack_len)
            if plain is not None:
                return plain
        return _loop_values(rows, prows, window, pack_len)
    except _Wide:  # values too far apart for the exact-int loop: numpy wraps as the kernels do
        as_array = None if prows is None else np.array(prows, dtype=np.int64)
        return _array_values(np.array(rows, dtype=np.int64), as_array, window, pack_len)


def _array_values(
    real: np.ndarray, padded: np.ndarray | None, window: Window | None, pack_len: int | None
) -> list[int]:
    if padded is None and window is None:
        plain = _numpy_plain(real, pack_len)
        if plain is not None:
            return plain
    return _numpy_values(real, padded, window, pack_len)


def plain_step(staged: list[tuple[list[list[int]], int | None]]) -> list[int] | None:
    """The summed vector of a step's microbatches, each `(rows, pack_len)`, in one pass over them all.

    The common case only: boundaries without padded ones or a window, every row well formed (a 0,
    boundaries that never decrease, an optional -1 tail), within its pack and under `_SMALL`; the
    sums are exact ints (the caller wraps them as int64 sums would). None for anything else: then
    `list_values` counts each microbatch, malformed rows included.
    """
    n = tokens = squared = padded = 0
    for rows, pack_len in staged:
        limit, before = _SMALL if pack_len is None or pack_len > _SMALL else pack_len, tokens
        for row in rows:
            if row[0]:
                return None
            prev = last = skipped = 0  # skipped: boundaries that end no segment (the leading 0 too)
            for value in row:
                length = value - prev
                if length > 0:
                    squared += length * length
                    prev = value
                elif length:  # a -1 tail, or out of order; past a tail, every value must be -1
                    if value != -1:
                        return None
                    if prev is not _PAST:
                        last, prev = prev, _PAST
                    skipped += 1
                else:
                    skipped += 1
            if prev is not _PAST:
                last = prev
            if last > limit:
                return None
            n += len(row) - skipped
            tokens += last
        padded += len(rows) * pack_len if pack_len is not None else tokens - before
    return [n, tokens, squared, padded, squared, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0]


# ---------------------------------------------------------------- the loop, for small packs


def _plain_values(rows: list[list[int]], pack_len: int | None) -> list[int] | None:
    """The vector of well-formed rows, no padded boundaries, no window; None: take the general loop.

    One pass per row: a row is a 0, then boundaries that never decrease, then an optional `-1`
    tail; anything else goes to the general loop, which counts what is wrong.
    """
    lasts = []
    n = squared = 0
    for row in rows:
        if row[0]:
            return None
        prev = 0
        for value in row:
            length = value - prev
            if length > 0:
                n += 1
                squared += length * length
                prev = value
            elif length:  # a decrease: the start of a -1 tail, or out of order
                if value != -1 or row.count(-1) != len(row) - row.index(-1):
                    return None
                break
        if prev >= _SPREAD:
            return None
        lasts.append(prev)
    return _plain_vector(lasts, n, squared, pack_len)


def _plain_vector(lasts: list[int], n: int, squared: int, pack_len: int | None) -> list[int]:
    """The vector of well-formed rows from their last boundaries and the length sums."""
    if len(lasts) == 1 and lasts[0] < _SPREAD:  # one row, far from any int64 limit
        tokens = lasts[0]
        past = int(pack_len is not None and tokens > pack_len)
        padded_tokens = pack_len if pack_len is not None else tokens
        return [n, tokens, squared, padded_tokens, squared, 0, 0, 0, 0, past, 0, 0, past, 0, 0]
    tokens = sum(lasts)
    beyond = wide = bad = 0
    total = 0.0
    for last in lasts:
        total += float(last) * float(last)
        past, wraps = pack_len is not None and last > pack_len, total >= INT64_LIMIT
        beyond, wide, bad = beyond + past, wide + wraps, bad + (past or wraps)
    padded_tokens = len(lasts) * pack_len if pack_len is not None else tokens
    if squared >= _TOP or tokens >= _TOP or padded_tokens >= _TOP:  # as int64 sums wrap
        n, tokens, squared, padded_tokens = (wrap_int64(v) for v in (n, tokens, squared, padded_tokens))
    return [n, tokens, squared, padded_tokens, squared, 0, 0, 0, 0, bad, 0, 0, beyond, 0, wide]


def _numpy_plain(bounds: np.ndarray, pack_len: int | None) -> list[int] | None:
    """`_plain_values` with numpy, a row at a time, a few passes per row; None: not well formed.

    A row whose last boundary is below `_EXACT_FLOAT` is taken in float64: a row accepted there
    rises from 0 to its last boundary without a decrease, so every value lies in [0, last], where
    float64 is exact (a larger or negative value would need a float decrease on the way to
    `last`), and Σs² <= last² < 2**53 keeps every partial sum exact. Other rows stay in their
    integer type: every boundary of a well-formed row before its tail is >= 0, so no difference of
    two of them wraps, even in int32; their squares are summed in int64 (wrapping as the kernels
    do). The reductions call the ufuncs themselves: `ndarray.min` adds a Python layer per call.
    """
    lasts = []
    n = squared = 0
    width = bounds.shape[-1]
    smallest = np.minimum.reduce
    for row in bounds:
        end = width
        while end and row[end - 1] == -1:
            end -= 1
            if width - end > 16:  # a long tail: the vectorised path checks it in one pass
                return None
        if not end or row[0]:
            return None
        last = int(row[end - 1])
        exact_float = 0 <= last < _EXACT_FLOAT
        body = row[:end].astype(np.float64) if exact_float else row[:end]
        if not exact_float and smallest(body) < 0:
            return None
        lengths = np.subtract(body[1:], body[:-1])
        if end > 1:
            shortest = smallest(lengths)
            if shortest < 0:
                return None
            n += end - 1 if shortest else int(np.count_nonzero(lengths))  # no empty segment: all count
        if not exact_float:
            lengths = lengths.astype(np.int64)
        squared += int(np.dot(lengths, lengths))
        lasts.append(last)
    return _plain_vector(lasts, n, squared, pack_len)


def _row(row: list[int]) -> tuple[list[int], int, bool, bool]:
    """(segment lengths over the width, last boundary as the running maximum ends, first fault, order fault)."""
    width = end = len(row)
    while end and row[end - 1] == -1:
        end -= 1
    if row[0] == 0:
        body = row if end == width else row[:end]
        lengths = list(map(sub, body[1:], body))
        if not lengths or min(lengths) >= 0:  # well formed: the running maximum is the row itself
            if body[-1] >= _SPREAD:
                raise _Wide
            return lengths + [0] * (width - end), body[-1], False, False
    if max(row) - min(row) >= _SPREAD:
        raise _Wide
    running = list(accumulate(row, max))
    lengths = list(map(sub, running[1:], running))
    # Out of order: a -1 before the tail (a value other than -1 follows it), or a decrease there.
    order = -1 in row[:end] or running[:end] != row[:end]
    return lengths, running[-1], row[0] != 0, order


def _pairs(lengths: list[int], side: int) -> int:
    """Σ over documents of the (query, key) pairs more than `side` apart (-1: unbounded, none)."""
    if side < 0:
        return 0
    return sum(m * (m + 1) // 2 for length in lengths if (m := length - 1 - side) > 0)


def _loop_values(
    rows: list[list[int]], prows: list[list[int]] | None, window: Window | None, pack_len: int | None
) -> list[int]:
    """The vector of any rows (malformed ones counted), one row at a time on exact ints."""
    real = [_row(row) for row in rows]
    padded = real if prows is None else [_row(row) for row in prows]
    left, right = window if window is not None else (-1, -1)
    sums = [0] * 9
    counts = dict.fromkeys(KINDS, 0)
    bad = 0
    squares = [0.0, 0.0]
    for (lengths, last, first, order), (plengths, plast, pfirst, porder) in zip(real, padded, strict=True):
        row_sums = (
            len(lengths) - lengths.count(0),
            sum(lengths),
            sum(map(mul, lengths, lengths)),
            sum(plengths),
            sum(map(mul, plengths, plengths)),
            _pairs(lengths, left),
            _pairs(lengths, right),
            _pairs(plengths, left),
            _pairs(plengths, right),
        )
        sums = [a + b for a, b in zip(sums, row_sums, strict=True)]
        squares = [squares[0] + float(last) * float(last), squares[1] + float(plast) * float(plast)]
        faults = {
            "first": first or pfirst,
            "order": order or porder,
            "beyond_pack": pack_len is not None and (last > pack_len or plast > pack_len),
            "int64": squares[0] >= INT64_LIMIT or squares[1] >= INT64_LIMIT,
            "longer_than_padded": any(map(gt, lengths, plengths)),
        }
        bad += any(faults.values())
        for kind, found in faults.items():
            counts[kind] += found
    if pack_len is not None:
        sums[3] = len(rows) * pack_len
    return [wrap_int64(v) for v in sums] + [bad] + [counts[kind] for kind in KINDS]


# ---------------------------------------------------------------- numpy, for larger packs


def _array(cu: torch.Tensor) -> np.ndarray:
    """`[rows, width]` on the tensor's own memory, in its own dtype (no copy)."""
    array = cu.numpy()
    if array.dtype.kind == "u":  # unsigned differences would wrap where the kernels' int64 ones go negative
        array = array.astype(np.int64)
    return array.reshape(1, -1) if array.ndim == 1 else array


def _plain_lengths(bounds: np.ndarray) -> np.ndarray | None:
    """Segment lengths `[sets, rows, width - 1]` when every row is well formed, else None.

    Well formed (first boundary 0, no decrease before a `-1` tail, nothing after it): then the
    running maximum the kernels take is the row up to its tail, so the lengths are the plain
    differences with the tail's set to 0, without the slow cumulative maximum.
    """
    if bounds[..., 0].any():
        return None
    tail = bounds == -1
    lengths = bounds[..., 1:] - bounds[..., :-1]
    out_of_order = lengths < 0
    out_of_order |= tail[..., :-1]
    if (out_of_order > tail[..., 1:]).any():  # a decrease or a -1 followed by something else
        return None
    if tail.any():
        lengths[tail[..., 1:]] = 0
    return lengths


def _numpy_values(
    real: np.ndarray, padded: np.ndarray | None, window: Window | None, pack_len: int | None
) -> list[int]:
    """The vector of `[rows, width]` boundaries, the kernels' operations in numpy (in int64)."""
    real = real.astype(np.int64, copy=False)
    padded = padded.astype(np.int64, copy=False) if padded is not None else None
    bounds = real[None] if padded is None else np.stack([real, padded])
    lengths = _plain_lengths(bounds)
    if lengths is None:
        running = np.maximum.accumulate(bounds, axis=-1)
        lengths = np.diff(running, axis=-1)
        last = running[..., -1]
        prev, nxt = bounds[..., :-1], bounds[..., 1:]
        first = bounds[..., 0] != 0
        order = (((nxt < prev) | (prev == -1)) & (nxt != -1)).any(-1)
    else:
        last = lengths.sum(-1)
        first = order = np.zeros(last.shape, dtype=bool)
    faults = {
        "first": first,
        "order": order,
        "beyond_pack": last > pack_len if pack_len is not None else None,
        "int64": np.cumsum(np.square(last.astype(np.float64)), axis=-1) >= INT64_LIMIT,
        "longer_than_padded": (lengths[:1] > lengths).any(-1) if padded is not None else None,
    }
    kinds = np.stack(
        [faults[k].any(0) if faults[k] is not None else np.zeros(len(real), bool) for k in KINDS]
    )
    tokens, squared = lengths.sum(-1).sum(-1), np.einsum("...i,...i->...", lengths, lengths).sum(-1)
    sums = [(lengths[0] > 0).sum(), tokens[0], squared[0], tokens[-1], squared[-1]]
    for side in window if window is not None else (-1, -1):
        sums.append(_numpy_pairs(lengths, side))
    sums[5:9] = [sums[5][0], sums[6][0], sums[5][-1], sums[6][-1]]
    if pack_len is not None:
        sums[3] = len(real) * pack_len
    counts = kinds.sum(-1)
    return [wrap_int64(int(v)) for v in sums] + [int(kinds.any(0).sum())] + [int(c) for c in counts]


def _numpy_pairs(lengths: np.ndarray, side: int) -> np.ndarray:
    """Per set, Σ of the pairs beyond `side` (int64, wrapping as the kernels do)."""
    if side < 0:
        return np.zeros(lengths.shape[0], dtype=np.int64)
    m = np.maximum(lengths - (1 + side), 0)
    return (m * (m + 1) // 2).sum(-1).sum(-1)
