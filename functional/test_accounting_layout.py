"""The accumulator's layout constructors on real gloo groups and a real megatron-core parallel state.

One 2-rank launch runs every check (a launch costs seconds): with plain process groups (DP = 2),
then under megatron-core's `parallel_state` with CP = 2, then with TP = 2. Each wrong group a user
can reach for (the DP x CP group, the world group under CP or TP, a group that disagrees with the
declared DP size) is refused with a message naming the fix, where it used to count the batch twice;
the right one counts the global batch exactly once. Expected FLOPs are Megatron-LM's formula
(`fixtures.oracles`) over the documents' real lengths, not the library's own count.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from fixtures.oracles import megatron_lm_step_flops
from megatron_testkit.ranks import run_ranks

pytestmark = [pytest.mark.L0, pytest.mark.world_size(2), pytest.mark.memory_budget(host="768MiB")]

PACK = 64
# Per rank, one pack: real document lengths (padded to multiples of 4 inside a 64-slot pack).
LENGTHS = {0: [30, 9], 1: [17, 3, 21]}


@dataclasses.dataclass(frozen=True)
class Model:
    """Megatron-LM's plain GPT block: the oracle's field names."""

    num_layers: int = 2
    hidden_size: int = 64
    num_attention_heads: int = 4
    num_query_groups: int = 4
    ffn_hidden_size: int = 256
    gated_linear_unit: bool = False
    vocab_size: int = 128


def _pack(lengths: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    cu, padded = [0], [0]
    for n in lengths:
        cu.append(cu[-1] + n)
        padded.append(padded[-1] + -(-n // 4) * 4)
    return torch.tensor(cu, dtype=torch.int32), torch.tensor(padded, dtype=torch.int32)


def _refusal(fn) -> str | None:
    try:
        fn()
    except ValueError as err:
        return str(err)
    return None


def _config(**parallel):
    from megatron.core.transformer.transformer_config import TransformerConfig

    m = Model()
    return TransformerConfig(
        num_layers=m.num_layers,
        hidden_size=m.hidden_size,
        num_attention_heads=m.num_attention_heads,
        ffn_hidden_size=m.ffn_hidden_size,
        add_bias_linear=False,
        **parallel,
    )


def _plain_groups(rank: int) -> dict:
    """DP = 2 on plain gloo groups; megatron's parallel state is not initialised."""
    from accounting import FlopsAccumulator, ModelShape

    world = torch.distributed.group.WORLD
    shape = ModelShape.from_megatron(_config(), Model.vocab_size)
    cu, padded = _pack(LENGTHS[rank])
    out = {}
    acc = FlopsAccumulator.from_process_groups(True, dp_group=world, config=_config())
    acc.add_microbatch(cu_seqlens=cu, cu_seqlens_padded=padded, seq_len=PACK)
    out["dp2_step"] = acc.step(shape)
    out["dp2_layout"] = (acc.layout.dp_size, acc.layout.cp_size)
    # The world group claimed as DP while the config says CP = 2: DP is 2 / 2 = 1.
    out["cp_world_as_dp"] = _refusal(
        lambda: FlopsAccumulator.from_process_groups(
            True, dp_group=world, cp_group=world, config=_config(context_parallel_size=2)
        )
    )
    # A plain accumulator whose declared DP size disagrees with its group.
    declared = FlopsAccumulator(packed=True, dp_group=world, dp_size=1)
    declared.add_microbatch(cu_seqlens=cu, cu_seqlens_padded=padded, seq_len=PACK)
    out["declared_dp_mismatch"] = _refusal(declared.resolve)
    return out


def _under_megatron_cp(rank: int) -> dict:
    """megatron-core's parallel state with CP = 2 (DP = 1): both ranks hold the same full pack."""
    from accounting import FlopsAccumulator, ModelShape
    from fixtures.megatron import cpu_shim, destroy_model_parallel, init_model_parallel

    cu, padded = _pack(LENGTHS[0])  # the same micro batch on both CP ranks
    out = {}
    with cpu_shim():
        init_model_parallel(context_parallel_size=2)
        from megatron.core import parallel_state as ps

        config = _config(context_parallel_size=2)
        shape = ModelShape.from_megatron(config, Model.vocab_size)
        acc = FlopsAccumulator.from_parallel_state(True, config=config, seq_length=PACK)
        acc.add_microbatch(cu_seqlens=cu, cu_seqlens_padded=padded, seq_len=PACK)
        out["cp2_step"] = acc.step(shape)
        out["cp2_layout"] = (acc.layout.dp_size, acc.layout.cp_size)
        for name, group in (
            ("dp_x_cp", ps.get_data_parallel_group(with_context_parallel=True)),
            ("world_under_cp", torch.distributed.group.WORLD),
            ("pure_dp", ps.get_data_parallel_group(with_context_parallel=False)),
        ):
            plain = FlopsAccumulator(packed=True, dp_group=group)
            plain.add_microbatch(cu_seqlens=cu, cu_seqlens_padded=padded, seq_len=PACK)
            out[name] = _refusal(lambda plain=plain: plain.step(shape))
            out[f"{name}_step"] = plain.total_flops
        local = acc.add_microbatch
        out["cp_local_tokens"] = _refusal(
            lambda: local(cu_seqlens=cu, cu_seqlens_padded=padded, tokens=torch.zeros(PACK // 2))
        )
        out["config_cp_mismatch"] = _refusal(
            lambda: FlopsAccumulator.from_parallel_state(True, config=_config())
        )
        dropping = _config(
            context_parallel_size=2,
            num_moe_experts=4,
            moe_router_topk=2,
            moe_expert_capacity_factor=1.25,
            moe_token_dispatcher_type="alltoall",
        )
        out["token_dropping"] = _refusal(lambda: FlopsAccumulator.from_parallel_state(True, config=dropping))
        destroy_model_parallel()
    return out


def _under_megatron_tp(rank: int) -> dict:
    """megatron-core's parallel state with TP = 2: the world group would count each TP rank."""
    from accounting import FlopsAccumulator
    from fixtures.megatron import cpu_shim, destroy_model_parallel, init_model_parallel

    out = {}
    with cpu_shim():
        init_model_parallel(tensor_model_parallel_size=2)
        plain = FlopsAccumulator(packed=False, dp_group=torch.distributed.group.WORLD)
        plain.add_microbatch(micro_batch_size=1, seq_len=PACK)
        out["world_under_tp"] = _refusal(plain.resolve)
        checked = FlopsAccumulator.from_parallel_state(False)
        checked.add_microbatch(micro_batch_size=1, seq_len=PACK)
        out["tp2_tokens"] = int(checked.resolve().tokens)
        destroy_model_parallel()
    return out


def layout_rank(rank: int, world_size: int) -> dict:
    torch.set_num_threads(1)
    return {**_plain_groups(rank), **_under_megatron_cp(rank), **_under_megatron_tp(rank)}


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    return run_ranks(layout_rank, 2, backend="gloo", timeout=240)


FIX = "get_data_parallel_group(with_context_parallel=False)"


def test_dp_groups_from_the_process_groups_count_the_global_batch_once(ranks):
    expected = megatron_lm_step_flops(Model(), LENGTHS[0] + LENGTHS[1])
    assert [r["dp2_step"] for r in ranks] == [expected, expected]
    assert ranks[0]["dp2_layout"] == (2, 1)


def test_a_world_group_named_dp_under_cp_is_refused_by_the_config(ranks):
    for r in ranks:
        assert "dp_group has 2 ranks but the data-parallel size is 1" in r["cp_world_as_dp"]
        assert FIX in r["cp_world_as_dp"]


def test_a_group_that_disagrees_with_the_declared_dp_size_is_refused(ranks):
    assert all(
        "dp_group has 2 ranks but the data-parallel size is 1" in r["declared_dp_mismatch"] for r in ranks
    )


def test_from_parallel_state_counts_the_cp_ranks_pack_once(ranks):
    expected = megatron_lm_step_flops(Model(), LENGTHS[0])
    assert [r["cp2_step"] for r in ranks] == [expected, expected]
    assert ranks[0]["cp2_layout"] == (1, 2)


@pytest.mark.parametrize("name", ["dp_x_cp", "world_under_cp"])
def test_a_dp_x_cp_or_world_group_under_megatron_cp_is_refused_not_counted_twice(ranks, name):
    for r in ranks:
        assert "dp_group has 2 ranks but the data-parallel size is 1" in r[name], r[name]
        assert "counted 2 times" in r[name] and FIX in r[name]
        assert r[f"{name}_step"] == 0  # nothing was added


def test_the_pure_dp_group_under_megatron_cp_is_accepted_and_counts_once(ranks):
    expected = megatron_lm_step_flops(Model(), LENGTHS[0])
    assert [(r["pure_dp"], r["pure_dp_step"]) for r in ranks] == [(None, expected)] * 2


def test_a_cp_ranks_local_tokens_are_refused_under_megatron_cp(ranks):
    for r in ranks:
        assert "this CP rank's slice" in r["cp_local_tokens"] and f"seq_len={PACK}" in r["cp_local_tokens"]


def test_a_config_for_another_layout_and_a_token_dropping_moe_are_refused(ranks):
    for r in ranks:
        assert "the model config says CP = 1" in r["config_cp_mismatch"]
        assert "moe_expert_capacity_factor = 1.25" in r["token_dropping"]


def test_the_world_group_under_megatron_tp_is_refused_and_the_constructor_counts_once(ranks):
    for r in ranks:
        assert "dp_group has 2 ranks but the data-parallel size is 1" in r["world_under_tp"]
        assert r["tp2_tokens"] == PACK  # one DP replica's micro batch, not one per TP rank
