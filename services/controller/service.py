"""motor.v1.Controller servicer: thin adapters from RPCs to the Controller's parts."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

import grpc

from motor_mesh.common import errors
from motor_mesh.common.rpc import BidiStream
from motor_mesh.controller import validation
from motor_mesh.controller.alarms.pages import list_page
from motor_mesh.controller.convert import instance_pb
from motor_mesh.gen.motor.v1 import controller_pb2 as pb
from motor_mesh.gen.motor.v1 import controller_pb2_grpc

if TYPE_CHECKING:  # app.py builds this servicer around the Controller it owns: types only
    from motor_mesh.controller.app import Controller


class ControllerService(controller_pb2_grpc.ControllerServicer):
    VALIDATORS = validation.VALIDATORS

    def __init__(self, controller: Controller) -> None:
        self._c = controller

    async def Register(
        self, request: pb.RegisterRequest, context: grpc.aio.ServicerContext
    ) -> pb.RegisterResponse:
        return await self._c.registrar.register(request)

    # Served with read/write instead of request/response iterators (services/common/rpc.py): one
    # coroutine per stream on the Controller's hottest path.
    async def Heartbeat(  # type: ignore[override]
        self, stream: BidiStream, context: grpc.aio.ServicerContext
    ) -> None:
        await self._c.hub.stream(stream, context)

    async def ListInstances(
        self, request: pb.ListInstancesRequest, context: grpc.aio.ServicerContext
    ) -> pb.ListInstancesResponse:
        found = self._c.table.find(role=request.role, status=request.status)
        return pb.ListInstancesResponse(instances=[instance_pb(i) for i in found])

    async def ReportAlarms(
        self, request: pb.ReportAlarmsRequest, context: grpc.aio.ServicerContext
    ) -> pb.ReportAlarmsResponse:
        # A failed write raises StateWriteError (UNAVAILABLE): nothing was stored, so sending
        # the same report again is safe.
        stored = await self._c.alarms.report(request.alarms)
        return self._c.recovery.after_report(stored)

    async def TerminateInstance(
        self, request: pb.TerminateInstanceRequest, context: grpc.aio.ServicerContext
    ) -> pb.TerminateInstanceResponse:
        return await self._c.recovery.terminate(request, context.time_remaining())

    async def ListAlarms(
        self, request: pb.ListAlarmsRequest, context: grpc.aio.ServicerContext
    ) -> pb.ListAlarmsResponse:
        return list_page(self._c.alarms, request)

    async def WatchAlarms(
        self, request: pb.WatchAlarmsRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.WatchAlarmsResponse]:
        async for alarm in self._c.alarm_watch.stream(request.after_sequence):
            yield pb.WatchAlarmsResponse(alarm=alarm)

    async def GetFaultToleranceStatus(
        self, request: pb.GetFaultToleranceStatusRequest, context: grpc.aio.ServicerContext
    ) -> pb.GetFaultToleranceStatusResponse:
        live = self._c.table.live
        if request.instance_id:
            if request.instance_id not in live:
                raise errors.not_found("instance", str(request.instance_id), "no live instance with this id")
            ids = [request.instance_id]
        else:
            ids = sorted(live)
        return pb.GetFaultToleranceStatusResponse(instances=self._c.faults.status([live[i] for i in ids]))

    async def ReportFaults(
        self, request: pb.ReportFaultsRequest, context: grpc.aio.ServicerContext
    ) -> pb.ReportFaultsResponse:
        by_node = {m.address: inst.id for inst in self._c.table.live.values() for m in inst.members}
        affected: set[int] = set()
        for f in request.faults:
            address = f"{f.host}:{f.nm_port}"
            if address in by_node:
                affected.add(by_node[address])
            elif not (f.cleared and self._c.faults.has_faults(address)):
                # A node that left keeps its faults, so they can still be cleared.
                raise errors.not_found("node", address, f"no live instance has NodeManager {address}")
        await self._c.faults.report(list(request.faults))
        for iid in affected:
            self._c.instance_loop.enqueue(iid)
        return pb.ReportFaultsResponse(affected_instance_ids=sorted(affected))

    async def SetDesiredInstances(
        self, request: pb.SetDesiredInstancesRequest, context: grpc.aio.ServicerContext
    ) -> pb.SetDesiredInstancesResponse:
        # Stored before it is shown: a failed write raises StateWriteError (UNAVAILABLE,
        # STATE_WRITE_FAILED) and the count stays what it was.
        stored = await self._c.desired.set(request.role, request.replicas)
        return pb.SetDesiredInstancesResponse(desired=stored)

    async def ListDesiredInstances(
        self, request: pb.ListDesiredInstancesRequest, context: grpc.aio.ServicerContext
    ) -> pb.ListDesiredInstancesResponse:
        return pb.ListDesiredInstancesResponse(desired=self._c.desired.entries())

    async def GetPlannerStatus(
        self, request: pb.GetPlannerStatusRequest, context: grpc.aio.ServicerContext
    ) -> pb.GetPlannerStatusResponse:
        return self._c.planner.status()

    async def ReloadConfig(
        self, request: pb.ReloadConfigRequest, context: grpc.aio.ServicerContext
    ) -> pb.ReloadConfigResponse:
        # Stored before anything applies (controller/settings.py): a failed write raises
        # StateWriteError (UNAVAILABLE, STATE_WRITE_FAILED) and nothing changed.
        revision, changed = await self._c.settings.reload(request.config_text)
        return pb.ReloadConfigResponse(settings_revision=revision, changed_keys=changed)
