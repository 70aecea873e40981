"""The accounting library's collectives on real process groups (gloo on CPU, NCCL with enough GPUs).

Each spawn runs several checks in one rank function (a spawn costs seconds). Collectives are
counted for real inside the ranks (`megatron_testkit.collectives.CollectiveCounter` wraps
`torch.distributed`'s functions), so "exactly one all-reduce" and "no collective" are measured,
not assumed. Expected values are plain Python sums and maxima over the inputs the parent generated.
"""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from fixtures.oracles import max_over_ranks
from megatron_testkit.collectives import COLLECTIVES, CollectiveCounter
from megatron_testkit.ranks import run_ranks
from unit.strategies import cu_from_lengths

pytestmark = [pytest.mark.L0]


def _cu(lengths: list[int]) -> torch.Tensor:
    return torch.tensor(cu_from_lengths(lengths, len(lengths) + 2, "sentinel"), dtype=torch.int32)


# ---------------------------------------------------------------- FLOPs accumulator, DP=2


def _dp_checks(rank: int, world_size: int, packs_per_rank: list[list[list[int]]]) -> dict:
    from accounting import FlopsAccumulator, ModelShape

    # Left installed: the rank exits after this function.
    counter = CollectiveCounter().install()
    world = torch.distributed.group.WORLD
    shape = ModelShape(num_layers=2, hidden_size=16, num_attention_heads=2, vocab_size=32)
    out = {}

    packed = FlopsAccumulator(packed=True, dp_group=world)
    for lengths in packs_per_rank[rank]:
        packed.add_microbatch(cu_seqlens=_cu(lengths))
    counter.phase = "packed"
    out["packed"] = packed.resolve().to_dict()
    out["packed_collectives"] = counter.counts("packed")

    counter.phase = "setup"
    dense = FlopsAccumulator(packed=False, dp_group=world)
    dense.add_microbatch(micro_batch_size=2, seq_len=16)
    counter.phase = "dense"
    out["dense"] = dense.resolve().to_dict()
    out["dense_collectives"] = sum(counter.counts("dense").values())
    # Dense without a DP size or group in a 2-rank world: refused, not silently counted as DP=1.
    counter.phase = "setup"
    ungrouped = FlopsAccumulator(packed=False)
    ungrouped.add_microbatch(micro_batch_size=2, seq_len=16)
    try:
        ungrouped.resolve()
        out["dense_without_group"] = None
    except ValueError as err:
        out["dense_without_group"] = str(err)

    # Rank 1 sees a degenerate pack (only zero-length segments), then no microbatch at all:
    # it must still join the reduce, or rank 0 would wait forever.
    counter.phase = "setup"
    degenerate = FlopsAccumulator(packed=True, dp_group=world)
    degenerate.add_microbatch(cu_seqlens=_cu([5, 7]) if rank == 0 else torch.tensor([0, 0, 0]))
    out["degenerate"] = degenerate.resolve().to_dict()
    nothing = FlopsAccumulator(packed=True, dp_group=world)
    if rank == 0:
        nothing.add_microbatch(cu_seqlens=_cu([3]))
    counter.phase = "nothing"
    out["step_flops"] = nothing.step(shape)
    out["nothing_collectives"] = counter.counts("nothing")["all_reduce"]
    return out


def _random_packs_per_rank(seed: int) -> list[list[list[int]]]:
    """Per rank, 1-3 microbatches of 0-5 documents of 1-200 tokens (a seeded draw).

    Not a hypothesis strategy: at one example per spawn, hypothesis only ever ran its minimal
    example, no document on either rank, which checks a sum of zeros.
    """
    rng = random.Random(seed)
    return [
        [[rng.randint(1, 200) for _ in range(rng.randint(0, 5))] for _ in range(rng.randint(1, 3))]
        for _ in range(2)
    ]


@pytest.mark.world_size(2)
def test_packed_dp_reduce_is_one_exact_all_reduce_and_dense_runs_none():
    packs_per_rank = _random_packs_per_rank(seed=0)
    assert all(any(rank_packs) for rank_packs in packs_per_rank), packs_per_rank  # documents on both ranks
    results = run_ranks(_dp_checks, 2, args=(packs_per_rank,), timeout=120)
    every_doc = [s for rank_packs in packs_per_rank for lengths in rank_packs for s in lengths]
    for out in results:
        assert out["packed"]["tokens"] == sum(every_doc)
        assert out["packed"]["squared"] == sum(s * s for s in every_doc)
        assert out["packed"]["num_sequences"] == len(every_doc)
        assert out["packed_collectives"] == {**dict.fromkeys(COLLECTIVES, 0), "all_reduce": 1}
        assert out["dense"]["tokens"] == 2 * 2 * 16 and out["dense"]["squared"] == 2 * 2 * 16 * 16
        assert out["dense_collectives"] == 0
        assert "pass dp_size= or dp_group=" in (out["dense_without_group"] or ""), out["dense_without_group"]
        assert (out["degenerate"]["tokens"], out["degenerate"]["squared"]) == (12, 25 + 49)
        assert out["nothing_collectives"] == 1
    assert results[0]["step_flops"] == results[1]["step_flops"] > 0


# ---------------------------------------------------------------- a malformed pack on one DP rank

# Per step, per rank: the microbatches (cu_seqlens as lists) and the pack length. Step 0: rank 0's
# microbatch 1 decreases (9 after 12); step 1: rank 1's microbatch 0 holds more tokens than its
# pack; step 2: healthy on both ranks, to prove the ranks still run their collectives in step.
_MALFORMED_STEPS = [
    [([[0, 4, 9], [0, 12, 9, 20]], 32), ([[0, 7, 7], [0, 3]], 32)],
    [([[0, 5]], 16), ([[0, 10, 17], [0, 1, 2]], 16)],
    [([[0, 6, 10]], 16), ([[0, 2], [0, 16]], 16)],
]


def _malformed_rank_checks(rank: int, world_size: int, steps: list) -> dict:
    from accounting import FlopsAccumulator, ModelShape

    counter = CollectiveCounter().install()
    shape = ModelShape(num_layers=2, hidden_size=16, num_attention_heads=2, vocab_size=32)
    acc = FlopsAccumulator(packed=True, dp_group=torch.distributed.group.WORLD)
    out = {"errors": [], "reduces": [], "step_flops": None}
    for i, per_rank in enumerate(steps):
        microbatches, pack_len = per_rank[rank]
        for cu in microbatches:
            acc.add_microbatch(cu_seqlens=torch.tensor(cu, dtype=torch.int32), seq_len=pack_len)
        counter.phase = f"step {i}"
        try:
            out["step_flops"] = acc.step(shape)
            out["errors"].append(None)
        except ValueError as err:
            out["errors"].append(str(err))
        out["reduces"].append(counter.counts(counter.phase)["all_reduce"])
        counter.phase = "setup"
    out["state"] = acc.state_dict()
    out["last_stats"] = acc.last_stats.to_dict()
    return out


@pytest.mark.world_size(2)
def test_a_malformed_pack_on_one_dp_rank_raises_on_both_ranks_and_none_hangs():
    # The malformed-row counters ride the one SUM all-reduce of step(): the healthy rank sees the
    # other rank's count and refuses the step too, after the same single collective (no rank waits
    # in a collective its peer never enters; run_ranks reports a hang as a failure within its timeout).
    results = run_ranks(_malformed_rank_checks, 2, args=(_MALFORMED_STEPS,), timeout=120)
    decrease = "a boundary smaller than the one before it"
    beyond = "more tokens than the pack length"
    own = "FlopsAccumulator.step: microbatch {} has 1 malformed row ({}"
    other = "FlopsAccumulator.step: another data-parallel rank's microbatches: 1 malformed boundary row (1 with {}"
    expected_starts = [
        [own.format(1, decrease), other.format(beyond)],  # rank 0: its own step-0 fault, rank 1's in step 1
        [other.format(decrease), own.format(0, beyond)],
    ]
    for rank, out in enumerate(results):
        for error, start in zip(out["errors"][:2], expected_starts[rank], strict=True):
            assert error is not None and error.startswith(start), (rank, error)
            assert error.endswith("validate_cu_seqlens(...) names the index"), error
        assert out["errors"][2] is None
        assert out["reduces"] == [1, 1, 1]  # one all-reduce per step, refused or not
    # Only the healthy step counted: the refused steps added nothing (plain Python sums as oracle).
    healthy = [cu for microbatches, _ in _MALFORMED_STEPS[2] for cu in microbatches]
    lengths = [b - a for cu in healthy for a, b in itertools.pairwise(cu)]
    for out in results:
        assert out["last_stats"]["tokens"] == out["state"]["total_tokens"] == sum(lengths) == 28
        assert out["last_stats"]["squared"] == sum(s * s for s in lengths)
        assert out["last_stats"]["padded_tokens"] == out["state"]["total_padded_tokens"] == 3 * 16
        assert out["state"]["steps"] == 1 and out["last_stats"]["malformed_rows"] == 0
    assert results[0]["step_flops"] == results[1]["step_flops"] == results[0]["state"]["total_flops"] > 0


# ---------------------------------------------------------------- step sums that pass int64 together

# The longest document whose s² fits an int64 (2**63 - 5,928,526,807), and one that still fits beside it.
_LONG, _BESIDE_LONG = 3_037_000_499, 76_995
# Per step, per rank: the documents of each microbatch (one per microbatch). Step 0: one LONG
# document per rank, so only the all-reduce's sum passes 2**63; step 1: rank 0's own two pass it;
# step 2: LONG beside a document that fits, counted exactly on both ranks.
_WRAP_STEPS = [
    [[_LONG], [_LONG]],
    [[_LONG, _LONG], [3]],
    [[_LONG], [_BESIDE_LONG]],
]
# How a microbatch arrives: counted on the host as a small pack or a large one (past the loop's
# limit: numpy), or staged for the device path's kernels.
_WRAP_FORMS = {"small pack": ("auto", 0), "large pack": ("auto", 200), "device path": ("device", 0)}


def _wrap_rank_checks(rank: int, world_size: int, steps: list, forms: dict) -> dict:
    from accounting import FlopsAccumulator, ModelShape

    counter = CollectiveCounter().install()
    shape = ModelShape(num_layers=2, hidden_size=16, num_attention_heads=2, vocab_size=32)
    out = {}
    for form, (count_on, tail) in forms.items():
        acc = FlopsAccumulator(packed=True, dp_group=torch.distributed.group.WORLD, count_on=count_on)
        errors, reduces = [], []
        for i, per_rank in enumerate(steps):
            for length in per_rank[rank]:
                acc.add_microbatch(cu_seqlens=torch.tensor([0, length] + [length] * tail))
            counter.phase = f"{form} {i}"
            try:
                acc.step(shape)
                errors.append(None)
            except ValueError as err:
                errors.append(str(err))
            reduces.append(counter.counts(counter.phase)["all_reduce"])
        out[form] = {
            "errors": errors,
            "reduces": reduces,
            "last": acc.last_stats.to_dict(),
            **acc.state_dict(),
        }
    return out


@pytest.mark.world_size(2)
def test_step_sums_that_pass_int64_only_over_the_dp_all_reduce_are_refused_on_every_rank():
    # The high words of each sum ride the same one all-reduce: whichever sum wraps (one rank's
    # microbatches, or the ranks' together), every rank refuses the step, and the next one counts.
    results = run_ranks(_wrap_rank_checks, 2, args=(_WRAP_STEPS, _WRAP_FORMS), timeout=120)
    prefix = "FlopsAccumulator.step: this step's sums over "
    step0 = f"the data-parallel ranks' microbatches reach 2**63 or more (squared = {2 * _LONG**2},"
    step1_own = f"this rank's 2 microbatches reach 2**63 or more (squared = {2 * _LONG**2 + 9},"
    step1_other = f"the data-parallel ranks' microbatches reach 2**63 or more (squared = {2 * _LONG**2 + 9},"
    for rank, out in enumerate(results):
        for form, got in out.items():
            errors = got["errors"]
            assert errors[0] is not None and errors[0].startswith(prefix + step0), (rank, form, errors[0])
            step1 = step1_own if rank == 0 else step1_other
            assert errors[1] is not None and errors[1].startswith(prefix + step1), (rank, form, errors[1])
            assert errors[2] is None, (rank, form, errors[2])
            assert got["reduces"] == [1, 1, 1], (rank, form)  # one all-reduce per step, refused or not
            # Only step 2 counted, exactly (Python's ints as the oracle).
            assert got["last"]["squared"] == _LONG**2 + _BESIDE_LONG**2 < 2**63, (rank, form)
            assert got["total_tokens"] == _LONG + _BESIDE_LONG and got["steps"] == 1, (rank, form)


# ---------------------------------------------------------------- CP=2 x DP=2 on 4 ranks


def _cp_dp_checks(rank: int, world_size: int, dp_packs: list[list[int]]) -> dict:
    from accounting import FlopsAccumulator, reduce_max_memory

    counter = CollectiveCounter().install()
    # Layout: rank = dp * 2 + cp. CP pairs {0,1}, {2,3} share a DP rank; DP groups {0,2}, {1,3}.
    dp_groups = [torch.distributed.new_group([0, 2]), torch.distributed.new_group([1, 3])]
    dp_group = dp_groups[rank % 2]
    dp_rank = rank // 2
    acc = FlopsAccumulator(packed=True, dp_group=dp_group)
    # Every CP rank of a DP rank sees the same, full cu_seqlens (tokens are CP-sliced, lengths are not).
    acc.add_microbatch(cu_seqlens=_cu(dp_packs[dp_rank]), tokens=torch.zeros(1, 4), seq_len=1024)
    counter.phase = "resolve"
    stats = acc.resolve().to_dict()
    reduces = counter.counts("resolve")["all_reduce"]
    counter.phase = "memory"

    report = {"peak_rss_bytes": 1000 + rank if rank in (1, 3) else 5000, "ooms": rank}
    values, ranks = (
        reduce_max_memory(report, dp_groups[1], return_ranks=True) if rank in (1, 3) else (None, None)
    )
    return {"stats": stats, "reduces": reduces, "values": values, "ranks": ranks}


@pytest.mark.world_size(4)
def test_cp_ranks_are_counted_once_by_reducing_over_the_pure_dp_group():
    dp_packs = [[100, 30, 7], [512, 1]]
    results = run_ranks(_cp_dp_checks, 4, args=(dp_packs,), timeout=180)
    docs = dp_packs[0] + dp_packs[1]
    for out in results:
        assert out["stats"]["tokens"] == sum(docs)  # not 2x: CP ranks are not summed
        assert out["stats"]["squared"] == sum(s * s for s in docs)
        assert out["stats"]["padded_tokens"] == 2 * 1024  # the configured pack length, not the CP slice
        assert out["reduces"] == 1
    # On the subgroup {1, 3}, ranks are reported as GLOBAL ranks.
    for rank in (1, 3):
        assert results[rank]["values"] == {"peak_rss_bytes": 1003, "ooms": 3}
        assert results[rank]["ranks"] == {"peak_rss_bytes": 3, "ooms": 3}


# ---------------------------------------------------------------- reduce_max_memory, 2 ranks


def _memory_checks(rank: int, world_size: int, cases: list[list[dict]]) -> dict:
    from accounting import reduce_max_memory

    counter = CollectiveCounter().install()
    world = torch.distributed.group.WORLD
    out = {"values": [], "ranked": [], "collectives": [], "unchanged": True}
    for i, reports in enumerate(cases):
        mine = reports[rank]
        copy = dict(mine)
        counter.phase = f"case {i}"
        out["values"].append(reduce_max_memory(mine, world))
        out["ranked"].append(reduce_max_memory(mine, world, return_ranks=True))
        out["collectives"].append(sum(counter.counts(counter.phase).values()))
        out["unchanged"] &= mine == copy and [type(v) for v in mine.values()] == [
            type(v) for v in copy.values()
        ]

    counter.phase = "mismatches"
    errors = []
    mismatches = [
        ({"a": 1, "b": 2}, {"a": 1, "c": 2}),  # same count, different names
        ({"a": 1}, {"a": 1, "b": 2}),  # different counts (different tensor lengths would misalign)
    ]
    for pair in mismatches:
        for return_ranks in (False, True):
            try:
                reduce_max_memory(pair[rank], world, return_ranks=return_ranks)
                errors.append(None)
            except ValueError as err:
                errors.append(str(err))
    out["errors"] = errors

    # A non-numeric value on one rank: a ValueError on both ranks, not a hang of the other one.
    bad_value_errors = []
    for return_ranks in (False, True):
        try:
            reduce_max_memory({"a": 1} if rank == 0 else {"a": "lots"}, world, return_ranks=return_ranks)
            bad_value_errors.append(None)
        except ValueError as err:
            bad_value_errors.append(str(err))
    out["bad_value_errors"] = bad_value_errors
    return out


def _expected_max(reports: list[dict]) -> tuple[dict, dict]:
    """The per-key max over the ranks' reports (list index = rank) and the lowest rank holding it."""
    return max_over_ranks(dict(enumerate(reports)))


_REPORT_KEYS = (
    "allocated_bytes",
    "peak_allocated_bytes",
    "reserved_bytes",
    "alloc_retries",
    "ooms",
    "rss_bytes",
)


def _random_rank_reports(rng: random.Random) -> list[dict]:
    """Two ranks' reports sharing 1-6 keys, each key an int (< 2**50), a float or a bool."""
    keys = rng.sample(_REPORT_KEYS, rng.randint(1, len(_REPORT_KEYS)))
    kinds = {k: rng.choice(("int", "float", "bool")) for k in keys}
    draw = {
        "int": lambda: rng.randint(0, 2**50),
        "float": lambda: rng.uniform(0, 1e12),
        "bool": lambda: rng.random() < 0.5,
    }
    return [{k: draw[kinds[k]]() for k in keys} for _ in range(2)]


@pytest.mark.world_size(2)
def test_reduce_max_memory_equals_the_elementwise_max_keeps_types_and_names_the_ranks():
    # A seeded draw, not hypothesis: at one example per spawn, hypothesis only ever ran its minimal
    # example (12 times {"allocated_bytes": 0.0} on both ranks).
    rng = random.Random(0)
    cases = [_random_rank_reports(rng) for _ in range(12)]
    kinds = {type(v) for reports in cases for v in reports[0].values()}
    winners = {r for reports in cases for r in _expected_max(reports)[1].values()}
    assert kinds == {int, float, bool} and winners == {0, 1}, (kinds, winners)  # the draw covers both
    cases = [*cases, [{"peak_allocated_bytes": 7, "ooms": 0}, {"peak_allocated_bytes": 7, "ooms": 0}]]  # ties
    results = run_ranks(_memory_checks, 2, args=(cases,), timeout=120)
    for out in results:
        assert out["unchanged"]
        assert out["collectives"] == [2] * len(cases)  # one per call, two calls per case
        for reports, values, (ranked_values, ranks) in zip(cases, out["values"], out["ranked"], strict=True):
            expected_values, expected_ranks = _expected_max(reports)
            assert values == expected_values and ranked_values == expected_values
            assert [type(v) for v in values.values()] == [type(v) for v in reports[0].values()]
            assert list(values) == list(reports[0])  # the caller's key order
            assert ranks == expected_ranks
        assert all(e is not None and "ranks report different keys" in e for e in out["errors"]), out["errors"]
    assert (
        results[0]["bad_value_errors"]
        == ["reduce_max_memory: another rank's report has a value that is not an int, float or bool"] * 2
    )
    assert (
        results[1]["bad_value_errors"]
        == ["reduce_max_memory: report['a'] = 'lots' is not an int, float or bool"] * 2
    )
