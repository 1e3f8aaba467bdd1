"""Test doubles around the Controller: NodeManager servers, a Coordinator server, a NodeManager's
client side (register + heartbeat stream) and an in-process Controller."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, TypeVar

import grpc

from motor_mesh.common import errors
from motor_mesh.common.config import ControllerConfig, load
from motor_mesh.common.rpc import service_handler
from motor_mesh.common.server import MotorServer
from motor_mesh.controller.app import Controller
from motor_mesh.controller.instances import InstanceTable
from motor_mesh.controller.model import Instance, Removal
from motor_mesh.gen.motor.v1 import (
    common_pb2,
    controller_pb2,
    controller_pb2_grpc,
    coordinator_pb2,
    coordinator_pb2_grpc,
    nodemanager_pb2,
    nodemanager_pb2_grpc,
)
from tests.poll import until

R = TypeVar("R")
NORMAL = common_pb2.ENDPOINT_STATUS_NORMAL
WAIT = common_pb2.ENDPOINT_STATUS_WAIT_TO_START
ABNORMAL = common_pb2.ENDPOINT_STATUS_ABNORMAL
EP_PAUSED = common_pb2.ENDPOINT_STATUS_PAUSED
ACTIVE = common_pb2.INSTANCE_STATUS_ACTIVE
INITIAL = common_pb2.INSTANCE_STATUS_INITIAL
INACTIVE = common_pb2.INSTANCE_STATUS_INACTIVE
PAUSED = common_pb2.INSTANCE_STATUS_PAUSED
DELETED = common_pb2.INSTANCE_STATUS_DELETED


# ---- the two sides of the Controller → Coordinator contract --------------------------------------

# A channel of its own, not sharing a connection (or a reconnect backoff) with any other.
FRESH = [("grpc.use_local_subchannel_pool", 1)]
# An instance as both sides name it: id, job, role and endpoints.
Identity = tuple[int, str, int, tuple[tuple[str, int], ...]]


def identity(i: common_pb2.Instance) -> Identity:
    return (i.id, i.job_name, i.role, tuple(sorted((e.host, e.port) for e in i.endpoints)))


def controller_side(instances: Iterable[common_pb2.Instance]) -> tuple[set[Identity], set[int]]:
    """What a Coordinator must hold, from the Controller's ListInstances: its ACTIVE and PAUSED
    instances, and which of them are paused."""
    routable = [i for i in instances if i.status in (ACTIVE, PAUSED)]
    return {identity(i) for i in routable}, {i.id for i in routable if i.status == PAUSED}


async def coordinator_side(address: str) -> tuple[set[Identity], set[int]]:
    """What the Coordinator at ``address`` holds, from its ListInstances: every instance
    (available, unavailable or paused), and the paused ones."""
    async with grpc.aio.insecure_channel(address, options=FRESH) as ch:
        stub = coordinator_pb2_grpc.CoordinatorStub(ch)
        r = await stub.ListInstances(coordinator_pb2.CoordinatorListInstancesRequest(), timeout=5)
    held = {identity(i) for group in (r.available, r.unavailable, r.paused) for i in group}
    return held, {i.id for i in r.paused}


# ---- NodeManager server ------------------------------------------------------------------------


def kv_ports(port: int) -> dict[str, int]:
    """The KV event ports a NodeManager reports for an engine at ``port`` (its default ones)."""
    return {"kv_events_port": port + 2000, "kv_events_replay_port": port + 2001}


class FakeNodeManager(nodemanager_pb2_grpc.NodeManagerServicer):
    """Records StartEngines, RestartEngines and Stop; answers GetStatus with ``ready`` (False:
    like a NodeManager whose engines are not up), or with ``status_error`` when set."""

    def __init__(self) -> None:
        self.starts: list[nodemanager_pb2.StartEnginesRequest] = []
        self.fail_starts = 0  # answer the next N StartEngines with ``start_error``
        self.start_error = errors.error_info(grpc.StatusCode.INTERNAL, "LAUNCH_FAILED", "test: launch failed")
        self.restarts: list[int] = []  # RestartAction of every RestartEngines, in order
        self.restart_error: errors.MotorError | None = None  # answer every RESTART with it
        self.restart_errors: list[errors.MotorError] = []  # answer the next RESTARTs with these
        self.relaunches = 0  # RESTARTs accepted (GetStatus relaunch_count)
        self.restart_delay = 0.0  # seconds between accepting a RESTART and answering it
        self.stops: list[str] = []  # reasons
        self.stopped_at: list[float] = []  # monotonic, to tell which NodeManager stopped first
        self.stop_delay = 0.0  # seconds Stop takes to answer
        self.ready = False
        self.status_error: errors.MotorError | None = None
        self.incarnation = 0  # what GetStatus says this process is
        self.engines_dead = False  # GetStatus: every engine ABNORMAL with no process
        self.instance_id = 0  # what GetStatus says it serves (0: not known)
        # SwitchRole: the role served (from StartEngines, then each switch), the roles of the
        # switches that relaunched, the error to answer them with, and how long one takes.
        self.role: int = common_pb2.ROLE_UNSPECIFIED
        self.switched: list[int] = []
        self.switch_calls = 0
        self.switch_error: errors.MotorError | None = None
        self.switch_delay = 0.0
        self.server: MotorServer | None = None
        self.host = "127.0.0.1"
        self.port = 0

    async def StartEngines(
        self, req: nodemanager_pb2.StartEnginesRequest, ctx: grpc.aio.ServicerContext
    ) -> nodemanager_pb2.StartEnginesResponse:
        self.starts.append(req)
        self.role = req.role
        if self.fail_starts:
            self.fail_starts -= 1
            raise self.start_error
        return nodemanager_pb2.StartEnginesResponse(
            endpoints=[
                common_pb2.Endpoint(
                    id=e.id,
                    host=e.host,
                    port=e.port,
                    pid=40000 + e.id,
                    status=common_pb2.ENDPOINT_STATUS_INITIAL,
                    **kv_ports(e.port),
                )
                for e in req.endpoints
            ]
        )

    async def GetStatus(
        self, req: nodemanager_pb2.GetStatusRequest, ctx: grpc.aio.ServicerContext
    ) -> nodemanager_pb2.GetStatusResponse:
        if self.status_error is not None:
            raise self.status_error
        if self.engines_dead:
            cmd = self.starts[-1] if self.starts else nodemanager_pb2.StartEnginesRequest()
            dead = [
                common_pb2.Endpoint(id=e.id, status=common_pb2.ENDPOINT_STATUS_ABNORMAL)
                for e in cmd.endpoints
            ]
            return nodemanager_pb2.GetStatusResponse(
                ready=False,
                endpoints=dead,
                incarnation=self.incarnation,
                relaunch_count=self.relaunches,
                instance_id=self.instance_id,
                role=self.role,  # type: ignore[arg-type]
            )
        if not self.ready:
            # Engines loading (WAIT_TO_START), as a NodeManager reports them after a start or
            # a relaunch.
            cmd = self.starts[-1] if self.starts else nodemanager_pb2.StartEnginesRequest()
            loading = [
                common_pb2.Endpoint(
                    id=e.id, pid=50000 + e.id, status=common_pb2.ENDPOINT_STATUS_WAIT_TO_START
                )
                for e in cmd.endpoints
            ]
            return nodemanager_pb2.GetStatusResponse(
                ready=False,
                endpoints=loading,
                incarnation=self.incarnation,
                relaunch_count=self.relaunches,
                instance_id=self.instance_id,
                role=self.role,  # type: ignore[arg-type]
            )
        # Ready: the engines of the last start command, NORMAL, with pids of a relaunch.
        cmd = self.starts[-1] if self.starts else nodemanager_pb2.StartEnginesRequest()
        endpoints = [
            common_pb2.Endpoint(
                id=e.id,
                host=e.host,
                port=e.port,
                pid=50000 + e.id,
                status=common_pb2.ENDPOINT_STATUS_NORMAL,
                **kv_ports(e.port),
            )
            for e in cmd.endpoints
        ]
        return nodemanager_pb2.GetStatusResponse(
            ready=True,
            endpoints=endpoints,
            incarnation=self.incarnation,
            relaunch_count=self.relaunches,
            instance_id=self.instance_id,
            role=self.role,  # type: ignore[arg-type]
        )

    async def SwitchRole(
        self, req: nodemanager_pb2.SwitchRoleRequest, ctx: grpc.aio.ServicerContext
    ) -> nodemanager_pb2.SwitchRoleResponse:
        """Like a NodeManager: the role it serves already changes nothing; another relaunches."""
        self.switch_calls += 1
        if self.switch_error is not None:
            raise self.switch_error
        if req.role == self.role:
            return nodemanager_pb2.SwitchRoleResponse(role=req.role, relaunch_count=self.relaunches)
        self.role = req.role
        self.relaunches += 1
        self.switched.append(req.role)
        await asyncio.sleep(self.switch_delay)  # relaunched, the answer not sent yet
        return nodemanager_pb2.SwitchRoleResponse(
            role=req.role, switched=True, relaunch_count=self.relaunches
        )

    async def RestartEngines(
        self, req: nodemanager_pb2.RestartEnginesRequest, ctx: grpc.aio.ServicerContext
    ) -> nodemanager_pb2.RestartEnginesResponse:
        self.restarts.append(req.action)
        if req.action == nodemanager_pb2.RESTART_ACTION_RESTART:
            if self.restart_errors:
                raise self.restart_errors.pop(0)
            if self.restart_error is not None:
                raise self.restart_error
            self.relaunches += 1
            await asyncio.sleep(self.restart_delay)  # relaunched, the answer not sent yet
        return nodemanager_pb2.RestartEnginesResponse(relaunch_count=self.relaunches)

    async def Pause(
        self, req: nodemanager_pb2.PauseRequest, ctx: grpc.aio.ServicerContext
    ) -> nodemanager_pb2.PauseResponse:
        return nodemanager_pb2.PauseResponse()

    async def Resume(
        self, req: nodemanager_pb2.ResumeRequest, ctx: grpc.aio.ServicerContext
    ) -> nodemanager_pb2.ResumeResponse:
        return nodemanager_pb2.ResumeResponse()

    async def Stop(
        self, req: nodemanager_pb2.StopRequest, ctx: grpc.aio.ServicerContext
    ) -> nodemanager_pb2.StopResponse:
        self.stops.append(req.reason)
        self.stopped_at.append(time.monotonic())
        await asyncio.sleep(self.stop_delay)  # engines slow to stop
        return nodemanager_pb2.StopResponse()

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> FakeNodeManager:
        """``port``: the address of a NodeManager that died, for its successor."""
        cfg = load(None, env={}, overrides={"nodemanager": {"host": host}}).nodemanager
        self.server = MotorServer(
            "nodemanager",
            cfg,
            [(nodemanager_pb2.DESCRIPTOR.services_by_name["NodeManager"], self)],
            port=port,
        )
        self.host, self.port = host, await self.server.start()
        return self

    async def stop(self) -> None:
        if self.server is not None:
            await self.server.stop()


# ---- Coordinator server ------------------------------------------------------------------------


class FakeCoordinator(coordinator_pb2_grpc.CoordinatorServicer):
    """A Coordinator's management table, recording every call; can fail the next N calls, refuse
    every call with a code, or take calls and never answer. ``health=False``: a server without
    the health service (Watch answers UNIMPLEMENTED)."""

    def __init__(self, health: bool = True) -> None:
        self.calls: list[tuple[str, Any, bool]] = []  # (method, request, succeeded)
        self.table: dict[int, common_pb2.Instance] = {}
        self.paused: set[int] = set()
        self.fail_next = 0
        self.refuse: grpc.StatusCode | None = None  # answer every call with this code while set
        self.hang = False  # take every call and never answer (until the caller gives up)
        self.hung: list[str] = []  # methods of the calls taken while hanging
        self.on_answer: Callable[[str], None] | None = None  # runs as a call succeeds (method)
        self.incarnation = uuid.uuid4().hex
        self.revision = 0
        self.health = health
        self.server: MotorServer | grpc.aio.Server | None = None
        self.port = 0
        self.clears: list[tuple[int, int]] = []  # (p, d) of every ClearPrecisionAlarm taken
        self.refuse_clears = 0  # answer the next N ClearPrecisionAlarm with UNAVAILABLE
        # DrainInstances, as the Coordinator answers it: requests in flight per instance (set
        # by the test: it is what the drain waits for), the deadline of each drained one (the
        # first call's time + drain_grace_s), and UNIMPLEMENTED like a Coordinator older than it.
        self.in_flight: dict[int, int] = {}
        self.drain_grace_s = 30.0
        self.draining: dict[int, float] = {}
        self.drain_unimplemented = False
        # ApplySettings as taken (they are not in ``calls``: the table tests count those), and
        # the code to refuse it with while set (UNIMPLEMENTED: a Coordinator older than it).
        self.settings: list[coordinator_pb2.ApplySettingsRequest] = []
        self.refuse_settings: grpc.StatusCode | None = None
        # What GetEngineMetrics answers (the planner's signals), set by the test.
        self.engine_metrics = coordinator_pb2.GetEngineMetricsResponse()

    def restart_state(self) -> None:
        """What a restarted Coordinator looks like: empty table, new incarnation."""
        self.table.clear()
        self.paused.clear()
        self.incarnation = uuid.uuid4().hex

    async def _enter(self, method: str, req: Any) -> None:
        if self.hang:
            self.calls.append((method, req, False))
            self.hung.append(method)
            await asyncio.Event().wait()  # until gRPC cancels the handler (deadline, stop)
        if self.refuse is not None:
            self.calls.append((method, req, False))
            raise errors.error_info(self.refuse, "TEST_REFUSED", f"test: {method} refused")
        if self.fail_next > 0:
            self.fail_next -= 1
            self.calls.append((method, req, False))
            # INTERNAL, not UNAVAILABLE: the channel's retry policy would hide UNAVAILABLE.
            raise errors.error_info(grpc.StatusCode.INTERNAL, "TEST_FAILURE", f"test: {method} failed")

    def _ok(self, method: str, req: Any, cls: Callable[..., R]) -> R:
        self.calls.append((method, req, True))
        if self.on_answer is not None:
            self.on_answer(method)
        self.revision += 1
        return cls(revision=self.revision, instance_count=len(self.table), incarnation=self.incarnation)

    def ok_calls(self, method: str | None = None) -> list[Any]:
        return [r for m, r, ok in self.calls if ok and (method is None or m == method)]

    def count(self, method: str, ok: bool | None = None) -> int:
        return sum(1 for m, _, good in self.calls if m == method and (ok is None or good == ok))

    async def SetInstances(
        self, req: coordinator_pb2.SetInstancesRequest, ctx: grpc.aio.ServicerContext
    ) -> coordinator_pb2.SetInstancesResponse:
        await self._enter("Set", req)
        self.table = {i.id: i for i in req.instances}
        self.paused = {i.id for i in req.instances if i.status == PAUSED}
        return self._ok("Set", req, coordinator_pb2.SetInstancesResponse)

    async def AddInstances(
        self, req: coordinator_pb2.AddInstancesRequest, ctx: grpc.aio.ServicerContext
    ) -> coordinator_pb2.AddInstancesResponse:
        await self._enter("Add", req)
        for i in req.instances:
            self.table[i.id] = i
            if i.status == PAUSED:  # like the Coordinator's table: stored paused is paused
                self.paused.add(i.id)
        return self._ok("Add", req, coordinator_pb2.AddInstancesResponse)

    async def DeleteInstances(
        self, req: coordinator_pb2.DeleteInstancesRequest, ctx: grpc.aio.ServicerContext
    ) -> coordinator_pb2.DeleteInstancesResponse:
        await self._enter("Delete", req)
        for i in req.instances:
            if i.id not in self.table:
                self.calls.append(("Delete", req, False))
                raise errors.not_found("instance", str(i.id))
        for i in req.instances:
            del self.table[i.id]
            self.paused.discard(i.id)
            self.draining.pop(i.id, None)
        return self._ok("Delete", req, coordinator_pb2.DeleteInstancesResponse)

    async def PauseInstances(
        self, req: coordinator_pb2.PauseInstancesRequest, ctx: grpc.aio.ServicerContext
    ) -> coordinator_pb2.PauseInstancesResponse:
        await self._enter("Pause", req)
        self.paused |= set(req.ids)
        return self._ok("Pause", req, coordinator_pb2.PauseInstancesResponse)

    async def ResumeInstances(
        self, req: coordinator_pb2.ResumeInstancesRequest, ctx: grpc.aio.ServicerContext
    ) -> coordinator_pb2.ResumeInstancesResponse:
        await self._enter("Resume", req)
        self.paused -= set(req.ids)
        return self._ok("Resume", req, coordinator_pb2.ResumeInstancesResponse)

    async def ListInstances(
        self, req: coordinator_pb2.CoordinatorListInstancesRequest, ctx: grpc.aio.ServicerContext
    ) -> coordinator_pb2.CoordinatorListInstancesResponse:
        return coordinator_pb2.CoordinatorListInstancesResponse(
            available=[i for k, i in self.table.items() if k not in self.paused],
            paused=[i for k, i in self.table.items() if k in self.paused],
            revision=self.revision,
            incarnation=self.incarnation,
        )

    async def ClearPrecisionAlarm(
        self, req: coordinator_pb2.ClearPrecisionAlarmRequest, ctx: grpc.aio.ServicerContext
    ) -> coordinator_pb2.ClearPrecisionAlarmResponse:
        if self.refuse_clears > 0:
            self.refuse_clears -= 1
            raise errors.unavailable("test: refusing ClearPrecisionAlarm")
        self.clears.append((req.p_instance_id, req.d_instance_id))
        return coordinator_pb2.ClearPrecisionAlarmResponse(dismissed=True)

    async def DrainInstances(
        self, req: coordinator_pb2.DrainInstancesRequest, ctx: grpc.aio.ServicerContext
    ) -> coordinator_pb2.DrainInstancesResponse:
        await self._enter("Drain", req)
        if self.drain_unimplemented:
            self.calls.append(("Drain", req, False))
            raise errors.unimplemented("DrainInstances")
        missing = [i for i in req.ids if i not in self.table]
        if missing:
            self.calls.append(("Drain", req, False))
            raise errors.not_found("instance", str(missing[0]))
        now = time.time()
        grace = req.grace.ToNanoseconds() / 1e9 if req.HasField("grace") else self.drain_grace_s
        resp = coordinator_pb2.DrainInstancesResponse(revision=self.revision, incarnation=self.incarnation)
        for iid in req.ids:
            move_at = self.draining.setdefault(iid, now + grace)
            entry = resp.drains.add(instance_id=iid, requests_in_flight=self.in_flight.get(iid, 0))
            entry.move_time.FromNanoseconds(int(move_at * 1e9))
        self.calls.append(("Drain", req, True))
        return resp

    async def GetEngineMetrics(
        self, req: coordinator_pb2.GetEngineMetricsRequest, ctx: grpc.aio.ServicerContext
    ) -> coordinator_pb2.GetEngineMetricsResponse:
        return self.engine_metrics

    async def ApplySettings(
        self, req: coordinator_pb2.ApplySettingsRequest, ctx: grpc.aio.ServicerContext
    ) -> coordinator_pb2.ApplySettingsResponse:
        if self.refuse_settings is not None:
            raise errors.error_info(self.refuse_settings, "TEST_REFUSED", "test: ApplySettings refused")
        self.settings.append(req)
        return coordinator_pb2.ApplySettingsResponse(
            settings_revision=req.settings_revision, replicas=req.replicas, incarnation=self.incarnation
        )

    async def start(self, port: int = 0) -> FakeCoordinator:
        descriptor = coordinator_pb2.DESCRIPTOR.services_by_name["Coordinator"]
        if not self.health:
            server = grpc.aio.server()
            server.add_generic_rpc_handlers((service_handler(descriptor, self),))
            self.port = server.add_insecure_port(f"127.0.0.1:{port}")
            await server.start()
            self.server = server
            return self
        cfg = load(None, env={}, overrides={}).coordinator
        self.server = MotorServer("coordinator", cfg, [(descriptor, self)], port=port)
        self.port = await self.server.start()
        return self

    async def stop(self) -> None:
        if isinstance(self.server, MotorServer):
            await self.server.stop()
        elif self.server is not None:
            await self.server.stop(0.2)
        self.server = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"


# ---- a NodeManager's client side ---------------------------------------------------------------


class NodeAgent:
    """Registers like a NodeManager and drives its heartbeat stream by hand."""

    def __init__(
        self,
        target: str,
        *,
        job: str,
        nm: FakeNodeManager | None = None,
        nm_port: int = 0,
        host: str = "127.0.0.1",
        ports: tuple[int, ...] = (10000,),
        role: int = common_pb2.ROLE_PREFILL,
        dp: int = 1,
        nnodes: int = 1,
        node_rank: int = 0,
        model: str = "motor-sim",
        engine_type: int = common_pb2.ENGINE_TYPE_SIM,
        device_count: int = 0,
        incarnation: int = 0,
    ) -> None:
        self.channel = grpc.aio.insecure_channel(target)
        self.stub = controller_pb2_grpc.ControllerStub(self.channel)
        self.nm = nm
        self.request = controller_pb2.RegisterRequest(
            job_name=job,
            role=role,  # type: ignore[arg-type]
            model_name=model,
            engine_type=engine_type,  # type: ignore[arg-type]
            host=nm.host if nm else host,
            nm_port=nm.port if nm else nm_port,
            ports=list(ports),
            device_count=device_count,
            parallel=common_pb2.ParallelConfig(
                dp=dp, tp=nnodes, pp=1, ep=1, nnodes=nnodes
            ),  # tp splits over the nodes
            node_rank=node_rank,
            incarnation=incarnation,
        )
        self.node_id = 0
        self.epoch = 0
        self.instance_id = 0
        self.call: Any = None
        self.seq = 0

    async def register(self, instance_id: int = 0) -> controller_pb2.RegisterResponse:
        req = controller_pb2.RegisterRequest()
        req.CopyFrom(self.request)
        req.instance_id = instance_id
        resp = await self.stub.Register(req, timeout=5)
        self.node_id, self.epoch = resp.node_id, resp.session_epoch
        self.instance_id = resp.instance_id or self.instance_id
        return resp

    def open(self) -> None:
        self.call = self.stub.Heartbeat()

    async def send(self, req: controller_pb2.HeartbeatRequest) -> controller_pb2.HeartbeatResponse:
        if self.call is None:
            self.open()
        await self.call.write(req)
        resp = await asyncio.wait_for(self.call.read(), 5)
        assert resp is not grpc.aio.EOF, "stream ended"
        return resp

    async def beat(self, *statuses: int, pids: tuple[int, ...] = ()) -> controller_pb2.HeartbeatResponse:
        """One beat; endpoint i of this node (ids from its StartEngines) gets ``statuses[i]``."""
        self.seq += 1
        ids = [e.id for e in self.nm.starts[-1].endpoints] if self.nm and self.nm.starts else []
        eps = [
            common_pb2.Endpoint(
                id=ids[i] if i < len(ids) else i,
                port=self.request.ports[i],
                status=s,  # type: ignore[arg-type]
                pid=pids[i] if i < len(pids) else 40000 + (ids[i] if i < len(ids) else i),
                **kv_ports(self.request.ports[i]),
            )
            for i, s in enumerate(statuses)
        ]
        beat = controller_pb2.Beat(
            node_id=self.node_id, session_epoch=self.epoch, seq=self.seq, endpoints=eps
        )
        return await self.send(controller_pb2.HeartbeatRequest(beat=beat))

    async def event(
        self, endpoint_id: int, pid: int, kind: int = controller_pb2.ENGINE_EVENT_TYPE_DEAD
    ) -> Any:
        self.seq += 1
        ev = controller_pb2.EngineEvent(
            endpoint_id=endpoint_id,
            pid=pid,
            type=kind,  # type: ignore[arg-type]
            detail="test",
            seq=self.seq,
            node_id=self.node_id,
            session_epoch=self.epoch,
        )
        return await self.send(controller_pb2.HeartbeatRequest(engine_event=ev))

    def drop_stream(self) -> None:
        if self.call is not None:
            self.call.cancel()
            self.call = None

    async def close(self) -> None:
        self.drop_stream()
        await self.channel.close()


# ---- an in-process Controller ------------------------------------------------------------------


class Harness:
    def __init__(self, controller: Controller, server: MotorServer) -> None:
        self.controller = controller
        self.server = server
        self.target = f"127.0.0.1:{server.port}"
        self.channel = grpc.aio.insecure_channel(self.target)
        self.stub = controller_pb2_grpc.ControllerStub(self.channel)
        self.agents: list[NodeAgent] = []

    def agent(self, **kw: Any) -> NodeAgent:
        a = NodeAgent(self.target, **kw)
        self.agents.append(a)
        return a

    async def start_node(self, nm: FakeNodeManager, status: int = NORMAL, **kw: Any) -> NodeAgent:
        """An agent for ``nm`` registered, its engines started, and one beat with ``status``."""
        agent = self.agent(nm=nm, **kw)
        seen = len(nm.starts)
        await agent.register()
        await until(lambda: len(nm.starts) > seen)
        await agent.beat(status)
        return agent

    async def instances(self, **kw: Any) -> list[common_pb2.Instance]:
        resp = await self.stub.ListInstances(controller_pb2.ListInstancesRequest(**kw), timeout=5)
        return list(resp.instances)


def controller_cfg(state_dir: Path, **overrides: Any) -> ControllerConfig:
    base = {
        "port": 0,
        "state_dir": str(state_dir),
        "coordinators": [],
        "coordinator_set_sync_interval_s": 3600,
    }
    return load(None, env={}, overrides={"controller": {**base, **overrides}}).controller


@asynccontextmanager
async def running_controller(
    state_dir: Path, *, coordinator_alarm_after_s: float | None = None, **overrides: Any
) -> AsyncIterator[Harness]:
    kw = {} if coordinator_alarm_after_s is None else {"coordinator_alarm_after_s": coordinator_alarm_after_s}
    controller = Controller(controller_cfg(state_dir, **overrides), **kw)
    server = MotorServer(
        "controller",
        controller.cfg,
        [(controller_pb2.DESCRIPTOR.services_by_name["Controller"], controller.servicer)],
        port=0,
    )
    server.on_stop(controller.end_streams)
    await server.start()
    await controller.start()
    h = Harness(controller, server)
    try:
        yield h
    finally:
        for a in h.agents:
            await a.close()
        await h.channel.close()
        await server.stop()
        await controller.stop()


async def delete(table: InstanceTable, inst: Instance, reason: Removal = Removal.HEARTBEAT_TIMEOUT) -> None:
    """Delete the instance at once, the way the instance reconcile does a doomed one."""
    await table.doom(inst, reason)
    await table.remove(inst)
