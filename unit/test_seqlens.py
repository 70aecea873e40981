"""seqlen_stats / SeqlenStats / validate_cu_seqlens: properties against plain loops, edge cases, rejections.

CPU tensors are counted on the host (a Python loop or numpy, no torch kernel) and every other
device with torch kernels; `seqlen_stats_vector` is always the kernel path, so the tests here
compare the host path with it value for value.
"""

from __future__ import annotations

import pickle

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from accounting import FlopsAccumulator, SeqlenStats, seqlen_stats, validate_cu_seqlens
from accounting.seqlen_fields import FIELDS, wrap_int64
from accounting.seqlen_host import LOOP_LIMIT, host_values, plain_step
from accounting.seqlens import seqlen_stats_vector
from unit.strategies import DTYPES, FORMS, packs, raw_boundaries, stats_inputs, windows

pytestmark = pytest.mark.L0


def _pairs_outside(length: int, left: int, right: int) -> tuple[int, int]:
    """Brute force: (query, key) pairs of one document left of / right of the window."""
    beyond_left = beyond_right = 0
    for i in range(length):
        for j in range(length):
            if left >= 0 and j < i - left:
                beyond_left += 1
            if right >= 0 and j > i + right:
                beyond_right += 1
    return beyond_left, beyond_right


def _window_tuple(window):
    if window is None:
        return None
    left, right = (window, 0) if isinstance(window, int) else window
    return None if (left, right) == (-1, -1) else (left, right)


# ---------------------------------------------------------------- properties


@given(packs(), st.booleans())
def test_stats_equal_plain_python_sums_over_document_lengths(pack, with_pack_len):
    pack_len = pack.pack_len if with_pack_len else None
    stats = seqlen_stats(pack.cu_seqlens(), pack.cu_seqlens_padded(), pack_len=pack_len).to_dict()
    assert stats["num_sequences"] == len(pack.lengths)
    assert stats["tokens"] == sum(pack.lengths)
    assert stats["squared"] == sum(s * s for s in pack.lengths)
    assert stats["padded_squared"] == sum(s * s for s in pack.padded_lengths)
    expected_padded_tokens = len(pack.rows) * pack.pack_len if with_pack_len else sum(pack.padded_lengths)
    assert stats["padded_tokens"] == expected_padded_tokens


@given(packs())
def test_squared_sum_is_invariant_to_padding_form(pack):
    results = [seqlen_stats(pack.cu_seqlens(form=f), pack.cu_seqlens_padded(form=f)).to_dict() for f in FORMS]
    assert results[0] == results[1]


@given(packs(), windows())
def test_stats_are_invariant_to_int32_or_int64_boundaries(pack, window):
    results = [
        seqlen_stats(pack.cu_seqlens(dtype=d), pack.cu_seqlens_padded(dtype=d), window_size=window).to_dict()
        for d in DTYPES
    ]
    assert results[0] == results[1]


@given(packs())
def test_squared_sum_never_exceeds_square_of_sum_nor_falls_below_square_of_sum_over_n(pack):
    stats = seqlen_stats(pack.cu_seqlens()).to_dict()
    n, total, squared = stats["num_sequences"], stats["tokens"], stats["squared"]
    assert squared <= total * total
    if n:
        assert squared * n >= total * total  # Cauchy-Schwarz: Σs² >= (Σs)²/n


@given(packs(max_len=24), windows())
def test_window_pairs_equal_brute_force_per_document_count(pack, window):
    stats = seqlen_stats(pack.cu_seqlens(), pack.cu_seqlens_padded(), window_size=window)
    w = _window_tuple(window)
    assert stats.window == w
    left, right = w if w is not None else (-1, -1)
    real = [_pairs_outside(s, left, right) for s in pack.lengths]
    padded = [_pairs_outside(s, left, right) for s in pack.padded_lengths]
    got = stats.to_dict()
    assert got["beyond_left"] == sum(r[0] for r in real)
    assert got["beyond_right"] == sum(r[1] for r in real)
    assert got["padded_beyond_left"] == sum(p[0] for p in padded)
    assert got["padded_beyond_right"] == sum(p[1] for p in padded)


@given(packs(two_d=True))
def test_two_d_stats_equal_the_sum_of_each_row_as_a_one_d_pack(pack):
    cu, cu_padded = pack.cu_seqlens(), pack.cu_seqlens_padded()
    whole = seqlen_stats(cu, cu_padded, pack_len=pack.pack_len).to_dict()
    rows = [seqlen_stats(cu[r], cu_padded[r], pack_len=pack.pack_len).to_dict() for r in range(cu.shape[0])]
    assert whole == {k: sum(row[k] for row in rows) for k in whole}


@given(packs(), windows())
@settings(max_examples=25)  # meta kernels are slow; the property is about shapes, not values
def test_stats_run_on_meta_tensors_without_reading_values(pack, window):
    stats = seqlen_stats(
        pack.cu_seqlens(device="meta"), pack.cu_seqlens_padded(device="meta"), window_size=window, pack_len=7
    )
    for name in SeqlenStats.field_names():
        value = getattr(stats, name)
        assert value.device.type == "meta" and value.dim() == 0 and value.dtype == torch.int64


@given(st.integers(0, 6), st.integers(0, 40), windows())
def test_dense_stats_equal_a_pack_of_equal_full_length_documents(batch, seq_len, window):
    rows = [[0, seq_len] for _ in range(batch)] or [[0]]
    cu = torch.tensor(rows)
    expected = seqlen_stats(cu, window_size=window, pack_len=seq_len).to_dict() if batch else None
    dense = SeqlenStats.dense(batch, seq_len, window_size=window).to_dict()
    if batch:
        assert dense == expected
    else:
        assert set(dense.values()) == {0}


@given(packs(), packs())
def test_adding_stats_equals_stats_of_the_two_packs_together(a, b):
    sa = seqlen_stats(a.cu_seqlens(), a.cu_seqlens_padded())
    sb = seqlen_stats(b.cu_seqlens(), b.cu_seqlens_padded())
    both = (sa + sb).to_dict()
    assert both["squared"] == sum(s * s for s in a.lengths + b.lengths)
    assert both["tokens"] == sum(a.lengths + b.lengths)
    assert both["num_sequences"] == len(a.lengths) + len(b.lengths)
    assert SeqlenStats.from_vector((sa + sb).to_vector()).to_dict() == both


@given(packs())
def test_valid_packs_pass_validation_in_every_form(pack):
    for form in FORMS:
        validate_cu_seqlens(
            pack.cu_seqlens(form=form), pack.cu_seqlens_padded(form=form), pack_len=pack.pack_len
        )


# ---------------------------------------------------------------- edge cases


def _stats(cu, padded=None, **kw):
    return seqlen_stats(torch.tensor(cu), None if padded is None else torch.tensor(padded), **kw).to_dict()


def test_sentinel_tail_contributes_nothing():
    got = _stats([0, 5, 9, -1, -1])
    assert (got["num_sequences"], got["tokens"], got["squared"]) == (2, 9, 25 + 16)


def test_repeated_value_tail_contributes_nothing():
    got = _stats([0, 5, 9, 9, 9])
    assert (got["num_sequences"], got["tokens"], got["squared"]) == (2, 9, 41)


def test_empty_pack_of_zero_length_segments_is_all_zero():
    assert set(_stats([0, 0, 0], pack_len=8).values()) == {0, 8}
    assert _stats([0, 0, 0])["tokens"] == 0


def test_single_boundary_zero_is_an_empty_pack():
    got = _stats([0])
    assert set(got.values()) == {0}
    validate_cu_seqlens(torch.tensor([0]))


def test_all_sentinel_row_is_an_empty_row():
    got = _stats([[0, 4, 6], [0, -1, -1]])
    assert (got["num_sequences"], got["tokens"], got["squared"]) == (2, 6, 16 + 4)


def test_two_d_ragged_rows_in_both_tail_forms():
    cu = [[0, 3, 10, -1], [0, 8, 8, 8], [0, 1, 2, 3]]
    got = _stats(cu)
    lengths = [3, 7, 8, 1, 1, 1]
    assert got["tokens"] == sum(lengths) and got["squared"] == sum(s * s for s in lengths)
    assert got["num_sequences"] == 6
    validate_cu_seqlens(torch.tensor(cu), pack_len=10)


def test_padded_boundaries_drive_padded_fields_and_pack_len_counts_trailing_slots():
    got = _stats([0, 3, 5, 5], [0, 4, 8, 8], pack_len=10)
    assert (got["tokens"], got["squared"]) == (5, 9 + 4)
    assert (got["padded_tokens"], got["padded_squared"]) == (10, 16 + 16)


def test_meta_tensors_of_a_real_pack_keep_shape_only():
    stats = seqlen_stats(torch.tensor([[0, 2, -1]], device="meta"), window_size=(4, 0))
    assert stats.squared.is_meta and stats.window == (4, 0)


def test_values_beyond_int32_products_stay_exact():
    big = 2**30  # squared would overflow int32 and lose bits in float32
    got = _stats(torch.tensor([0, big, 2 * big], dtype=torch.int64).tolist())
    assert got["squared"] == 2 * big * big


def test_stats_fields_are_int64_tensors_even_for_int32_input():
    stats = seqlen_stats(torch.tensor([0, 3], dtype=torch.int32))
    assert stats.squared.dtype == torch.int64 and int(stats.squared) == 9


def test_window_int_means_left_size_with_no_right_context():
    assert seqlen_stats(torch.tensor([0, 3]), window_size=1).window == (1, 0)
    assert seqlen_stats(torch.tensor([0, 3]), window_size=(-1, -1)).window is None


@pytest.mark.parametrize(
    ("cu", "kwargs", "message"),
    [
        (
            torch.tensor([0.0, 1.0]),
            {},
            r"cu_seqlens has dtype torch.float32: boundaries must be an integer tensor",
        ),
        (torch.tensor([True, False]), {}, r"dtype torch.bool"),
        (torch.zeros(1, 1, 2, dtype=torch.int64), {}, r"cu_seqlens has 3 dimensions \(shape \[1, 1, 2\]\)"),
        (torch.zeros(0, dtype=torch.int64), {}, r"needs at least the leading 0"),
        (torch.tensor([[0, 2], [3, 4]]), {}, r"^cu_seqlens\[1, 0\] = 3: the first boundary must be 0$"),
        (torch.tensor([1, 4]), {}, r"^cu_seqlens\[0\] = 1: the first boundary must be 0$"),
        (
            torch.tensor([[0, 1, 2, 3, 4], [0, 2, 5, 9, 7]]),
            {},
            r"^cu_seqlens\[1, 4\] = 7 is smaller than cu_seqlens\[1, 3\] = 9: boundaries must not decrease "
            r"before the padding tail$",
        ),
        (
            torch.tensor([0, 3, -2]),
            {},
            r"^cu_seqlens\[2\] = -2 is negative: only -1 may mark the padding tail$",
        ),
        (
            torch.tensor([0, 3, -1, 5]),
            {},
            r"^cu_seqlens\[3\] = 5 follows the -1 padding tail that starts at cu_seqlens\[2\]",
        ),
        (
            torch.tensor([0, 3, 9000, -1]),
            {"pack_len": 8192},
            r"^cu_seqlens\[2\] = 9000 exceeds the pack length 8192: more tokens than the pack holds$",
        ),
    ],
)
def test_validate_rejects_malformed_boundaries_saying_what_and_where(cu, kwargs, message):
    with pytest.raises(ValueError, match=message):
        validate_cu_seqlens(cu, **kwargs)


def test_validate_rejects_a_real_document_longer_than_its_padded_segment():
    with pytest.raises(ValueError, match=r"^segment 1 of row 0 has 7 real tokens but only 5 padded slots"):
        validate_cu_seqlens(torch.tensor([[0, 2, 9]]), torch.tensor([[0, 4, 9]]))


def test_validate_rejects_padded_boundaries_of_another_shape():
    with pytest.raises(ValueError, match=r"cu_seqlens_padded has shape \[4\] but cu_seqlens has shape \[3\]"):
        validate_cu_seqlens(torch.tensor([0, 2, 4]), torch.tensor([0, 2, 4, 4]))


def test_validate_names_cu_seqlens_padded_when_it_is_the_malformed_one():
    with pytest.raises(
        ValueError, match=r"^cu_seqlens_padded\[2\] = 1 is smaller than cu_seqlens_padded\[1\] = 4"
    ):
        validate_cu_seqlens(torch.tensor([0, 2, 2]), torch.tensor([0, 4, 1]))


def test_stats_reject_what_the_metadata_shows_without_syncing():
    with pytest.raises(ValueError, match=r"dtype torch\.float32"):
        seqlen_stats(torch.zeros(3, device="meta"))
    with pytest.raises(ValueError, match="3 dimensions"):
        seqlen_stats(torch.zeros(1, 1, 3, dtype=torch.int64, device="meta"))
    with pytest.raises(ValueError, match="pack_len"):
        seqlen_stats(torch.tensor([0, 1]), pack_len=-1)


def _every_path(cu: torch.Tensor, padded: torch.Tensor | None = None) -> dict:
    """What each way of counting boundaries makes of them: tokens, Σs² and malformed rows, or its error."""

    def accumulated(count_on: str) -> dict:
        acc = FlopsAccumulator(packed=True, count_on=count_on)
        acc.add_microbatch(cu_seqlens=cu, cu_seqlens_padded=padded)
        return acc.local_stats().to_dict()

    paths = {
        "seqlen_stats": lambda: seqlen_stats(cu, padded).to_dict(),
        "kernels": lambda: SeqlenStats.from_vector(seqlen_stats_vector(cu, padded)).to_dict(),
        "accumulator (host)": lambda: accumulated("auto"),
        "accumulator (device path)": lambda: accumulated("device"),
        "validate_cu_seqlens": lambda: validate_cu_seqlens(cu, padded) or {},
    }
    out = {}
    for name, path in paths.items():
        try:
            got = path()
            out[name] = (got.get("tokens"), got.get("squared"), got.get("malformed_rows"))
        except ValueError as err:
            out[name] = str(err)
    return out


@pytest.mark.parametrize("width", [2, 2 * LOOP_LIMIT], ids=["loop", "numpy"])
def test_uint64_boundaries_are_refused_on_every_path_alike(width):
    # [0, 2**64 - 1] read as an empty pack on one path and a raw OverflowError on another.
    cu = torch.tensor([0] + [2**64 - 1] * (width - 1), dtype=torch.uint64)
    message = (
        "cu_seqlens has dtype torch.uint64: unsigned boundaries may be at most 32 bits wide (a uint64 value "
        "can be 2**63 or more, past the int64 sums); pass cu_seqlens.to(torch.int64)"
    )
    assert set(_every_path(cu).values()) == {message}
    padded = {
        "cu_seqlens_padded has dtype torch.uint64: unsigned boundaries may be at most 32 bits wide (a uint64 "
        "value can be 2**63 or more, past the int64 sums); pass cu_seqlens_padded.to(torch.int64)"
    }
    assert set(_every_path(torch.tensor([0, 1]), torch.tensor([0, 1], dtype=torch.uint64)).values()) == padded


# Values past the signed type of the same width (negative if read as int16 / int32), with squares
# that still fit the int64 sums.
@pytest.mark.parametrize(("dtype", "top"), [(torch.uint16, 2**16 - 1), (torch.uint32, 2**31 + 5)])
@pytest.mark.parametrize("width", [3, 2 * LOOP_LIMIT], ids=["loop", "numpy"])
def test_uint16_and_uint32_boundaries_are_read_as_their_unsigned_values_on_every_path(dtype, top, width):
    cu = torch.tensor([0, top - 1] + [top] * (width - 2), dtype=dtype)
    expected = (top, (top - 1) ** 2 + 1, 0)  # Python ints: a document of top - 1 tokens, then one of 1
    got = _every_path(cu)
    assert got.pop("validate_cu_seqlens") == (None, None, None)  # validated, nothing to say
    assert set(got.values()) == {expected}, got


@pytest.mark.parametrize(
    ("make", "layout"),
    [
        (lambda cu: cu.to_sparse(), "torch.sparse_coo"),
        (lambda cu: cu.unsqueeze(0).to_sparse_csr(), "torch.sparse_csr"),
        (lambda cu: torch.nested.nested_tensor([cu, cu], layout=torch.jagged), "torch.jagged"),
        (lambda cu: torch.nested.nested_tensor([cu, cu]), "nested (torch.strided)"),
    ],
    ids=["sparse_coo", "sparse_csr", "nested jagged", "nested strided"],
)
def test_sparse_and_nested_boundaries_get_one_error_naming_the_layout_on_every_path(make, layout):
    cu = make(torch.tensor([0, 3, 7]))
    errors = set(_every_path(cu).values())
    assert len(errors) == 1, errors
    error = errors.pop()
    assert error.startswith(
        f"cu_seqlens has layout {layout}: boundaries must be a dense torch.strided tensor"
    )
    padded = _every_path(torch.tensor([0, 3, 7]), make(torch.tensor([0, 3, 7])))
    assert all(e.startswith(f"cu_seqlens_padded has layout {layout}") for e in padded.values()), padded


def test_quantized_boundaries_get_one_error_naming_the_layout_on_every_path():
    cu = torch.quantize_per_tensor(torch.tensor([0.0, 3.0, 7.0]), 1.0, 0, torch.qint32)
    assert set(_every_path(cu).values()) == {
        "cu_seqlens has dtype torch.qint32, layout quantized: boundaries must be a plain integer tensor "
        "(int32 or int64); pass cu_seqlens.dequantize().round().to(torch.int64)"
    }


def test_stats_reject_padded_boundaries_of_another_width_naming_both_shapes():
    with pytest.raises(ValueError, match=r"cu_seqlens_padded has shape \[4\] but cu_seqlens has shape \[3\]"):
        seqlen_stats(torch.tensor([0, 2, 4]), torch.tensor([0, 2, 4, 4]))
    with pytest.raises(ValueError, match=r"cu_seqlens_padded has 2 rows but cu_seqlens has 1"):
        seqlen_stats(torch.tensor([[0, 2]]), torch.tensor([[0, 2], [0, 2]]))


@pytest.mark.parametrize("window", [-2, (1, 2, 3), "4", (0.5, 0), True])
def test_bad_window_sizes_are_rejected(window):
    with pytest.raises(ValueError, match="window_size"):
        seqlen_stats(torch.tensor([0, 1]), window_size=window)


def test_adding_stats_of_different_windows_is_refused():
    a = SeqlenStats.dense(1, 4, window_size=2)
    with pytest.raises(ValueError, match="windows"):
        a + SeqlenStats.dense(1, 4)


# ---------------------------------------------------------------- malformed rows, counted sync-free


def _row_is_rejected(row, padded_row, pack_len) -> int:
    try:
        validate_cu_seqlens(
            torch.tensor(row), None if padded_row is None else torch.tensor(padded_row), pack_len=pack_len
        )
    except ValueError:
        return 1
    return 0


@given(packs(), st.booleans())
def test_valid_packs_count_no_malformed_row_in_every_form_and_dtype(pack, with_pack_len):
    pack_len = pack.pack_len if with_pack_len else None
    for form in FORMS:
        for dtype in DTYPES:
            cu = pack.cu_seqlens(form=form, dtype=dtype)
            stats = seqlen_stats(cu, pack.cu_seqlens_padded(form=form, dtype=dtype), pack_len=pack_len)
            assert stats.malformed() == {} and int(stats.malformed_rows) == 0


@given(raw_boundaries())
def test_malformed_row_count_equals_the_rows_the_syncing_validation_rejects(raw):
    # The oracle is validate_cu_seqlens, a Python loop over each row on its own.
    padded = raw.padded or [None] * len(raw.rows)
    expected = sum(_row_is_rejected(r, p, raw.pack_len) for r, p in zip(raw.rows, padded, strict=True))
    stats = seqlen_stats(
        torch.tensor(raw.rows),
        None if raw.padded is None else torch.tensor(raw.padded),
        pack_len=raw.pack_len,
    )
    assert int(stats.malformed_rows) == expected
    counts = stats.malformed()
    assert (sum(counts.values()) >= expected) and all(n <= expected for n in counts.values())


@pytest.mark.parametrize(
    ("cu", "dtype", "kwargs", "kinds"),
    [
        # Inputs that once gave silently wrong answers: each is now counted as malformed.
        ([0, 5, 3, 8], torch.int64, {}, {"order": 1}),
        ([5, 10], torch.int64, {}, {"first": 1}),
        ([0, 5, -1, 8], torch.int64, {}, {"order": 1}),
        ([0, 100, 200, 300], torch.int8, {}, {"order": 1}),  # int8 wraps 200 to -56
        ([0, 4, 8], torch.int64, {"pack_len": 4}, {"beyond_pack": 1}),
        ([0, 3, -2], torch.int64, {}, {"order": 1}),
        ([0, 2**32, 2 * 2**32], torch.int64, {}, {"int64": 1}),  # row total (2^33)^2 = 2^66
    ],
)
def test_malformed_rows_are_counted_by_kind(cu, dtype, kwargs, kinds):
    # int8 boundaries: built from int64 values, wrapped the way a narrowing cast wraps them.
    tensor = torch.tensor(cu, dtype=torch.int64).to(dtype)
    stats = seqlen_stats(tensor, **kwargs)
    assert stats.malformed() == kinds
    assert int(stats.malformed_rows) == 1
    with pytest.raises(ValueError):
        validate_cu_seqlens(tensor, **kwargs)


def test_a_real_segment_longer_than_its_padded_one_is_counted_per_row():
    stats = seqlen_stats(torch.tensor([[0, 2, 9], [0, 3, 4]]), torch.tensor([[0, 4, 9], [0, 3, 4]]))
    assert stats.malformed() == {"longer_than_padded": 1} and int(stats.malformed_rows) == 1


def test_rows_that_fit_int64_one_by_one_but_not_together_are_counted_from_where_the_sum_wraps():
    s = 2**31  # one row of one document: s^2 = 2^62; two rows reach 2^63
    cu = torch.tensor([[0, s], [0, s], [0, s]])
    stats = seqlen_stats(cu)
    assert stats.malformed() == {"int64": 2}
    with pytest.raises(ValueError, match=r"^row 1 of cu_seqlens: the squared row token totals sum to"):
        validate_cu_seqlens(cu)
    assert seqlen_stats(cu[:1]).malformed() == {}  # 2^62 alone fits


def test_malformed_counters_stay_on_meta_tensors():
    stats = seqlen_stats(
        torch.tensor([[0, 5, 3]], device="meta"), torch.tensor([[0, 5, 2]], device="meta"), pack_len=2
    )
    assert stats.malformed_rows.is_meta and stats.malformed_int64.is_meta


def test_malformed_counters_add_and_round_trip_through_the_vector():
    bad = seqlen_stats(torch.tensor([0, 5, 3]))
    both = bad + bad
    assert both.malformed() == {"order": 2}
    assert SeqlenStats.from_vector(both.to_vector()).malformed() == {"order": 2}


# ---------------------------------------------------------------- the host path equals the kernels


def _kernels(given) -> list[int]:
    return seqlen_stats_vector(
        given.cu_seqlens, given.cu_seqlens_padded, window=given.window, pack_len=given.pack_len
    ).tolist()


@settings(max_examples=300)
@given(stats_inputs())
def test_host_loop_and_numpy_give_exactly_the_kernels_vector(given):
    # Malformed rows included: the counters, and the (wrong) sums of malformed rows, are the same.
    expected = _kernels(given)
    two_d = given.cu_seqlens.dim() == 2
    for method in ("loop", "numpy"):
        got = host_values(
            given.cu_seqlens,
            given.cu_seqlens_padded,
            two_d,
            window=given.window,
            pack_len=given.pack_len,
            method=method,
        )
        assert got == expected, method
    stats = seqlen_stats(
        given.cu_seqlens, given.cu_seqlens_padded, window_size=given.window, pack_len=given.pack_len
    )
    assert stats.held_ints() is not None  # CPU boundaries: counted on the host, no kernel
    assert list(stats.to_dict().values()) == expected


def _step_rows(inputs) -> list[tuple[list[list[int]], int | None]]:
    """A step's microbatches as `FlopsAccumulator` holds small host packs: (rows as lists, pack length)."""
    return [(cu.tolist() if cu.dim() == 2 else [cu.tolist()], pack_len) for cu, pack_len in inputs]


def _summed_kernel_vectors(inputs) -> list[int]:
    vectors = [seqlen_stats_vector(cu, pack_len=pack_len).tolist() for cu, pack_len in inputs]
    return [wrap_int64(sum(column)) for column in zip(*vectors, strict=True)]


@settings(max_examples=200)
@given(st.lists(stats_inputs(), min_size=1, max_size=6))
def test_one_pass_over_a_step_is_the_sum_of_each_microbatchs_kernel_vector_or_declines(drawn):
    # Malformed rows included: the one-pass step count either declines (None: each microbatch is
    # then counted on its own) or gives exactly the summed kernel vectors (no window, no padded).
    inputs = [(given.cu_seqlens, given.pack_len) for given in drawn]
    got = plain_step(_step_rows(inputs))
    if got is not None:
        assert [wrap_int64(v) for v in got] == _summed_kernel_vectors(inputs)


@settings(max_examples=200)
@given(st.lists(packs(), min_size=1, max_size=6), st.booleans())
def test_one_pass_over_a_step_counts_every_well_formed_step(drawn, with_pack_len):
    # Well-formed packs within their pack length never make it decline: the fast pass is the one taken.
    inputs = [(pack.cu_seqlens(), pack.pack_len if with_pack_len else None) for pack in drawn]
    got = plain_step(_step_rows(inputs))
    assert got is not None and got == _summed_kernel_vectors(inputs)
    assert got[1] == sum(sum(map(sum, pack.rows)) for pack in drawn)  # tokens, from the drawn lengths


@pytest.mark.parametrize("docs", [1, 8, 200, 3000])
@pytest.mark.parametrize("form", FORMS)
def test_host_paths_equal_the_kernels_on_both_sides_of_the_size_switch(docs, form):
    # Packs below and above LOOP_LIMIT take different host paths; 2-D ragged rows, int32.
    rows = [[1 + (i * 7 + r) % 13 for i in range(docs - r)] for r in range(3)]
    width = docs + 2
    cu = torch.tensor(
        [
            [0, *torch.tensor(row).cumsum(0).tolist()]
            + [-1 if form == "sentinel" else sum(row)] * (width - len(row) - 1)
            for row in rows
        ],
        dtype=torch.int32,
    )
    assert (cu.numel() <= LOOP_LIMIT) == (docs < 30)
    for window in (None, (5, 0), (2, 3)):
        expected = seqlen_stats_vector(cu, window=window, pack_len=40 * docs).tolist()
        assert list(seqlen_stats(cu, window_size=window, pack_len=40 * docs).to_dict().values()) == expected
        assert expected[1] == sum(map(sum, rows)) and expected[9] == 0


def test_huge_boundaries_wrap_on_the_host_as_int64_kernels_wrap():
    # Lengths of 2**40: their squares wrap an int64 sum; the host path wraps the same way.
    cu = torch.tensor([[0, 2**40, 2**41, 3 * 2**40]] * 3)
    expected = seqlen_stats_vector(cu, window=(0, -1)).tolist()
    assert list(seqlen_stats(cu, window_size=(0, -1)).to_dict().values()) == expected
    assert seqlen_stats(cu).malformed() == {"int64": 3}


def test_host_stats_are_ints_until_a_field_is_asked_for_then_int64_tensors():
    stats = seqlen_stats(torch.tensor([0, 3, 5], dtype=torch.int32), pack_len=8)
    assert stats.held_ints() == (2, 5, 13, 8, 13, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0)
    assert stats.squared.dtype == torch.int64 and stats.squared.dim() == 0 and int(stats.squared) == 13
    assert stats.to_vector().tolist() == list(stats.held_ints())


def test_seqlen_stats_are_immutable_and_pickle_as_what_they_hold():
    host = seqlen_stats(torch.tensor([0, 3, 5]), window_size=1)
    with pytest.raises(AttributeError, match="immutable"):
        host.tokens = torch.tensor(0)
    again = pickle.loads(pickle.dumps(host))
    assert again.held_ints() == host.held_ints() and again.window == (1, 0)
    kernel = SeqlenStats.from_vector(
        seqlen_stats_vector(torch.tensor([0, 3, 5]), window=(1, 0)), window=(1, 0)
    )
    assert pickle.loads(pickle.dumps(kernel)).to_dict() == host.to_dict()


def test_seqlen_stats_constructor_takes_the_fields_by_position_or_name():
    tensors = [torch.tensor(i) for i in range(len(FIELDS))]
    by_name = SeqlenStats(**dict(zip(FIELDS, tensors, strict=True)))
    assert list(SeqlenStats(*tensors).to_dict().values()) == list(range(len(FIELDS)))
    assert by_name.to_dict() == SeqlenStats(*tensors).to_dict()
    with pytest.raises(TypeError, match="fields"):
        SeqlenStats(*tensors[:3])
