"""Sequence-length statistics of packed (THD) batches: sync-free on a device, kernel-free on the host.

A packed micro-batch is described by `cu_seqlens`, the cumulative document boundaries
`[0, s0, s0+s1, ...]`, either 1-D `[n+1]` or 2-D `[micro_batch, n+1]`. Two tail-padding
conventions are in use upstream and both are accepted here: a `-1` sentinel tail (legacy
Megatron-Bridge collate) and a repeated-last-value tail (zero-length segments, current collate and
CUDA graphs). `seqlen_stats` never reads a device value back to the host: boundaries on a device
(or `meta`) go through a fixed set of torch kernels (`seqlen_kernels`); boundaries in host memory
(CPU tensors) are read from their own buffer and summed without torch dispatch (`seqlen_host`),
to the same int64 vector. `validate_cu_seqlens` is the separate, syncing check for debug mode and
tests.

Window convention (shared with `accounting.flops`): `window_size` is `(left, right)` as in
megatron-core / flash-attention, `-1` meaning unbounded; query `i` may see key `j` only when
`i - left <= j <= i + right`. An int `w` means `(w, 0)`. The statistics carry, per side, the exact
number of (query, key) pairs of each document that fall outside the window, summed over documents.
"""

from __future__ import annotations

from typing import Any

import torch

from accounting.boundaries import check_boundaries, check_pack_len, on_host
from accounting.seqlen_fields import FIELDS, MALFORMED, describe_malformed, wrap_int64
from accounting.seqlen_host import host_values
from accounting.seqlen_kernels import row_columns
from accounting.seqlen_validate import validate_cu_seqlens
from accounting.window import Window, normalize_window, pairs_beyond

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


def to_device(vector: torch.Tensor, device: torch.device | str | None) -> torch.Tensor:
    """A host vector on `device`; to CUDA from pinned memory without blocking (no host sync)."""
    device = torch.device(device) if device is not None else vector.device
    if device.type == "cuda":
        return vector.pin_memory().to(device, non_blocking=True)
    return vector.to(device)


def _field(index: int, name: str) -> property:
    def get(self: SeqlenStats) -> torch.Tensor:
        return self._tensors()[index]

    return property(get, doc=f"`{name}` as a 0-d int64 tensor.")


class SeqlenStats:
    """Sums over the documents of a batch; each field a 0-d int64 tensor (exact; `int()` it to read).

    `tokens`/`squared` count real tokens (Σsᵢ, Σsᵢ²): the model-FLOPs numerator. The `padded_*`
    fields count what the kernels execute: `padded_tokens` is every token slot the linear layers
    see (the whole pack when its length is known), `padded_squared` sums the squared padded
    segment lengths the attention kernel runs over. `beyond_left`/`beyond_right` count pairs outside
    `window` (zero when `window` is None). `malformed_rows` counts the boundary rows that are
    malformed (see `MALFORMED`), `malformed_<kind>` the rows of each kind: the sums of a batch
    with any are wrong, and `training_flops` / `FlopsAccumulator.step` refuse them.

    Immutable. Held as whichever the statistics came as (exact Python ints from the host path,
    one int64 vector from the kernels, or the fifteen tensors given to the constructor); field
    tensors are made on first access, so statistics nobody looks at as tensors cost no torch call.
    """

    __slots__ = ("_fields", "_ints", "_vector", "window")

    def __init__(self, *values: torch.Tensor, window: Window | None = None, **named: torch.Tensor) -> None:
        names = FIELDS[len(values) :]
        if len(values) > len(FIELDS) or set(named) != set(names):
            raise TypeError(f"SeqlenStats takes the {len(FIELDS)} fields {FIELDS}, positional or by name")
        self._set(None, None, (*values, *(named[n] for n in names)), window)

    def _set(self, ints, vector, tensors, window) -> None:
        set_ints, set_vector, set_fields, set_window = _SLOT_SETTERS  # past the refusing __setattr__
        set_ints(self, ints)
        set_vector(self, vector)
        set_fields(self, tensors)
        set_window(self, window)

    @classmethod
    def _from_ints(cls, values: list[int] | tuple[int, ...], window: Window | None) -> SeqlenStats:
        """From exact ints in `FIELDS` order, each already within int64 (no torch call)."""
        stats = cls.__new__(cls)
        stats._set(tuple(values), None, None, window)
        return stats

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"SeqlenStats is immutable: cannot set {name!r}")

    def __reduce__(self):
        if self._ints is not None:
            return (SeqlenStats._from_ints, (self._ints, self.window))
        return (_from_vector_kw, (self.to_vector(), self.window))

    def __repr__(self) -> str:
        if self._ints is not None:
            return f"SeqlenStats({dict(zip(FIELDS, self._ints, strict=True))}, window={self.window})"
        return f"SeqlenStats(vector={self.to_vector()!r}, window={self.window})"

    def held_ints(self) -> tuple[int, ...] | None:
        """The exact ints when held on the host (statistics of CPU boundaries), else None: free to read."""
        return self._ints

    def _tensors(self) -> tuple[torch.Tensor, ...]:
        if self._fields is None:
            vector = self._vector if self._vector is not None else torch.tensor(self._ints, dtype=torch.int64)
            object.__setattr__(self, "_fields", tuple(vector.unbind(0)))
        return self._fields

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        """The tensor fields, in the order `to_vector` lays them out."""
        return FIELDS

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
        if batch * seq_len * seq_len >= 2**63:
            raise ValueError(
                f"SeqlenStats.dense: batch * seq_len**2 = {batch * seq_len * seq_len} >= 2**63 is past the "
                "exact int64 sums"
            )
        malformed = (0,) * (1 + len(MALFORMED))
        return cls._from_ints(values + values[1:] + (batch * left, batch * right) * 2 + malformed, window)

    @classmethod
    def zeros(cls, *, window_size: int | tuple[int, int] | None = None, device=None) -> SeqlenStats:
        """Statistics of nothing: the neutral element of `+` (on `device` when given)."""
        window = normalize_window(window_size)
        if device is None or torch.device(device).type == "cpu":
            return cls._from_ints((0,) * len(FIELDS), window)
        return cls.from_vector(torch.zeros(len(FIELDS), dtype=torch.int64, device=device), window=window)

    @classmethod
    def from_vector(cls, vec: torch.Tensor, *, window: Window | None = None) -> SeqlenStats:
        """Inverse of `to_vector`: one int64 vector back into named fields (kept, not copied)."""
        if vec.shape != (len(FIELDS),):
            raise ValueError(
                f"SeqlenStats.from_vector: expected shape ({len(FIELDS)},), got {tuple(vec.shape)}"
            )
        stats = cls.__new__(cls)
        stats._set(None, vec.to(torch.int64), None, window)
        return stats

    def to_vector(self, device=None) -> torch.Tensor:
        """All fields as one new int64 vector (for a single all-reduce); on `device` when given."""
        if self._vector is not None:
            return self._vector.to(device=device if device is not None else self._vector.device, copy=True)
        if self._ints is not None:
            vector = torch.tensor(self._ints, dtype=torch.int64)
            return vector if device is None else to_device(vector, device)
        device = device if device is not None else self._fields[1].device
        return torch.stack([f.to(device=device, dtype=torch.int64) for f in self._fields])

    def _as_vector(self, device) -> torch.Tensor:
        """The vector without a copy where it is held as one (for arithmetic that makes a new one)."""
        if self._vector is not None and (device is None or self._vector.device == device):
            return self._vector
        return self.to_vector(device)

    def __add__(self, other: SeqlenStats) -> SeqlenStats:
        if not isinstance(other, SeqlenStats):
            return NotImplemented
        if self.window != other.window:
            raise ValueError(f"cannot add SeqlenStats computed for windows {self.window} and {other.window}")
        if self._ints is not None and other._ints is not None:
            summed = (wrap_int64(a + b) for a, b in zip(self._ints, other._ints, strict=True))
            return SeqlenStats._from_ints(tuple(summed), self.window)
        held = self if self._ints is None else other  # the device of a tensor-held one wins
        device = (held._vector if held._vector is not None else held._fields[1]).device
        return SeqlenStats.from_vector(self._as_vector(device) + other._as_vector(device), window=self.window)

    def scaled(self, factor: int) -> SeqlenStats:
        """Every sum multiplied by `factor` (dense data parallelism: identical shapes on each rank)."""
        if self._ints is not None:
            return SeqlenStats._from_ints(tuple(wrap_int64(v * factor) for v in self._ints), self.window)
        return SeqlenStats.from_vector(self._as_vector(None) * factor, window=self.window)

    def malformed(self) -> dict[str, int]:
        """The malformed-row counters by kind (`MALFORMED` keys) that are not zero (reads them back)."""
        values = self.to_dict()
        return {kind: values[f"malformed_{kind}"] for kind in MALFORMED if values[f"malformed_{kind}"]}

    def to_dict(self) -> dict[str, int]:
        """The sums as exact Python ints (one device-to-host read for all fields; none on the host path)."""
        if self._ints is not None:
            return dict(zip(FIELDS, self._ints, strict=True))
        return dict(zip(FIELDS, self._as_vector(None).tolist(), strict=True))


for _i, _name in enumerate(FIELDS):
    setattr(SeqlenStats, _name, _field(_i, _name))
# The slots' own setters: statistics are made once per step at least, and a slot's setter is
# about half the cost of `object.__setattr__` by name.
_SLOT_SETTERS = tuple(
    SeqlenStats.__dict__[slot].__set__ for slot in ("_ints", "_vector", "_fields", "window")
)


def _from_vector_kw(vector: torch.Tensor, window: Window | None) -> SeqlenStats:
    return SeqlenStats.from_vector(vector, window=window)


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
    CPU tensors are counted on the host (no kernel), others with kernels on their device.
    """
    window = normalize_window(window_size)
    two_d, rows = check_boundaries(cu_seqlens, cu_seqlens_padded)
    check_pack_len(pack_len, rows)
    if on_host(cu_seqlens, cu_seqlens_padded):
        values = host_values(cu_seqlens, cu_seqlens_padded, two_d, window=window, pack_len=pack_len)
        return SeqlenStats._from_ints(values, window)
    vec = kernel_vector(cu_seqlens, cu_seqlens_padded, two_d, rows, window=window, pack_len=pack_len)
    return SeqlenStats.from_vector(vec, window=window)


def seqlen_stats_vector(
    cu_seqlens: torch.Tensor,
    cu_seqlens_padded: torch.Tensor | None = None,
    *,
    window: Window | None = None,
    pack_len: int | None = None,
) -> torch.Tensor:
    """`seqlen_stats` as one int64 vector in `SeqlenStats.field_names()` order, with torch kernels.

    Always the kernel path, on the tensors' device (CPU included: the reference the host path is
    compared with). A fixed number of kernels whatever the pack; no sync.
    """
    two_d, rows = check_boundaries(cu_seqlens, cu_seqlens_padded)
    check_pack_len(pack_len, rows)
    return kernel_vector(cu_seqlens, cu_seqlens_padded, two_d, rows, window=window, pack_len=pack_len)


def kernel_vector(
    cu_seqlens: torch.Tensor,
    cu_seqlens_padded: torch.Tensor | None,
    two_d: bool,
    rows: int,
    *,
    window: Window | None,
    pack_len: int | None,
) -> torch.Tensor:
    """The kernel path of checked boundaries: per-row columns, one sum over the rows."""
    bounds = cu_seqlens.to(torch.int64)
    bounds = bounds if two_d else bounds.unsqueeze(0)
    if cu_seqlens_padded is None:
        bounds = bounds.unsqueeze(0)
    else:
        padded = cu_seqlens_padded.to(device=bounds.device, dtype=torch.int64)
        bounds = torch.stack([bounds, padded if padded.dim() == 2 else padded.unsqueeze(0)])
    vec = row_columns(bounds, window=window, limit=pack_len).sum(-1)
    if pack_len is not None:
        # An in-place fill, not a host-to-device copy: stays sync-free on CUDA.
        vec[3].fill_(rows * pack_len)
    return vec
