"""motor.v1.NodeManager servicer: a thin layer over :class:`EngineSupervisor`.

It subclasses the generated servicer for its method types only: ``motor_mesh.common.rpc`` registers
the methods itself (raw-bytes parsing, validators, rich errors).
"""

from __future__ import annotations

from collections.abc import Callable

import grpc

from motor_mesh.common import log
from motor_mesh.gen.motor.v1 import nodemanager_pb2 as pb
from motor_mesh.gen.motor.v1 import nodemanager_pb2_grpc
from motor_mesh.nodemanager import validation
from motor_mesh.nodemanager.supervisor import EngineSupervisor

# Stop answers first, then the process exits; this leaves the answer time to leave.
EXIT_AFTER_STOP_S = 0.3


class NodeManagerService(nodemanager_pb2_grpc.NodeManagerServicer):
    VALIDATORS = validation.VALIDATORS

    def __init__(
        self,
        supervisor: EngineSupervisor,
        request_exit: Callable[[int, str, float], None],
        leave: Callable[[], None] = lambda: None,
    ) -> None:
        self.sup = supervisor
        self.request_exit = request_exit
        self.leave = leave

    async def StartEngines(
        self, request: pb.StartEnginesRequest, context: grpc.aio.ServicerContext
    ) -> pb.StartEnginesResponse:
        return pb.StartEnginesResponse(endpoints=await self.sup.start(request))

    async def RestartEngines(
        self, request: pb.RestartEnginesRequest, context: grpc.aio.ServicerContext
    ) -> pb.RestartEnginesResponse:
        return pb.RestartEnginesResponse(relaunch_count=await self.sup.restart(request))

    async def SwitchRole(
        self, request: pb.SwitchRoleRequest, context: grpc.aio.ServicerContext
    ) -> pb.SwitchRoleResponse:
        role, switched, relaunch_count = await self.sup.switch_role(request)
        return pb.SwitchRoleResponse(role=role, switched=switched, relaunch_count=relaunch_count)

    async def GetStatus(
        self, request: pb.GetStatusRequest, context: grpc.aio.ServicerContext
    ) -> pb.GetStatusResponse:
        sup = self.sup
        resp = pb.GetStatusResponse(
            ready=sup.ready(request.relaxed),
            endpoints=sup.status_endpoints(),
            relaunch_count=sup.relaunch_count,
            instance_id=sup.instance_id,
            incarnation=sup.incarnation,
            role=sup.role,
        )
        until = sup.freeze.until
        if until is not None:
            resp.frozen_until.FromNanoseconds(int(until * 1e9))
        return resp

    async def Pause(self, request: pb.PauseRequest, context: grpc.aio.ServicerContext) -> pb.PauseResponse:
        self.sup.set_paused(True)
        return pb.PauseResponse()

    async def Resume(self, request: pb.ResumeRequest, context: grpc.aio.ServicerContext) -> pb.ResumeResponse:
        self.sup.set_paused(False)
        return pb.ResumeResponse()

    async def Stop(self, request: pb.StopRequest, context: grpc.aio.ServicerContext) -> pb.StopResponse:
        log.event("stop_requested", reason=request.reason)
        # Leaving from now on: while the engines stop, this node must not register again (the
        # Controller deleted its instance first, so its stream would be told to) nor start
        # engines; it comes back as a new process.
        self.leave()
        await self.sup.stop_all(self.sup.nm_cfg.engine_stop_grace_s)
        self.request_exit(1, f"Stop: {request.reason}" if request.reason else "Stop", EXIT_AFTER_STOP_S)
        return pb.StopResponse()
