"""An accumulator that holds its layout, in one process: CP slices, VPP chunks, token dropping refused.

Each mistake is first shown to give a silently wrong count on a plain `FlopsAccumulator` (so the
refusal guards something real), then refused by one holding its `ParallelLayout` (as
`FlopsAccumulator.from_parallel_state` builds it) with a message naming the fix. The group checks need real process groups: functional/test_accounting_layout.py.
"""

from __future__ import annotations

import pytest
import torch

from accounting import FlopsAccumulator, ModelShape, SeqlenStats, seqlen_stats, training_flops
from accounting.parallel_layout import ParallelLayout, accumulator_for_layout, check_no_token_dropping
from megatron_testkit import skips

pytestmark = pytest.mark.L0

SHAPE = ModelShape(num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=128, ffn_hidden_size=256)
PACK = 256
# A half-full pack: two documents of 100 and 20 tokens padded to 104 and 24: 128 of its 256 slots.
CU = torch.tensor([0, 100, 120])
CU_PADDED = torch.tensor([0, 104, 128])


def _checked(packed: bool, layout: ParallelLayout) -> FlopsAccumulator:
    """A FlopsAccumulator holding `layout`, as from_parallel_state builds one (without the groups)."""
    return accumulator_for_layout(FlopsAccumulator, packed, layout)


def _cp_layout(seq_length: int | None = PACK, cp: int = 2) -> ParallelLayout:
    return ParallelLayout(dp_size=1, cp_size=cp, seq_length=seq_length)


def _full_pack_flops() -> tuple[int, int]:
    """Model and hardware FLOPs of the pack, counted independently of the accumulator."""
    full = training_flops(SHAPE, seqlen_stats(CU, CU_PADDED, pack_len=PACK))
    return full.total, full.hardware_total


def test_a_cp_ranks_local_tokens_silently_under_count_on_the_plain_accumulator():
    # What a new user does on a CP = 2 rank: pass the tokens the rank holds (half the pack).
    local_tokens = torch.zeros(PACK // 2, dtype=torch.long)
    plain = FlopsAccumulator(packed=True)
    plain.add_microbatch(cu_seqlens=CU, cu_seqlens_padded=CU_PADDED, tokens=local_tokens)
    plain.step(SHAPE)
    total, hardware = _full_pack_flops()
    assert plain.total_flops == total  # model FLOPs come from the real lengths...
    assert plain.hardware_total_flops < 0.6 * hardware  # ...but the pack's padding tail is lost


@pytest.mark.parametrize("seq_length", [PACK, None])
def test_a_cp_ranks_local_tokens_are_refused_with_the_fix(seq_length):
    acc = _checked(True, _cp_layout(seq_length))
    with pytest.raises(
        ValueError, match=r"CP = 2\) the length of `tokens` \(128\) is this CP rank's slice"
    ) as err:
        acc.add_microbatch(cu_seqlens=CU, cu_seqlens_padded=CU_PADDED, tokens=torch.zeros(PACK // 2))
    assert f"pass seq_len={seq_length or 'the un-sliced pack length'}" in str(err.value)


def test_a_sliced_seq_len_is_refused_when_the_configured_length_shows_it():
    acc = _checked(True, _cp_layout())
    with pytest.raises(
        ValueError, match=r"seq_len = 128 is a CP rank's slice of the configured 256 \(CP = 2\)"
    ):
        acc.add_microbatch(cu_seqlens=CU, cu_seqlens_padded=CU_PADDED, seq_len=PACK // 2)


@pytest.mark.parametrize(
    "how",
    [
        {"seq_len": PACK},
        {"tokens": torch.zeros(PACK)},  # the full, un-sliced tokens
        {},  # nothing: the configured seq_length
    ],
    ids=["seq_len", "full-tokens", "configured"],
)
def test_the_un_sliced_length_counts_the_whole_pack(how):
    acc = _checked(True, _cp_layout())
    acc.add_microbatch(cu_seqlens=CU, cu_seqlens_padded=CU_PADDED, **how)
    acc.step(SHAPE)
    assert (acc.total_flops, acc.hardware_total_flops) == _full_pack_flops()


def test_without_cp_the_tokens_length_is_the_sequence():
    acc = _checked(True, ParallelLayout(dp_size=1))
    acc.add_microbatch(cu_seqlens=CU, cu_seqlens_padded=CU_PADDED, tokens=torch.zeros(PACK))
    acc.step(SHAPE)
    assert (acc.total_flops, acc.hardware_total_flops) == _full_pack_flops()


def test_dense_batches_under_cp_refuse_the_local_slice_too():
    acc = _checked(False, ParallelLayout(dp_size=2, cp_size=2, seq_length=64))
    with pytest.raises(
        ValueError, match=r"length of `tokens` \(32\) is this CP rank's slice.*pass seq_len=64"
    ):
        acc.add_microbatch(tokens=torch.zeros(4, 32))
    acc.add_microbatch(tokens=torch.zeros(4, 64))
    assert acc.step(SHAPE) == training_flops(SHAPE, SeqlenStats.dense(4 * 2, 64)).total  # x DP 2


def test_under_vpp_a_micro_batch_without_its_chunk_is_refused_and_with_it_counts_once():
    layout = ParallelLayout(dp_size=1, vpp_size=4)
    plain = FlopsAccumulator(packed=False, dp_size=1)
    for _ in range(4):  # every chunk's forward step, no vp_stage: four times the step
        plain.add_microbatch(micro_batch_size=1, seq_len=16)
    assert plain.step(SHAPE) == 4 * training_flops(SHAPE, SeqlenStats.dense(1, 16)).total
    checked = _checked(False, layout)
    with pytest.raises(ValueError, match=r"VPP = 4.*pass vp_stage="):
        checked.add_microbatch(micro_batch_size=1, seq_len=16)
    for chunk in range(4):
        checked.add_microbatch(micro_batch_size=1, seq_len=16, vp_stage=chunk)
    assert checked.step(SHAPE) == training_flops(SHAPE, SeqlenStats.dense(1, 16)).total


@pytest.mark.parametrize(
    ("fields", "bad"),
    [
        ({}, None),
        ({"dp_size": 0}, "dp_size"),
        ({"cp_size": True}, "cp_size"),
        ({"seq_length": 0}, "seq_length"),
    ],
)
def test_a_layout_with_non_positive_sizes_is_refused(fields, bad):
    if bad is None:
        assert ParallelLayout(dp_size=1).cp_size == 1
        return
    with pytest.raises(ValueError, match=bad):
        ParallelLayout(**{"dp_size": 1, **fields})


def test_an_moe_that_drops_tokens_is_refused_not_over_counted():
    skips.require_megatron(why="the test builds a real megatron-core config")
    from megatron.core.transformer.transformer_config import TransformerConfig

    base = {
        "num_layers": 2,
        "hidden_size": 64,
        "num_attention_heads": 4,
        "num_moe_experts": 4,
        "moe_router_topk": 2,
        "moe_token_dispatcher_type": "alltoall",
    }
    check_no_token_dropping(TransformerConfig(**base))  # dropless: counted exactly
    dropping = TransformerConfig(**base, moe_expert_capacity_factor=1.0)
    with pytest.raises(ValueError, match=r"moe_expert_capacity_factor = 1.0.*over-counted.*train dropless"):
        check_no_token_dropping(dropping)
