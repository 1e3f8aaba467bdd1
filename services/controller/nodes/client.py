"""Calls from the Controller to NodeManagers: probes, start commands, relaunches and stops.

Each call is made once; retrying is the work queue's job (instances.py's reconcile requeues a
key with its backoff). Channels are cached per address (bounded, least recently used closed
first) so a cluster of thousands of nodes does not keep thousands of idle connections.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict

import grpc

from motor_mesh.common.channel import open_channel
from motor_mesh.common.config import ServerConfig
from motor_mesh.gen.motor.v1 import nodemanager_pb2, nodemanager_pb2_grpc

PROBE_TIMEOUT_S = 3.0
PROBE_ATTEMPTS = 2
START_TIMEOUT_S = 30.0
RESTART_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 30.0
CACHE_SIZE = 512
# Calls in flight at once: a burst of thousands of registrations (a fleet starting, or every
# NodeManager re-registering after a Controller restart) must not time its own probes out.
MAX_IN_FLIGHT = 64


class NodeManagerClients:
    def __init__(self, key: str | None, tls: ServerConfig | None, max_message_bytes: int = 4 << 20) -> None:
        self._key = key
        self._tls = tls
        self._max = max_message_bytes
        self._channels: OrderedDict[str, grpc.aio.Channel] = OrderedDict()
        self._probes: OrderedDict[str, grpc.aio.Channel] = OrderedDict()
        self._closing: set[asyncio.Task[None]] = set()
        self._in_flight = asyncio.Semaphore(MAX_IN_FLIGHT)

    def stub(self, address: str, probe: bool = False) -> nodemanager_pb2_grpc.NodeManagerAsyncStub:
        """A stub on the cached channel to ``address``; ``probe``: on a channel that does not
        retry, so a NodeManager that is gone is known as gone at once."""
        cache = self._probes if probe else self._channels
        ch = cache.get(address)
        if ch is None:
            ch = cache[address] = self._open(address, retries=not probe)
            while len(cache) > CACHE_SIZE:
                _, old = cache.popitem(last=False)
                self._close_later(old)
        else:
            cache.move_to_end(address)
        return nodemanager_pb2_grpc.NodeManagerStub(ch)

    def registered(self, address: str) -> None:
        """The NodeManager at ``address`` just registered, so it answers now: a cached channel
        still in reconnect backoff from its predecessor (a restart in place) is dropped, or the
        assembly's probe that follows would fail on it and drop the registration."""
        for cache in (self._channels, self._probes):
            ch = cache.get(address)
            if ch is not None and ch.get_state() == grpc.ChannelConnectivity.TRANSIENT_FAILURE:
                del cache[address]
                self._close_later(ch)

    def _open(self, address: str, retries: bool) -> grpc.aio.Channel:
        return open_channel(
            address,
            key=self._key,
            tls=self._tls,
            max_message_bytes=self._max,
            service="controller",
            retries=retries,
        )

    async def reachable(self, address: str, probe_timeout_s: float = PROBE_TIMEOUT_S) -> bool:
        """Does the NodeManager answer ``GetStatus``? A refused connection fails fast; a slow
        answer gets a second chance before the NodeManager counts as gone."""
        for attempt in range(PROBE_ATTEMPTS):
            try:
                async with self._in_flight:
                    await self.stub(address, probe=True).GetStatus(
                        nodemanager_pb2.GetStatusRequest(relaxed=True),
                        timeout=probe_timeout_s,
                        wait_for_ready=False,
                    )
                return True
            except grpc.aio.AioRpcError as err:
                if err.code() != grpc.StatusCode.DEADLINE_EXCEEDED or attempt + 1 == PROBE_ATTEMPTS:
                    return False
        return False

    async def start_engines(
        self, address: str, request: nodemanager_pb2.StartEnginesRequest
    ) -> nodemanager_pb2.StartEnginesResponse:
        """One ``StartEngines``; waits (up to the deadline) for a NodeManager that is restarting."""
        async with self._in_flight:
            return await self.stub(address).StartEngines(request, timeout=START_TIMEOUT_S)

    async def get_status(self, address: str, relaxed: bool = True) -> nodemanager_pb2.GetStatusResponse:
        async with self._in_flight:
            return await self.stub(address).GetStatus(
                nodemanager_pb2.GetStatusRequest(relaxed=relaxed),
                timeout=PROBE_TIMEOUT_S,
                wait_for_ready=False,
            )

    async def status_now(self, address: str) -> nodemanager_pb2.GetStatusResponse:
        """GetStatus on a channel of its own: the cached one to an address whose process just
        died is in reconnect backoff and would fail a call to its successor for a while."""
        channel = self._open(address, retries=False)
        try:
            async with self._in_flight:
                return await nodemanager_pb2_grpc.NodeManagerStub(channel).GetStatus(
                    nodemanager_pb2.GetStatusRequest(relaxed=True), timeout=PROBE_TIMEOUT_S
                )
        finally:
            await channel.close()

    async def restart_engines(
        self, address: str, action: nodemanager_pb2.RestartAction.ValueType, instance_id: int
    ) -> nodemanager_pb2.RestartEnginesResponse:
        """RESTART answers once the new engines are spawned (stopping the old ones takes up to
        the node's engine_stop_grace_s); ABORT at once."""
        request = nodemanager_pb2.RestartEnginesRequest(action=action, instance_id=instance_id)
        async with self._in_flight:
            return await self.stub(address).RestartEngines(request, timeout=RESTART_TIMEOUT_S)

    async def switch_role(
        self, address: str, instance_id: int, role: int
    ) -> nodemanager_pb2.SwitchRoleResponse:
        """SwitchRole answers once the new engines are spawned (the old ones stop first, up to
        the node's engine_stop_grace_s), like a RESTART."""
        request = nodemanager_pb2.SwitchRoleRequest(instance_id=instance_id, role=role)  # type: ignore[arg-type]
        async with self._in_flight:
            return await self.stub(address).SwitchRole(request, timeout=RESTART_TIMEOUT_S)

    async def stop(self, address: str, reason: str) -> None:
        async with self._in_flight:
            await self.stub(address).Stop(nodemanager_pb2.StopRequest(reason=reason), timeout=STOP_TIMEOUT_S)

    def _close_later(self, channel: grpc.aio.Channel) -> None:
        task = asyncio.get_running_loop().create_task(channel.close(grace=5.0))
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    async def close(self) -> None:
        channels = [*self._channels.values(), *self._probes.values()]
        self._channels.clear()
        self._probes.clear()
        await asyncio.gather(*(c.close(grace=0.5) for c in channels), *self._closing, return_exceptions=True)
