"""The syncing check of packed-batch boundaries, for debug mode and tests: says what and where.

`seqlen_stats` never reads a value back and counts malformed rows instead of raising;
`validate_cu_seqlens` reads the boundaries and raises a ValueError naming the first bad index.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

__all__ = ["validate_boundary_list", "validate_cu_seqlens"]


def _as_rows(cu: torch.Tensor, name: str) -> torch.Tensor:
    """2-D view of a 1-D or 2-D boundary tensor; rejects what metadata alone shows to be wrong."""
    from accounting.boundaries import check_shape  # torch: only where a tensor is validated

    return cu if len(check_shape(cu, name)) == 2 else cu.unsqueeze(0)


def _where(name: str, row: int, col: int, two_d: bool) -> str:
    return f"{name}[{row}, {col}]" if two_d else f"{name}[{col}]"


def _check_rows(cu: torch.Tensor, name: str, pack_len: int | None) -> list[list[int]]:
    """Validates one boundary tensor and returns its rows with the padding tail resolved."""
    return _check_lists(_as_rows(cu, name).tolist(), name, pack_len, cu.dim() == 2)


def validate_boundary_list(cu: list[int], *, pack_len: int | None, name: str = "cu_seqlens") -> list[int]:
    """`validate_cu_seqlens` of one row of boundaries given as Python ints (no torch); returns the
    row with its `-1` tail resolved to the last boundary (the command line's packs)."""
    rows = _check_lists([cu], name, pack_len, False)
    _check_squares(rows, name, False)
    return rows[0]


def _check_lists(rows: list[list[int]], name: str, pack_len: int | None, two_d: bool) -> list[list[int]]:
    resolved = []
    for r, row in enumerate(rows):
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
