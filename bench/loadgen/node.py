"""A simulated NodeManager as the Controller sees it: ``Register``, then one bidi ``Heartbeat``
stream kept open with a beat every interval and at once on a status change.

It behaves like services/nodemanager/link.py on the wire (beats carry no endpoints until
``StartEngines``, then NORMAL endpoints with a pid; ``DIRECTIVE_REREGISTER`` → register again
with the instance id) but without engines, and it measures each beat's round trip (write → ack).
Cheap per node by design (one task, one timer): a generator process runs thousands of them.
"""

from __future__ import annotations

import asyncio
import random
import time
from array import array
from dataclasses import dataclass, field
from typing import Any

import grpc

from motor_mesh.gen.motor.v1 import common_pb2, controller_pb2

NORMAL = common_pb2.ENDPOINT_STATUS_NORMAL
ABNORMAL = common_pb2.ENDPOINT_STATUS_ABNORMAL
REGISTER_TIMEOUT_S = 30.0
# As services/nodemanager/link.py: these end registration for good, anything else is retried
# (a saturated grpc.aio server answers queued calls CANCELLED).
FATAL = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED}


@dataclass
class Stats:
    """Shared by every node of one process. ``samples`` holds ack round trips (ms) while
    ``recording`` is on."""

    registered: int = 0
    streaming: int = 0  # nodes whose current stream has carried at least one ack
    started: int = 0  # nodes that received StartEngines
    beats: int = 0
    acks: int = 0
    errors: int = 0
    reregisters: int = 0
    register_retries: int = 0
    recording: bool = False
    codes: dict[str, int] = field(default_factory=dict)  # why streams broke, by status code
    progress: asyncio.Event = field(default_factory=asyncio.Event)  # set on registered/started
    samples: array = field(default_factory=lambda: array("d"))


@dataclass
class NodeSpec:
    job_name: str
    role: int
    model_name: str
    host: str
    nm_port: int
    port: int
    engine_type: int = common_pb2.ENGINE_TYPE_SIM


class FakeNode:
    def __init__(self, spec: NodeSpec, stub: Any, stats: Stats, interval_s: float = 3.0) -> None:
        self.spec = spec
        self.stub = stub
        self.stats = stats
        self.interval_s = interval_s
        self.node_id = 0
        self.epoch = 0
        self.instance_id = 0
        self.endpoints: list[common_pb2.Endpoint] = []
        self._seq = 0
        self._waiter: asyncio.Future[None] | None = None
        self._streaming = False
        # perf_counter() of the first write of a beat carrying the current endpoint statuses
        # (propagation measures from there).
        self.change_sent_at = 0.0
        self.change_sent_wall = 0.0
        self._change_pending = False

    # ---- what the fake NodeManager server and the benchmarks call ---------------------------

    def start_engines(self, endpoints: list[common_pb2.Endpoint]) -> list[common_pb2.Endpoint]:
        """StartEngines: the engines are "up" at once; a beat goes out now, as a real node's would
        once its engine turns ready."""
        if not self.endpoints:
            self.stats.started += 1
            self.stats.progress.set()
        pid = 100000 + random.randrange(1 << 20)
        self.endpoints = [
            common_pb2.Endpoint(
                id=e.id,
                host=e.host,
                port=e.port,
                bootstrap_port=e.bootstrap_port,
                status=NORMAL,
                headless=e.headless,
                device_ids=list(e.device_ids),
                pid=pid,
            )
            for e in endpoints
        ]
        self.set_status(NORMAL)
        return [common_pb2.Endpoint(id=e.id, host=e.host, port=e.port, pid=e.pid) for e in self.endpoints]

    def assume_started(self) -> None:
        """For the echo baseline (no StartEngines comes): beat the same payload as a started node."""
        self.start_engines(
            [common_pb2.Endpoint(id=0, host=self.spec.host, port=self.spec.port, device_ids=[0])]
        )

    def set_status(self, status: int) -> None:
        for e in self.endpoints:
            e.status = status  # type: ignore[assignment]
        self._change_pending = True
        self.wake()

    def wake(self) -> None:
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)

    # ---- Register ----------------------------------------------------------------------------

    async def register(self) -> None:
        s = self.spec
        req = controller_pb2.RegisterRequest(
            job_name=s.job_name,
            role=s.role,  # type: ignore[arg-type]
            model_name=s.model_name,
            engine_type=s.engine_type,  # type: ignore[arg-type]
            host=s.host,
            nm_port=s.nm_port,
            ports=[s.port],
            device_count=1,
            parallel=common_pb2.ParallelConfig(dp=1, tp=1, pp=1, ep=1, nnodes=1),
            node_rank=0,
            instance_id=self.instance_id,
        )
        delay = 0.5
        while True:
            try:
                resp = await self.stub.Register(req, timeout=REGISTER_TIMEOUT_S)
                break
            except grpc.aio.AioRpcError as err:
                if err.code() in FATAL:
                    raise
                self.stats.register_retries += 1
                name = f"register {err.code().name}"
                self.stats.codes[name] = self.stats.codes.get(name, 0) + 1
                await asyncio.sleep(delay * (1 + random.random() / 4))
                delay = min(delay * 2, 10.0)
        self.node_id, self.epoch = resp.node_id, resp.session_epoch
        if resp.instance_id:
            self.instance_id = resp.instance_id
        if resp.heartbeat_interval_ms:
            self.interval_s = resp.heartbeat_interval_ms / 1000

    # ---- the node's life ---------------------------------------------------------------------

    async def run(self) -> None:
        await self.register()
        self.stats.registered += 1
        self.stats.progress.set()
        backoff = 0.2
        while True:
            outcome = await self._stream_once()
            if outcome == "reregister":
                self.stats.reregisters += 1
                await self.register()
                backoff = 0.2
                continue
            self.stats.errors += 1
            await asyncio.sleep(backoff * (1 + random.random() / 4))
            backoff = min(backoff * 2, 2.0)

    def _beat(self) -> controller_pb2.HeartbeatRequest:
        self._seq += 1
        return controller_pb2.HeartbeatRequest(
            beat=controller_pb2.Beat(
                node_id=self.node_id, session_epoch=self.epoch, seq=self._seq, endpoints=self.endpoints
            )
        )

    async def _sleep_until(self, deadline: float) -> None:
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[None] = loop.create_future()
        self._waiter = fut
        handle = loop.call_at(deadline, _resolve, fut)
        try:
            await fut
        finally:
            handle.cancel()
            self._waiter = None

    async def _stream_once(self) -> str:
        """One stream: beats go out on their own schedule (next beat one interval after the
        write, as the real NodeManager does: a slow ack never delays a beat); a reader task
        takes the acks and times each one against its beat's write."""
        stats = self.stats
        loop = asyncio.get_running_loop()
        call = self.stub.Heartbeat()
        sent: dict[int, float] = {}
        reader = loop.create_task(self._read_acks(call, sent))
        reader.add_done_callback(lambda _: self.wake())
        perf = time.perf_counter
        try:
            next_beat = loop.time()
            while not reader.done():
                if not self._change_pending and loop.time() < next_beat:
                    await self._sleep_until(next_beat)
                    continue
                changed, self._change_pending = self._change_pending, False
                req = self._beat()
                t0 = perf()
                if changed:
                    self.change_sent_at, self.change_sent_wall = t0, time.time()
                sent[self._seq] = t0
                try:
                    await call.write(req)
                except (grpc.aio.AioRpcError, asyncio.InvalidStateError):
                    break  # the stream ended: the reader has (or will have) the reason
                stats.beats += 1
                next_beat = loop.time() + self.interval_s
            return await reader
        finally:
            reader.cancel()
            call.cancel()

    async def _read_acks(self, call: Any, sent: dict[int, float]) -> str:
        stats = self.stats
        perf = time.perf_counter
        try:
            async for resp in call:
                if resp.WhichOneof("kind") == "directive":
                    if resp.directive == controller_pb2.DIRECTIVE_REREGISTER:
                        return "reregister"
                    continue
                stats.acks += 1
                t0 = sent.pop(resp.ack.seq, None)
                if stats.recording and t0 is not None:
                    stats.samples.append((perf() - t0) * 1000.0)
                if not self._streaming:
                    self._streaming = True
                    stats.streaming += 1
            stats.codes["EOF"] = stats.codes.get("EOF", 0) + 1
            return "broken"
        except grpc.aio.AioRpcError as err:
            if err.code() == grpc.StatusCode.FAILED_PRECONDITION:
                return "reregister"
            name = f"{err.code().name}:{err.details()}"[:80]
            stats.codes[name] = stats.codes.get(name, 0) + 1
            return "broken"
        finally:
            if self._streaming:
                self._streaming = False
                stats.streaming -= 1


def _resolve(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)
