"""A latency histogram counted in plain integers, exported when ``/metrics`` is scraped.

``prometheus_client.Histogram.observe`` takes a lock per call; on the Controller's heartbeat
path (every beat of every NodeManager) that is a cost paid thousands of times a second for a
number read once per scrape. :meth:`LatencyHistogram.observe` is one bisect and two additions
on the event loop's thread; :meth:`LatencyHistogram.metric` turns the counts into the
cumulative buckets Prometheus expects.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Sequence

from prometheus_client.core import HistogramMetricFamily
from prometheus_client.utils import floatToGoString


class LatencyHistogram:
    """Seconds per bucket, bucketed as Prometheus does: a value goes to the first upper bound at
    or above it (the last bound is +Inf). Only one thread may observe."""

    __slots__ = ("_bounds", "counts", "total")

    def __init__(self, bounds: Sequence[float]) -> None:
        self._bounds = (*sorted(bounds), float("inf"))
        self.counts = [0] * len(self._bounds)
        self.total = 0.0

    def observe(self, seconds: float) -> None:
        self.counts[bisect_left(self._bounds, seconds)] += 1
        self.total += seconds

    @property
    def count(self) -> int:
        return sum(self.counts)

    def metric(self, name: str, documentation: str) -> HistogramMetricFamily:
        cumulative, buckets = 0, []
        for bound, n in zip(self._bounds, self.counts, strict=True):
            cumulative += n
            buckets.append((floatToGoString(bound), cumulative))
        return HistogramMetricFamily(name, documentation, buckets=buckets, sum_value=self.total)
