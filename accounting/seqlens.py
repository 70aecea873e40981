"""Sequence-length statistics of packed (THD) batches, computed on device without host syncs.

A packed micro-batch is described by `cu_seqlens`, the cumulative document boundaries
`[0, s0, s0+s1, ...]`, either 1-D `[n+1]` or 2-D `[micro_batch, n+1]`. Two tail-padding
conventions are in use upstream and both are accepted here: a `-1` sentinel tail (legacy
Megatron-Bridge collate) and a repeated-last-value tail (zero-length segments, current collate and
CUDA graphs). `seqlen_stats` never reads a value back to the host; `validate_cu_seqlens` is the
separate, syncing check for debug mode and tests.

Window convention (shared with `accounting.flops`): `window_size` is `(left, right)` as in
megatron-core / flash-attention, `-1` meaning unbounded; query `i` may see key `j` only when
`i - left <= j <= i + right`. An int `w` means `(w, 0)`. The statistics carry, per side, the exact
number of (query, key) pairs of each document that fall outside the window, summed over documents.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

__all__ = [
    "MALFORMED",
    "SeqlenStats",
    "describe_malformed",
    "normalize_window",
    "pairs_beyond",
    "seqlen_stats",
    "seqlen_stats_vector",
    "validate_cu_seqlens",
]

Window = tuple[int, int]

# What makes a row of boundaries malformed, by the name of its `SeqlenStats.malformed_<kind>`
# counter, with the words an error message uses. The sync-free statistics count the rows of each
# kind (and `malformed_rows` those with any) so that whoever reads the vector anyway can refuse it.
MALFORMED: dict[str, str] = {
    "first": "a first boundary that is not 0",
    "order": (
        "a boundary smaller than the one before it, or a negative one other than a -1 padding tail "
        "that runs to the end of the row"
    ),
    "beyond_pack": "more tokens than the pack length (pack_len / seq_len)",
    "longer_than_padded": "a real segment longer than its padded segment in cu_seqlens_padded",
    "int64": "row token totals whose squares sum to 2**63 or more (the int64 sums of s² could wrap)",
}
# Σ over rows of (row token total)², an upper bound of Σs², at or past this may wrap an int64 sum.
_INT64_LIMIT = float(2**63)


def normalize_window(window_size: int | tuple[int, int] | list[int] | None) -> Window | None:
    """`window_size` as `(left, right)` with -1 for unbounded, or None when no side is bounded."""
    if window_size is None:
        return None
    if isinstance(window_size, bool):
        raise ValueError(f"window_size = {window_size!r}: expected an int or a (left, right) pair of ints")
    if isinstance(window_size, int):
        window_size = (window_size, 0)
    try:
        left, right = window_size
    except (TypeError, ValueError):
        raise ValueError(
            f"window_size = {window_size!r}: expected an int or a (left, right) pair of ints"
        ) from None
    for side, value in (("left", left), ("right", right)):
        if isinstance(value, bool) or not isinstance(value, int) or value < -1:
            raise ValueError(
                f"window_size = {tuple(window_size)!r}: the {side} size must be an int >= 0, or -1 for unbounded"
            )
    if left == -1 and right == -1:
        return None
    return (left, right)


def _pairs_beyond(excess: torch.Tensor) -> torch.Tensor:
    """Per document, the (query, key) pairs more than `side` positions apart in one direction.

    `excess` is `length - (1 + side)`: a document of length s has m = s - 1 - side queries with
    keys beyond the window, contributing 1 + 2 + ... + m = m (m + 1) / 2 pairs (m (m + 1) is even).
    """
    m = torch.clamp(excess, min=0)
    return torch.div(m * (m + 1), 2, rounding_mode="floor")


def pairs_beyond(length: int, side: int) -> int:
    """Python-int twin of `_pairs_beyond` for one document of `length` tokens (-1: unbounded, none)."""
    if side < 0:
        return 0
    m = max(0, length - 1 - side)
    return m * (m + 1) // 2


@dataclass(frozen=True, eq=False)
class SeqlenStats:
    """Sums over the documents of a batch, as 0-d int64 tensors (exact; `int()` them to read).

    `tokens`/`squared` count real tokens (Σsᵢ, Σsᵢ²): the model-FLOPs numerator. The `padded_*`
    fields count what the kernels execute: `padded_tokens` is every token slot the linear layers
    see (the whole pack when its length is known), `padded_squared` sums the squared padded
    segment lengths the attention kernel runs over. `beyond_left`/`beyond_right` count pairs outside
    `window` (zero when `window` is None). `malformed_rows` counts the boundary rows that are
    malformed (see `MALFORMED`), `malformed_<kind>` the rows of each kind: the sums of a batch
    with any are wrong, and `training_flops` / `FlopsAccumulator.step` refuse them.
    """

    num_sequences: torch.Tensor
    tokens: torch.Tensor
    squared: torch.Tensor
    padded_tokens: torch.Tensor
    padded_squared: torch.Tensor
    beyond_left: torch.Tensor
    beyond_right: torch.Tensor
    padded_beyond_left: torch.Tensor
    padded_beyond_right: torch.Tensor
    malformed_rows: torch.Tensor
    malformed_first: torch.Tensor
    malformed_order: torch.Tensor
    malformed_beyond_pack: torch.Tensor
    malformed_longer_than_padded: torch.Tensor
    malformed_int64: torch.Tensor
    window: Window | None = None

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        """The tensor fields, in the order `to_vector` lays them out."""
        return tuple(f.name for f in fields(cls) if f.name != "window")

    @classmethod
    def dense(
        cls, batch: int, seq_len: int, *, window_size: int | tuple[int, int] | None = None
    ) -> SeqlenStats:
        """The BSHD case: `batch` sequences of `seq_len` real tokens each (no padding)."""
        for name, value in (("batch", batch), ("seq_len", seq_len)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"SeqlenStats.dense: {name} = {value!r} must be an int >= 0")
        window = normalize_window(window_size)
        left = pairs_beyond(seq_len, window[0]) if window else 0
        right = pairs_beyond(seq_len, window[1]) if window else 0
        num = batch if seq_len > 0 else 0
        values = (num, batch * seq_len, batch * seq_len * seq_len)
        malformed = (0,) * (1 + len(MALFORMED))
        if batch * seq_len * seq_len >= 2**63:
            raise ValueError(
                f"SeqlenStats.dense: batch * seq_len**2 = {batch * seq_len * seq_len} >= 2**63 is past the "
                "exact int64 sums"
            )
        return cls._from_ints(values + values[1:] + (batch * left, batch * right) * 2 + malformed, window)

    @classmethod
    def zeros(cls, *, window_size: int | tuple[int, int] | None = None, device=None) -> SeqlenStats:
        """Statistics of nothing: the neutral element of `+`."""
        vec = torch.zeros(len(cls.field_names()), dtype=torch.int64, device=device)
        return cls.from_vector(vec, window=normalize_window(window_size))

    @classmethod
    def _from_ints(cls, values: tuple[int, ...], window: Window | None) -> SeqlenStats:
        return cls(*(torch.tensor(v, dtype=torch.int64) for v in values), window=window)

    @classmethod
    def from_vector(cls, vec: torch.Tensor, *, window: Window | None = None) -> SeqlenStats:
        """Inverse of `to_vector`: one int64 vector back into named fields."""
        names = cls.field_names()
        if vec.shape != (len(names),):
            raise ValueError(
                f"SeqlenStats.from_vector: expected shape ({len(names)},), got {tuple(vec.shape)}"
            )
        return cls(*vec.to(torch.int64).unbind(0), window=window)

    def to_vector(self, device=None) -> torch.Tensor:
        """All fields as one int64 vector (for a single all-reduce)."""
        device = device if device is not None else self.tokens.device
        return torch.stack(
            [getattr(self, n).to(device=device, dtype=torch.int64) for n in self.field_names()]
        )

    def __add__(self, other: SeqlenStats) -> SeqlenStats:
        if not isinstance(other, SeqlenStats):
            return NotImplemented
        if self.window != other.window:
            raise ValueError(f"cannot add SeqlenStats computed for windows {self.window} and {other.window}")
        summed = (getattr(self, n) + getattr(other, n) for n in self.field_names())
        return SeqlenStats(*summed, window=self.window)

    def scaled(self, factor: int) -> SeqlenStats:
        """Every sum multiplied by `factor` (dense data parallelism: identical shapes on each rank)."""
        return SeqlenStats(*(getattr(self, n) * factor for n in self.field_names()), window=self.window)

    def malformed(self) -> dict[str, int]:
        """The malformed-row counters by kind (`MALFORMED` keys) that are not zero (reads them back)."""
        values = self.to_dict()
        return {kind: values[f"malformed_{kind}"] for kind in MALFORMED if values[f"malformed_{kind}"]}

    def to_dict(self) -> dict[str, int]:
        """The sums as exact Python ints (one device-to-host read for all fields)."""
        return dict(zip(self.field_names(), self.to_vector().tolist(), strict=True))


def describe_malformed(values: dict[str, int]) -> str:
    """One sentence on the malformed-row counters of `SeqlenStats.to_dict()` values."""
    kinds = "; ".join(
        f"{values[f'malformed_{k}']} with {MALFORMED[k]}" for k in MALFORMED if values[f"malformed_{k}"]
    )
    rows = values["malformed_rows"]
    return f"{rows} malformed boundary row{'s' if rows != 1 else ''} ({kinds}): the sums are wrong"


def _shape(cu: torch.Tensor, name: str) -> tuple[int, ...]:
    """The shape of a 1-D or 2-D boundary tensor; rejects what metadata alone shows to be wrong."""
    if not isinstance(cu, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(cu).__name__}")
    dtype, shape = cu.dtype, tuple(cu.shape)  # each read of a tensor attribute is a torch call
    if dtype.is_floating_point or dtype.is_complex or dtype == torch.bool:
        raise ValueError(f"{name} has dtype {dtype}: boundaries must be an integer tensor (int32 or int64)")
    if len(shape) not in (1, 2):
        raise ValueError(
            f"{name} has {len(shape)} dimensions (shape {list(shape)}): expected [n+1] or [micro_batch, n+1]"
        )
    if shape[-1] < 1:
        raise ValueError(f"{name} has shape {list(shape)}: each row needs at least the leading 0")
    return shape


def _as_rows(cu: torch.Tensor, name: str) -> torch.Tensor:
    """2-D view of a 1-D or 2-D boundary tensor; rejects what metadata alone shows to be wrong."""
    return cu if len(_shape(cu, name)) == 2 else cu.unsqueeze(0)


def seqlen_stats(
    cu_seqlens: torch.Tensor,
    cu_seqlens_padded: torch.Tensor | None = None,
    *,
    window_size: int | tuple[int, int] | None = None,
    pack_len: int | None = None,
) -> SeqlenStats:
    """Per-batch sums of a packed batch, sync-free (runs on `device="meta"` tensors too).

    `cu_seqlens` holds the real document boundaries; `cu_seqlens_padded` (same shape) the padded
    ones the attention kernel runs over (TE's `cu_seqlens_q_padded`), defaulting to the real ones.
    `pack_len`, when given, is the token length of each row as the linear layers see it; then
    `padded_tokens = rows * pack_len` (trailing slots after the last document included).
    Malformed rows are counted (`malformed_rows` and one counter per `MALFORMED` kind), not
    raised: raising would need a sync. `validate_cu_seqlens` says where, in debug mode.
    """
    window = normalize_window(window_size)
    vec = seqlen_stats_vector(cu_seqlens, cu_seqlens_padded, window=window, pack_len=pack_len)
    return SeqlenStats.from_vector(vec, window=window)


def _boundaries(cu_seqlens: torch.Tensor, cu_seqlens_padded: torch.Tensor | None) -> tuple[torch.Tensor, int]:
    """int64 boundaries `[rows, n+1]`, or `[2, rows, n+1]` (real, padded) with padded ones; and rows."""
    given = _shape(cu_seqlens, "cu_seqlens")
    shape = (1, *given) if len(given) == 1 else given
    if cu_seqlens_padded is not None:
        padded_given = _shape(cu_seqlens_padded, "cu_seqlens_padded")
        padded_shape = (1, *padded_given) if len(padded_given) == 1 else padded_given
        if padded_shape[0] != shape[0]:
            raise ValueError(f"cu_seqlens_padded has {padded_shape[0]} rows but cu_seqlens has {shape[0]}")
        if padded_shape != shape:
            raise ValueError(
                f"cu_seqlens_padded has shape {list(padded_given)} but cu_seqlens has shape {list(given)}: "
                "they must describe the same segments"
            )
    bounds = cu_seqlens.to(torch.int64)
    if len(given) == 1:
        bounds = bounds.unsqueeze(0)
    if cu_seqlens_padded is None:
        return bounds, shape[0]
    padded = cu_seqlens_padded.to(device=bounds.device, dtype=torch.int64)
    if len(padded_given) == 1:
        padded = padded.unsqueeze(0)
    return torch.stack([bounds, padded]), shape[0]


def _row_faults(
    bounds: torch.Tensor, last: torch.Tensor, pack_len: int | None
) -> dict[str, torch.Tensor | None]:
    """Per row (and boundary set), bool: first boundary not 0, out of order, beyond `pack_len`, int64 risk.

    `bounds` are int64 boundaries `[..., rows, n+1]`, `last` the running maximum at their end. A
    `-1` tail runs to the end of the row, so out of order is a value other than -1 that is below
    the one before it (which catches every negative value but -1) or that follows a -1. The int64
    risk bounds Σs² by Σ over rows of the row's token total squared (float64, never wraps). None:
    the kind cannot occur (no `pack_len`).
    """
    prev, nxt = bounds[..., :-1], bounds[..., 1:]
    return {
        "first": bounds[..., 0] != 0,
        "order": (((nxt < prev) | (prev == -1)) & (nxt != -1)).any(-1),
        "beyond_pack": last > pack_len if pack_len is not None else None,
        "int64": last.double().square().cumsum(-1) >= _INT64_LIMIT,
    }


def _window_columns(
    lengths: torch.Tensor, window: Window | None, rows: int, two: bool
) -> list[torch.Tensor | None]:
    """Per row, the pairs beyond each bounded side: `[left, right, padded left, padded right]`.

    Both sides (and, with `two`, both boundary sets) go through the same few kernels; None stands
    for an unbounded side (zero pairs).
    """
    columns: list[torch.Tensor | None] = [None] * 4
    if window is None:
        return columns
    sides = [i for i, side in enumerate(window) if side >= 0]
    excess = [lengths - (1 + window[i]) for i in sides]
    stacked = excess[0] if len(sides) == 1 else torch.stack(excess, dim=1 if two else 0)
    sets = 2 if two else 1
    pairs = _pairs_beyond(stacked).sum(-1).reshape(sets * len(sides), rows).unbind(0)
    for j, column in enumerate(pairs):  # (set, side) order
        k, i = divmod(j, len(sides))
        columns[2 * k + sides[i]] = column
    if not two:
        columns[2:] = columns[:2]
    return columns


def seqlen_stats_vector(
    cu_seqlens: torch.Tensor,
    cu_seqlens_padded: torch.Tensor | None = None,
    *,
    window: Window | None = None,
    pack_len: int | None = None,
) -> torch.Tensor:
    """`seqlen_stats` as one int64 vector in `SeqlenStats.field_names()` order (few kernels, no sync).

    Every field is first a per-row column (row sums of the per-document features, row fault
    flags); one concatenation and one sum over the rows then give the whole vector.
    """
    if pack_len is not None and (isinstance(pack_len, bool) or not isinstance(pack_len, int) or pack_len < 0):
        raise ValueError(f"pack_len = {pack_len!r} must be an int >= 0")
    two = cu_seqlens_padded is not None
    # Real and padded boundaries go through every kernel together: int64 [(2,) rows, n+1].
    bounds, rows = _boundaries(cu_seqlens, cu_seqlens_padded)
    running = torch.cummax(bounds, dim=-1).values
    # Segment lengths come from the running maximum, which replaces every `-1` sentinel by the
    # last real boundary, so the tail's differences are 0 (a repeated-value tail is already 0).
    lengths = running.diff(dim=-1)
    faults = _row_faults(bounds, running[..., -1], pack_len)
    tokens, squared = lengths.sum(-1), (lengths * lengths).sum(-1)
    if two:
        # Row 0 compares the real lengths with themselves: never longer.
        faults["longer_than_padded"] = (lengths[:1] > lengths).any(-1)
        real = lengths[0]
        (tokens, padded_tokens), (squared, padded_squared) = tokens.unbind(0), squared.unbind(0)
    else:
        real, padded_tokens, padded_squared = lengths, tokens, squared
    sums = [(real > 0).sum(-1), tokens, squared, padded_tokens, padded_squared]
    sums += _window_columns(lengths, window, rows, two)
    if any(c is None for c in sums):  # an unbounded window side: no pair beyond it
        zero = bounds.new_zeros(rows)
        sums = [zero if c is None else c for c in sums]
    flags = [faults.get(kind) for kind in MALFORMED]
    if any(f is None for f in flags):  # a kind that cannot occur (no pack_len, no padded boundaries)
        false = bounds.new_zeros((2, rows) if two else rows, dtype=torch.bool)
        flags = [false if f is None else f for f in flags]
    # [kind, rows]; a row is malformed when either of its boundary sets is: one `any` over the pair.
    kinds = torch.stack(flags).any(1) if two else torch.stack(flags)
    # One reduction over the rows for every field instead of one kernel (and one tensor) per field.
    # The int64 sums and the bool flags are stacked apart: on CPU, one stack of fifteen columns of
    # mixed dtypes costs several times more than two stacks and one concatenation.
    vec = torch.cat([torch.stack(sums), kinds.any(0, keepdim=True), kinds]).sum(-1)
    if pack_len is not None:
        # An in-place fill, not a host-to-device copy: stays sync-free on CUDA.
        vec[3].fill_(rows * pack_len)
    return vec


def _where(name: str, row: int, col: int, two_d: bool) -> str:
    return f"{name}[{row}, {col}]" if two_d else f"{name}[{col}]"


def _check_rows(cu: torch.Tensor, name: str, pack_len: int | None) -> list[list[int]]:
    """Validates one boundary tensor and returns its rows with the padding tail resolved."""
    rows = _as_rows(cu, name)
    two_d = cu.dim() == 2
    resolved = []
    for r, row in enumerate(rows.tolist()):
        at = lambda c, r=r: _where(name, r, c, two_d)  # noqa: E731
        if row[0] != 0:
            raise ValueError(f"{at(0)} = {row[0]}: the first boundary must be 0")
        tail_start = None
        out = [0]
        for c in range(1, len(row)):
            value = row[c]
            if value == -1:
                if tail_start is None:
                    tail_start = c
                out.append(out[-1])
                continue
            if value < 0:
                raise ValueError(f"{at(c)} = {value} is negative: only -1 may mark the padding tail")
            if tail_start is not None:
                raise ValueError(
                    f"{at(c)} = {value} follows the -1 padding tail that starts at {at(tail_start)}: "
                    "the -1 tail must run to the end of the row"
                )
            if value < row[c - 1]:
                raise ValueError(
                    f"{at(c)} = {value} is smaller than {at(c - 1)} = {row[c - 1]}: "
                    "boundaries must not decrease before the padding tail"
                )
            out.append(value)
        if pack_len is not None and out[-1] > pack_len:
            last = tail_start - 1 if tail_start is not None else len(row) - 1
            raise ValueError(
                f"{at(last)} = {out[-1]} exceeds the pack length {pack_len}: more tokens than the pack holds"
            )
        resolved.append(out)
    return resolved


def _check_squares(rows: list[list[int]], name: str, two_d: bool) -> None:
    """Raises where Σ over rows of (row token total)², the bound of Σs², reaches 2^63."""
    total = 0
    for r, row in enumerate(rows):
        total += row[-1] * row[-1]
        if total >= 2**63:
            where = f"row {r} of {name}" if two_d else name
            raise ValueError(
                f"{where}: the squared row token totals sum to {total} >= 2**63: the int64 sums of s² could wrap"
            )


def validate_cu_seqlens(
    cu_seqlens: torch.Tensor,
    cu_seqlens_padded: torch.Tensor | None = None,
    *,
    pack_len: int | None = None,
) -> None:
    """Raises ValueError saying what is wrong and where; syncs (debug mode and tests only).

    Checks: integer dtype, 1-D or 2-D, first boundary 0, no negative value except a `-1` tail
    that runs to the end, no decrease before the tail, last boundary within `pack_len`, squared
    row totals (a bound of Σs²) summing below 2^63, and for `cu_seqlens_padded`: same shape, and no real document longer than its padded segment.
    """
    real = _check_rows(cu_seqlens, "cu_seqlens", pack_len)
    _check_squares(real, "cu_seqlens", cu_seqlens.dim() == 2)
    if cu_seqlens_padded is None:
        return
    padded = _check_rows(cu_seqlens_padded, "cu_seqlens_padded", pack_len)
    _check_squares(padded, "cu_seqlens_padded", cu_seqlens.dim() == 2)
    if tuple(cu_seqlens_padded.shape) != tuple(cu_seqlens.shape):
        raise ValueError(
            f"cu_seqlens_padded has shape {list(cu_seqlens_padded.shape)} but cu_seqlens has shape "
            f"{list(cu_seqlens.shape)}: they must describe the same segments"
        )
    two_d = cu_seqlens.dim() == 2
    for r, (real_row, padded_row) in enumerate(zip(real, padded, strict=True)):
        for c in range(1, len(real_row)):
            got = real_row[c] - real_row[c - 1]
            room = padded_row[c] - padded_row[c - 1]
            if got > room:
                span = f"[{r}, {c - 1}:{c + 1}]" if two_d else f"[{c - 1}:{c + 1}]"
                raise ValueError(
                    f"segment {c - 1}{f' of row {r}' if two_d else ''} has {got} real tokens but only {room} "
                    f"padded slots (cu_seqlens{span} vs cu_seqlens_padded{span})"
                )
