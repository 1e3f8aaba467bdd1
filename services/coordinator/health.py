"""Circuit breaker: endpoints that refuse connections leave rotation at once and are probed back.

An endpoint is taken out when a connection to it is refused (or times out), unless that would
leave its role without any healthy instance of the model: the last one stays in rotation, so
a flapping engine costs retries, never an outage of the whole role. Endpoints that are out are
probed with ``GET /health`` every ``PROBE_INTERVAL_S`` and come back on the first 200.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from motor_mesh.common import log
from motor_mesh.common.enums import ROLE_NAMES
from motor_mesh.common.httpclient import Disconnected, Pool, Refused, UpstreamTimeout
from motor_mesh.common.tasks import supervise
from motor_mesh.coordinator.routes import RoutingView, Upstream

PROBE_INTERVAL_S = 1.0
PROBE_TIMEOUT_S = 2.0


class Breaker:
    def __init__(
        self, view: Callable[[], RoutingView], on_count: Callable[[int], None] = lambda n: None
    ) -> None:
        self._view = view
        self._on_count = on_count  # told how many endpoints are out, after every change
        self._task: asyncio.Task[None] | None = None
        self._pool = Pool(PROBE_TIMEOUT_S)  # probes never take a connection from the hot path

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
        self._on_count(self._view().down_total)

    def start(self) -> None:
        self._task = asyncio.create_task(supervise("breaker_probes", self._probe_loop))

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        self._pool.close()

    async def _probe_loop(self) -> None:
        while True:
            await asyncio.sleep(PROBE_INTERVAL_S)
            view = self._view()
            if not view.down_total:
                continue
            down = [ep for t in view.targets for ep in t.endpoints if ep.down]
            if down:
                await asyncio.gather(*(self._probe(ep) for ep in down))
            self._on_count(self._view().down_total)

    async def _probe(self, ep: Upstream) -> None:
        deadline = asyncio.get_running_loop().time() + PROBE_TIMEOUT_S
        try:
            resp = await self._pool.request(ep.host, ep.port, b"GET", b"/health", b"", b"", deadline=deadline)
            await resp.read(deadline)
            resp.release()
            ok = resp.status == 200
        except (Refused, Disconnected, UpstreamTimeout):
            ok = False
        if ok and ep.down:
            ep.owner.set_down(ep, False)
            role = ROLE_NAMES.get(ep.owner.role, "?")
            log.event("endpoint_back_in_rotation", instance=ep.owner.id, endpoint=ep.base, role=role)
