"""The layout of the sequence-statistics vector, shared by the kernel, host and staging paths.

Every path that computes `SeqlenStats` produces the same int64 vector: `FIELDS` in this order,
int64 wrap-around included, so that a host computation and a device one can be compared
value for value. No torch here: the host path imports it without touching a kernel.
"""

from __future__ import annotations

__all__ = ["FIELDS", "INT64_LIMIT", "KINDS", "MALFORMED", "MALFORMED_AT", "describe_malformed", "wrap_int64"]

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
    "int64": (
        "row token totals whose squares sum to 2**63 or more, or a step's sums over its microbatches and "
        "data-parallel ranks that reach 2**63 (the int64 sums of s² could wrap)"
    ),
}
KINDS = tuple(MALFORMED)

FIELDS: tuple[str, ...] = (
    "num_sequences",
    "tokens",
    "squared",
    "padded_tokens",
    "padded_squared",
    "beyond_left",
    "beyond_right",
    "padded_beyond_left",
    "padded_beyond_right",
    "malformed_rows",
    *(f"malformed_{kind}" for kind in KINDS),
)
# Where the malformed-row counters start (`malformed_rows`, then one per kind).
MALFORMED_AT = FIELDS.index("malformed_rows")

# Σ over rows of (row token total)², an upper bound of Σs², at or past this may wrap an int64 sum.
# Compared in float64 by every path (the same rounding everywhere).
INT64_LIMIT = float(2**63)

_MASK = 2**64 - 1


def wrap_int64(value: int) -> int:
    """`value` as an int64 sum holds it: modulo 2**64, in [-2**63, 2**63)."""
    return ((value + 2**63) & _MASK) - 2**63


def describe_malformed(values: dict[str, int]) -> str:
    """One sentence on the malformed-row counters of `SeqlenStats.to_dict()` values."""
    kinds = "; ".join(
        f"{values[f'malformed_{k}']} with {MALFORMED[k]}" for k in MALFORMED if values[f"malformed_{k}"]
    )
    rows = values["malformed_rows"]
    return f"{rows} malformed boundary row{'s' if rows != 1 else ''} ({kinds}): the sums are wrong"
