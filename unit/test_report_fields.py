"""The report's one generic reader: bounds declared on a dataclass field are what it checks, by path.

`megatron_testkit.report_fields` walks ``dataclasses.fields()`` and the type hints; these tests
declare their own small dataclasses (and one built on `TestEntry`) to show that a bound, a text
limit, a list limit, choices and a required field come from the declaration alone, strict and
lenient, and that the schema's cross-class bounds hold in every class that has the field.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import pytest

from megatron_testkit.report_fields import JsonRecord, SchemaError, bounds, read_object
from megatron_testkit.schema import ReportError, TestEntry, check_report, read_report

pytestmark = pytest.mark.L0


@dataclass
class Shard(JsonRecord):
    index: int = field(metadata=bounds(range=(0, 7), required=True))
    label: str = field(default="", metadata=bounds(chars=4))


@dataclass
class Plan(JsonRecord):
    shards: list[Shard] = field(default_factory=list, metadata=bounds(items=2))
    mode: Literal["a", "b"] | None = None
    sizes: dict[str, int] | None = field(default=None, metadata=bounds(keys=("x", "y"), range=(0, 9)))
    ratio: float = 1.0


@pytest.mark.parametrize(
    ("data", "says"),
    [
        ({"shards": [{"index": 1}, {"index": 8}]}, "plan.shards[1].index is not an integer in [0, 7]"),
        (
            {"shards": [{"index": 1, "label": "five!"}]},
            "plan.shards[0].label is not text of at most 4 characters",
        ),
        ({"shards": [{"index": 0}] * 3}, "plan.shards is not a list of at most 2 entries"),
        ({"shards": [{"label": "a"}]}, "plan.shards[0].index is not an integer in [0, 7]"),
        ({"shards": [{"index": True}]}, "plan.shards[0].index is not an integer in [0, 7]"),
        ({"mode": "c"}, "plan.mode is not one of a, b"),
        ({"sizes": {"z": 1}}, "plan.sizes is not one of x, y"),
        ({"sizes": {"x": 10}}, "plan.sizes.x is not an integer in [0, 9]"),
        ({"ratio": "1"}, "plan.ratio is not a finite number"),
        ({"shards": {"0": {"index": 1}}}, "plan.shards is not a list of at most 2 entries"),
    ],
)
def test_a_bound_declared_in_a_fields_metadata_is_enforced_naming_the_fields_path(
    data: dict[str, Any], says: str
) -> None:
    with pytest.raises(SchemaError) as excinfo:
        read_object(data, Plan, "plan", strict=True)
    assert str(excinfo.value) == says


def test_what_fits_the_declarations_reads_into_the_dataclasses_and_back() -> None:
    data = {"shards": [{"index": 7, "label": "last"}], "mode": "b", "sizes": {"x": 9}, "ratio": 2, "other": 1}
    plan = read_object(data, Plan, "plan", strict=True)
    assert plan == Plan([Shard(7, "last")], "b", {"x": 9}, 2)
    assert plan.to_json() == {k: v for k, v in data.items() if k != "other"}  # unknown keys are never read


def test_the_lenient_reader_reads_a_mistyped_field_as_its_default_and_still_needs_required_ones() -> None:
    # Lenient: the kit's own JSON and older report versions. Bounds are the strict reader's.
    plan = Plan.from_json({"shards": [{"index": 70, "label": 5}, "not a shard"], "mode": 3, "ratio": None})
    assert plan == Plan([Shard(70, "")], None, None, 1.0)
    with pytest.raises(SchemaError, match=r"^plan\.shards\[0\] has no integer 'index'$"):
        Plan.from_json({"shards": [{"label": "a"}]}, "plan")


def test_a_field_added_to_a_report_dataclass_is_read_and_checked_with_no_other_code() -> None:
    # A row with one more field, declared as the schema declares its own: nothing else is written
    # for it, and the reader reads it, bounds it and writes it back.
    extended = dataclasses.make_dataclass(
        "ExtendedEntry",
        [("shard", int | None, field(default=None, metadata=bounds(range=(0, 3))))],
        bases=(TestEntry,),
    )
    row = {"nodeid": "t.py::a", "outcome": "failed", "world_size": 2, "shard": 2}
    entry = extended.from_json(row)
    assert (entry.nodeid, entry.world_size, entry.shard) == ("t.py::a", 2, 2)
    assert entry.to_json()["shard"] == 2 and list(entry.to_json())[-1] == "shard"
    with pytest.raises(SchemaError, match=r"^tests\[4\]\.shard is not an integer in \[0, 3\]$"):
        read_object({**row, "shard": 9}, extended, "tests[4]", strict=True)


def test_a_field_of_two_types_is_refused_when_its_class_is_first_read() -> None:
    @dataclass
    class Either(JsonRecord):
        value: int | str = 0

    with pytest.raises(TypeError, match="one type or None"):
        Either.from_json({"value": 1})


def _report(**row: Any) -> dict[str, Any]:
    return {"version": 5, "session": {}, "tests": [{"nodeid": "t.py::a", "outcome": "failed", **row}]}


def test_a_row_whose_ranks_are_a_number_is_a_one_line_error_not_a_traceback(tmp_path: Path) -> None:
    """The structure pass read ``ranks`` with ``or []`` and iterated the number: a TypeError out of
    `read_report`, which only turns a `SchemaError` into its one-line `ReportError`."""
    with pytest.raises(SchemaError, match=r"^tests\[0\]\.ranks is not a list of at most 65536 entries$"):
        check_report(_report(ranks=7))
    path = tmp_path / "kit-report.json"
    path.write_text(json.dumps(_report(ranks=7)))
    with pytest.raises(ReportError) as excinfo:
        read_report(path)
    assert str(excinfo.value) == f"{path}: tests[0].ranks is not a list of at most 65536 entries"


@pytest.mark.parametrize(
    ("row", "where"),
    [
        ({"ranks": [{"rank": 65536}]}, "tests[0].ranks[0].rank"),
        ({"failure": {"rank": 65536}}, "tests[0].failure.rank"),
        (
            {"launches": [{"world_size": 2, "backend": "gloo", "seed": 1, "rank": 65536}]},
            "tests[0].launches[0].rank",
        ),
        (
            {
                "launches": [
                    {
                        "world_size": 2,
                        "backend": "gloo",
                        "seed": 1,
                        "memory": [{"rank": 65536, "t_s": [0.0], "rss_bytes": [1]}],
                    }
                ]
            },
            "tests[0].launches[0].memory[0].rank",
        ),
    ],
    ids=["rank peak", "failure", "launch", "memory series"],
)
def test_a_rank_past_the_largest_world_size_is_refused_in_every_class_that_names_one(
    row: dict[str, Any], where: str
) -> None:
    with pytest.raises(SchemaError) as excinfo:
        check_report(_report(**row))
    assert str(excinfo.value) == f"{where} is not an integer in [0, 65535]"


def test_the_lenient_reader_drops_a_memory_series_it_cannot_read_and_keeps_the_others() -> None:
    # The kit's own report of an earlier version is read leniently: a rank's series that lacks its
    # rank, or whose times are not a list, is left out (as is one whose lengths differ), never the
    # whole report; read strictly (a report from a file), the same series is an error by path.
    from megatron_testkit.schema import Report

    good = {"rank": 1, "t_s": [0.5], "rss_bytes": [10]}
    launch = {"world_size": 2, "backend": "gloo", "seed": 0, "duration_s": 1.0}
    for bad in ({"t_s": [1.0], "rss_bytes": [1]}, {"rank": 0, "t_s": "no", "rss_bytes": [1]}):
        row = {"nodeid": "t.py::a", "outcome": "passed", "launches": [{**launch, "memory": [bad, good]}]}
        data = {"version": 5, "tests": [row]}
        memory = Report.from_json(data).tests[0].launches[0].memory
        assert memory is not None and [(m.rank, m.t_s, m.rss_bytes) for m in memory] == [(1, [0.5], [10])]
        with pytest.raises(SchemaError, match=r"tests\[0\]\.launches\[0\]\.memory\[0\]"):
            check_report(data)
