"""A rank's record (`megatron_testkit.rank_record`): written by the kit's writer, read back typed
through the bounded reader, forged ones refused in one line; and the verdict rules that read it
(`megatron_testkit.diagnosis.judge`). The launcher's side on real ranks is functional/test_launcher.py.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from megatron_testkit import diagnosis, rank_record, ranks
from megatron_testkit.diagnosis import BudgetBelowFootprint, Evidence, judge
from megatron_testkit.rank_record import RankRecord, Unreadable, WrittenRecord

pytestmark = pytest.mark.L0


def _written(**fields: object) -> WrittenRecord:
    base: dict[str, object] = {
        "rank": 1,
        "pid": 4242,
        "status": "failed",
        "started": 100.0,
        "time": 103.5,
        "peak_host_bytes": 300 << 20,
        "peak_process": None,
        "peak_device_bytes": None,
        "device": "cpu",
        "platform": "cpu",
        "last_collective": "all_reduce #3",
        "collective_seq": 3,
        "in_function": True,
        "idle_host_bytes": 200 << 20,
        "ready_at": 101.25,
        "cpu_substitutions": {"torch.cuda.device_count": 2},
        "exc_type": "ValueError",
        "exc_message": "bad shard",
        "traceback": "Traceback ...\nValueError: bad shard\n",
        "kind_hint": None,
        "budget_exceeded": None,
    }
    return WrittenRecord(**{**base, **fields})


def test_a_written_record_reads_back_field_for_field(tmp_path: Path) -> None:
    written = _written()
    path = rank_record.write(tmp_path, written)
    assert path == tmp_path / "rank1.json"
    assert rank_record.read(path) == written
    assert list(tmp_path.iterdir()) == [path]  # the writer's temporary file is gone


def test_a_missing_record_is_none_and_a_forged_one_is_unreadable_in_one_line(tmp_path: Path) -> None:
    assert rank_record.read(tmp_path / "rank0.json") is None
    forged = {
        "deep": "[" * 100_000 + "]" * 100_000,
        "nan": '{"time": NaN}',
        "list": "[1, 2]",
        "not_utf8": b'{"exc_type": "\xff"}',
        "duplicate": '{"status": "ok", "status": "failed"}',
    }
    for name, text in forged.items():
        path = tmp_path / f"{name}.json"
        path.write_bytes(text if isinstance(text, bytes) else text.encode())
        read = rank_record.read(path)
        assert isinstance(read, Unreadable), name
        assert "\n" not in read.why and str(path) in read.why, read.why


def test_a_field_of_the_wrong_type_reads_as_its_default(tmp_path: Path) -> None:
    path = tmp_path / "rank0.json"
    path.write_text(
        json.dumps(
            {
                "status": 1,
                "collective_seq": -1,
                "peak_host_bytes": True,
                "time": "soon",
                "ready_at": 7,
                "in_function": "no",
                "cpu_substitutions": {"a": 1, "b": -1, "c": True, "d": 2**53, "x" * 300: 2},
                "exc_message": "a\0b" + "y" * (rank_record.MAX_TEXT + 10),
                "unknown_key": [1],
            }
        )
    )
    read = rank_record.read(path)
    assert isinstance(read, WrittenRecord)
    assert (read.status, read.collective_seq, read.peak_host_bytes, read.time) == (None, None, None, None)
    assert read.ready_at == 7.0 and isinstance(read.ready_at, float)
    assert read.in_function is True  # a record that does not say is no startup failure
    assert read.cpu_substitutions == {"a": 1, "x" * 256: 2}
    assert read.exc_message is not None and len(read.exc_message) == rank_record.MAX_TEXT
    assert read.exc_message.startswith("a b")


def test_every_written_field_is_taken_merged_or_named_as_not_kept() -> None:
    launcher_fields = {f.name for f in dataclasses.fields(RankRecord)}
    written = {f.name for f in dataclasses.fields(WrittenRecord)}
    assert set(rank_record._TAKEN_AS_WRITTEN) <= launcher_fields
    assert set(rank_record._TAKEN_AS_WRITTEN) | rank_record._MERGED | rank_record._NOT_KEPT == written


def test_the_launcher_merges_the_record_with_what_it_saw_itself() -> None:
    rec = RankRecord(rank=1, status="torn_down", time=104.0, peak_host_bytes=500 << 20, peak_process="helper")
    rec.take(_written())
    assert rec.status == "failed"  # the rank said so before it was torn down
    assert rec.time == 103.5  # the rank's own clock, not the exit the launcher saw later
    assert rec.peak_host_bytes == 500 << 20  # the larger of the two peaks
    assert rec.peak_process == "helper"  # the record names none
    assert (rec.exc_type, rec.collective_seq, rec.ready_at) == ("ValueError", 3, 101.25)
    assert (rec.device, rec.idle_host_bytes, rec.cpu_substitutions) == (
        "cpu",
        200 << 20,
        {"torch.cuda.device_count": 2},
    )


def _startup_oom() -> list[RankRecord]:
    rec = RankRecord(rank=0, status="failed", time=1.0)
    rec.take(
        _written(
            rank=0,
            in_function=False,
            exc_type="megatron_testkit.MemoryBudgetExceeded",
            exc_message="host memory budget exceeded: RSS 60MiB > budget 48MiB",
            kind_hint="oom",
            budget_exceeded="host",
        )
    )
    return [rec, RankRecord(rank=1, status="torn_down")]


def test_an_oom_at_startup_is_refused_as_the_budget_only_when_there_is_a_host_budget() -> None:
    with pytest.raises(
        BudgetBelowFootprint, match=r"host memory budget 48\.00 MiB is below a rank's startup"
    ):
        judge(_startup_oom(), Evidence(host_budget=48 << 20))
    failure = judge(_startup_oom(), Evidence(repro="here"))
    assert failure is not None and (failure.rank, failure.kind) == (0, "oom")
    assert str(failure).endswith("\nrepro: here")


def test_the_names_stay_importable_where_they_are_documented() -> None:
    assert diagnosis.RankRecord is rank_record.RankRecord
    assert ranks.BudgetBelowFootprint is diagnosis.BudgetBelowFootprint
    assert ranks.RankFailure is diagnosis.RankFailure
