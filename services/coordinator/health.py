"""Circuit breaker: endpoints that refuse connections leave rotation at once and are probed back.

An endpoint is taken out when a connection to it is refused (or times out), unless that would
leave its role without any healthy instance of the model: the last one stays in rotation, so
a flapping engine costs retries, never an outage of the whole role. Endpoints that are out are
probed with ``GET /health`` every ``PROBE_INTERVAL_S`` and come back on the first 200.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import aiohttp

from services.common import log
from services.common.enums import ROLE_NAMES
from services.coordinator.routes import RoutingView, Target, Upstream

PROBE_INTERVAL_S = 1.0
PROBE_TIMEOUT = aiohttp.ClientTimeout(total=2.0)


class Breaker:
    def __init__(self, view: Callable[[], RoutingView]) -> None:
        self._view = view
        self._task: asyncio.Task[None] | None = None

    def refused(self, ep: Upstream, role: str) -> None:
        if ep.down:
            return
        target = ep.owner
        others_up = any(not e.down for e in target.endpoints if e is not ep)
        if not others_up:
            peers = [
                t
                for t in self._view().targets
                if t is not target and t.model == target.model and t.role == target.role and t.healthy
            ]
            if not peers:
                log.warn("breaker_kept_last", instance=target.id, endpoint=ep.base, role=role)
                return
        target.set_down(ep, True)
        log.warn("endpoint_out_of_rotation", instance=target.id, endpoint=ep.base, role=role)

    def start(self, session: aiohttp.ClientSession) -> None:
        self._task = asyncio.create_task(self._probe_loop(session))

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def _probe_loop(self, session: aiohttp.ClientSession) -> None:
        while True:
            await asyncio.sleep(PROBE_INTERVAL_S)
            if not Target.down_total:
                continue
            down = [ep for t in self._view().targets for ep in t.endpoints if ep.down]
            if down:
                await asyncio.gather(*(self._probe(session, ep) for ep in down))

    @staticmethod
    async def _probe(session: aiohttp.ClientSession, ep: Upstream) -> None:
        try:
            async with session.get(ep.base + "/health", timeout=PROBE_TIMEOUT) as resp:
                ok = resp.status == 200
        except (aiohttp.ClientError, TimeoutError):
            ok = False
        if ok and ep.down:
            ep.owner.set_down(ep, False)
            role = ROLE_NAMES.get(ep.owner.role, "?")
            log.event("endpoint_back_in_rotation", instance=ep.owner.id, endpoint=ep.base, role=role)
