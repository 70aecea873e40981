"""Each rank's memory over time, as the launcher's poll samples it, kept small enough for a report.

The launcher samples every rank's RSS on its poll (budget or not). `Sampler` keeps each rank's
series bounded while the launch runs (past `RAW_POINTS` neighbouring samples merge pairwise, the
larger value kept, so a peak is never smoothed away) and hands each launch's series down to at most
`POINTS_PER_LAUNCH` points a rank. `bound_total` then holds a whole report under
`MAX_REPORT_POINTS` points (a few MiB of JSON, far inside the report's 32 MiB cap) by merging every
series further, in the same way. Stdlib only (its bounds are declared through `megatron_testkit.report_fields`).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from megatron_testkit.report_fields import BYTES, RANK, bounds

# What the charts draw per launch and rank: a few hundred points resolve a run of minutes.
POINTS_PER_LAUNCH = 200
# While a launch runs, each rank keeps at most this many samples (merged pairwise past it).
RAW_POINTS = 4 * POINTS_PER_LAUNCH
# A whole report's points over every launch and rank. A point is two numbers, about 40 bytes of
# the report's indented JSON: 100 000 points are about 4 MiB of the 32 MiB the reader accepts.
MAX_REPORT_POINTS = 100_000
# The reader's bound on one series (the writer writes at most POINTS_PER_LAUNCH).
MAX_SERIES_POINTS = 1024
# Seconds between samples: the poll runs every 50 ms; a sample every 100 ms is plenty.
SAMPLE_EVERY_S = 0.1


@dataclass
class RankMemory:
    """One rank's RSS over a launch: ``t_s[i]`` seconds after spawn, ``rss_bytes[i]`` there."""

    rank: int = field(metadata=bounds(range=RANK, required=True))
    t_s: list[float] = field(default_factory=list, metadata=bounds(items=MAX_SERIES_POINTS, required=True))
    rss_bytes: list[int] = field(
        default_factory=list, metadata=bounds(items=MAX_SERIES_POINTS, range=BYTES, required=True)
    )

    @property
    def points(self) -> int:
        """How many samples it holds."""
        return len(self.t_s)


def merge_pairs(series: RankMemory) -> RankMemory:
    """Half as many points: each neighbouring pair becomes one, at the pair's first time, with the
    larger RSS (a peak survives every merge)."""
    t, rss = series.t_s, series.rss_bytes
    merged = RankMemory(series.rank)
    for i in range(0, len(t), 2):
        merged.t_s.append(t[i])
        merged.rss_bytes.append(max(rss[i : i + 2]))
    return merged


def downsample(series: RankMemory, points: int) -> RankMemory:
    """`series` merged pairwise until it holds at most `points` points (at least 1)."""
    points = max(1, points)
    while series.points > points:
        series = merge_pairs(series)
    return series


class Sampler:
    """A launch's series, one per rank, fed by the launcher's poll."""

    def __init__(self, started: float) -> None:
        self.started = started
        self.last = float("-inf")
        self.ranks: dict[int, RankMemory] = {}

    def due(self, now: float) -> bool:
        """Whether a sample is due at `now` (monotonic seconds)."""
        if now - self.last < SAMPLE_EVERY_S:
            return False
        self.last = now
        return True

    def add(self, rank: int, now: float, rss: int | None) -> None:
        """One rank's RSS at `now` (monotonic seconds; None: not measured, nothing kept)."""
        if rss is None:
            return
        series = self.ranks.setdefault(rank, RankMemory(rank))
        series.t_s.append(round(now - self.started, 3))
        series.rss_bytes.append(int(rss))
        if series.points > RAW_POINTS:
            self.ranks[rank] = merge_pairs(series)

    def series(self) -> list[RankMemory]:
        """Each rank's series, at most `POINTS_PER_LAUNCH` points each, by rank."""
        return [downsample(self.ranks[r], POINTS_PER_LAUNCH) for r in sorted(self.ranks)]


def bound_total(all_series: Iterable[list[RankMemory]], limit: int = MAX_REPORT_POINTS) -> int:
    """Merge every series of every launch in place (pairwise, as often as needed) until all of
    them together hold at most `limit` points; the number of pairwise merges applied."""
    launches = list(all_series)
    merges = 0
    while sum(s.points for launch in launches for s in launch) > limit:
        if all(s.points <= 1 for launch in launches for s in launch):
            for launch in launches:  # more series than points allowed: none kept, the peaks remain
                launch.clear()
            break
        for launch in launches:
            launch[:] = [merge_pairs(s) for s in launch]
        merges += 1
    return merges
