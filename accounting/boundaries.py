"""Boundary tensors as they arrive: what their metadata shows wrong, and where they are counted.

The checks read metadata only (type, dtype, shape, device: no value, no sync), so they run on
every microbatch and every `seqlen_stats` call. `route` is the one place a microbatch's
boundaries are sent to be counted: CPU tensors to the host's pending microbatches
(`seqlen_host.HostMicrobatches`, counted without torch), any other device's to the staged ones
(`microbatch_staging.StagedMicrobatches`, counted by one set of kernels per step). A reader
follows `cu_seqlens` from `FlopsAccumulator.add_microbatch` here, then to one of those two.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["check_boundaries", "check_pack_len", "check_shape", "on_host", "route"]

_INTEGER = frozenset({torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8})
# Unsigned boundaries are read as their values (exact in int64) up to uint32; uint64 can hold values
# of 2**63 and more, which the int64 sums cannot (one path read them as an empty pack, another raised
# a raw OverflowError), so it is refused whole, on every path alike.
_UNSIGNED_READ = frozenset({torch.uint16, torch.uint32})
_UNSIGNED_REFUSED = torch.uint64
_INT32, _INT64 = torch.int32, torch.int64  # what data loaders make: compared by identity, cheaper than a set
_STRIDED = torch.strided
# Quantized tensors keep the strided layout but hold scaled integers (a quantized "layout").
_QUANTIZED = frozenset(
    getattr(torch, name)
    for name in ("qint8", "quint8", "qint32", "quint4x2", "quint2x4")
    if hasattr(torch, name)
)
_TENSOR = torch.Tensor
_TOP = 2**63  # a pack total at or past it is past the exact int64 sums


def check_shape(cu: torch.Tensor, name: str) -> torch.Size:
    """The shape of a 1-D or 2-D boundary tensor; rejects what metadata alone shows to be wrong.

    Four tensor reads (its type, layout, dtype and shape), since it runs on every microbatch.
    """
    if type(cu) is not _TENSOR and not isinstance(cu, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(cu).__name__}")
    if cu.layout is not _STRIDED:
        raise ValueError(_layout_error(name, str(cu.layout)))
    try:
        dtype, shape = cu.dtype, cu.shape
    except RuntimeError:  # a nested tensor of strided layout has no single shape to read
        raise ValueError(_layout_error(name, "nested (torch.strided)")) from None
    if dtype is not _INT32 and dtype is not _INT64 and dtype not in _INTEGER:
        _check_dtype(dtype, name)
    if not 0 < len(shape) < 3 or shape[-1] < 1:
        raise ValueError(_shape_error(name, shape))
    return shape


def _layout_error(name: str, layout: str) -> str:
    hint = f"{name}.to_dense()" if "sparse" in layout else "one [n+1] or [micro_batch, n+1] tensor"
    return f"{name} has layout {layout}: boundaries must be a dense torch.strided tensor; pass {hint}"


def _check_dtype(dtype: torch.dtype, name: str) -> None:
    """Refuses the dtypes that are not boundaries: float, complex, bool, quantized, uint64."""
    if dtype in _UNSIGNED_READ:
        return
    if dtype is _UNSIGNED_REFUSED:
        raise ValueError(
            f"{name} has dtype {dtype}: unsigned boundaries may be at most 32 bits wide (a uint64 value can "
            f"be 2**63 or more, past the int64 sums); pass {name}.to(torch.int64)"
        )
    if dtype.is_floating_point or dtype.is_complex or dtype == torch.bool:
        raise ValueError(f"{name} has dtype {dtype}: boundaries must be an integer tensor (int32 or int64)")
    if dtype in _QUANTIZED:
        raise ValueError(
            f"{name} has dtype {dtype}, layout quantized: boundaries must be a plain integer tensor (int32 or "
            f"int64); pass {name}.dequantize().round().to(torch.int64)"
        )
    # Anything else (bit types, sub-byte integer shells) holds no plain integers either.
    raise ValueError(f"{name} has dtype {dtype}: boundaries must be an integer tensor (int32 or int64)")


def _shape_error(name: str, shape: torch.Size) -> str:
    if len(shape) not in (1, 2):
        return (
            f"{name} has {len(shape)} dimensions (shape {list(shape)}): expected [n+1] or [micro_batch, n+1]"
        )
    return f"{name} has shape {list(shape)}: each row needs at least the leading 0"


def check_boundaries(cu_seqlens: torch.Tensor, cu_seqlens_padded: torch.Tensor | None) -> tuple[bool, int]:
    """Whether the boundaries are 2-D, and their rows; rejects what metadata alone shows to be wrong."""
    shape = check_shape(cu_seqlens, "cu_seqlens")
    rows = shape[0] if len(shape) == 2 else 1
    if cu_seqlens_padded is not None:
        _check_padded(shape, rows, cu_seqlens_padded)
    return len(shape) == 2, rows


def _check_padded(given: torch.Size, rows: int, cu_seqlens_padded: torch.Tensor) -> None:
    """The padded boundaries describe the same segments as the real ones (`given`, `rows`)."""
    padded_given = check_shape(cu_seqlens_padded, "cu_seqlens_padded")
    padded_rows = padded_given[0] if len(padded_given) == 2 else 1
    if padded_rows != rows:
        raise ValueError(f"cu_seqlens_padded has {padded_rows} rows but cu_seqlens has {rows}")
    if padded_given[-1] != given[-1]:
        raise ValueError(
            f"cu_seqlens_padded has shape {list(padded_given)} but cu_seqlens has shape {list(given)}: "
            "they must describe the same segments"
        )


def check_pack_len(pack_len: int | None, rows: int) -> None:
    """`pack_len` is None or an int >= 0 whose pack total (rows x pack_len) fits an int64."""
    if pack_len is None:
        return
    if isinstance(pack_len, bool) or not isinstance(pack_len, int) or pack_len < 0:
        raise ValueError(f"pack_len = {pack_len!r} must be an int >= 0")
    if rows * pack_len >= _TOP:
        raise ValueError(f"pack_len = {pack_len}: {rows} rows of it are past the exact int64 sums")


def on_host(cu: torch.Tensor, padded: torch.Tensor | None = None) -> bool:
    """Whether the boundaries are plain CPU tensors, whose buffers the host path may read."""
    if type(cu) is not _TENSOR or not cu.is_cpu:
        return False
    return padded is None or (type(padded) is _TENSOR and padded.is_cpu)


def route(
    index: int,
    cu: torch.Tensor,
    padded: torch.Tensor | None,
    pack_len: int | None,
    host: Any,
    device: Any,
) -> None:
    """Checks microbatch `index`'s boundaries and hands them to `host` (CPU tensors; None: never)
    or to `device` (a `StagedMicrobatches`): the one host-or-device decision of a microbatch."""
    shape = check_shape(cu, "cu_seqlens")
    two_d = len(shape) == 2
    rows = shape[0] if two_d else 1
    if padded is not None:
        _check_padded(shape, rows, padded)
    if pack_len is not None and not (type(pack_len) is int and pack_len >= 0 and rows * pack_len < _TOP):
        check_pack_len(pack_len, rows)  # raises, saying which
    # `on_host`, written out: this runs on every microbatch.
    if host is not None and type(cu) is _TENSOR and cu.is_cpu and (padded is None or on_host(padded)):
        host.add(index, cu, padded, two_d, rows * shape[-1], pack_len)
    else:
        device.add(index, cu, padded, rows, shape[-1], pack_len)
