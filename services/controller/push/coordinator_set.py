"""Which Coordinators the Controller keeps in step.

``controller.coordinators`` lists ``host:port`` entries, each one Coordinator, and
``dns:///name:port`` entries, each standing for every address ``name`` resolves to: a
Kubernetes headless Service names one address per Coordinator pod, so a Deployment can scale
without the Controller's config changing. A plain ``host:port`` is never expanded (``localhost``
resolving to both 127.0.0.1 and ::1 is still one Coordinator).

The names are resolved again every ``RESOLVE_S``. A name that does not exist (NXDOMAIN, or a
headless Service with no pods) stands for no Coordinator; a lookup that fails for any other
reason (the resolver down) keeps the addresses last resolved, so a DNS outage never drops a
Coordinator from the push.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence

from motor_mesh.common import log
from motor_mesh.common.dns import resolve, split_entry
from motor_mesh.common.tasks import cancel_quietly, spawn

RESOLVE_S = 5.0

Resolver = Callable[[str, int], Awaitable[list[str]]]


class CoordinatorSet:
    """The current addresses, told to ``on_change`` (sorted) whenever they differ."""

    def __init__(
        self,
        entries: Sequence[str],
        on_change: Callable[[list[str]], None],
        *,
        resolver: Resolver | None = None,
        interval_s: float | None = None,
    ) -> None:
        self._entries = list(entries)
        self._on_change = on_change
        self._resolve = resolver or resolve
        self.interval_s = RESOLVE_S if interval_s is None else interval_s
        self._resolved: dict[str, list[str]] = {}
        # Before the first resolution only the plain addresses are known.
        self.current: list[str] = sorted({e for e in self._entries if split_entry(e) is None})
        self._task: asyncio.Task[None] | None = None

    @property
    def dynamic(self) -> bool:
        return any(split_entry(e) is not None for e in self._entries)

    async def refresh(self) -> list[str]:
        """Resolve every name once; tell ``on_change`` when the set moved."""
        for entry in self._entries:
            parts = split_entry(entry)
            if parts is None:
                continue
            try:
                found = await self._resolve(*parts)
            except OSError as err:
                log.warn("coordinator_resolve_failed", entry=entry, error=str(err) or type(err).__name__)
                continue
            if found != self._resolved.get(entry):
                log.event("coordinators_resolved", entry=entry, addresses=",".join(found) or "-")
                self._resolved[entry] = list(found)
        addresses = {e for e in self._entries if split_entry(e) is None}
        for found in self._resolved.values():
            addresses.update(found)
        new = sorted(addresses)
        if new != self.current:
            self.current = new
            self._on_change(new)
        return new

    def start(self) -> None:
        if self.dynamic:
            self._task = spawn("coordinator-resolve", self._loop)

    async def _loop(self) -> None:
        while True:
            await self.refresh()
            await asyncio.sleep(self.interval_s)

    async def close(self) -> None:
        if self._task is not None:
            await cancel_quietly(self._task)
