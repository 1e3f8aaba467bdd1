"""motor.v1.Controller as served by a Controller that may not be the leader.

The gRPC server comes up before the election (health answers, and standbys can tell clients
where the leader is), so the servicer it is given is this gate: while the process stands by,
every RPC answers UNAVAILABLE with an ErrorInfo ``NOT_LEADER`` whose ``leader`` metadata names
the leader's address ("" when none is known yet) and a RetryInfo; clients
(services/common/leader_target.py) follow it. Once elected, :meth:`activate` hands every call
to the real servicer.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import NoReturn

import grpc
from google.rpc import error_details_pb2

from motor_mesh.common import errors
from motor_mesh.common.rpc import BidiStream
from motor_mesh.controller import validation
from motor_mesh.controller.service import ControllerService
from motor_mesh.gen.motor.v1 import controller_pb2 as pb
from motor_mesh.gen.motor.v1 import controller_pb2_grpc

NOT_LEADER = "NOT_LEADER"
RETRY_S = 1


def not_leader(leader: str) -> errors.MotorError:
    where = f"the leader is {leader}" if leader else "no leader is elected yet"
    return errors.MotorError(
        grpc.StatusCode.UNAVAILABLE,
        f"this Controller is a standby; {where}",
        [
            error_details_pb2.ErrorInfo(reason=NOT_LEADER, domain=errors.DOMAIN, metadata={"leader": leader}),
            error_details_pb2.RetryInfo(retry_delay={"seconds": RETRY_S}),
        ],
    )


class LeaderGate(controller_pb2_grpc.ControllerServicer):
    VALIDATORS = validation.VALIDATORS

    def __init__(self, leader: Callable[[], str]) -> None:
        self._leader = leader
        self._active: ControllerService | None = None

    def activate(self, servicer: ControllerService) -> None:
        self._active = servicer

    def _serving(self) -> ControllerService:
        if self._active is None:
            self._refuse()
        return self._active

    def _refuse(self) -> NoReturn:
        raise not_leader(self._leader())

    async def Register(
        self, request: pb.RegisterRequest, context: grpc.aio.ServicerContext
    ) -> pb.RegisterResponse:
        return await self._serving().Register(request, context)

    async def Heartbeat(  # type: ignore[override]
        self, stream: BidiStream, context: grpc.aio.ServicerContext
    ) -> None:
        await self._serving().Heartbeat(stream, context)

    async def ListInstances(
        self, request: pb.ListInstancesRequest, context: grpc.aio.ServicerContext
    ) -> pb.ListInstancesResponse:
        return await self._serving().ListInstances(request, context)

    async def ReportAlarms(
        self, request: pb.ReportAlarmsRequest, context: grpc.aio.ServicerContext
    ) -> pb.ReportAlarmsResponse:
        return await self._serving().ReportAlarms(request, context)

    async def TerminateInstance(
        self, request: pb.TerminateInstanceRequest, context: grpc.aio.ServicerContext
    ) -> pb.TerminateInstanceResponse:
        return await self._serving().TerminateInstance(request, context)

    async def ListAlarms(
        self, request: pb.ListAlarmsRequest, context: grpc.aio.ServicerContext
    ) -> pb.ListAlarmsResponse:
        return await self._serving().ListAlarms(request, context)

    async def WatchAlarms(
        self, request: pb.WatchAlarmsRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.WatchAlarmsResponse]:
        async for resp in self._serving().WatchAlarms(request, context):
            yield resp

    async def GetFaultToleranceStatus(
        self, request: pb.GetFaultToleranceStatusRequest, context: grpc.aio.ServicerContext
    ) -> pb.GetFaultToleranceStatusResponse:
        return await self._serving().GetFaultToleranceStatus(request, context)

    async def ReportFaults(
        self, request: pb.ReportFaultsRequest, context: grpc.aio.ServicerContext
    ) -> pb.ReportFaultsResponse:
        return await self._serving().ReportFaults(request, context)

    async def SetDesiredInstances(
        self, request: pb.SetDesiredInstancesRequest, context: grpc.aio.ServicerContext
    ) -> pb.SetDesiredInstancesResponse:
        return await self._serving().SetDesiredInstances(request, context)

    async def ListDesiredInstances(
        self, request: pb.ListDesiredInstancesRequest, context: grpc.aio.ServicerContext
    ) -> pb.ListDesiredInstancesResponse:
        return await self._serving().ListDesiredInstances(request, context)

    async def GetPlannerStatus(
        self, request: pb.GetPlannerStatusRequest, context: grpc.aio.ServicerContext
    ) -> pb.GetPlannerStatusResponse:
        return await self._serving().GetPlannerStatus(request, context)

    async def ReloadConfig(
        self, request: pb.ReloadConfigRequest, context: grpc.aio.ServicerContext
    ) -> pb.ReloadConfigResponse:
        return await self._serving().ReloadConfig(request, context)
