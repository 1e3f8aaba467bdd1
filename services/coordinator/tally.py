"""Counting on the request path without touching prometheus_client there.

A ``Counter.inc`` or ``Histogram.observe`` takes a lock and, with inference workers, writes a
memory-mapped file: several microseconds each, several times per request. The request path adds
to plain integers here instead; :meth:`Tallies.flush` moves the sums into the Prometheus
objects, once a second and before every scrape, as one ``inc`` per counter child and per
histogram bucket, whatever the request rate.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable, Sequence
from typing import Any, Protocol, TypeVar

from prometheus_client import Counter, Histogram


class CounterTally:
    __slots__ = ("_child", "n")

    def __init__(self, child: Counter) -> None:
        self._child = child
        self.n = 0

    def flush(self) -> None:
        if self.n:
            n, self.n = self.n, 0
            self._child.inc(n)


class HistogramTally:
    """Observations bucketed as prometheus_client buckets them (the first upper bound at or
    above the value; the last bound is +Inf), then added to the child's own bucket values."""

    __slots__ = ("_bounds", "_child", "counts", "total")

    def __init__(self, child: Histogram, bounds: Sequence[float]) -> None:
        self._child = child
        self._bounds = (*bounds, float("inf"))
        self.counts = [0] * len(self._bounds)
        self.total = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self._bounds, value)] += 1
        self.total += value

    def flush(self) -> None:
        if not any(self.counts):
            return
        counts, self.counts = self.counts, [0] * len(self._bounds)
        total, self.total = self.total, 0.0
        child: Any = self._child  # its per-bucket values are prometheus_client internals
        buckets = child._buckets
        for i, n in enumerate(counts):
            if n:
                buckets[i].inc(n)
        child._sum.inc(total)


class Flushable(Protocol):
    def flush(self) -> None: ...


F = TypeVar("F", bound=Flushable)


class Tallies:
    """The tallies of one process, created on first use per label set."""

    def __init__(self) -> None:
        self._all: list[Flushable] = []

    def add(self, t: F) -> F:
        """Any tally (one of these, or of another shape), flushed with the others."""
        self._all.append(t)
        return t

    def counter(self, make: Callable[[], Counter]) -> CounterTally:
        return self.add(CounterTally(make()))

    def histogram(self, make: Callable[[], Histogram], bounds: Sequence[float]) -> HistogramTally:
        return self.add(HistogramTally(make(), bounds))

    def flush(self) -> None:
        for t in self._all:
            t.flush()
