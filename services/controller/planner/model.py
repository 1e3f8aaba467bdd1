"""The planner's model, as pure functions: the demand predictor, the capacity learner and the
choice of a split (docs/planner.md says why each is what it is).

- **Demand** of each role for the next interval is the exponentially weighted moving average
  (EWMA, weight ``DEMAND_ALPHA`` on the newest interval) of what each interval asked of it:
  prefill, prompt tokens per second (those processed, plus the queue left waiting spread over
  the interval); decode, sequences decoding at once (running plus waiting). An EWMA follows a
  shift in the traffic within two or three intervals and ignores a one-interval spike: the
  switch it would cause takes longer than the spike lasts.
- **Capacity** of one instance at the latency target is learned from the same intervals: the
  load one instance carried, scaled by target / measured p90 (latency taken as growing in
  proportion to the load, which is exact where it matters, near the target), kept within
  ``[0.5, 2]`` times the load seen (``[0.8, 2]`` when requests queued: a saturated engine's
  throughput is about its capacity), and averaged (EWMA, ``CAPACITY_ALPHA``) over the intervals
  in which the role was busy (``learn_capacity``).
- **The split**: each role needs ``demand * HEADROOM / capacity`` instances; a split's predicted
  attainment is the smaller of the two roles' ``instances / need``, capped at 1. The best split
  has the highest attainment, then the most balanced spare capacity, then the fewest moves.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

DEMAND_ALPHA = 0.5
CAPACITY_ALPHA = 0.3
# Plan for a little more than the predicted demand: the next interval's traffic varies around it.
HEADROOM = 1.15
# Bounds of the capacity scaling: target / p90 within these, times the load seen.
SCALE_HIGH = 2.0
SCALE_LOW = 0.5
SCALE_LOW_SATURATED = 0.8
# A role whose p90 is at least this share of its target is busy enough to learn its capacity from.
BUSY = 0.5


@dataclass
class Ewma:
    alpha: float
    value: float | None = None

    def update(self, x: float) -> float:
        self.value = x if self.value is None else self.alpha * x + (1 - self.alpha) * self.value
        return self.value


def capacity_sample(load: float, p90_s: float | None, target_s: float, saturated: bool) -> float | None:
    """What one instance serves at the target, judged from one interval in which it carried
    ``load`` with a p90 latency of ``p90_s``; None when the interval says nothing (no load or
    no latency measured)."""
    if load <= 0 or p90_s is None or p90_s <= 0:
        return None
    low = SCALE_LOW_SATURATED if saturated else SCALE_LOW
    return load * min(SCALE_HIGH, max(low, target_s / p90_s))


def learn_capacity(
    capacity: Ewma, load: float, p90_s: float | None, target_s: float, saturated: bool
) -> None:
    """One interval's lesson. The first says what it can; after that only an interval in which
    the role was busy (requests queued, or its p90 at least ``BUSY`` of the target) moves the
    average: a light one, whose latency says little about the limit, only raises it to the
    load it carried within the target (a lower bound), so an idle role's capacity does not
    sink towards the little it was asked."""
    sample = capacity_sample(load, p90_s, target_s, saturated)
    if sample is None or p90_s is None:
        return
    if capacity.value is None or saturated or p90_s >= BUSY * target_s:
        capacity.update(sample)
    elif p90_s <= target_s:
        capacity.value = max(capacity.value, load)


def need(demand: float, capacity: float) -> float:
    """Instances a role needs (fractional)."""
    return demand * HEADROOM / capacity if capacity > 0 else math.inf


def attainment(instances: int, needed: float) -> float:
    """Predicted fraction of one role's target met: 1 when it has what it needs."""
    if needed <= 0:
        return 1.0
    return min(1.0, instances / needed)


def split_attainment(prefill: int, decode: int, need_prefill: float, need_decode: float) -> float:
    return min(attainment(prefill, need_prefill), attainment(decode, need_decode))


@dataclass(frozen=True)
class Choice:
    prefill: int
    decode: int
    attainment: float  # predicted, with this split
    current: float  # predicted, with the split there is

    @property
    def gain(self) -> float:
        return self.attainment - self.current


def choose(
    pool: int,
    need_prefill: float,
    need_decode: float,
    min_prefill: int,
    min_decode: int,
    current_prefill: int,
) -> Choice:
    """The best split of ``pool`` instances. A pool too small for both minimums keeps its split."""
    current = split_attainment(current_prefill, pool - current_prefill, need_prefill, need_decode)
    candidates = range(min_prefill, pool - min_decode + 1)
    if not candidates:
        return Choice(current_prefill, pool - current_prefill, current, current)

    def spare(p: int) -> float:
        ratios = [n / w for n, w in ((p, need_prefill), (pool - p, need_decode)) if w > 0]
        return min(ratios) if ratios else math.inf

    best = max(
        candidates,
        key=lambda p: (
            round(split_attainment(p, pool - p, need_prefill, need_decode), 6),
            round(min(spare(p), 1e9), 6),
            -abs(p - current_prefill),
        ),
    )
    return Choice(best, pool - best, split_attainment(best, pool - best, need_prefill, need_decode), current)
