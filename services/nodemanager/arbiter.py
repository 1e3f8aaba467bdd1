"""Freeze and suicide arbitration.

When engines stay broken and nobody repairs them in place, the NodeManager stops its engines
and exits non-zero so the pod (or ``motor up``) restarts it. A freeze holds that fallback off
while the Controller relaunches the engines; it always expires on its own, so a lost ABORT can
never keep a broken pod alive forever.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterable
from typing import Protocol

from motor_mesh.common import enums, log
from motor_mesh.nodemanager.engine import Engine


class Freeze:
    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self._clock = clock
        self._until = 0.0

    def freeze(self, seconds: float, reason: str = "") -> None:
        """Freeze until now + ``seconds``; never shortens an existing freeze."""
        until = self._clock() + seconds
        if until > self._until:
            self._until = until
            log.event("frozen", seconds=seconds, reason=reason)

    def unfreeze(self, reason: str = "") -> None:
        if self._until:
            self._until = 0.0
            log.event("unfrozen", reason=reason)

    @property
    def frozen(self) -> bool:
        if self._until and self._clock() >= self._until:
            self._until = 0.0
            log.event("unfrozen", reason="expired")
        return self._until > 0

    @property
    def until(self) -> float | None:
        """Wall-clock end of the freeze, or None."""
        return self._until if self.frozen else None


class Supervised(Protocol):
    """What the arbiter looks at (the engine supervisor)."""

    generation: int
    freeze: Freeze
    relaunching: bool

    def current_engines(self) -> Iterable[Engine]: ...


class SuicideArbiter:
    """Counts consecutive observations with a dead or ABNORMAL endpoint; at ``threshold`` it
    calls ``on_suicide`` (which stops the engines and exits non-zero)."""

    def __init__(
        self, node: Supervised, interval_s: float, threshold: int, on_suicide: Callable[[str], None]
    ) -> None:
        self.node = node
        self.interval_s = interval_s
        self.threshold = threshold
        self.on_suicide = on_suicide
        self.count = 0
        self._generation = node.generation

    def step(self) -> bool:
        """One observation; True when the node must die."""
        node = self.node
        engines = list(node.current_engines())
        if node.generation != self._generation:
            self._generation = node.generation
            self.count = 0
            return False
        if node.freeze.frozen or node.relaunching or not engines:
            self.count = 0
            return False
        dead = [e for e in engines if not e.alive and not e.stopping]
        abnormal = [e for e in engines if e.status == enums.EP_ABNORMAL]
        # A model still loading is not broken; a process that died is broken all the same.
        starting = any(e.alive and e.in_startup_window() for e in engines)
        if not (dead or abnormal) or (starting and not dead):
            self.count = 0
            return False
        self.count += 1
        log.warn(
            "suicide_check",
            count=self.count,
            threshold=self.threshold,
            dead=[e.spec.id for e in dead],
            abnormal=[e.spec.id for e in abnormal],
        )
        return self.count >= self.threshold

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            if self.step():
                self.on_suicide(f"engines broken for {self.count} consecutive checks")
                return
