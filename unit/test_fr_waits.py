"""The NCCL side of the wait-for graph: flight-recorder dumps read as its input (megatron_testkit.fr_waits).

The dumps under fixtures/fr_dumps/ are real: recorded from gloo ranks (`python -m fixtures.fr_dumps`),
whose process groups record into PyTorch's flight recorder and dump the format NCCL's monitor
thread writes. Each shape's verdict must name the cycle, the groups and the mismatch exactly as
the wrappers' path does for the same shape on real ranks (functional/test_stall.py).
"""

from __future__ import annotations

import json
import pickle
import shutil
from pathlib import Path

import pytest

from fixtures import fr_dumps
from megatron_testkit import flight_recorder, fr_waits, stall
from megatron_testkit.stall import Position, StallDetector

WINDOW = 5.0


def _stem(
    tmp_path: Path, shape: str, source: Path = fr_dumps.STORED, form: str = "json"
) -> tuple[Path, dict]:
    """The shape's dumps where the launcher reads them (``<stem><rank>``), and the groups' ranks."""
    stem = tmp_path / flight_recorder.DUMP_STEM
    tmp_path.mkdir(parents=True, exist_ok=True)
    for dump in sorted((source / shape).glob(f"rank*.{form}")):
        shutil.copy(dump, flight_recorder.dump_path(stem, int(dump.stem.removeprefix("rank"))))
    return stem, json.loads((source / shape / "groups.json").read_text())


def _verdict(stem: Path, groups: dict, world_size: int) -> stall.Stall | None:
    """What the launcher judges on an NCCL launch whose host view saw no collective (NCCL's
    collectives return at once): the flight recorder's positions, twice a window apart."""
    host = {r: Position(None, 0, 0, True, None) for r in range(world_size)}
    detector = StallDetector(WINDOW, min_work=0.5)
    for now in (0.0, WINDOW + 1):
        positions = stall.with_flight_recorder(host, stall.nccl_positions(stem, range(world_size), groups))
        for rank, position in positions.items():
            detector.observe(now, rank, position)
    return detector.verdict(WINDOW + 1, range(world_size))


# The wrappers' path's lines for the same shapes (functional/test_stall.py).
PAIR_CYCLE = (
    "rank 0 waits in all_reduce #1 of group [0, 1] for rank 1",
    "rank 1 waits in all_reduce #1 of group [1, 2] for rank 2",
    "rank 2 waits in all_reduce #1 of group [0, 2] for rank 0",
)
SIDE_BARRIER = (
    "rank 0 waits in all_reduce #1 of group [0, 1, 2] for rank 2 (knock-on)",
    "rank 1 waits in all_reduce #1 of group [0, 1, 2] for rank 2",
    "rank 2 waits in barrier #1 of group [1, 2] for rank 1",
)


def _assert_pair_cycle(verdict: stall.Stall | None) -> None:
    assert verdict is not None and verdict.rank == 0 and verdict.cycle == (0, 1, 2, 0)
    assert verdict.why.startswith("deadlock: every live rank blocked in a collective")
    assert "the cycle is symmetric" in verdict.why and "rank 0 -> rank 1 -> rank 2 -> rank 0" in verdict.why
    assert verdict.waits == PAIR_CYCLE


@pytest.mark.L0
def test_recorded_pair_cycle_dumps_name_the_symmetric_cycle_as_the_wrappers_do(tmp_path: Path) -> None:
    _assert_pair_cycle(_verdict(*_stem(tmp_path, "pair_cycle"), 3))


@pytest.mark.L0
def test_recorded_side_barrier_dumps_name_the_rank_the_others_wait_for(tmp_path: Path) -> None:
    verdict = _verdict(*_stem(tmp_path, "world_against_side_barrier"), 3)
    assert verdict is not None and verdict.rank == 2 and verdict.cycle == (2, 1, 2)
    assert "rank 2 is in barrier #1 " in verdict.why and "rank 2 -> rank 1 -> rank 2" in verdict.why
    assert "symmetric" not in verdict.why
    assert verdict.waits == SIDE_BARRIER


@pytest.mark.L0
def test_recorded_collective_mismatch_dumps_name_both_sides(tmp_path: Path) -> None:
    # The shape runs on a pair group beside the world (its short timeout ends the run): two groups
    # over ranks [0, 1], which the verdict tells apart by name, on either path.
    verdict = _verdict(*_stem(tmp_path, "collective_mismatch"), 2)
    assert verdict is not None and verdict.rank == 0
    assert verdict.why.startswith(
        "collective mismatch: rank 0 is in all_reduce #1 of group [0, 1] (group name '1') while rank 1 is in "
        "broadcast #1 of group [0, 1] (group name '1'): members of one group at the same collective of it "
        "called different ones"
    )


@pytest.mark.L0
def test_recorded_size_mismatch_dumps_name_both_sides_sizes(tmp_path: Path) -> None:
    verdict = _verdict(*_stem(tmp_path, "size_mismatch"), 2)
    assert verdict is not None and verdict.rank == 0
    assert verdict.why.startswith(
        "collective mismatch: rank 0 is in all_reduce #1 of group [0, 1] (group name '1') with float32 [4] "
        "while rank 1 is in all_reduce #1 of group [0, 1] (group name '1') with float32 [8]: members of one "
        "group at the same collective of it passed tensors of different sizes"
    )
    assert verdict.waits == (
        "rank 0 is in all_reduce #1 of group [0, 1] (group name '1') with float32 [4]",
        "rank 1 is in all_reduce #1 of group [0, 1] (group name '1') with float32 [8]",
    )


@pytest.mark.L0
def test_a_dump_read_as_waits_carries_group_sequence_op_state_and_tensors() -> None:
    dump = flight_recorder.load_dump(fr_dumps.STORED / "world_against_side_barrier" / "rank2.json")
    trace = flight_recorder.parse_dump(dump, 2)
    (entry,) = trace.entries
    assert (entry.pg_name, entry.seq, fr_waits.op_name(entry.op), entry.done) == ("1", 1, "barrier", False)
    waits = fr_waits.rank_waits(trace, {"0": [0, 1, 2], "1": [1, 2]})
    assert waits.main is not None and (waits.main.group, waits.main.seq, waits.main.kind) == (
        "1",
        1,
        "collective",
    )
    assert waits.entered == {"1": 1} and waits.groups == {"0": (0, 1, 2), "1": (1, 2)}
    size = fr_waits.rank_waits(
        flight_recorder.parse_dump(
            flight_recorder.load_dump(fr_dumps.STORED / "size_mismatch" / "rank1.json"), 1
        )
    )
    assert size.main is not None and (size.main.sizes, size.main.dtypes) == (((8,),), ("float32",))


def _nccl_entry(record_id: int, name: str, seq: int, *, p2p: bool = False, state: str = "scheduled") -> dict:
    """An entry as ProcessGroupNCCL records it (its fields, names and pg_config's ranks text)."""
    return {
        "record_id": record_id,
        "pg_id": 1,
        "process_group": ["5", "undefined"],
        "collective_seq_id": 0 if p2p else seq,
        "p2p_seq_id": seq if p2p else 0,
        "profiling_name": name,
        "state": state,
        "retired": state == "completed",
        "input_sizes": [[4]],
        "input_dtypes": ["BFloat16"],
        "output_sizes": [[4]],
        "output_dtypes": ["BFloat16"],
        "is_p2p": p2p,
    }


@pytest.mark.L0
def test_nccl_group_ranks_come_from_pg_config_and_p2p_waits_on_the_peer_by_global_rank() -> None:
    dump = {
        "version": "2.10",
        "pg_config": {"5": {"name": "5", "desc": "undefined", "ranks": "[2, 3]"}},
        "pg_status": {},
        "entries": [
            _nccl_entry(0, "nccl:all_reduce", 1, state="completed"),
            _nccl_entry(1, "nccl:send 0->1", 1, p2p=True, state="completed"),
            _nccl_entry(2, "nccl:send 0->1", 2, p2p=True),
        ],
    }
    waits = fr_waits.rank_waits(flight_recorder.parse_dump(dump, 2), {"5": [9, 9]})
    assert waits.groups == {"5": (2, 3)}  # the dump's own pg_config wins
    assert waits.main is not None and (waits.main.kind, waits.main.peer, waits.main.seq) == ("send", 3, 2)
    assert waits.sent == {3: 2} and waits.entered == {"5": 1}
    assert waits.main.dtypes == ("bfloat16",)
    # The ring buffer dropped older entries: counts per peer are not whole, the wait is unknown, and
    # a group with no entry left would read as never entered: it is left out.
    for i, entry in enumerate(dump["entries"]):
        entry["record_id"] = 100 + i
    dump["pg_config"]["7"] = {"name": "7", "desc": "", "ranks": "[2, 3]"}
    waits = fr_waits.rank_waits(flight_recorder.parse_dump(dump, 2))
    assert waits.main is not None and waits.main.kind == "unknown" and waits.sent == {}
    assert set(waits.groups) == {"5"}


@pytest.mark.L0
def test_nccls_internal_op_names_read_as_the_calls_that_make_them() -> None:
    assert fr_waits.op_name("nccl:all_reduce_barrier") == "barrier"
    assert fr_waits.op_name("nccl:_all_gather_base") == "all_gather_into_tensor"
    assert fr_waits.op_name("nccl:_reduce_scatter_base") == "reduce_scatter_tensor"
    assert fr_waits.op_name("nccl:recv 1<-0") == "recv"
    assert fr_waits.op_name("gloo:broadcast") == "broadcast"


@pytest.mark.L0
def test_the_flight_recorder_wins_where_a_rank_has_a_dump_and_views_are_never_mixed(tmp_path: Path) -> None:
    stem, groups = _stem(tmp_path, "pair_cycle")
    recorded = stall.nccl_positions(stem, range(3), groups)
    host_waits = recorded[0].waits  # any waits: the host's view of a rank
    host = {r: Position("all_reduce #1", 1, 1, r != 1, 3.0, host_waits) for r in range(4)}
    merged = stall.with_flight_recorder(host, recorded)
    assert merged[0].waits == recorded[0].waits and merged[0].inside == "all_reduce #1"
    assert merged[1].ready is False  # the host's readiness stays
    assert (
        merged[3].waits is None and merged[3].inside == "all_reduce #1"
    )  # no dump: no waits of the other view
    assert stall.with_flight_recorder(host, {}) == host  # no dump at all: the host's view, as on gloo


class Smuggled:
    """A class a crafted dump could name: unpickling it would import this module."""


@pytest.mark.L0
def test_a_dump_naming_any_class_is_refused_in_one_line(tmp_path: Path) -> None:
    path = tmp_path / "crafted0"
    path.write_bytes(pickle.dumps({"entries": [Smuggled()], "version": "2.10"}))
    with pytest.raises(ValueError) as excinfo:
        flight_recorder.load_dump(path)
    message = str(excinfo.value)
    assert "\n" not in message
    assert message.startswith(f"{path}: not a flight-recorder dump")
    assert "test_fr_waits.Smuggled; refusing to import it" in message


@pytest.mark.L1
@pytest.mark.world_size(3)
def test_a_live_dump_of_real_gloo_ranks_reads_as_the_stored_one(tmp_path: Path) -> None:
    """Recorded here, in torch's default (pickle) form: if torch's format drifts from the stored
    fixtures, the verdict or the fields the reader uses differ here."""
    live = tmp_path / "live"
    fr_dumps.record("pair_cycle", live / "pair_cycle", form="pickle")
    _assert_pair_cycle(_verdict(*_stem(tmp_path / "a", "pair_cycle", live, "pickle"), 3))
    stored = json.loads((fr_dumps.STORED / "pair_cycle" / "rank0.json").read_text())
    fresh = flight_recorder.load_dump(live / "pair_cycle" / "rank0.pickle")
    for key in ("entries", "pg_status", "pg_config", "version"):
        assert key in fresh, key
    used = (
        "record_id",
        "pg_id",
        "process_group",
        "collective_seq_id",
        "p2p_seq_id",
        "profiling_name",
        "state",
        "retired",
        "input_sizes",
        "input_dtypes",
        "output_sizes",
        "output_dtypes",
        "is_p2p",
    )
    for key in used:
        assert key in stored["entries"][0] and key in fresh["entries"][0], key
    live_trace = flight_recorder.parse_dump(fresh, 0)
    stored_trace = flight_recorder.parse_dump(stored, 0)
    strip = [(e.pg_name, e.seq, e.op, e.done, e.input_sizes, e.input_dtypes) for e in live_trace.entries]
    assert strip == [
        (e.pg_name, e.seq, e.op, e.done, e.input_sizes, e.input_dtypes) for e in stored_trace.entries
    ]


@pytest.mark.L0
def test_a_dump_not_rewritten_since_the_last_poll_is_not_read_again(tmp_path: Path) -> None:
    stem, groups = _stem(tmp_path, "pair_cycle")
    cache: dict = {}
    first = stall.nccl_positions(stem, range(3), groups, cache)
    assert stall.nccl_positions(stem, range(3), groups, cache)[0] is first[0]
    # Rank 0 dumps again (a new file in its place, as the monitor thread writes it): read anew.
    newer = tmp_path / "newer"
    shutil.copy(fr_dumps.STORED / "world_against_side_barrier" / "rank0.json", newer)
    newer.replace(flight_recorder.dump_path(stem, 0))
    again = stall.nccl_positions(stem, range(3), groups, cache)
    assert again[0].waits is not None and again[0].waits.main is not None
    assert again[0].waits.main.group == "0" and again[1] is first[1]
