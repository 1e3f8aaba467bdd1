"""The NodeManager's connection to the Controller: ``Register`` and the ``Heartbeat`` stream.

Registration gives up for good (the node exits 1) only on a request that can never be accepted:
INVALID_ARGUMENT, UNAUTHENTICATED, PERMISSION_DENIED. Everything else is retried, 1 s doubling to
30 s with jitter: ALREADY_EXISTS too, because it means the node's previous session has not timed
out yet. The stream stays open for the node's life: a beat every interval and at once on any
status change, an engine event the instant an engine dies; it reconnects after 0.2 s doubling to
2 s with jitter, and on ``DIRECTIVE_REREGISTER`` (or a STALE_SESSION refusal) registers again with
its instance id (the engines keep running).

Several Controllers (``controller`` lists them, or a ``dns:///`` name stands for them): both
calls go to the leader (:class:`~motor_mesh.common.leader_target.ControllerTarget`). A standby's
NOT_LEADER, a refused connection or a stream gone silent moves the link to the next Controller
at once, and a round over all of them that found no leader is followed by a short pause (0.2 s
to 0.5 s, not the backoffs above): a new leader hears from every node well within a heartbeat
interval of serving, and tells it to register again as a restarted Controller would.
"""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import AsyncIterator

import grpc

from motor_mesh.common import enums, errors, log, retry
from motor_mesh.common.config import NodeManagerConfig, read_key_file
from motor_mesh.common.leader_target import NOT_LEADER, ControllerTarget, moves_on
from motor_mesh.gen.motor.v1 import common_pb2, controller_pb2
from motor_mesh.nodemanager import launch
from motor_mesh.nodemanager.supervisor import EngineSupervisor

REGISTER_POLICY = retry.policy(
    {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED}
)
REGISTER_TIMEOUT_S = 5.0
DEFAULT_INTERVAL_S = 3.0
# No ack for this many beat intervals (and at least ACK_MIN_S): the stream is dead even if TCP
# has not noticed yet.
ACK_INTERVALS = 4
ACK_MIN_S = 10.0
# The pause between two rounds over several Controllers that found no leader.
SEARCH_BACKOFF = (0.2, 0.5)


class RegistrationRefused(Exception):
    """The Controller refused this node for good (exit 1)."""


class ControllerLink:
    def __init__(self, nm_cfg: NodeManagerConfig, nm_port: int, supervisor: EngineSupervisor) -> None:
        self.nm_cfg = nm_cfg
        self.nm_port = nm_port
        self.sup = supervisor
        key_file = nm_cfg.controller_key_file
        self.target = ControllerTarget(
            nm_cfg.controller,
            key=read_key_file(key_file) if key_file else None,
            tls=nm_cfg,
            max_message_bytes=nm_cfg.max_message_bytes,
            service="nodemanager",
            backoff=retry.Backoff(*SEARCH_BACKOFF),
        )
        self.node_id = 0
        self.session_epoch = 0
        self.interval_s = DEFAULT_INTERVAL_S
        self.relaunch_enabled = False
        self.registered = asyncio.Event()
        self._seq = 0
        self._wake = asyncio.Event()
        self._beat_wanted = False
        # Events not yet sent, and events sent but not acked (re-sent on a new stream).
        self._unsent: collections.deque[tuple[controller_pb2.EngineEvent, asyncio.Future[bool]]] = (
            collections.deque()
        )
        self._unacked: dict[int, tuple[controller_pb2.EngineEvent, asyncio.Future[bool]]] = {}
        self._last_rx = time.monotonic()
        self.connected = False  # a heartbeat stream is open and acking (/metrics)
        # The node is leaving (a SIGTERM drains its instance): beats go on, but a request to
        # register again ends the link instead, so it is never assembled into a new instance.
        self.leaving = False

    # --- the EventSink the supervisor reports to ---------------------------------------------

    def beat_now(self) -> None:
        self._beat_wanted = True
        self._wake.set()

    def engine_event(
        self, type_: controller_pb2.EngineEventType.ValueType, endpoint_id: int, pid: int, detail: str
    ) -> asyncio.Future[bool]:
        fut: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        ev = controller_pb2.EngineEvent(endpoint_id=endpoint_id, pid=pid, type=type_, detail=detail)
        self._unsent.append((ev, fut))
        self._wake.set()
        return fut

    # --- registration ------------------------------------------------------------------------

    def register_request(self) -> controller_pb2.RegisterRequest:
        # The role served now (a SwitchRole changes it), not the configured one: a stream that
        # reconnects after a switch registers the node as what its engines are.
        return register_request(
            self.nm_cfg, self.nm_port, self.sup.instance_id, self.sup.incarnation, self.sup.role
        )

    async def register(self) -> None:
        backoff = retry.Backoff(initial=1.0, maximum=30.0)
        self.registered.clear()
        while True:
            await self.target.resolve()
            req = self.register_request()
            address = self.target.address
            try:
                resp = await self.target.stub().Register(
                    req, timeout=REGISTER_TIMEOUT_S, wait_for_ready=False
                )
            except grpc.aio.AioRpcError as err:
                failure = errors.RpcFailure.of(err)
                if not REGISTER_POLICY.retryable(failure.code):
                    log.error("register_refused", code=failure.code.name, message=failure.message)
                    raise RegistrationRefused(str(failure)) from None
                wait = self._retry_delay(failure, backoff)
                # Going straight on to the next Controller is the search at work, not a failure.
                if wait:
                    log.warn(
                        "register_failed",
                        controller=address,
                        code=failure.code.name,
                        message=failure.message,
                        retry_in_s=round(wait, 2),
                    )
                await asyncio.sleep(wait)
                continue
            self.target.reached()
            self.node_id = resp.node_id
            self.session_epoch = resp.session_epoch
            self.interval_s = (
                resp.heartbeat_interval_ms / 1000 if resp.heartbeat_interval_ms else DEFAULT_INTERVAL_S
            )
            self.relaunch_enabled = resp.engine_relaunch_enabled
            if resp.instance_id and not self.sup.instance_id:
                self.sup.instance_id = resp.instance_id
            log.event(
                "registered",
                controller=self.target.address,
                node_id=self.node_id,
                session_epoch=self.session_epoch,
                instance_id=resp.instance_id,
                heartbeat_interval_ms=resp.heartbeat_interval_ms,
                engine_relaunch_enabled=self.relaunch_enabled,
            )
            self.registered.set()
            return

    # --- heartbeat stream --------------------------------------------------------------------

    async def run(self) -> None:
        """Register, then keep the stream open until cancelled. Raises RegistrationRefused."""
        await self.register()
        backoff = retry.Backoff(initial=0.2, maximum=2.0)
        while True:
            outcome, healthy, failure = await self._stream_once()
            if outcome == "reregister" and self.leaving:
                log.event("reregister_skipped", node_id=self.node_id, reason="leaving")
                return
            if outcome == "reregister":
                await self.register()
                backoff.reset()
                continue
            if healthy:
                backoff.reset()
            await asyncio.sleep(self._retry_delay(failure, backoff))

    def _retry_delay(self, failure: errors.RpcFailure | None, backoff: retry.Backoff) -> float:
        """How long to wait before the next try after ``failure`` (None: the Controller ended
        the stream itself). Not reaching the leader moves to the next Controller, at once or
        after the pause that ends a round; with a single Controller the link keeps ``backoff``.
        Any other failure is the leader's own answer: ``backoff`` too."""
        if failure is None or not moves_on(failure):
            if failure is not None:
                self.target.reached()
            return backoff.next()
        delay = self.target.failed(failure)
        if delay and not self.target.following:
            return backoff.next()
        return delay

    def _next_seq(self) -> int:
        self._seq += 1
        return self._seq

    def _beat(self) -> controller_pb2.HeartbeatRequest:
        self._beat_wanted = False
        return controller_pb2.HeartbeatRequest(
            beat=controller_pb2.Beat(
                node_id=self.node_id,
                session_epoch=self.session_epoch,
                seq=self._next_seq(),
                endpoints=self.sup.endpoints(),
            )
        )

    def _stamp(
        self, ev: controller_pb2.EngineEvent, fut: asyncio.Future[bool]
    ) -> controller_pb2.HeartbeatRequest:
        ev.seq = self._next_seq()
        ev.node_id = self.node_id
        ev.session_epoch = self.session_epoch
        self._unacked[ev.seq] = (ev, fut)
        return controller_pb2.HeartbeatRequest(engine_event=ev)

    async def _requests(self) -> AsyncIterator[controller_pb2.HeartbeatRequest]:
        # Events first: a death report must not wait behind anything.
        for seq in sorted(self._unacked):
            ev, fut = self._unacked.pop(seq)
            yield self._stamp(ev, fut)
        yield self._beat()
        next_beat = time.monotonic() + self.interval_s
        while True:
            left = next_beat - time.monotonic()
            if left > 0 and not self._wake.is_set():
                try:
                    await asyncio.wait_for(self._wake.wait(), left)
                except TimeoutError:
                    pass
            self._wake.clear()
            while self._unsent:
                ev, fut = self._unsent.popleft()
                yield self._stamp(ev, fut)
            if self._beat_wanted or time.monotonic() >= next_beat:
                yield self._beat()
                next_beat = time.monotonic() + self.interval_s

    def _on_ack(self, seq: int) -> None:
        # Acks arrive in order on one stream: an ack of N covers every event up to N.
        for s in [s for s in self._unacked if s <= seq]:
            _, fut = self._unacked.pop(s)
            if not fut.done():
                fut.set_result(True)

    async def _watchdog(
        self,
        call: grpc.aio.StreamStreamCall[controller_pb2.HeartbeatRequest, controller_pb2.HeartbeatResponse],
    ) -> None:
        limit = max(ACK_INTERVALS * self.interval_s, ACK_MIN_S)
        while True:
            await asyncio.sleep(min(limit / 4, 1.0))
            if time.monotonic() - self._last_rx > limit:
                log.warn("heartbeat_stream_silent", seconds=round(limit, 1))
                call.cancel()
                return

    async def _stream_once(self) -> tuple[str, bool, errors.RpcFailure | None]:
        """One stream's life: ("broken" | "reregister", whether it carried any ack, why it broke
        when the Controller did not end it itself)."""
        await self.target.resolve()
        address = self.target.address
        call = self.target.stub().Heartbeat(self._requests(), wait_for_ready=False)
        self._last_rx = time.monotonic()
        watchdog = asyncio.create_task(self._watchdog(call))
        healthy = False
        try:
            async for resp in call:
                self._last_rx = time.monotonic()
                kind = resp.WhichOneof("kind")
                if kind == "ack":
                    if not healthy:
                        self.target.reached()
                        log.event(
                            "heartbeat_stream_open", node_id=self.node_id, session_epoch=self.session_epoch
                        )
                    healthy = self.connected = True
                    self._on_ack(resp.ack.seq)
                elif kind == "directive" and resp.directive == enums.REREGISTER:
                    log.warn("reregister_requested", node_id=self.node_id, session_epoch=self.session_epoch)
                    call.cancel()
                    return "reregister", healthy, None
            log.warn("heartbeat_stream_ended", node_id=self.node_id)
            return "broken", healthy, None
        except grpc.aio.AioRpcError as err:
            failure = errors.RpcFailure.of(err)
            if failure.reason == "STALE_SESSION":
                log.warn("session_stale", node_id=self.node_id, message=failure.message)
                return "reregister", healthy, None
            # A standby's refusal is part of finding the leader, not a break.
            if failure.code != grpc.StatusCode.CANCELLED and failure.reason != NOT_LEADER:
                log.warn(
                    "heartbeat_stream_broken",
                    controller=address,
                    code=failure.code.name,
                    message=failure.message,
                )
            return "broken", healthy, failure
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                call.cancel()
                raise
            # The watchdog cancelled the call (grpc raises CancelledError for a local cancel): the
            # Controller may be cut off, another may lead.
            return "broken", healthy, errors.RpcFailure(grpc.StatusCode.DEADLINE_EXCEEDED, "no ack in time")
        finally:
            self.connected = False
            watchdog.cancel()
            # Events taken from the queue by a dead stream are re-sent by the next one.

    async def terminate_instance(
        self, reason: str, timeout_s: float
    ) -> controller_pb2.TerminateInstanceResponse:
        """``TerminateInstance`` of this node's instance on the leading Controller: the
        Controller drains it, deletes it and sends every one of its NodeManagers Stop. Answered
        once that is recorded (``terminated`` false while it is under way); raises the
        AioRpcError of a Controller that refused or could not be reached."""
        req = controller_pb2.TerminateInstanceRequest(instance_id=self.sup.instance_id, reason=reason)
        resp: controller_pb2.TerminateInstanceResponse = await self.target.call(
            "TerminateInstance", req, timeout_s, wait_for_ready=False
        )
        return resp

    async def close(self) -> None:
        await self.target.close()


def register_request(
    cfg: NodeManagerConfig,
    nm_port: int,
    instance_id: int = 0,
    incarnation: int = 0,
    role: enums.Role | None = None,
) -> controller_pb2.RegisterRequest:
    """What a NodeManager with ``cfg``, serving on ``nm_port``, registers with; ``role``: the
    role it serves when not the configured one (after a SwitchRole)."""
    par = cfg.parallel
    return controller_pb2.RegisterRequest(
        job_name=cfg.job_name,
        role=enums.ROLES_BY_NAME[cfg.role] if role is None else role,
        model_name=cfg.served_model_name or cfg.model,
        engine_type=enums.ENGINE_TYPES_BY_NAME[cfg.engine_type],
        host=cfg.host,
        nm_port=nm_port,
        ports=list(cfg.ports),
        device_count=cfg.device_count,
        parallel=common_pb2.ParallelConfig(dp=par.dp, tp=par.tp, pp=par.pp, ep=par.ep, nnodes=par.nnodes),
        node_rank=cfg.node_rank,
        instance_id=instance_id,
        pd_protocol=launch.pd_protocol(cfg.engine_type, cfg.sim_protocol),
        incarnation=incarnation,
    )
