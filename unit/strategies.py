"""Shared hypothesis strategies: packed batches in every padding form, model shapes, memory reports.

Other test modules import these; every strategy draws plain Python data first (document
lengths, key names) so that tests can compute their expected values with plain loops, and only
then builds tensors from it.

- `packs()` draws a `Pack`: per-row document lengths, per-document padding, a padding-tail form
  ("sentinel" -1 tail or "repeat" repeated last value), int32/int64, 1-D or 2-D, ragged rows.
  `Pack.cu_seqlens(form=..., dtype=...)` renders the same pack in any form, so invariance
  properties compare renderings of one drawn pack.
- `raw_boundaries()` draws boundary rows that may be malformed (a valid pack with entries
  overwritten by arbitrary small ints), with or without padded rows and a pack length.
- `stats_inputs()` draws what `seqlen_stats` takes, as tensors: a valid pack or raw (often
  malformed) rows, padded boundaries or not, a pack length or not, a window or not.
- `model_shapes()` draws valid `ModelShape`s (MHA/GQA, gated or not, MoE with shared experts and
  int or list `moe_layer_freq`, MTP, windows with int or list `window_attn_skip_freq`, causal or not); `dense_megatron_shapes()` only those
  Megatron-LM's formula covers without a window.
- `memory_reports(keys)` draws one report with the given keys (ints, floats, bools),
  `memory_report_keys()` a key set, `rank_memory_reports(n)` n reports sharing one key set.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from hypothesis import strategies as st

from accounting import ModelShape, SeqlenStats, seqlen_stats

__all__ = [
    "DTYPES",
    "FORMS",
    "Pack",
    "cu_from_lengths",
    "dense_megatron_shapes",
    "doc_lengths",
    "memory_report_keys",
    "memory_reports",
    "model_shapes",
    "pack_stats",
    "packs",
    "rank_memory_reports",
    "raw_boundaries",
    "stats_inputs",
    "windows",
]

FORMS = ("sentinel", "repeat")
DTYPES = (torch.int32, torch.int64)


def cu_from_lengths(lengths: list[int], width: int, form: str) -> list[int]:
    """Boundaries `[0, l0, l0+l1, ...]` padded to `width` entries with the given tail form."""
    cu = [0]
    for length in lengths:
        cu.append(cu[-1] + length)
    fill = -1 if form == "sentinel" else cu[-1]
    return cu + [fill] * (width - len(cu))


def pack_stats(lengths: list[int]) -> SeqlenStats:
    """`seqlen_stats` of one unpadded pack of documents of these lengths."""
    return seqlen_stats(torch.tensor(cu_from_lengths(lengths, len(lengths) + 1, "repeat")))


@dataclass(frozen=True)
class Pack:
    """A packed micro-batch as plain data: `rows[r]` are row r's real document lengths."""

    rows: tuple[tuple[int, ...], ...]
    pads: tuple[tuple[int, ...], ...]  # padded slots added after each document (padded = real + pad)
    tail: int  # extra padding entries after the longest row's last boundary
    spare: int  # pack slots after the last padded document (trailing padding tokens)
    form: str
    dtype: torch.dtype
    two_d: bool

    @property
    def padded_rows(self) -> tuple[tuple[int, ...], ...]:
        return tuple(
            tuple(r + p for r, p in zip(row, pad, strict=True))
            for row, pad in zip(self.rows, self.pads, strict=True)
        )

    @property
    def width(self) -> int:
        return max(len(row) for row in self.rows) + 1 + self.tail

    @property
    def pack_len(self) -> int:
        return max(sum(row) for row in self.padded_rows) + self.spare

    @property
    def lengths(self) -> list[int]:
        """All real document lengths, every row."""
        return [length for row in self.rows for length in row]

    @property
    def padded_lengths(self) -> list[int]:
        return [length for row in self.padded_rows for length in row]

    def _render(self, rows, form, dtype, device) -> torch.Tensor:
        form = form or self.form
        data = [cu_from_lengths(list(row), self.width, form) for row in rows]
        t = torch.tensor(data if self.two_d else data[0], dtype=dtype or self.dtype)
        return t.to(device) if device is not None else t

    def cu_seqlens(
        self, *, form: str | None = None, dtype: torch.dtype | None = None, device=None
    ) -> torch.Tensor:
        """The real boundaries rendered in `form`/`dtype` (default: the drawn ones)."""
        return self._render(self.rows, form, dtype, device)

    def cu_seqlens_padded(
        self, *, form: str | None = None, dtype: torch.dtype | None = None, device=None
    ) -> torch.Tensor:
        """The padded boundaries, same shape as `cu_seqlens()`."""
        return self._render(self.padded_rows, form, dtype, device)


def doc_lengths(*, min_docs: int = 0, max_docs: int = 8, max_len: int = 64) -> st.SearchStrategy[list[int]]:
    """Document lengths (>= 1; zero-length segments are what the padding forms add)."""
    return st.lists(st.integers(1, max_len), min_size=min_docs, max_size=max_docs)


@st.composite
def packs(
    draw,
    *,
    two_d: bool | None = None,
    max_rows: int = 4,
    max_docs: int = 6,
    max_len: int = 64,
    min_docs: int = 0,
    padded: bool | None = None,
) -> Pack:
    """A `Pack` in a random padding form, dtype and rank; 2-D rows are ragged (different counts)."""
    two_d = draw(st.booleans()) if two_d is None else two_d
    n_rows = draw(st.integers(1, max_rows)) if two_d else 1
    rows = tuple(
        tuple(draw(doc_lengths(min_docs=min_docs, max_docs=max_docs, max_len=max_len))) for _ in range(n_rows)
    )
    with_pad = draw(st.booleans()) if padded is None else padded
    pads = tuple(tuple(draw(st.integers(0, 7)) if with_pad else 0 for _ in row) for row in rows)
    return Pack(
        rows=rows,
        pads=pads,
        tail=draw(st.integers(0, 3)),
        spare=draw(st.integers(0, 16)),
        form=draw(st.sampled_from(FORMS)),
        dtype=draw(st.sampled_from(DTYPES)),
        two_d=two_d,
    )


@dataclass(frozen=True)
class RawBoundaries:
    """Boundary rows as plain lists, possibly malformed, plus optional padded rows and pack length."""

    rows: list[list[int]]
    padded: list[list[int]] | None
    pack_len: int | None


@st.composite
def raw_boundaries(draw, *, max_rows: int = 3) -> RawBoundaries:
    """A drawn pack whose entries are then overwritten at random by ints in [-3, 40]."""
    pack = draw(packs(two_d=True, max_rows=max_rows, max_docs=4, max_len=12))
    value = st.integers(-3, 40)

    def corrupt(rows: list[list[int]]) -> list[list[int]]:
        out = [list(row) for row in rows]
        for _ in range(draw(st.integers(0, 2))):
            r = draw(st.integers(0, len(out) - 1))
            out[r][draw(st.integers(0, len(out[r]) - 1))] = draw(value)
        return out

    rows = corrupt(pack.cu_seqlens().tolist())
    padded = corrupt(pack.cu_seqlens_padded().tolist()) if draw(st.booleans()) else None
    pack_len = draw(st.one_of(st.none(), st.just(pack.pack_len), st.integers(0, 40)))
    return RawBoundaries(rows=rows, padded=padded, pack_len=pack_len)


def windows(*, bounded: bool = False) -> st.SearchStrategy:
    """A window_size as ModelShape/seqlen_stats accept it: an int, a (left, right) pair, or None.

    Sizes stay small (<= 24) so that they clip the drawn documents; `bounded=True` always bounds
    the left side (never None, never -1 on the left).
    """
    size = st.integers(0, 24)
    side = st.one_of(st.just(-1), size)
    if bounded:
        return st.one_of(size, st.tuples(size, side))
    return st.one_of(st.none(), size, st.tuples(side, side))


@st.composite
def model_shapes(
    draw, *, moe: bool | None = None, window: bool | None = None, mtp: bool | None = None
) -> ModelShape:
    """A small valid ModelShape; MoE, window and MTP on or off at random unless fixed."""
    heads = draw(st.sampled_from([1, 2, 4, 8]))
    groups = draw(st.sampled_from([g for g in (1, 2, 4, 8) if heads % g == 0]))
    kv = draw(st.sampled_from([4, 8, 16]))
    hidden = draw(st.sampled_from([16, 32, 64]))
    layers = draw(st.integers(1, 6))
    use_moe = draw(st.booleans()) if moe is None else moe
    kwargs = {}
    if use_moe:
        experts = draw(st.integers(1, 8))
        freq = draw(
            st.one_of(st.integers(1, 3), st.lists(st.sampled_from([0, 1]), min_size=layers, max_size=layers))
        )
        kwargs.update(
            num_moe_experts=experts,
            moe_router_topk=draw(st.integers(1, experts)),
            moe_ffn_hidden_size=draw(st.sampled_from([8, 24, 48])),
            moe_shared_expert_intermediate_size=draw(st.sampled_from([None, 0, 16, 32])),
            moe_layer_freq=freq,
        )
    use_window = draw(st.booleans()) if window is None else window
    use_mtp = draw(st.booleans()) if mtp is None else mtp
    return ModelShape(
        num_layers=layers,
        hidden_size=hidden,
        ffn_hidden_size=draw(st.sampled_from([32, 64, 96])),
        num_attention_heads=heads,
        num_query_groups=groups,
        kv_channels=kv,
        vocab_size=draw(st.sampled_from([64, 128, 1000])),
        gated_linear_unit=draw(st.booleans()),
        mtp_num_layers=draw(st.integers(1, 2)) if use_mtp else None,
        window_size=draw(windows(bounded=True)) if use_window else None,
        window_attn_skip_freq=draw(
            st.one_of(
                st.none(),
                st.integers(1, 3),
                st.lists(st.sampled_from([0, 1]), min_size=layers, max_size=layers),
            )
        )
        if use_window
        else None,
        attention_output_gate=draw(st.booleans()),
        causal=draw(st.booleans()),
        **kwargs,
    )


def dense_megatron_shapes() -> st.SearchStrategy[ModelShape]:
    """Shapes Megatron-LM's num_floating_point_operations covers: causal, no window."""
    return model_shapes(window=False).filter(lambda s: s.causal)


_MEMORY_KEY_NAMES = (
    "allocated_bytes",
    "peak_allocated_bytes",
    "reserved_bytes",
    "peak_reserved_bytes",
    "alloc_retries",
    "ooms",
    "rss_bytes",
    "fragmentation",
    "offloaded",
)


def memory_report_keys(min_size: int = 1) -> st.SearchStrategy[tuple[tuple[str, str], ...]]:
    """(key, kind) pairs, kind in int/float/bool; the key set a group of ranks shares."""
    kinds = st.sampled_from(["int", "float", "bool"])
    return st.lists(
        st.tuples(st.sampled_from(_MEMORY_KEY_NAMES), kinds),
        min_size=min_size,
        max_size=6,
        unique_by=lambda kv: kv[0],
    ).map(tuple)


def memory_reports(keys: tuple[tuple[str, str], ...]) -> st.SearchStrategy[dict]:
    """One report with exactly these keys; ints up to 2**50 bytes (exact in float64)."""
    value = {
        "int": st.integers(0, 2**50),
        "float": st.floats(0, 1e12, allow_nan=False, allow_infinity=False),
        "bool": st.booleans(),
    }
    return st.fixed_dictionaries({k: value[kind] for k, kind in keys})


def rank_memory_reports(n: int) -> st.SearchStrategy[list[dict]]:
    """`n` reports (one per rank) that share one key set."""
    return memory_report_keys().flatmap(lambda keys: st.lists(memory_reports(keys), min_size=n, max_size=n))


@dataclass(frozen=True)
class StatsInput:
    """Everything `seqlen_stats` takes, as tensors: a drawn pack or malformed boundary rows."""

    cu_seqlens: torch.Tensor
    cu_seqlens_padded: torch.Tensor | None
    pack_len: int | None
    window: tuple[int, int] | None


@st.composite
def stats_inputs(draw, *, malformed: bool | None = None) -> StatsInput:
    """Boundaries `seqlen_stats` may be given: a valid `Pack` in any form, dtype and rank, or
    `raw_boundaries` rows (often malformed), with or without padded ones, a pack length, a window."""
    from accounting.seqlens import normalize_window

    window = normalize_window(draw(windows()))
    if malformed if malformed is not None else draw(st.booleans()):
        raw = draw(raw_boundaries())
        dtype = draw(st.sampled_from(DTYPES))
        padded = None if raw.padded is None else torch.tensor(raw.padded, dtype=dtype)
        return StatsInput(torch.tensor(raw.rows, dtype=dtype), padded, raw.pack_len, window)
    pack = draw(packs())
    padded = pack.cu_seqlens_padded() if draw(st.booleans()) else None
    return StatsInput(pack.cu_seqlens(), padded, pack.pack_len if draw(st.booleans()) else None, window)
