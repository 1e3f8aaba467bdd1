"""motor.v1.Coordinator servicer (management plane): the routing table over gRPC.

``motor_mesh.common.rpc`` registers these methods itself (raw-bytes parsing, ``VALIDATORS``, rich
errors); the generated servicer is the base class for its request and response types.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, TypeVar

import grpc
from prometheus_client.parser import text_string_to_metric_families

from motor_mesh.common import errors, log
from motor_mesh.common.enums import ROLE_NAMES, ROLES_BY_NAME
from motor_mesh.common.interceptors import LEADER_TERM_METADATA
from motor_mesh.coordinator import validation
from motor_mesh.coordinator.engine_metrics import exposition
from motor_mesh.coordinator.engine_metrics.aggregate import OutFamily
from motor_mesh.coordinator.table import RoutingTable, TableState
from motor_mesh.gen.motor.v1 import coordinator_pb2 as pb
from motor_mesh.gen.motor.v1 import coordinator_pb2_grpc

if TYPE_CHECKING:
    from motor_mesh.coordinator.engine_metrics.source import EngineMetrics
    from motor_mesh.coordinator.workers.pool import WorkerPool

R = TypeVar("R")

_VIEWS = {
    pb.ENGINE_METRICS_VIEW_FULL: "full",
    pb.ENGINE_METRICS_VIEW_INSTANCE: "instance",
    pb.ENGINE_METRICS_VIEW_ROLE: "role",
    pb.ENGINE_METRICS_VIEW_DP: "dp",
    pb.ENGINE_METRICS_VIEW_NODE: "node",
}


def _own_families(text: bytes) -> list[pb.MetricFamily]:
    """This Coordinator's motor_coordinator_* series, from its own exposition."""
    out = []
    for fam in text_string_to_metric_families(text.decode()):
        if not fam.name.startswith("motor_coordinator_"):
            continue
        samples = tuple((s.name, tuple(sorted(s.labels.items())), float(s.value)) for s in fam.samples)
        out.append(OutFamily(fam.name, fam.type, fam.documentation, samples))
    return exposition.protos(out)


class CoordinatorService(coordinator_pb2_grpc.CoordinatorServicer):
    VALIDATORS = validation.VALIDATORS

    def __init__(
        self,
        table: RoutingTable,
        route_by: Callable[[TableState | None], Awaitable[None]],
        dismiss_precision: Callable[[int, int], bool] = lambda p, d: False,
        pool: WorkerPool | None = None,
        *,
        legs: Callable[[int], tuple[dict[int, int], int]] = lambda since: ({}, 0),
        drain_grace_s: float = 30.0,
        engine_metrics: EngineMetrics | None = None,
        own_metrics: Callable[[], Awaitable[bytes]] | None = None,
        apply_settings: Callable[[int, str, int], Awaitable[None]] | None = None,
        settings_state: Callable[[], tuple[int, int]] = lambda: (0, 1),
    ) -> None:
        self.table = table
        # ApplySettings (revision, settings JSON, replicas; raises MotorError, applying nothing),
        # and the (settings revision, replicas) in force; None: ApplySettings is UNIMPLEMENTED.
        self._apply_settings = apply_settings
        self._settings_state = settings_state
        # The engines' metrics (None: collection is off) and this Coordinator's own exposition.
        self._engine_metrics = engine_metrics
        self._own_metrics = own_metrics
        # Legs in flight per instance id, every process serving HTTP counted, and how many
        # workers have not reported since a given revision (DrainInstances).
        self._legs = legs
        self.drain_grace_s = drain_grace_s  # coordinator.drain_grace_s: a reload changes it
        # The inference worker processes; None when this process serves HTTP itself.
        self._pool = pool
        # Makes the inference workers (and readiness) follow a new state, or, given None, makes
        # sure they hold the table's own; raises MotorError when they could not.
        self._route_by = route_by
        # Drops the precision-detection state of group (p, d); True when there was some.
        self._dismiss_precision = dismiss_precision
        # The highest Controller leader term seen on a push (0: none yet, or no HA).
        self.leader_term = 0
        # One write at a time: each is drafted on the table the previous one committed.
        self._writing = asyncio.Lock()

    def _fence(self, rpc: str, term: int | None) -> None:
        """Refuse a push from a Controller whose leadership is older than one already seen: a
        paused or cut-off old leader must never overwrite what the new one pushed. A push
        without a term (one Controller on SQLite, ``motor register``) is not fenced."""
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

    async def _write(
        self,
        rpc: str,
        context: grpc.aio.ServicerContext,
        change: Callable[[RoutingTable], bool],
        resp_cls: Callable[..., R],
    ) -> R:
        # Shielded: a caller that gives up (its deadline) must not stop a write halfway, with
        # the workers holding a state the table never took; it ends as if the caller had waited.
        # So the call's metadata is read now, while the call is sure to be alive.
        write = asyncio.ensure_future(self._write_now(rpc, _term_of(context), change, resp_cls))
        try:
            return await asyncio.shield(write)
        except asyncio.CancelledError:
            write.add_done_callback(lambda done: _unwatched(rpc, done))
            raise

    async def _write_now(
        self,
        rpc: str,
        term: int | None,
        change: Callable[[RoutingTable], bool],
        resp_cls: Callable[..., R],
    ) -> R:
        async with self._writing:
            # Fenced under the lock: a write that waited here must not land after a newer leader's.
            self._fence(rpc, term)
            draft = self.table.draft()
            changed = change(draft)  # a refused request raises here, changing nothing
            # The workers first, then the table ListInstances shows: an instance listed is one
            # every worker routes to. Called for an unchanged table too: a retried write must
            # still wait for inference workers that missed it. When they fail, nothing changed.
            await self._route_by(draft.state if changed else None)
            if changed:
                self.table.commit(draft.state)
                log.event(
                    "table_changed",
                    rpc=rpc,
                    revision=draft.state.revision,
                    instances=len(draft.state.instances),
                )
            state = self.table.state
        return resp_cls(
            revision=state.revision, instance_count=len(state.instances), incarnation=self.table.incarnation
        )

    async def SetInstances(
        self, request: pb.SetInstancesRequest, context: grpc.aio.ServicerContext
    ) -> pb.SetInstancesResponse:
        return await self._write(
            "SetInstances", context, lambda t: t.set(request.instances), pb.SetInstancesResponse
        )

    async def AddInstances(
        self, request: pb.AddInstancesRequest, context: grpc.aio.ServicerContext
    ) -> pb.AddInstancesResponse:
        return await self._write(
            "AddInstances", context, lambda t: t.add(request.instances), pb.AddInstancesResponse
        )

    async def DeleteInstances(
        self, request: pb.DeleteInstancesRequest, context: grpc.aio.ServicerContext
    ) -> pb.DeleteInstancesResponse:
        return await self._write(
            "DeleteInstances", context, lambda t: t.delete(request.instances), pb.DeleteInstancesResponse
        )

    async def PauseInstances(
        self, request: pb.PauseInstancesRequest, context: grpc.aio.ServicerContext
    ) -> pb.PauseInstancesResponse:
        return await self._write(
            "PauseInstances", context, lambda t: t.pause(request.ids), pb.PauseInstancesResponse
        )

    async def ResumeInstances(
        self, request: pb.ResumeInstancesRequest, context: grpc.aio.ServicerContext
    ) -> pb.ResumeInstancesResponse:
        return await self._write(
            "ResumeInstances", context, lambda t: t.resume(request.ids), pb.ResumeInstancesResponse
        )

    async def GetEngineMetrics(
        self, request: pb.GetEngineMetricsRequest, context: grpc.aio.ServicerContext
    ) -> pb.GetEngineMetricsResponse:
        source = self._engine_metrics
        if source is None:
            raise errors.precondition(
                "ENGINE_METRICS_OFF",
                "coordinator.engine_metrics_interval_s",
                "engine metrics collection is off (coordinator.engine_metrics_interval_s = 0)",
            )
        view = _VIEWS.get(request.view, "full")
        role = ROLE_NAMES.get(request.role, "")
        snap, families = await source.protos(view, role)
        resp = pb.GetEngineMetricsResponse(families=families)
        now = time.time()
        for e in sorted(source.endpoints(snap), key=lambda e: (e.instance_id, e.dp_rank, e.host, e.port)):
            if role and e.role != role:
                continue
            entry = resp.engines.add(
                instance_id=e.instance_id,
                role=ROLES_BY_NAME.get(e.role, 0),
                host=e.host,
                port=e.port,
                dp_rank=e.dp_rank,
                error=e.error,
                fresh=e.fresh(now, snap.stale_s),
            )
            if e.ok_at:
                entry.last_success_time.FromNanoseconds(int(e.ok_at * 1e9))
        if snap.seq:
            resp.collect_time.FromNanoseconds(int(snap.at * 1e9))
        if request.include_coordinator and self._own_metrics is not None:
            text = await self._own_metrics()
            resp.coordinator_families.extend(await asyncio.to_thread(_own_families, text))
        return resp

    async def ListInstances(
        self, request: pb.CoordinatorListInstancesRequest, context: grpc.aio.ServicerContext
    ) -> pb.CoordinatorListInstancesResponse:
        state = self.table.state
        available, unavailable, paused = state.groups()
        revision, replicas = self._settings_state()
        return pb.CoordinatorListInstancesResponse(
            available=available,
            unavailable=unavailable,
            paused=paused,
            revision=state.revision,
            incarnation=self.table.incarnation,
            inference_workers=self._pool.count if self._pool is not None else 1,
            inference_workers_serving=len(self._pool.hub.serving()) if self._pool is not None else 1,
            draining_ids=sorted(state.draining),
            settings_revision=revision,
            replicas=replicas,
        )

    async def DrainInstances(
        self, request: pb.DrainInstancesRequest, context: grpc.aio.ServicerContext
    ) -> pb.DrainInstancesResponse:
        """A write like Pause (the workers take the new table first), answered with each
        instance's deadline and the legs still on it."""
        grace = (
            request.grace.ToTimedelta().total_seconds() if request.HasField("grace") else self.drain_grace_s
        )
        now = time.time()
        ids = list(request.ids)
        written = await self._write(
            "DrainInstances", context, lambda t: t.drain(ids, grace, now), _drain_response
        )
        state = self.table.state
        drains = [state.draining.get(iid) for iid in ids]
        legs, behind = self._legs(max((d.revision for d in drains if d is not None), default=0))
        resp = pb.DrainInstancesResponse(revision=written.revision, incarnation=written.incarnation)
        for iid, drain in zip(ids, drains, strict=True):
            # A worker that has not reported since it took the drain may still have sent a
            # request there: counted as one until it has.
            entry = resp.drains.add(instance_id=iid, requests_in_flight=legs.get(iid, 0) + behind)
            if drain is not None:  # None: the instance came back with other engines meanwhile
                entry.move_time.FromNanoseconds(int(drain.move_at * 1e9))
        began = [
            iid
            for iid, d in zip(ids, drains, strict=True)
            if d is not None and d.revision == written.revision
        ]
        if began:  # one line when a drain begins, not one per poll
            log.event("instances_draining", ids=",".join(map(str, began)), grace_s=grace)
        return resp

    async def ApplySettings(
        self, request: pb.ApplySettingsRequest, context: grpc.aio.ServicerContext
    ) -> pb.ApplySettingsResponse:
        """The Controller's settings and replicas (docs/configuration-reload.md), applied whole
        or not at all by the Coordinator (app.py ``apply_settings``). Fenced like the table's
        writes: an older leader's push never undoes a newer one's."""
        if self._apply_settings is None:
            raise errors.unimplemented("ApplySettings")
        self._fence("ApplySettings", _term_of(context))
        # Shielded like a table write: a caller that gives up must not leave the workers on
        # settings the Coordinator does not say it runs by.
        apply = asyncio.ensure_future(
            self._apply_settings(request.settings_revision, request.settings_json, request.replicas)
        )
        try:
            await asyncio.shield(apply)
        except asyncio.CancelledError:
            apply.add_done_callback(lambda done: _unwatched("ApplySettings", done))
            raise
        revision, replicas = self._settings_state()
        return pb.ApplySettingsResponse(
            settings_revision=revision, replicas=replicas, incarnation=self.table.incarnation
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


def _drain_response(revision: int, instance_count: int, incarnation: str) -> pb.DrainInstancesResponse:
    return pb.DrainInstancesResponse(revision=revision, incarnation=incarnation)


def _unwatched(rpc: str, write: asyncio.Future[Any]) -> None:
    """The end of a write whose caller went away, logged here as nobody else sees it: a refusal
    in one line (it was the write's answer), a bug with its traceback."""
    if write.cancelled():
        return
    method = f"/motor.v1.Coordinator/{rpc}"
    try:
        write.result()
    except errors.MotorError as err:
        log.warn("rpc_refused", method=method, caller="gone", code=err.code.name, message=err.message)
    except Exception:
        log.exception("rpc_failed", method=method, caller="gone")


def _term_of(context: grpc.aio.ServicerContext) -> int | None:
    for key, value in context.invocation_metadata() or ():
        if key == LEADER_TERM_METADATA:
            try:
                return int(value)
            except (TypeError, ValueError):
                raise errors.bad_request([(LEADER_TERM_METADATA, "must be a decimal integer")]) from None
    return None
