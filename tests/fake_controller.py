"""A fake motor.v1.Controller, served in-process, that leads or stands by.

Leading, it registers NodeManagers and keeps their heartbeat streams as the real one does
(acks by seq; an unknown node or stale session gets ``DIRECTIVE_REREGISTER`` then
STALE_SESSION, as after a restart or a failover), lists its instances and alarms, and records
reported alarms and faults. Standing by, it answers every call UNAVAILABLE with an ErrorInfo
``NOT_LEADER`` naming ``leader_hint`` and a RetryInfo, as a standby Controller does. ``kill()``
stops the server at once: open streams are cut and the port refuses connections, like a dead
process.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import grpc
from google.rpc import error_details_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio

from motor_mesh.common import enums, errors
from motor_mesh.common.rpc import service_handler
from motor_mesh.gen.motor.v1 import alarm_pb2, common_pb2, controller_pb2

CONTROLLER = controller_pb2.DESCRIPTOR.services_by_name["Controller"]


def not_leader(leader: str) -> errors.MotorError:
    where = f"the leader is {leader}" if leader else "no leader is elected yet"
    return errors.MotorError(
        grpc.StatusCode.UNAVAILABLE,
        f"this Controller is a standby; {where}",
        [
            error_details_pb2.ErrorInfo(
                reason="NOT_LEADER", domain=errors.DOMAIN, metadata={"leader": leader}
            ),
            error_details_pb2.RetryInfo(retry_delay={"seconds": 1}),
        ],
    )


class FakeController:
    def __init__(self, *, leading: bool = True, leader_hint: str = "", interval_ms: int = 200) -> None:
        self.leading = leading
        self.leader_hint = leader_hint
        self.interval_ms = interval_ms
        self.instances: list[common_pb2.Instance] = []
        self.alarms: list[alarm_pb2.Alarm] = []
        self.registers: list[controller_pb2.RegisterRequest] = []
        self.received: list[controller_pb2.HeartbeatRequest] = []
        self.faults: list[controller_pb2.ReportFaultsRequest] = []
        self.refused = 0  # calls answered NOT_LEADER
        self._nodes: dict[tuple[str, int], int] = {}
        self._sessions: dict[int, int] = {}  # node id -> session epoch

    def beats(self) -> list[controller_pb2.Beat]:
        return [r.beat for r in self.received if r.HasField("beat")]

    def _lead(self) -> None:
        """Raise NOT_LEADER unless leading."""
        if not self.leading:
            self.refused += 1
            raise not_leader(self.leader_hint)

    async def Register(self, request: controller_pb2.RegisterRequest, context: Any) -> Any:
        self._lead()
        self.registers.append(request)
        node_id = self._nodes.setdefault((request.host, request.nm_port), len(self._nodes) + 1)
        self._sessions[node_id] = self._sessions.get(node_id, 0) + 1
        return controller_pb2.RegisterResponse(
            node_id=node_id,
            session_epoch=self._sessions[node_id],
            heartbeat_interval_ms=self.interval_ms,
            instance_id=request.instance_id,
        )

    async def Heartbeat(self, stream: Any, context: Any) -> None:
        self._lead()
        while (req := await stream.read()) is not None:
            msg = req.beat if req.HasField("beat") else req.engine_event
            if self._sessions.get(msg.node_id) != msg.session_epoch:
                await stream.write(controller_pb2.HeartbeatResponse(directive=enums.REREGISTER))
                raise errors.precondition(
                    "STALE_SESSION", f"node/{msg.node_id}", "unknown node; register again"
                )
            self.received.append(req)
            await stream.write(controller_pb2.HeartbeatResponse(ack=controller_pb2.Ack(seq=msg.seq)))

    async def ListInstances(self, request: Any, context: Any) -> Any:
        self._lead()
        return controller_pb2.ListInstancesResponse(instances=self.instances)

    async def ListAlarms(self, request: controller_pb2.ListAlarmsRequest, context: Any) -> Any:
        self._lead()
        newest_first = sorted(self.alarms, key=lambda a: -a.sequence)
        return controller_pb2.ListAlarmsResponse(alarms=newest_first[: request.page_size or None])

    async def WatchAlarms(
        self, request: controller_pb2.WatchAlarmsRequest, context: Any
    ) -> AsyncIterator[controller_pb2.WatchAlarmsResponse]:
        self._lead()
        for a in sorted(self.alarms, key=lambda a: a.sequence):
            if a.sequence > request.after_sequence:
                yield controller_pb2.WatchAlarmsResponse(alarm=a)
        await asyncio.Event().wait()  # open until the client or the server ends it

    async def ReportAlarms(self, request: controller_pb2.ReportAlarmsRequest, context: Any) -> Any:
        self._lead()
        self.alarms.extend(request.alarms)
        return controller_pb2.ReportAlarmsResponse()

    async def ReportFaults(self, request: controller_pb2.ReportFaultsRequest, context: Any) -> Any:
        self._lead()
        self.faults.append(request)
        return controller_pb2.ReportFaultsResponse()

    async def GetFaultToleranceStatus(self, request: Any, context: Any) -> Any:
        self._lead()
        return controller_pb2.GetFaultToleranceStatusResponse()

    async def TerminateInstance(self, request: Any, context: Any) -> Any:
        self._lead()
        raise errors.unimplemented("TerminateInstance")

    async def SetDesiredInstances(self, request: Any, context: Any) -> Any:
        self._lead()
        raise errors.unimplemented("SetDesiredInstances")

    async def ListDesiredInstances(self, request: Any, context: Any) -> Any:
        self._lead()
        return controller_pb2.ListDesiredInstancesResponse()

    async def GetPlannerStatus(self, request: Any, context: Any) -> Any:
        self._lead()
        return controller_pb2.GetPlannerStatusResponse(mode="off")

    async def ReloadConfig(self, request: Any, context: Any) -> Any:
        self._lead()
        raise errors.unimplemented("ReloadConfig")


class FakeControllerServer:
    """``fake`` served on loopback (``port`` 0: any free one), with health ``""`` SERVING."""

    def __init__(self, fake: FakeController | None = None, port: int = 0) -> None:
        self.fake = fake or FakeController()
        self.port = port
        self._server: grpc.aio.Server | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    async def start(self) -> FakeControllerServer:
        server = grpc.aio.server()
        server.add_generic_rpc_handlers((service_handler(CONTROLLER, self.fake),))
        health = health_aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(health, server)
        self.port = server.add_insecure_port(f"127.0.0.1:{self.port}")
        await server.start()
        await health.set("", health_pb2.HealthCheckResponse.SERVING)
        self._server = server
        return self

    async def kill(self) -> None:
        """Stop at once: streams cut, the port closed."""
        server, self._server = self._server, None
        if server is not None:
            await server.stop(None)


@contextlib.asynccontextmanager
async def controllers(*fakes: FakeController) -> AsyncIterator[list[FakeControllerServer]]:
    """Every fake served; killed on the way out."""
    servers: list[FakeControllerServer] = []
    try:
        for fake in fakes:
            servers.append(await FakeControllerServer(fake).start())
        yield servers
    finally:
        for s in servers:
            await s.kill()
