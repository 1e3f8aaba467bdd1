"""motor.v1.Controller servicer: thin adapters from RPCs to the Controller's parts."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import grpc
from motor.v1 import controller_pb2 as pb

from services.common import errors
from services.common.rpc import BidiStream
from services.controller import validation

if TYPE_CHECKING:
    from services.controller.app import Controller


class ControllerService:
    VALIDATORS = validation.VALIDATORS

    def __init__(self, controller: Controller) -> None:
        self._c = controller

    async def Register(self, request: pb.RegisterRequest, context: grpc.aio.ServicerContext) -> Any:
        return self._c.assembler.register(request)

    async def Heartbeat(self, stream: BidiStream, context: grpc.aio.ServicerContext) -> None:
        await self._c.hub.stream(stream, context)

    async def ListInstances(self, request: pb.ListInstancesRequest, context: grpc.aio.ServicerContext) -> Any:
        found = self._c.table.find(role=request.role, status=request.status)
        return pb.ListInstancesResponse(instances=[i.to_pb() for i in found])

    # Later issues: the alarm store, the recovery service and the fault manager.

    async def ReportAlarms(self, request: pb.ReportAlarmsRequest, context: grpc.aio.ServicerContext) -> Any:
        raise errors.unimplemented("alarm store (ReportAlarms)")

    async def TerminateInstance(
        self, request: pb.TerminateInstanceRequest, context: grpc.aio.ServicerContext
    ) -> Any:
        raise errors.unimplemented("recovery service (TerminateInstance)")

    async def ListAlarms(self, request: pb.ListAlarmsRequest, context: grpc.aio.ServicerContext) -> Any:
        raise errors.unimplemented("alarm store (ListAlarms)")

    async def WatchAlarms(self, request: pb.WatchAlarmsRequest, context: grpc.aio.ServicerContext) -> Any:
        raise errors.unimplemented("alarm store (WatchAlarms)")
        yield  # pragma: no cover

    async def GetFaultToleranceStatus(
        self, request: pb.GetFaultToleranceStatusRequest, context: grpc.aio.ServicerContext
    ) -> Any:
        raise errors.unimplemented("fault manager (GetFaultToleranceStatus)")
