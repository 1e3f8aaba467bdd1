"""The Controller's health Watch on one Coordinator (docs/architecture.md, "Controller →
Coordinator").

A break (the stream failing or ending, or the Coordinator saying anything but SERVING) and
then SERVING again means the Coordinator may have restarted, lost its table or missed calls:
the pusher is told, and it sends a full Set unless one has certainly reached the process that
answers now. While the Coordinator is down the Watch is tried again every ``RETRY`` (at most
0.25 s): a connect to a closed port fails at once and costs nothing, and the sooner the Watch
sees the port answer again, the sooner the full set is back.

Each try goes out on a fresh channel, so as not to wait out the old channel's reconnect backoff
(up to 2 s); every channel has its own subchannel pool (services/common/channel.py), so a fresh
one really starts from scratch.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Callable
from typing import Protocol

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from motor_mesh.common import log
from motor_mesh.common.retry import Backoff
from motor_mesh.common.tasks import cancel_quietly, cancelled_from_outside, spawn

COORDINATOR_SERVICE = "motor.v1.Coordinator"
RETRY = (0.05, 0.25)
# A break whose start is not known (the watch itself failed): no Set sent before counts.
UNKNOWN = sys.maxsize
# Told (address, reachable, why) when what the Watch sees changes: the Coordinator alarm.
Reachability = Callable[[str, bool, str], None]


class Watched(Protocol):
    """The pusher, as the watch sees it."""

    address: str
    channel_gen: int  # counts the channels opened: which one a call went out on

    def health_stub(self) -> health_pb2_grpc.HealthStub: ...

    def reopen(self) -> None: ...

    def restored(self, broken_gen: int) -> None: ...


class CoordinatorWatch:
    def __init__(self, pusher: Watched, on_reachability: Reachability | None = None) -> None:
        self._pusher = pusher
        self._on_reachability = on_reachability
        self.reachable: bool | None = None  # None: not known yet
        self._backoff = Backoff(*RETRY)
        # The channel generation on which the current break was first seen; None: no break.
        # Kept here, not in the loop, so a watch restarted after a failure still knows.
        self.broken_gen: int | None = None
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = spawn(f"coordinator-watch-{self._pusher.address}", self._run)

    async def close(self) -> None:
        await cancel_quietly(self._task)

    async def _run(self) -> None:
        try:
            await self._follow()
        except BaseException:
            # Nobody watched until the restart: the Coordinator may have restarted meanwhile.
            self.broken_gen = UNKNOWN
            raise

    async def _follow(self) -> None:
        req = health_pb2.HealthCheckRequest(service=COORDINATOR_SERVICE)
        while True:
            gen, stub = self._pusher.channel_gen, self._pusher.health_stub()
            try:
                async for resp in stub.Watch(req, wait_for_ready=False):
                    if resp.status != health_pb2.HealthCheckResponse.SERVING:
                        self._broke(gen, health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status))
                        continue
                    self._backoff.reset()
                    self._reached(True)
                    if self.broken_gen is not None:
                        broken, self.broken_gen = self.broken_gen, None
                        self._pusher.restored(broken)
                why = "stream_ended"
            except grpc.aio.AioRpcError as err:
                if err.code() == grpc.StatusCode.UNIMPLEMENTED:
                    log.warn("coordinator_health_unavailable", coordinator=self._pusher.address)
                    self._reached(True)  # it answered
                    return  # nothing to watch: the periodic Set and the resync still run
                why = err.code().name
            except asyncio.CancelledError:
                if cancelled_from_outside():
                    raise
                # grpc.aio's way of ending a stream whose channel was closed under it (the pusher
                # opened a fresh one): watch again on the new channel.
                why = "channel_closed"
            self._broke(gen, why)
            await self._backoff.sleep()
            self._pusher.reopen()

    def _broke(self, gen: int, why: str) -> None:
        self._reached(False, why)
        if self.broken_gen is None:
            self.broken_gen = gen
            log.warn("coordinator_unreachable", coordinator=self._pusher.address, why=why)

    def _reached(self, reachable: bool, why: str = "") -> None:
        if reachable != self.reachable:
            self.reachable = reachable
            if self._on_reachability is not None:
                self._on_reachability(self._pusher.address, reachable, why)
