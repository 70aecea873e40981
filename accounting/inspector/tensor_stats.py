"""Mergeable tensor statistics: one device-side row of partial sums per tensor, merged on the host.

`partial_stats` reduces a tensor to a small float64 row without a host sync, so a hook keeps no
activation alive; `combine_partials` merges the rows of several microbatches with Chan et al.'s
parallel formula, giving the statistics of their concatenation. Pure torch + math.
"""

from __future__ import annotations

import math

import torch

SUPPORTED_STATS = ("min", "max", "mean", "std", "l1_norm", "l2_norm", "nan_count", "inf_count")

# Column layout of one partial-statistics row.
_N, _MIN, _MAX, _SUM, _M2, _L1, _SQ, _NAN, _INF = range(9)


def partial_stats(tensor: torch.Tensor) -> torch.Tensor:
    """One float64 row of mergeable partial statistics of `tensor`, computed on its device.

    Columns: count, min, max, sum, centred sum of squares (M2), sum |x|, sum x^2, NaN count,
    inf count. No host sync: the row stays on the tensor's device. Half-precision tensors
    (bf16, fp16) are widened to float32 first, which is exact.
    """
    x = tensor.detach().reshape(-1)
    if x.is_floating_point() and x.dtype != torch.float64:
        x = x.float()
    elif not x.is_floating_point():
        x = x.double()
    n = x.numel()
    if n == 0:
        nan = torch.full((), math.nan, dtype=torch.float64, device=x.device)
        zero = torch.zeros((), dtype=torch.float64, device=x.device)
        return torch.stack([zero, nan, nan, zero, zero, zero, zero, zero, zero])
    f64 = torch.float64
    # Sums accumulate in float64 (no float64 copy of the tensor is made); the mean is then
    # accurate to the tensor's own precision, so a constant tensor gets M2 = 0 exactly.
    total = x.sum(dtype=f64)
    mean = (total / n).to(x.dtype)
    parts = [
        torch.full((), float(n), dtype=f64, device=x.device),
        x.min(),
        x.max(),
        total,
        (x - mean).square().sum(dtype=f64),
        x.abs().sum(dtype=f64),
        x.square().sum(dtype=f64),
        x.isnan().sum(),
        x.isinf().sum(),
    ]
    return torch.stack([p.to(torch.float64) for p in parts])


def combine_partials(rows: list[list[float]], stats: tuple[str, ...]) -> dict[str, float | int]:
    """The requested statistics of the concatenation of the tensors behind `rows` (host floats).

    Means and centred sums of squares merge by Chan et al.'s parallel formula, which stays
    accurate where `sum x^2 - n mean^2` would cancel. `std` is unbiased (`torch.std`'s default,
    as nvdlfw-inspect and TE use); a tensor containing NaN yields NaN for every statistic except
    the counts, as torch's own reductions do.
    """
    n = sum(r[_N] for r in rows)
    total = sum(r[_SUM] for r in rows)
    mean = total / n if n else math.nan
    m2 = sum(r[_M2] for r in rows) + sum(r[_N] * (r[_SUM] / r[_N] - mean) ** 2 for r in rows if r[_N])
    values: dict[str, float | int] = {
        # Empty tensors (count 0) have no extremes; they only add zeros to the sums.
        "min": min((r[_MIN] for r in rows if r[_N]), key=_nan_first, default=math.nan),
        "max": max((r[_MAX] for r in rows if r[_N]), key=_nan_last, default=math.nan),
        "mean": mean,
        "std": math.sqrt(m2 / (n - 1)) if n > 1 and m2 == m2 else math.nan,
        "l1_norm": sum(r[_L1] for r in rows),
        "l2_norm": math.sqrt(sum(r[_SQ] for r in rows)),
        "nan_count": int(sum(r[_NAN] for r in rows)),
        "inf_count": int(sum(r[_INF] for r in rows)),
    }
    return {s: values[s] for s in stats}


def _nan_first(v: float) -> tuple[int, float]:
    # A NaN anywhere makes min/max NaN, as torch.min/max do on the whole tensor.
    return (0, 0.0) if v != v else (1, v)


def _nan_last(v: float) -> tuple[int, float]:
    return (1, 0.0) if v != v else (0, v)
