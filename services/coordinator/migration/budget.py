"""The bound on what continuation state a process keeps (coordinator.max_migration_state_*)."""

from __future__ import annotations

import math

STEP = 16 * 1024  # bytes taken from the total at a time: one check per step, not per token


class StateBudget:
    """Bytes of continuation state this process may hold at once, all requests together."""

    __slots__ = ("per_request", "total", "used")

    def __init__(self, per_request: int, total: int) -> None:
        self.per_request = per_request
        self.total = total
        self.used = 0

    @classmethod
    def share(cls, per_request: int, total: int, workers: int) -> StateBudget:
        """One inference worker's part of the Coordinator-wide total (rounded up)."""
        return cls(per_request, math.ceil(total / workers))

    def take(self, n: int) -> bool:
        if self.used + n > self.total:
            return False
        self.used += n
        return True

    def give(self, n: int) -> None:
        self.used -= n
