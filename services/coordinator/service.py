"""motor.v1.Coordinator servicer (management plane): the routing table over gRPC.

``motor_mesh.common.rpc`` registers these methods itself (raw-bytes parsing, ``VALIDATORS``, rich
errors); the generated servicer is the base class for its request and response types.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, TypeVar

import grpc

from motor_mesh.common import errors, log
from motor_mesh.common.interceptors import LEADER_TERM_METADATA
from motor_mesh.coordinator import validation
from motor_mesh.coordinator.table import RoutingTable
from motor_mesh.gen.motor.v1 import coordinator_pb2 as pb
from motor_mesh.gen.motor.v1 import coordinator_pb2_grpc

if TYPE_CHECKING:
    from motor_mesh.coordinator.workers.pool import WorkerPool

R = TypeVar("R")


class CoordinatorService(coordinator_pb2_grpc.CoordinatorServicer):
    VALIDATORS = validation.VALIDATORS

    def __init__(
        self,
        table: RoutingTable,
        on_change: Callable[[], Awaitable[None]],
        dismiss_precision: Callable[[int, int], bool] = lambda p, d: False,
        pool: WorkerPool | None = None,
    ) -> None:
        self.table = table
        # The inference worker processes; None when this process serves HTTP itself.
        self._pool = pool
        self._on_change = on_change
        # Drops the precision-detection state of group (p, d); True when there was some.
        self._dismiss_precision = dismiss_precision
        # The highest Controller leader term seen on a push (0: none yet, or no HA).
        self.leader_term = 0

    def _fence(self, rpc: str, context: grpc.aio.ServicerContext) -> None:
        """Refuse a push from a Controller whose leadership is older than one already seen: a
        paused or cut-off old leader must never overwrite what the new one pushed. A push
        without a term (one Controller on SQLite, ``motor register``) is not fenced."""
        term = _term_of(context)
        if term is None:
            return
        if term < self.leader_term:
            raise errors.precondition(
                "STALE_LEADER",
                f"term/{term}",
                f"{rpc} from a Controller leader of term {term}, older than term {self.leader_term}",
            )
        if term > self.leader_term:
            log.event("leader_term", term=term, previous=self.leader_term)
            self.leader_term = term

    async def _applied(self, rpc: str, changed: bool, resp_cls: Callable[..., R]) -> R:
        state = self.table.state
        if changed:
            log.event("table_changed", rpc=rpc, revision=state.revision, instances=len(state.instances))
        # Routing and readiness follow before the caller hears "done". Called for an unchanged
        # table too: a retried write must still wait for inference workers that missed it.
        await self._on_change()
        return resp_cls(
            revision=state.revision, instance_count=len(state.instances), incarnation=self.table.incarnation
        )

    async def SetInstances(
        self, request: pb.SetInstancesRequest, context: grpc.aio.ServicerContext
    ) -> pb.SetInstancesResponse:
        self._fence("SetInstances", context)
        return await self._applied("SetInstances", self.table.set(request.instances), pb.SetInstancesResponse)

    async def AddInstances(
        self, request: pb.AddInstancesRequest, context: grpc.aio.ServicerContext
    ) -> pb.AddInstancesResponse:
        self._fence("AddInstances", context)
        return await self._applied("AddInstances", self.table.add(request.instances), pb.AddInstancesResponse)

    async def DeleteInstances(
        self, request: pb.DeleteInstancesRequest, context: grpc.aio.ServicerContext
    ) -> pb.DeleteInstancesResponse:
        self._fence("DeleteInstances", context)
        changed = self.table.delete(request.instances)
        return await self._applied("DeleteInstances", changed, pb.DeleteInstancesResponse)

    async def PauseInstances(
        self, request: pb.PauseInstancesRequest, context: grpc.aio.ServicerContext
    ) -> pb.PauseInstancesResponse:
        self._fence("PauseInstances", context)
        return await self._applied("PauseInstances", self.table.pause(request.ids), pb.PauseInstancesResponse)

    async def ResumeInstances(
        self, request: pb.ResumeInstancesRequest, context: grpc.aio.ServicerContext
    ) -> pb.ResumeInstancesResponse:
        self._fence("ResumeInstances", context)
        changed = self.table.resume(request.ids)
        return await self._applied("ResumeInstances", changed, pb.ResumeInstancesResponse)

    async def ListInstances(
        self, request: pb.CoordinatorListInstancesRequest, context: grpc.aio.ServicerContext
    ) -> pb.CoordinatorListInstancesResponse:
        state = self.table.state
        available, unavailable, paused = state.groups()
        return pb.CoordinatorListInstancesResponse(
            available=available,
            unavailable=unavailable,
            paused=paused,
            revision=state.revision,
            incarnation=self.table.incarnation,
            inference_workers=self._pool.count if self._pool is not None else 1,
            inference_workers_serving=len(self._pool.hub.serving()) if self._pool is not None else 1,
        )

    async def ClearPrecisionAlarm(
        self, request: pb.ClearPrecisionAlarmRequest, context: grpc.aio.ServicerContext
    ) -> pb.ClearPrecisionAlarmResponse:
        """The Controller cleared the group's alarm (recovery or an operator): forget what the
        group's samples said, so it is judged afresh. p = 0 names every group of decode instance
        d. Idempotent: a second call finds nothing and answers dismissed = false."""
        p, d = request.p_instance_id, request.d_instance_id
        dismissed = self._dismiss_precision(p, d)
        log.event("precision_alarm_dismissed", p=p, d=d, dismissed=dismissed)
        return pb.ClearPrecisionAlarmResponse(dismissed=dismissed)


def _term_of(context: grpc.aio.ServicerContext) -> int | None:
    for key, value in context.invocation_metadata() or ():
        if key == LEADER_TERM_METADATA:
            try:
                return int(value)
            except (TypeError, ValueError):
                raise errors.bad_request([(LEADER_TERM_METADATA, "must be a decimal integer")]) from None
    return None
