"""Each rank's memory over time: bounded per launch and per report, and a peak never smoothed away."""

from __future__ import annotations

import pytest

from megatron_testkit.memory_series import (
    MAX_REPORT_POINTS,
    POINTS_PER_LAUNCH,
    RAW_POINTS,
    RankMemory,
    Sampler,
    bound_total,
    downsample,
)
from megatron_testkit.schema import SchemaError, check_report

pytestmark = pytest.mark.L0


def test_a_long_launch_keeps_at_most_a_few_hundred_points_a_rank_and_its_peak() -> None:
    sampler = Sampler(started=100.0)
    # 10 000 samples 0.1 s apart (1000 s), one spike of 5 GiB at sample 7777 over a flat 1 GiB.
    for i in range(10_000):
        sampler.add(1, 100.0 + i / 10, 5 * 2**30 if i == 7777 else 2**30)
        assert sampler.ranks[1].points <= RAW_POINTS + 1  # bounded while it runs
    (series,) = sampler.series()
    assert series.rank == 1 and 1 <= series.points <= POINTS_PER_LAUNCH
    assert max(series.rss_bytes) == 5 * 2**30
    assert series.t_s[0] == 0.0 and series.t_s == sorted(series.t_s)
    # The spike's bucket starts at or before it, and the next bucket after it.
    spike = series.rss_bytes.index(5 * 2**30)
    assert series.t_s[spike] <= 777.7 < (series.t_s[spike + 1] if spike + 1 < series.points else 1e9)


def test_samples_are_taken_every_tenth_of_a_second_at_most() -> None:
    sampler = Sampler(started=0.0)
    assert sampler.due(1.0) and not sampler.due(1.05) and sampler.due(1.1)


def test_a_whole_report_holds_at_most_its_points_however_many_launches() -> None:
    # 2 000 launches of 2 ranks at 200 points: 800 000 points, eight times the cap.
    launches = [
        [RankMemory(r, [i / 10 for i in range(200)], [2**20 * (i % 7) for i in range(200)]) for r in range(2)]
        for _ in range(2000)
    ]
    merges = bound_total(launches)
    total = sum(s.points for launch in launches for s in launch)
    assert total <= MAX_REPORT_POINTS and merges == 3  # 200 -> 100 -> 50 -> 25 points a series
    assert all(max(s.rss_bytes) == 6 * 2**20 for launch in launches for s in launch)


def test_downsample_takes_a_series_to_the_points_asked() -> None:
    series = RankMemory(0, [float(i) for i in range(9)], list(range(9)))
    assert downsample(series, 3).rss_bytes == [3, 7, 8]  # (0..3), (4..7), (8)


def test_a_report_with_an_oversized_or_malformed_series_is_refused() -> None:
    launch = {"world_size": 2, "backend": "gloo", "seed": 1}
    row = {"nodeid": "t.py::x", "outcome": "passed", "world_size": 2}

    def report(memory: object) -> dict:
        return {"version": 4, "session": {}, "tests": [{**row, "launches": [{**launch, "memory": memory}]}]}

    ok = check_report(report([{"rank": 0, "t_s": [0.0, 0.1], "rss_bytes": [1, 2]}]))
    assert ok.tests[0].launches[0].memory == [RankMemory(0, [0.0, 0.1], [1, 2])]
    with pytest.raises(SchemaError, match=r"memory\[0\]\.t_s is not a list of at most 1024"):
        check_report(report([{"rank": 0, "t_s": [0.0] * 1025, "rss_bytes": [1] * 1025}]))
    with pytest.raises(SchemaError, match=r"memory\[0\]\.rss_bytes\[0\] is not an integer"):
        check_report(report([{"rank": 0, "t_s": [0.0], "rss_bytes": [-1]}]))
    with pytest.raises(SchemaError, match=r"memory\[0\]\.rss_bytes"):
        check_report(report([{"rank": 0, "t_s": [0.0]}]))
