"""A step's int64 sums, checked for wrap-around by the high words that travel beside them.

One microbatch's statistics are refused when its own sums could wrap (the `int64` malformed kind),
but a step adds its microbatches' vectors, and `resolve` adds the data-parallel ranks' with one
int64 SUM all-reduce: valid microbatches can pass 2**63 together, and the sum wraps silently.
So every sum carries, field by field, `Σ (addend >> 32)`: the addends' high words (a host total,
summed exactly in Python, is one addend). An int64 addend's is below 2**31 in size, so their sum
cannot wrap, and the all-reduce sums them with the statistics (one tensor, one collective). With
the exact sum `T = Σ addends` and the int64 sum `W`: `T >> 32` lies in `[high, high + addends)`,
and each wrap past 2**63 takes 2**64 from `W`, 2**32 from `W >> 32`; for fewer than 2**32 addends
the sum wrapped upward exactly when `(W >> 32) < high` (a field summed without a wrap never is). Deciding that is one comparison, kept on the device until someone reads the statistics: a
wrapped sum is then one more malformed row of the `int64` kind, which `step` and `training_flops`
refuse. (A downward wrap needs negative addends, which only malformed rows give: refused already.)
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from accounting.seqlen_fields import FIELDS, MALFORMED_AT, wrap_int64

__all__ = [
    "FLAG_SLICE",
    "WORD",
    "exact_sums",
    "fold_",
    "fold_ints",
    "high_words",
    "unfold_",
    "wrapped_fields",
]

WORD = 32  # bits of the low word: what `>> WORD` drops from each addend
_INT64 = FIELDS.index("malformed_int64")
# `malformed_rows` and `malformed_int64`, as one strided slice of the vector (a view: no kernel).
FLAG_SLICE = slice(MALFORMED_AT, _INT64 + 1, _INT64 - MALFORMED_AT)
assert FIELDS[FLAG_SLICE] == ("malformed_rows", "malformed_int64")


def high_words(exact: Sequence[int]) -> list[int]:
    """The high words of exact sums held as Python ints (one addend each)."""
    return [value >> WORD for value in exact]


def wrapped_fields(sums: Sequence[int], high: Sequence[int]) -> list[str]:
    """The fields whose int64 sum (`sums`, as read back) wrapped past 2**63, given their high words."""
    return [name for name, w, h in zip(FIELDS, sums, high, strict=True) if (w >> WORD) < h]


def exact_sums(sums: Sequence[int], high: Sequence[int]) -> list[int]:
    """What the wrapped sums were before they wrapped (fewer than 2**32 non-negative addends)."""
    return [(h << WORD) + ((w - (h << WORD)) % 2**64) for w, h in zip(sums, high, strict=True)]


def fold_ints(ints: Sequence[int], high: Sequence[int]) -> tuple[tuple[int, ...], int]:
    """Host sums with a wrapped one counted as a malformed `int64` row, and that count (0 or 1)."""
    if not wrapped_fields(ints, high):
        return tuple(ints), 0
    folded = list(ints)
    for at in range(len(FIELDS))[FLAG_SLICE]:
        folded[at] = wrap_int64(folded[at] + 1)
    return tuple(folded), 1


def fold_(vector: torch.Tensor, high: torch.Tensor) -> torch.Tensor:
    """Counts a wrapped sum of the int64 `vector` as a malformed `int64` row, in place (three
    kernels and an add, no read); returns that count as a 0-d bool tensor, for `unfold_`."""
    wrapped = torch.lt(vector >> WORD, high).any()
    vector[FLAG_SLICE].add_(wrapped)
    return wrapped


def unfold_(vector: torch.Tensor, wrapped: torch.Tensor | int) -> None:
    """Takes back, in place, what `fold_` or `fold_ints` counted (before the sums are summed again)."""
    vector[FLAG_SLICE].add_(wrapped, alpha=-1)  # `sub_` refuses a bool tensor
