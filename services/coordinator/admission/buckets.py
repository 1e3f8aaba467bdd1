"""Token buckets that refill continuously: the rate limits (docs/admission.md, "Rate limits").

A bucket of ``capacity`` refills at ``capacity / window_s`` per second, so a client may spend a
whole window's allowance at once after a quiet spell and then ``capacity / window_s`` per
second. It may go below zero: tokens are charged at admission as prompt plus ``max_tokens``
and corrected by the real usage at the end, and a request larger than the whole bucket is let
through when the bucket is full (refusing it forever would be worse), leaving a debt that the
refill pays off before the next one passes.
"""

from __future__ import annotations

import math


class Bucket:
    __slots__ = ("capacity", "level", "rate", "stamp")

    def __init__(self, capacity: float, window_s: float, now: float) -> None:
        self.capacity = capacity
        self.rate = capacity / window_s
        self.level = capacity
        self.stamp = now

    def fill(self, now: float) -> float:
        """The level now (refilled since the last look)."""
        if now > self.stamp:
            level = self.level + (now - self.stamp) * self.rate
            self.level = level if level < self.capacity else self.capacity
            self.stamp = now
        return self.level

    def can_take(self, n: float, now: float) -> bool:
        level = self.fill(now)
        return level >= n or (level >= self.capacity and level > 0)

    def take(self, n: float) -> None:
        """Spend ``n`` (after :meth:`can_take` said yes)."""
        self.level -= n

    def give_back(self, n: float, now: float) -> None:
        """Correct an earlier charge: ``n`` > 0 returns tokens, ``n`` < 0 charges more."""
        self.fill(now)
        level = self.level + n
        self.level = level if level < self.capacity else self.capacity

    def wait_s(self, n: float, now: float) -> float:
        """Seconds until ``n`` could be taken (until full, for more than the whole bucket)."""
        level = self.fill(now)
        need = min(n, self.capacity) - level
        return need / self.rate if need > 0 and self.rate > 0 else 0.0

    def reset_s(self, now: float) -> int:
        """Whole seconds until the bucket is full again (``X-RateLimit-Reset``)."""
        missing = self.capacity - self.fill(now)
        return math.ceil(missing / self.rate) if missing > 0 and self.rate > 0 else 0

    def resize(self, capacity: float, window_s: float, now: float) -> None:
        """New limits (a reload, or this process's part moved): the tokens held stay, up to the
        new size, and the refill follows the new rate. A resize never hands out tokens, so parts
        moving between processes never add up to more than the limit."""
        if capacity == self.capacity and capacity / window_s == self.rate:
            return
        self.fill(now)
        self.capacity = capacity
        self.rate = capacity / window_s
        if self.level > capacity:
            self.level = capacity
