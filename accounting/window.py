"""The attention window convention, shared by the statistics and the FLOPs formulas (no torch).

`window_size` is `(left, right)` as in megatron-core / flash-attention, `-1` meaning unbounded;
query `i` may see key `j` only when `i - left <= j <= i + right`. An int `w` means `(w, 0)`.
"""

from __future__ import annotations

__all__ = ["Window", "normalize_window", "pairs_beyond"]

Window = tuple[int, int]


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


def pairs_beyond(length: int, side: int) -> int:
    """The (query, key) pairs of one document of `length` tokens more than `side` apart (-1: none)."""
    if side < 0:
        return 0
    m = max(0, length - 1 - side)
    return m * (m + 1) // 2
