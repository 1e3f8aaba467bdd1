"""Heartbeat streams (the ``Heartbeat`` RPC) and the heartbeat timeout.

The per-beat path is the Controller's hot loop (10,000 nodes every 3 s): check the session,
stamp ``last_heard``, compare the beat's (id, status, pid) tuple with the previous one, ack.
The handlers only record what was observed (endpoint statuses and pids, dead engines) and
enqueue the instance: deciding what follows is the instance reconciler's job.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import grpc

from motor_mesh.common import errors, log
from motor_mesh.common.enums import EP_ABNORMAL, EVENT_DEAD, EVENT_UNHEALTHY, REREGISTER, enum_name
from motor_mesh.common.gcpolicy import GcGuard
from motor_mesh.common.latency import LatencyHistogram
from motor_mesh.common.rpc import BidiStream
from motor_mesh.controller.instances import InstanceTable
from motor_mesh.controller.model import Instance, Member, Session, observe_kv_ports
from motor_mesh.controller.nodes.sessions import SessionTable
from motor_mesh.gen.motor.v1 import common_pb2
from motor_mesh.gen.motor.v1 import controller_pb2 as pb

STATS_WINDOW_S = 10.0
# Upper bounds (seconds) of the ack latency histogram: a healthy ack takes well under 1 ms.
ACK_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
_REREGISTER = pb.HeartbeatResponse(directive=REREGISTER)
_FAULTS = (EVENT_DEAD, EVENT_UNHEALTHY)
_KNOWN_STATUSES = frozenset(common_pb2.EndpointStatus.values())


def _identity(req: pb.HeartbeatRequest) -> tuple[int, int]:
    if req.HasField("beat"):
        return req.beat.node_id, req.beat.session_epoch
    return req.engine_event.node_id, req.engine_event.session_epoch


def _stale(node_id: int) -> errors.MotorError:
    return errors.precondition(
        "STALE_SESSION",
        f"node/{node_id}",
        f"node {node_id}: unknown node or stale session epoch; register again",
    )


class HeartbeatHub:
    def __init__(
        self,
        table: InstanceTable,
        sessions: SessionTable,
        timeout_s: float,
        enqueue: Callable[[int], None],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.clock = clock  # last_heard's clock (nodes/liveclock.py)
        self.table = table
        self.sessions = sessions
        self.timeout_s = timeout_s
        self.enqueue = enqueue  # instance id -> the instance reconciler
        self._streams: set[asyncio.Task[None]] = set()
        # Server-side ack latency (message in hand -> ack handed to gRPC), seconds, for the
        # current ``heartbeat_stats`` window.
        self._acks: list[float] = []
        self._window_start = clock()
        # The same latencies since the start, for /metrics; every acked message is in it, so
        # beats are its count minus the engine events (one counter fewer on the beat path).
        self.ack_latency = LatencyHistogram(ACK_BUCKETS)
        self.events_acked = 0

    async def stream(self, stream: BidiStream, context: grpc.aio.ServicerContext) -> None:
        req = await stream.read()
        if req is None:
            return
        write = stream.write
        node_id, epoch = _identity(req)
        session = self.sessions.get(node_id)
        if session is None or session.epoch != epoch or not session.valid:
            log.event("stale_session", node_id=node_id)
            await write(_REREGISTER)
            raise _stale(node_id)
        member = session.member
        member.open_streams += 1
        member.stream_lost = False
        task = asyncio.current_task()
        if task is not None:
            self._streams.add(task)
        clock, perf, acks, observe = self.clock, time.perf_counter, self._acks, self.ack_latency.observe
        try:
            while req is not None:
                t0 = perf()
                if req.HasField("beat"):
                    beat = req.beat
                    if not session.valid or beat.node_id != node_id or beat.session_epoch != epoch:
                        await write(_REREGISTER)
                        raise _stale(beat.node_id)
                    member.last_heard = clock()
                    inst = member.instance
                    if inst is not None:
                        fingerprint = tuple((e.id, e.status, e.pid) for e in beat.endpoints)
                        if fingerprint != member.beat_fingerprint:
                            member.beat_fingerprint = fingerprint
                            self._apply_beat(member, inst, beat)
                    await write(pb.HeartbeatResponse(ack=pb.Ack(seq=beat.seq)))
                    took = perf() - t0
                    acks.append(took)
                    observe(took)
                elif req.HasField("engine_event"):
                    ev = req.engine_event
                    if not session.valid or (
                        ev.node_id and (ev.node_id, ev.session_epoch) != (node_id, epoch)
                    ):
                        await write(_REREGISTER)
                        raise _stale(ev.node_id or node_id)
                    member.last_heard = clock()
                    self._apply_event(session, ev)
                    await write(pb.HeartbeatResponse(ack=pb.Ack(seq=ev.seq)))
                    took = perf() - t0
                    acks.append(took)
                    observe(took)
                    self.events_acked += 1
                req = await stream.read()
        finally:
            member.open_streams -= 1
            # A broken stream starts the heartbeat clock at once.
            member.last_heard = clock()
            if member.open_streams == 0 and member.instance is not None and session.valid:
                member.stream_lost = True
                self.enqueue(member.instance.id)
            if task is not None:
                self._streams.discard(task)

    def _apply_beat(self, member: Member, inst: Instance, beat: pb.Beat) -> None:
        changed = False
        if member.started is None:
            # Known from before a Controller restart: a NodeManager reporting no endpoints has
            # no engines running for this instance, so they must be started.
            member.started = bool(beat.endpoints)
            changed = not member.started
        for reported in beat.endpoints:
            ep = member.by_id.get(reported.id)
            if ep is None:
                ep = member.by_port.get(reported.port)
                if ep is None:
                    continue
            status = reported.status
            # A beat still showing an engine that was reported dead as healthy is outdated; a
            # status this build does not know is not a healthy one either (and must never reach
            # a Coordinator, which would refuse the whole table over it).
            if (reported.pid and reported.pid in member.dead_pids) or status not in _KNOWN_STATUSES:
                status = EP_ABNORMAL
            if ep.status != status:
                ep.status = status
                changed = True
            if reported.pid != ep.pid:
                ep.pid = reported.pid
            observe_kv_ports(ep, reported)
        if changed:
            self.enqueue(inst.id)

    def _apply_event(self, session: Session, ev: pb.EngineEvent) -> None:
        member = session.member
        inst = member.instance
        log.event(
            "engine_event",
            node_id=session.node_id,
            instance_id=inst.id if inst else 0,
            endpoint_id=ev.endpoint_id,
            pid=ev.pid,
            type=enum_name(pb.EngineEventType, ev.type),
            detail=ev.detail,
        )
        if inst is None or ev.type not in _FAULTS:
            return
        if ev.type == EVENT_DEAD and ev.pid:
            member.dead_pids.add(ev.pid)
        member.beat_fingerprint = None  # the next beat is applied in full
        ep = member.by_id.get(ev.endpoint_id)
        if ep is None and ev.pid:
            ep = next((e for e in member.by_id.values() if e.pid == ev.pid), None)
        if ep is not None:
            ep.status = EP_ABNORMAL
            if ev.type == EVENT_DEAD:
                ep.pid = 0  # what the next beat will say too: the fault manager acts on it now
        self.enqueue(inst.id)

    def sweep(self, now: float) -> None:
        """Enqueue every instance one of whose NodeManagers was silent for the timeout."""
        limit = now - self.timeout_s
        for inst in self.table.live.values():
            for m in inst.members:
                if m.last_heard < limit:
                    self.enqueue(inst.id)
                    break

    def report(self, now: float, gc: GcGuard | None = None) -> None:
        """Every STATS_WINDOW_S with traffic: one ``heartbeat_stats`` line (the scale benchmark
        reads messages, ack_p50_ms, ack_p99_ms and window_s from it, in that order), with the
        garbage collector's collections and longest pause over the window."""
        elapsed = now - self._window_start
        if elapsed < STATS_WINDOW_S:
            return
        # Cleared in place: every open stream holds a reference to this list.
        acks = sorted(self._acks)
        self._acks.clear()
        self._window_start = now
        collections, gc_max_ms = gc.take_stats() if gc is not None else (0, 0.0)
        if not acks:
            return
        log.event(
            "heartbeat_stats",
            messages=len(acks),
            ack_p50_ms=round(acks[len(acks) // 2] * 1000, 3),
            ack_p99_ms=round(acks[min(len(acks) - 1, int(len(acks) * 0.99))] * 1000, 3),
            window_s=round(elapsed, 3),
            streams=len(self._streams),
            sessions=len(self.sessions),
            instances=len(self.table.live),
            gc_collections=collections,
            gc_max_ms=gc_max_ms,
        )

    def cancel_streams(self) -> None:
        """On stop: end every open stream so the NodeManagers reconnect to the next Controller."""
        for t in list(self._streams):
            t.cancel()

    @property
    def open_streams(self) -> int:
        return len(self._streams)

    @property
    def beats_acked(self) -> int:
        return self.ack_latency.count - self.events_acked
