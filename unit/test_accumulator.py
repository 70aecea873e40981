"""FlopsAccumulator in one process: sync-free accumulation, VPP dedup, dense extrapolation, exact counters.

CPU boundaries are counted on the host as they come; `count_on="device"` stages them for the
kernel path a device runs (here on CPU tensors, which have values to compare, or on `meta`
tensors, which prove that nothing is read back and whose dispatch shows the kernels). The
collective paths (packed DP reduce, CP ranks, empty packs) run on real gloo groups in
functional/test_accounting_collectives.py.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from accounting import FlopsAccumulator, ModelShape, SeqlenStats, seqlen_stats, training_flops
from accounting.seqlens import normalize_window, seqlen_stats_vector
from ci.benchmarks.accounting_packs import CountKernels  # the benchmarks' counter, one definition
from unit.strategies import packs, stats_inputs

pytestmark = pytest.mark.L0

SHAPE = ModelShape(num_layers=2, hidden_size=16, num_attention_heads=2, vocab_size=32, ffn_hidden_size=24)


@given(st.lists(packs(), min_size=1, max_size=4))
def test_accumulated_stats_equal_the_plain_sums_over_every_microbatchs_documents(microbatches):
    acc = FlopsAccumulator(packed=True)
    for pack in microbatches:
        acc.add_microbatch(
            cu_seqlens=pack.cu_seqlens(), cu_seqlens_padded=pack.cu_seqlens_padded(), seq_len=pack.pack_len
        )
    stats = acc.resolve().to_dict()
    lengths = [s for pack in microbatches for s in pack.lengths]
    padded = [s for pack in microbatches for s in pack.padded_lengths]
    assert stats["tokens"] == sum(lengths)
    assert stats["squared"] == sum(s * s for s in lengths)
    assert stats["padded_squared"] == sum(s * s for s in padded)
    assert stats["padded_tokens"] == sum(len(p.rows) * p.pack_len for p in microbatches)


@given(st.lists(packs(), min_size=1, max_size=3), st.integers(2, 4))
def test_only_the_first_virtual_pipeline_stage_counts_a_microbatch(microbatches, vp_size):
    plain, virtual = FlopsAccumulator(packed=True), FlopsAccumulator(packed=True)
    for pack in microbatches:
        plain.add_microbatch(cu_seqlens=pack.cu_seqlens())
        for vp_stage in range(vp_size):
            virtual.add_microbatch(cu_seqlens=pack.cu_seqlens(), vp_stage=vp_stage)
    assert plain.resolve().to_dict() == virtual.resolve().to_dict()
    assert virtual.num_microbatches == len(microbatches)


@given(st.integers(1, 4), st.integers(1, 64), st.integers(1, 3), st.integers(1, 8))
def test_dense_resolve_is_local_times_dp_size(micro_batch_size, seq_len, microbatches, dp_size):
    acc = FlopsAccumulator(packed=False, dp_size=dp_size)
    for _ in range(microbatches):
        acc.add_microbatch(micro_batch_size=micro_batch_size, seq_len=seq_len)
    stats = acc.resolve().to_dict()
    sequences = micro_batch_size * microbatches * dp_size
    assert stats["tokens"] == sequences * seq_len
    assert stats["squared"] == sequences * seq_len * seq_len


def test_dense_mode_reads_batch_and_length_from_the_tokens_shape():
    acc = FlopsAccumulator(packed=False, dp_size=2)
    acc.add_microbatch(tokens=torch.zeros(3, 10, dtype=torch.int64))
    assert acc.resolve().to_dict()["squared"] == 2 * 3 * 100


def test_dense_mode_prefers_the_configured_length_over_a_cp_sliced_tokens_tensor():
    acc = FlopsAccumulator(packed=False)
    acc.add_microbatch(tokens=torch.zeros(1, 2048, dtype=torch.int64), seq_len=4096)
    assert acc.resolve().to_dict()["squared"] == 4096 * 4096


def test_packed_pack_length_prefers_seq_len_over_the_tokens_shape():
    acc = FlopsAccumulator(packed=True)
    acc.add_microbatch(cu_seqlens=torch.tensor([0, 3]), tokens=torch.zeros(1, 4), seq_len=8)
    assert acc.resolve().to_dict()["padded_tokens"] == 8
    acc = FlopsAccumulator(packed=True)
    acc.add_microbatch(cu_seqlens=torch.tensor([0, 3]), tokens=torch.zeros(1, 4))
    assert acc.resolve().to_dict()["padded_tokens"] == 4


@given(st.lists(packs(), min_size=1, max_size=3))
def test_step_adds_the_flops_of_the_global_batch_and_resets(microbatches):
    acc = FlopsAccumulator(packed=True)
    expected_total = 0
    for pack in microbatches:  # one step per pack
        acc.add_microbatch(cu_seqlens=pack.cu_seqlens())
        flops = acc.step(SHAPE)
        # Independent: the formula on the plain lengths via a dense-equivalent shape check.
        q, h = 16, 16
        per_token = 3 * 2 * (2 * (h * (q + 2 * q) + q * h) + 2 * h * 24 * 2 + h * 32)
        expected = per_token * sum(pack.lengths) + 3 * 2 * 2 * q * sum(s * s for s in pack.lengths)
        assert flops == expected
        expected_total += expected
        assert acc.num_microbatches == 0
    assert acc.total_flops == expected_total and type(acc.total_flops) is int
    assert acc.steps == len(microbatches)
    assert acc.total_tokens == sum(sum(p.lengths) for p in microbatches)


def test_step_with_no_microbatch_counts_zero():
    acc = FlopsAccumulator(packed=True)
    assert acc.step(SHAPE) == 0 and acc.total_flops == 0 and acc.steps == 1


@given(
    st.integers(2**53, 2**80),
    st.integers(2**53, 2**80),
    st.integers(0, 2**70),
    st.integers(0, 2**70),
    st.integers(0, 10**9),
)
def test_state_dict_round_trip_is_exact_beyond_two_to_the_53(flops, hardware, tokens, padded, steps):
    source = FlopsAccumulator(packed=True)
    source.load_state_dict(
        {
            "total_flops": flops,
            "hardware_total_flops": hardware,
            "total_tokens": tokens,
            "total_padded_tokens": padded,
            "steps": steps,
        }
    )
    state = source.state_dict()
    restored = FlopsAccumulator(packed=True)
    restored.load_state_dict(state)
    assert restored.state_dict() == {
        "total_flops": flops,
        "hardware_total_flops": hardware,
        "total_tokens": tokens,
        "total_padded_tokens": padded,
        "steps": steps,
    }
    assert all(type(v) is int for v in restored.state_dict().values())
    # One more step after the resume keeps adding exactly.
    restored.add_microbatch(cu_seqlens=torch.tensor([0, 1]))
    added = restored.step(SHAPE)
    assert restored.total_flops == flops + added


def test_state_dict_survives_torch_save_and_load_exactly(tmp_path):
    acc = FlopsAccumulator(packed=False)
    acc.load_state_dict({"total_flops": 2**53 + 1, "steps": 3})
    torch.save(acc.state_dict(), tmp_path / "acc.pt")
    other = FlopsAccumulator(packed=False)
    other.load_state_dict(torch.load(tmp_path / "acc.pt"))
    assert other.total_flops == 2**53 + 1 and other.steps == 3


def test_load_state_dict_refuses_floats_that_would_lose_precision():
    acc = FlopsAccumulator(packed=True)
    with pytest.raises(ValueError, match="total_flops"):
        acc.load_state_dict({"total_flops": 1.5e20})
    with pytest.raises(ValueError, match="total_flops"):
        acc.load_state_dict({"total_flops": torch.tensor(1.0e20, dtype=torch.float32)})
    acc.load_state_dict({"total_flops": torch.tensor(2**62, dtype=torch.int64)})
    assert acc.total_flops == 2**62


@given(packs())
def test_add_microbatch_is_sync_free_on_meta_tensors(pack):
    acc = FlopsAccumulator(packed=True, window_size=4, device="meta")
    acc.add_microbatch(
        cu_seqlens=pack.cu_seqlens(device="meta"),
        cu_seqlens_padded=pack.cu_seqlens_padded(device="meta"),
        seq_len=pack.pack_len,
    )
    acc.add_microbatch(cu_seqlens=pack.cu_seqlens(device="meta"))
    assert acc.local_stats().squared.is_meta


def test_packed_mode_needs_cu_seqlens_and_dense_mode_needs_a_shape():
    with pytest.raises(ValueError, match="cu_seqlens"):
        FlopsAccumulator(packed=True).add_microbatch(tokens=torch.zeros(1, 4))
    with pytest.raises(ValueError, match="micro_batch_size or tokens"):
        FlopsAccumulator(packed=False).add_microbatch(seq_len=4)
    with pytest.raises(ValueError, match="packed"):
        FlopsAccumulator(packed="yes")


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"micro_batch_size": 2.7, "seq_len": 8}, "micro_batch_size"),
        ({"micro_batch_size": -1, "seq_len": 8}, "micro_batch_size"),
        ({"micro_batch_size": 2, "seq_len": torch.tensor(8)}, "seq_len"),
        ({"micro_batch_size": True, "seq_len": 8}, "micro_batch_size"),
    ],
)
def test_dense_microbatch_sizes_must_be_ints_not_truncated_floats_or_tensors(kwargs, name):
    with pytest.raises(ValueError, match=rf"^add_microbatch: {name} = .* must be an int >= 0"):
        FlopsAccumulator(packed=False).add_microbatch(**kwargs)


def test_validate_mode_rejects_malformed_boundaries():
    acc = FlopsAccumulator(packed=True, validate=True)
    with pytest.raises(ValueError, match="must not decrease"):
        acc.add_microbatch(cu_seqlens=torch.tensor([0, 5, 3]))


def test_window_is_carried_to_the_flops():
    shape = ModelShape(num_layers=1, hidden_size=8, num_attention_heads=1, vocab_size=8, window_size=2)
    acc = FlopsAccumulator(packed=True, window_size=2)
    acc.add_microbatch(cu_seqlens=torch.tensor([0, 10]))
    expected = training_flops(shape, seqlen_stats(torch.tensor([0, 10]), window_size=2)).total
    # Independent of training_flops: per token 2*(8*(8+2*8) + 8*8) projections + 2*8*32*2 mlp +
    # 2*8*8 logits = 1664; window (2, 0) leaves 1+2+3*8 = 27 causal pairs, Megatron's convention
    # counts 2*27 - 10 = 44 half-pairs at 2q = 16 FLOPs each; fwd + bwd = 3x.
    assert expected == 3 * (1664 * 10 + 16 * 44) == 52032
    assert acc.step(shape) == expected
    with pytest.raises(ValueError, match="window"):
        FlopsAccumulator(packed=True).step(shape)


def test_recompute_configured_at_construction_reaches_hardware_flops():
    acc = FlopsAccumulator(packed=False, recompute="full")
    acc.add_microbatch(micro_batch_size=1, seq_len=8)
    acc.step(SHAPE)
    plain = training_flops(SHAPE, SeqlenStats.dense(1, 8))
    assert acc.hardware_total_flops > plain.hardware_total == acc.total_flops


# ---------------------------------------------------------------- malformed input: counted sync-free, raised at step


class CallLog(torch.overrides.TorchFunctionMode):
    """Every torch function and tensor method called inside the mode, by name."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.calls.append(getattr(func, "__name__", str(func)))
        return func(*args, **(kwargs or {}))


SYNCS = {"item", "tolist", "cpu", "__bool__", "__float__", "__int__", "__index__", "numpy", "nonzero"}


@pytest.mark.parametrize(
    ("cu", "seq_len", "what"),
    [
        ([0, 5, 3, 8], None, "a boundary smaller than the one before it"),
        ([5, 10], None, "a first boundary that is not 0"),
        ([0, 5, -1, 8], None, "a boundary smaller than the one before it, or a negative one other than a -1"),
        ([0, 4, 8], 4, "more tokens than the pack length"),
    ],
)
def test_step_names_the_malformed_microbatch_and_what_is_wrong(cu, seq_len, what):
    acc = FlopsAccumulator(packed=True)
    acc.add_microbatch(cu_seqlens=torch.tensor([0, 4, 8]))
    acc.add_microbatch(cu_seqlens=torch.tensor([0, 3]), vp_stage=1)  # a VPP repeat: not counted
    acc.add_microbatch(cu_seqlens=torch.tensor(cu), seq_len=seq_len)
    with pytest.raises(
        ValueError, match=rf"^FlopsAccumulator\.step: microbatch 1 has 1 malformed row \({what}"
    ):
        acc.step(SHAPE)
    # The step is discarded: nothing counted, the microbatch state reset for the next step.
    assert acc.state_dict() == dict.fromkeys(acc.state_dict(), 0) and acc.num_microbatches == 0
    acc.add_microbatch(cu_seqlens=torch.tensor([0, 4, 8]))
    assert acc.step(SHAPE) == training_flops(SHAPE, seqlen_stats(torch.tensor([0, 4, 8]))).total


def test_a_wrapped_int64_sum_is_refused_at_step():
    acc = FlopsAccumulator(packed=True)
    acc.add_microbatch(cu_seqlens=torch.tensor([0, 2**32, 2**33]))
    with pytest.raises(ValueError, match=r"microbatch 0 has 1 malformed row .*could wrap"):
        acc.step(SHAPE)


def test_validate_mode_still_names_the_index_as_the_microbatch_is_added():
    acc = FlopsAccumulator(packed=True, validate=True)
    with pytest.raises(ValueError, match=r"^cu_seqlens\[2\] = 3 is smaller than cu_seqlens\[1\] = 5"):
        acc.add_microbatch(cu_seqlens=torch.tensor([0, 5, 3, 8]))


def test_malformed_statistics_are_refused_by_training_flops_too():
    with pytest.raises(ValueError, match=r"^training_flops: the statistics count 1 malformed boundary row"):
        training_flops(SHAPE, seqlen_stats(torch.tensor([5, 10])))


@pytest.mark.parametrize("count_on", ["auto", "device"])
def test_add_microbatch_calls_no_syncing_function_even_on_malformed_input(count_on):
    # The device path never reads a value; the host path reads the CPU buffer, which is no sync,
    # and runs no torch kernel at all.
    acc = FlopsAccumulator(packed=True, window_size=3, count_on=count_on)
    with CallLog() as log, CountKernels() as kernels:
        acc.add_microbatch(cu_seqlens=torch.tensor([[0, 4, 9, -1], [0, 5, 3, 8]]), seq_len=9)
        acc.add_microbatch(cu_seqlens=torch.tensor([0, 4]), cu_seqlens_padded=torch.tensor([0, 6]), seq_len=9)
    if count_on == "device":
        assert log.calls and not [c for c in log.calls if c in SYNCS]
        assert kernels.count == 3  # one int64 copy per boundary tensor
    else:
        assert kernels.count == 0
    assert acc.local_stats().malformed() == {"order": 1}


def _sentinel_pack(docs: int, rows: int, device: str = "cpu") -> torch.Tensor:
    """`rows` rows of `docs` documents of 3 tokens, then a -1 tail of 2 (int32)."""
    cu = torch.arange(0, 3 * (docs + 1), 3).expand(rows, -1)
    return torch.cat([cu, torch.full((rows, 2), -1)], dim=1).to(device=device, dtype=torch.int32)


def _step_kernels(microbatches: int, docs: int, rows: int, padded_and_window: bool) -> tuple[list[int], int]:
    """On meta tensors: the kernels of each add_microbatch, and of the resolve that follows."""
    acc = FlopsAccumulator(packed=True, window_size=(3, 1) if padded_and_window else None, device="meta")
    per_microbatch = []
    for i in range(microbatches):
        cu = _sentinel_pack(docs + i, rows, "meta")  # widths differ: the step's layout pads them
        with CountKernels() as counter:
            acc.add_microbatch(
                cu_seqlens=cu, cu_seqlens_padded=cu if padded_and_window else None, seq_len=3 * docs
            )
        per_microbatch.append(counter.count)
    with CountKernels() as counter:
        stats = acc.resolve()
    assert stats.squared.is_meta
    return per_microbatch, counter.count


@pytest.mark.parametrize("padded_and_window", [False, True])
def test_device_path_stages_each_microbatch_in_at_most_two_kernels_and_counts_a_step_in_a_fixed_number(
    padded_and_window,
):
    # Structure, not timing: kernels are the non-view ATen operators dispatched on meta tensors
    # (one launch each on a GPU). Staging is one int64 copy per boundary tensor, whatever the
    # pack; the step's statistics are one fixed set of kernels, whatever the number of
    # microbatches, documents or rows.
    per_step = {}
    for microbatches in (1, 4, 8):
        for docs, rows in ((1, 1), (300, 1), (300, 8)):
            per_microbatch, at_resolve = _step_kernels(microbatches, docs, rows, padded_and_window)
            assert per_microbatch == [2 if padded_and_window else 1] * microbatches
            per_step[microbatches, docs, rows] = at_resolve
    assert len(set(per_step.values())) == 1, per_step
    # Counted per microbatch, the kernel path cost 29 kernels each (232 for a step of 8); a whole
    # step now costs at most 48, whatever the number of microbatches.
    assert next(iter(per_step.values())) <= 48, per_step


def test_a_second_step_of_the_same_layout_reuses_the_gather_index():
    acc = FlopsAccumulator(packed=True, device="meta")
    counts = []
    for _ in range(3):
        for _ in range(4):
            acc.add_microbatch(cu_seqlens=_sentinel_pack(5, 2, "meta"), seq_len=15)
        with CountKernels() as counter:
            acc.local_stats()
        counts.append(counter.count)

        acc._reset_microbatches()
    assert counts[1] == counts[2] == counts[0] - 1  # the index moved to the device once


@pytest.mark.parametrize("padded_and_window", [False, True])
def test_add_microbatch_makes_a_fixed_number_of_torch_calls_whatever_the_pack(padded_and_window):
    # Host path: every call, whatever the pack, makes the same few torch calls (attribute reads and
    # one read of the buffer), no kernel. Device path: the same, one copy per boundary tensor. The
    # ceiling is the budget set when the single-pack kernel path was vectorised (55 calls before).
    for count_on in ("auto", "device"):
        acc = FlopsAccumulator(
            packed=True, window_size=(3, 1) if padded_and_window else None, count_on=count_on
        )
        counts = []
        for docs, rows in ((1, 1), (300, 1), (300, 8)):
            cu = _sentinel_pack(docs, rows)
            kwargs = {
                "cu_seqlens": cu,
                "cu_seqlens_padded": cu if padded_and_window else None,
                "seq_len": 3 * docs,
            }
            acc.add_microbatch(**kwargs)
            with CallLog() as log:
                acc.add_microbatch(**kwargs)
            counts.append(len(log.calls))
        assert len(set(counts)) == 1, (count_on, counts)
        assert counts[0] <= 36, counts


@settings(max_examples=150)
@given(st.lists(stats_inputs(), min_size=1, max_size=5), st.sampled_from([None, 2, (3, 1), (-1, 0)]))
def test_host_path_and_staged_device_path_give_the_same_statistics(microbatches, window):
    # The same microbatches, malformed ones included, counted on the host as they come and by the
    # kernels of one staged step; both equal the sum of each pack's own kernel vector.
    window = normalize_window(window)
    host = FlopsAccumulator(packed=True, window_size=window)
    device = FlopsAccumulator(packed=True, window_size=window, count_on="device")
    expected = [0] * len(SeqlenStats.field_names())
    each = []
    for drawn in microbatches:
        for acc in (host, device):
            acc.add_microbatch(
                cu_seqlens=drawn.cu_seqlens, cu_seqlens_padded=drawn.cu_seqlens_padded, seq_len=drawn.pack_len
            )
        one = seqlen_stats_vector(
            drawn.cu_seqlens, drawn.cu_seqlens_padded, window=window, pack_len=drawn.pack_len
        ).tolist()
        each.append(one)
        expected = [a + b for a, b in zip(expected, one, strict=True)]
    assert host.local_stats().held_ints() is not None and host.local_stats().held_ints() == tuple(expected)
    assert device.local_stats().held_ints() is None
    assert list(device.local_stats().to_dict().values()) == expected
    # Each microbatch's own vector too (the step's error message names microbatches from them).
    assert host._per_microbatch() == device._per_microbatch() == each


@pytest.mark.parametrize("count_on", ["auto", "device"])
def test_step_reads_the_statistics_back_exactly_once(count_on):
    # The device path reads the step's vector back once; the host path holds ints and reads none.
    acc = FlopsAccumulator(packed=True, count_on=count_on)
    for _ in range(3):
        acc.add_microbatch(cu_seqlens=torch.tensor([0, 4, 9, 9]), seq_len=12)
    with CallLog() as log:
        acc.step(SHAPE)
    assert [c for c in log.calls if c in SYNCS] == (["tolist"] if count_on == "device" else [])
    assert acc.total_tokens == 27


@given(packs())
def test_malformed_counters_ride_the_meta_vector_without_a_read(pack):
    acc = FlopsAccumulator(packed=True, device="meta")
    acc.add_microbatch(cu_seqlens=pack.cu_seqlens(device="meta"), seq_len=1)  # likely beyond the pack
    assert acc.local_stats().malformed_rows.is_meta


# ---------------------------------------------------------------- statistics made in the data loader


PACK_LEN = 64


def _collate(samples: list[list[int]]) -> dict:
    """A packing collate function: documents end to end in one pack, and the pack's statistics."""
    tokens = torch.cat([torch.tensor(doc) for doc in samples])
    cu = torch.tensor([0, *torch.tensor([len(doc) for doc in samples]).cumsum(0).tolist()], dtype=torch.int32)
    return {
        "tokens": tokens,
        "cu_seqlens": cu,
        "flops_stats": seqlen_stats(cu, pack_len=PACK_LEN, window_size=4),
    }


@pytest.mark.parametrize("workers", [0, 1])
def test_stats_made_in_a_dataloader_collate_count_what_the_boundaries_count(workers):
    documents = [[1] * n for n in (5, 9, 1, 17, 3, 8, 12, 2, 6)]
    loader = torch.utils.data.DataLoader(documents, batch_size=3, collate_fn=_collate, num_workers=workers)
    from_stats = FlopsAccumulator(packed=True, window_size=4)
    from_boundaries = FlopsAccumulator(packed=True, window_size=4)
    for batch in loader:
        with CountKernels() as kernels:
            from_stats.add_microbatch(stats=batch["flops_stats"])
        assert kernels.count == 0  # the training step does no device work for FLOPs
        from_boundaries.add_microbatch(cu_seqlens=batch["cu_seqlens"], seq_len=PACK_LEN)
    assert from_stats.num_microbatches == 3
    shape = ModelShape(num_layers=1, hidden_size=8, num_attention_heads=1, vocab_size=8, window_size=4)
    lengths = [len(doc) for doc in documents]
    assert from_stats.local_stats().to_dict()["squared"] == sum(n * n for n in lengths)
    assert from_stats.step(shape) == from_boundaries.step(shape) > 0
    assert from_stats.total_tokens == sum(lengths)


def test_stats_of_another_window_or_with_boundaries_too_are_refused():
    acc = FlopsAccumulator(packed=True, window_size=4)
    with pytest.raises(ValueError, match=r"window \(4, 0\).*window_size=\(4, 0\)"):
        acc.add_microbatch(stats=seqlen_stats(torch.tensor([0, 3])))
    with pytest.raises(ValueError, match="not both"):
        acc.add_microbatch(
            stats=seqlen_stats(torch.tensor([0, 3]), window_size=4), cu_seqlens=torch.tensor([0, 3])
        )
    with pytest.raises(ValueError, match="must be a SeqlenStats"):
        acc.add_microbatch(stats={"tokens": 3})
    with pytest.raises(ValueError, match="packed"):
        FlopsAccumulator(packed=False).add_microbatch(stats=SeqlenStats.dense(1, 4))
    assert acc.num_microbatches == 0


def test_malformed_stats_from_the_data_loader_are_named_at_step():
    acc = FlopsAccumulator(packed=True)
    acc.add_microbatch(stats=seqlen_stats(torch.tensor([0, 4, 8])))
    acc.add_microbatch(cu_seqlens=torch.tensor([0, 2]))
    acc.add_microbatch(stats=seqlen_stats(torch.tensor([0, 5, 3])))
    with pytest.raises(ValueError, match=r"microbatch 2 has 1 malformed row \(a boundary smaller"):
        acc.step(SHAPE)


def test_device_held_stats_join_the_staged_microbatches_without_a_read():
    acc = FlopsAccumulator(packed=True, device="meta")
    acc.add_microbatch(stats=seqlen_stats(torch.tensor([0, 4, 8], device="meta")))
    acc.add_microbatch(cu_seqlens=torch.tensor([0, 2], device="meta"))
    assert acc.local_stats().squared.is_meta
    cpu = FlopsAccumulator(packed=True, count_on="device")
    cpu.add_microbatch(stats=SeqlenStats.from_vector(seqlen_stats_vector(torch.tensor([0, 4, 8]))))
    cpu.add_microbatch(stats=seqlen_stats(torch.tensor([0, 5])))  # held on the host: added as ints
    cpu.add_microbatch(cu_seqlens=torch.tensor([0, 2]))
    assert cpu.local_stats().to_dict()["squared"] == 16 + 16 + 25 + 4


def test_host_and_device_paths_wrap_a_step_sum_past_int64_alike():
    # Each pack fits (s² = (2**31 - 1)**2 < 2**63); four of them pass 2**64 - 2**34 and wrap, on
    # the host as in the device's int64 sum: -2**34 + 4.
    cu = torch.tensor([0, 2**31 - 1])
    host, device = FlopsAccumulator(packed=True), FlopsAccumulator(packed=True, count_on="device")
    for acc in (host, device):
        for _ in range(4):
            acc.add_microbatch(cu_seqlens=cu)
    assert host.local_stats().to_dict() == device.local_stats().to_dict()
    assert host.local_stats().to_dict()["squared"] == 4 * (2**31 - 1) ** 2 - 2**64 == -(2**34) + 4


# The longest document whose s² fits an int64: s² = 2**63 - 5,928,526,807. Two of them in one step
# pass 2**63 (the step's int64 sum wraps to -11,857,053,614: 2.73e20 FLOPs instead of 1.45e25).
LONG = 3_037_000_499
# A second document that still fits beside it: 76,995² = 5,928,230,025 < 5,928,526,807.
BESIDE_LONG = 76_995


def _long_microbatch(form: str) -> dict:
    """One microbatch of one LONG document: a small pack, a large pack (past the host loop's
    limit, so numpy counts it), or statistics made elsewhere and held as a device-style vector."""
    if form == "small pack":
        return {"cu_seqlens": torch.tensor([0, LONG])}
    if form == "large pack":
        return {"cu_seqlens": torch.tensor([0, LONG] + [LONG] * 200)}
    return {"stats": SeqlenStats.from_vector(seqlen_stats_vector(torch.tensor([0, LONG])))}


@pytest.mark.parametrize("count_on", ["auto", "device"])
@pytest.mark.parametrize("form", ["small pack", "large pack", "stats vector"])
def test_valid_microbatches_whose_step_sum_passes_int64_are_refused_at_step(form, count_on):
    assert LONG**2 < 2**63 <= 2 * LONG**2  # each microbatch valid, the two together not
    acc = FlopsAccumulator(packed=True, count_on=count_on)
    for _ in range(2):
        acc.add_microbatch(**_long_microbatch(form))
    # Sync-free until read: the wrap is one more malformed row of the int64 kind, which
    # training_flops refuses as well.
    assert acc.resolve().malformed() == {"int64": 1}
    with pytest.raises(ValueError, match=r"^training_flops: the statistics count 1 malformed boundary row"):
        training_flops(SHAPE, acc.resolve())
    exact = 2 * LONG * LONG  # Python's exact ints: 18,446,744,061,852,498,002
    with pytest.raises(
        ValueError,
        match=rf"^FlopsAccumulator\.step: this step's sums over this rank's 2 microbatches reach 2\*\*63 or "
        rf"more \(squared = {exact}, padded_squared = {exact}\).* The step is not counted$",
    ):
        acc.step(SHAPE)
    assert acc.state_dict() == dict.fromkeys(acc.state_dict(), 0) and acc.num_microbatches == 0
    # Beside a document that still fits, the step counts exactly.
    acc.add_microbatch(**_long_microbatch(form))
    acc.add_microbatch(cu_seqlens=torch.tensor([0, BESIDE_LONG]))
    acc.step(SHAPE)
    assert acc.last_stats.to_dict()["squared"] == LONG**2 + BESIDE_LONG**2 == 2**63 - 296_782
    assert acc.total_tokens == LONG + BESIDE_LONG


def test_host_and_device_microbatches_of_one_step_are_checked_together():
    # A host-counted microbatch and a staged one: each fits, their sum does not.
    acc = FlopsAccumulator(packed=True)
    acc.add_microbatch(cu_seqlens=torch.tensor([0, LONG]))
    acc.add_microbatch(**_long_microbatch("stats vector"))
    assert acc.local_stats().held_ints() is None and acc.local_stats().malformed() == {"int64": 1}
    with pytest.raises(ValueError, match=r"^FlopsAccumulator\.step: this step's sums over this rank's 2"):
        acc.step(SHAPE)


@pytest.mark.parametrize(("microbatches", "dp_size"), [(2, 1), (1, 2)])
def test_a_dense_step_whose_sums_pass_int64_is_refused(microbatches, dp_size):
    # Dense counts shapes: each microbatch fits, the step's sum (or its product with the DP size) not.
    acc = FlopsAccumulator(packed=False, dp_size=dp_size)
    for _ in range(microbatches):
        acc.add_microbatch(micro_batch_size=1, seq_len=LONG)
    assert acc.resolve().malformed() == {"int64": 1}
    scope = "this rank's 2 microbatches" if microbatches == 2 else "the data-parallel ranks' microbatches"
    with pytest.raises(ValueError, match=rf"^FlopsAccumulator\.step: this step's sums over {scope} .*"):
        acc.step(SHAPE)
    acc.add_microbatch(micro_batch_size=1, seq_len=LONG // 2)
    assert acc.step(SHAPE) > 0 and acc.total_tokens == dp_size * (LONG // 2)


@pytest.mark.parametrize("docs", [3, 400])
def test_a_host_pack_is_counted_as_it_was_when_added(docs):
    # Small host packs are read at add_microbatch and counted at resolve, large ones counted at
    # once: either way, a data loader that refills its buffer in place afterwards changes nothing.
    cu = torch.arange(0, 2 * docs + 1, 2, dtype=torch.int32)  # documents of 2 tokens
    acc = FlopsAccumulator(packed=True)
    acc.add_microbatch(cu_seqlens=cu, seq_len=2 * docs)
    cu.mul_(3)  # refilled: documents of 6 tokens, beyond the pack length
    acc.add_microbatch(cu_seqlens=cu, seq_len=6 * docs)
    got = acc.local_stats().to_dict()
    assert (got["num_sequences"], got["tokens"], got["squared"]) == (2 * docs, 8 * docs, 40 * docs)
    assert got["malformed_rows"] == 0 and got["padded_tokens"] == 8 * docs


# ---------------------------------------------------------------- the counting path, and refusals


def _module_walk(call) -> list[tuple[str, str]]:
    """The calls from one `accounting` module into another while `call()` runs, in order."""
    import sys

    edges = []

    def profile(frame, event, arg):
        if event == "call" and frame.f_back is not None:
            callee, caller = frame.f_globals.get("__name__", ""), frame.f_back.f_globals.get("__name__", "")
            if callee.startswith("accounting.") and caller.startswith("accounting.") and callee != caller:
                edges.append((caller, callee))

    sys.setprofile(profile)
    try:
        call()
    finally:
        sys.setprofile(None)
    return edges


@pytest.mark.parametrize(
    ("count_on", "docs", "last"),
    [
        ("auto", 3, "accounting.seqlen_host"),  # a small pack, read into lists
        ("auto", 300, "accounting.seqlen_host"),  # a larger one, counted with numpy
        ("device", 3, "accounting.microbatch_staging"),
    ],
)
def test_cu_seqlens_walk_from_add_microbatch_three_modules_without_coming_back(count_on, docs, last):
    acc = FlopsAccumulator(packed=True, count_on=count_on)
    cu = _sentinel_pack(docs, 1)[0].clone()
    edges = _module_walk(lambda: acc.add_microbatch(cu_seqlens=cu, seq_len=3 * docs))
    assert edges[:2] == [("accounting.accumulator", "accounting.boundaries"), ("accounting.boundaries", last)]
    # A chain: each call leaves the module the previous one entered, so no module is come back to.
    assert all(a[1] == b[0] or a == b for a, b in itertools.pairwise(edges)), edges
    assert {module for edge in edges for module in edge} <= {
        "accounting.accumulator", "accounting.boundaries", last
    }  # fmt: skip


def test_a_meta_microbatch_is_refused_at_step_in_one_line():
    acc = FlopsAccumulator(packed=True)
    acc.add_microbatch(cu_seqlens=torch.tensor([0, 4, 8], device="meta"))
    assert acc.resolve().tokens.is_meta  # tracing still works
    with pytest.raises(
        ValueError, match=r"^FlopsAccumulator\.step: the microbatches' boundaries are meta"
    ) as err:
        acc.step(SHAPE)
    assert "\n" not in str(err.value) and acc.num_microbatches == 0 and acc.total_flops == 0


def test_a_dense_accumulator_refuses_boundaries_instead_of_ignoring_them():
    acc = FlopsAccumulator(packed=False, dp_size=1)
    for kwargs in ({"cu_seqlens": torch.tensor([0, 4])}, {"cu_seqlens_padded": torch.tensor([0, 4])}):
        with pytest.raises(
            ValueError, match=r"^add_microbatch: cu_seqlens= is for a packed FlopsAccumulator"
        ):
            acc.add_microbatch(micro_batch_size=1, seq_len=4, **kwargs)
    assert acc.num_microbatches == 0


@pytest.mark.parametrize("vp_stage", [-1, 1.0, "0", True])
def test_a_vp_stage_that_is_not_a_chunk_index_is_refused(vp_stage):
    acc = FlopsAccumulator(packed=True)
    with pytest.raises(ValueError, match=r"^add_microbatch: vp_stage = .* must be an int >= 0"):
        acc.add_microbatch(cu_seqlens=torch.tensor([0, 4]), vp_stage=vp_stage)
    assert acc.num_microbatches == 0


@pytest.mark.parametrize(
    ("state", "message"),
    [
        ({"total_flops": -1}, r"state_dict\['total_flops'\] = -1 must be >= 0"),
        ({"steps": None}, r"state_dict\['steps'\] = None must be an int"),
        ({"total_tokens": torch.tensor(-5)}, r"state_dict\['total_tokens'\] = -5 must be >= 0"),
        ([("total_flops", 1)], "state_dict must be a dict of counters, got list"),
    ],
)
def test_load_state_dict_refuses_negative_or_missing_values_and_restores_nothing(state, message):
    acc = FlopsAccumulator(packed=True)
    acc.load_state_dict({"total_flops": 7, "steps": 1})
    with pytest.raises(ValueError, match=message):
        acc.load_state_dict({"hardware_total_flops": 9, **state} if isinstance(state, dict) else state)
    assert acc.state_dict() == {"total_flops": 7, "hardware_total_flops": 0, "total_tokens": 0,
                                "total_padded_tokens": 0, "steps": 1}  # fmt: skip


def test_total_terms_add_up_to_total_flops():
    acc = FlopsAccumulator(packed=True)
    for cu in ([0, 4, 8], [0, 3, 9, 9]):
        acc.add_microbatch(cu_seqlens=torch.tensor(cu))
        acc.step(SHAPE)
    assert sum(acc.total_terms.values()) == acc.total_flops > 0
    assert acc.total_terms["core_attention"] > 0 and acc.total_terms["mlp"] > 0
