"""FlopsAccumulator in one process: sync-free accumulation, VPP dedup, dense extrapolation, exact counters.

The collective paths (packed DP reduce, CP ranks, empty packs) run on real gloo groups in
functional/test_accounting_collectives.py.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from accounting import FlopsAccumulator, ModelShape, SeqlenStats, seqlen_stats, training_flops
from unit.strategies import packs

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


def test_add_microbatch_calls_no_syncing_function_even_on_malformed_input():
    acc = FlopsAccumulator(packed=True, window_size=3)
    with CallLog() as log:
        acc.add_microbatch(cu_seqlens=torch.tensor([[0, 4, 9, -1], [0, 5, 3, 8]]), seq_len=9)
        acc.add_microbatch(cu_seqlens=torch.tensor([0, 4]), cu_seqlens_padded=torch.tensor([0, 6]), seq_len=9)
    assert log.calls and not [c for c in log.calls if c in SYNCS]


def _sentinel_pack(docs: int, rows: int) -> torch.Tensor:
    """`rows` rows of `docs` documents of 3 tokens, then a -1 tail of 2 (int32)."""
    cu = torch.arange(0, 3 * (docs + 1), 3).expand(rows, -1)
    return torch.cat([cu, torch.full((rows, 2), -1)], dim=1).to(torch.int32)


@pytest.mark.parametrize("padded_and_window", [False, True])
def test_add_microbatch_makes_a_fixed_number_of_torch_calls_whatever_the_pack(padded_and_window):
    # The sync-free path is a fixed sequence of vectorised kernels: its torch calls (kernel launches
    # on a GPU, views and attribute reads aside) grow neither with the documents nor with the rows.
    # The ceiling is the budget set when the path was vectorised (it took 55 calls before);
    # ci/bench_accounting.py measures the cost.
    acc = FlopsAccumulator(packed=True, window_size=(3, 1) if padded_and_window else None)
    counts = []
    for docs, rows in ((1, 1), (300, 1), (300, 8)):
        cu = _sentinel_pack(docs, rows)
        kwargs = {
            "cu_seqlens": cu,
            "cu_seqlens_padded": cu if padded_and_window else None,
            "seq_len": 3 * docs,
        }
        acc.add_microbatch(**kwargs)  # the steady state: later calls also add to the running sum
        with CallLog() as log:
            acc.add_microbatch(**kwargs)
        counts.append(len(log.calls))
    assert len(set(counts)) == 1, counts
    assert padded_and_window or counts[0] <= 36, counts


def test_step_reads_the_statistics_back_exactly_once():
    acc = FlopsAccumulator(packed=True)
    for _ in range(3):
        acc.add_microbatch(cu_seqlens=torch.tensor([0, 4, 9, 9]), seq_len=12)
    with CallLog() as log:
        acc.step(SHAPE)
    assert [c for c in log.calls if c in SYNCS] == ["tolist"]


@given(packs())
def test_malformed_counters_ride_the_meta_vector_without_a_read(pack):
    acc = FlopsAccumulator(packed=True, device="meta")
    acc.add_microbatch(cu_seqlens=pack.cu_seqlens(device="meta"), seq_len=1)  # likely beyond the pack
    assert acc.local_stats().malformed_rows.is_meta
