"""The event pusher: keeps one Coordinator's instance table equal to the Controller's
ACTIVE/PAUSED instances (behaviour.md "Event pusher").

Transitions become incremental calls the moment they happen (ready → Add, separated/removed →
Delete, paused → Pause, resumed → Resume), sent in order by one task. Anything that may have
left the Coordinator out of step — a failed incremental call, a new ``incarnation`` in a
response, the health Watch stream coming back after a break, the periodic timer — raises one
flag, ``need_set``: the next call is a full ``SetInstances`` that supersedes every queued
incremental call. A failed Set leaves the flag up (it never queues a second Set) and is retried
with backoff; the Watch stream coming back wakes the retry at once, so a Coordinator that comes
up gets its Set within about a second. Delete answering NOT_FOUND counts as done.
"""

from __future__ import annotations

import asyncio
import hashlib
import random
import time
from collections import deque
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from motor.v1 import coordinator_pb2, coordinator_pb2_grpc

from services.common import log
from services.common.channel import open_channel
from services.common.config import ServerConfig

from . import state_machine as sm
from .instances import InstanceTable
from .model import Instance, Status

COORDINATOR_SERVICE = "motor.v1.Coordinator"
CALL_TIMEOUT_S = 3.0
MIN_BACKOFF_S = 0.1
MAX_BACKOFF_S = 1.0
WARN_EVERY_S = 30.0

Op = tuple[str, list[Any]]  # ("add", [Instance]), ("delete", [Instance]), ("pause"|"resume", [id])


def op_for(inst: Instance, old: Status, new: Status) -> Op | None:
    """The incremental call one transition needs, if any."""
    if new == sm.ACTIVE:
        return ("resume", [inst.id]) if old == sm.PAUSED else ("add", [inst.to_pb()])
    if new == sm.PAUSED and old == sm.ACTIVE:
        return ("pause", [inst.id])
    if new in (sm.INACTIVE, sm.DELETED) and old in (sm.ACTIVE, sm.PAUSED):
        return ("delete", [inst.identity_pb()])
    return None


def _jitter(seconds: float) -> float:
    return seconds * (0.8 + 0.4 * random.random())


class CoordinatorPusher:
    def __init__(
        self,
        address: str,
        table: InstanceTable,
        *,
        key: str | None = None,
        tls: ServerConfig | None = None,
        max_message_bytes: int = 4 << 20,
        sync_interval_s: float = 0.0,
    ) -> None:
        self.address = address
        self._table = table
        self._key = key
        self._tls = tls
        self._max = max_message_bytes
        self._sync_interval_s = sync_interval_s
        self._ops: deque[Op] = deque()
        self._need_set = True  # the first call after start-up is always a full Set
        self._wake = asyncio.Event()
        self._link_up = asyncio.Event()
        self._channel: grpc.aio.Channel | None = None
        # Typed Any: the generated stubs are typed for the sync API.
        self._stub: Any = None
        self._health: Any = None
        self._tasks: list[asyncio.Task] = []
        self._closing: set[asyncio.Task] = set()
        # What the Coordinator is known to hold: its incarnation and the fingerprint of the last
        # Set it accepted (a failed Set never advances it).
        self.incarnation = ""
        self.synced_fingerprint = ""
        self.last_set_ok = float("-inf")
        self._set_in_flight = False
        self._last_warn: tuple[str, float] = ("", float("-inf"))
        self._suppressed = 0
        self.stats = {"set_ok": 0, "set_failed": 0, "incremental_ok": 0, "incremental_failed": 0}

    # ---- observer ----------------------------------------------------------------------------

    def on_transition(self, inst: Instance, old: Status, new: Status, reason: str) -> None:
        op = op_for(inst, old, new)
        if op is None:
            return
        if not self._need_set:  # a pending Set will carry this change anyway
            self._ops.append(op)
        self._wake.set()

    def request_full_sync(self, reason: str) -> None:
        if not self._need_set:
            log.event("coordinator_full_sync_queued", coordinator=self.address, reason=reason)
        self._need_set = True
        self._ops.clear()
        self._wake.set()

    # ---- lifecycle ---------------------------------------------------------------------------

    def start(self) -> None:
        self._open()
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._run()), loop.create_task(self._watch())]
        if self._sync_interval_s > 0:
            self._tasks.append(loop.create_task(self._periodic()))
        self._wake.set()

    async def close(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._channel is not None:
            await self._channel.close(grace=0.2)
        await asyncio.gather(*self._closing, return_exceptions=True)

    def _open(self) -> None:
        old = self._channel
        self._channel = open_channel(
            self.address, key=self._key, tls=self._tls, max_message_bytes=self._max, service="controller"
        )
        self._stub = coordinator_pb2_grpc.CoordinatorStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)
        if old is not None:
            task = asyncio.get_running_loop().create_task(old.close(grace=1.0))
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)

    # ---- the push loop -----------------------------------------------------------------------

    async def _run(self) -> None:
        backoff = MIN_BACKOFF_S
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._need_set or self._ops:
                if await self._push_once():
                    backoff = MIN_BACKOFF_S
                    continue
                # Wait out the backoff, or less if the health Watch sees the Coordinator return.
                self._link_up.clear()
                try:
                    await asyncio.wait_for(self._link_up.wait(), _jitter(backoff))
                except TimeoutError:
                    pass
                backoff = min(backoff * 2, MAX_BACKOFF_S)

    async def _push_once(self) -> bool:
        assert self._stub is not None
        if self._need_set:
            return await self._send_set()
        kind = self._ops[0][0]
        batch: list[Any] = []
        while self._ops and self._ops[0][0] == kind:
            batch.extend(self._ops.popleft()[1])
        try:
            resp = await self._call(kind, batch)
        except grpc.aio.AioRpcError as err:
            if kind == "delete" and err.code() == grpc.StatusCode.NOT_FOUND:
                if len(batch) > 1:  # all-or-nothing: find which ones are still there
                    self._ops.extendleft(("delete", [i]) for i in reversed(batch))
                return True
            self.stats["incremental_failed"] += 1
            self._warn_failed(kind, err)
            self.request_full_sync(f"{kind}_failed")
            return False
        self.stats["incremental_ok"] += 1
        self._last_warn = ("", float("-inf"))
        self._check_incarnation(resp.incarnation)
        return True

    async def _send_set(self) -> bool:
        assert self._stub is not None
        # Lower the flag before the call: a change made while it is in flight queues an
        # incremental call to follow it.
        self._need_set = False
        self._ops.clear()
        instances = [i.to_pb() for i in self._table.routable()]
        req = coordinator_pb2.SetInstancesRequest(instances=instances)
        self._set_in_flight = True
        try:
            resp = await self._stub.SetInstances(req, timeout=CALL_TIMEOUT_S, wait_for_ready=False)
        except grpc.aio.AioRpcError as err:
            self.stats["set_failed"] += 1
            self._need_set = True
            self._ops.clear()
            self._warn_failed("set", err)
            return False
        finally:
            self._set_in_flight = False
        self.stats["set_ok"] += 1
        self._last_warn = ("", float("-inf"))
        self.last_set_ok = time.monotonic()
        self.incarnation = resp.incarnation
        self.synced_fingerprint = hashlib.blake2b(
            req.SerializeToString(deterministic=True), digest_size=8
        ).hexdigest()
        paused = [i.id for i in instances if i.status == sm.PAUSED]
        if paused:
            self._ops.appendleft(("pause", paused))
        log.event(
            "coordinator_synced",
            coordinator=self.address,
            instances=len(instances),
            revision=resp.revision,
            incarnation=resp.incarnation,
        )
        return True

    async def _call(self, kind: str, batch: list[Any]) -> Any:
        assert self._stub is not None
        kw: dict[str, Any] = {"timeout": CALL_TIMEOUT_S, "wait_for_ready": False}
        if kind == "add":
            return await self._stub.AddInstances(coordinator_pb2.AddInstancesRequest(instances=batch), **kw)
        if kind == "delete":
            return await self._stub.DeleteInstances(
                coordinator_pb2.DeleteInstancesRequest(instances=batch), **kw
            )
        if kind == "pause":
            return await self._stub.PauseInstances(coordinator_pb2.PauseInstancesRequest(ids=batch), **kw)
        return await self._stub.ResumeInstances(coordinator_pb2.ResumeInstancesRequest(ids=batch), **kw)

    def _warn_failed(self, call: str, err: grpc.aio.AioRpcError) -> None:
        """One line per new kind of failure, then at most one every WARN_EVERY_S while it lasts."""
        key, now = f"{call}:{err.code().name}", time.monotonic()
        if key == self._last_warn[0] and now - self._last_warn[1] < WARN_EVERY_S:
            self._suppressed += 1
            return
        log.warn(
            "coordinator_push_failed",
            coordinator=self.address,
            call=call,
            code=err.code().name,
            detail=err.details() or "",
            repeated=self._suppressed,
        )
        self._last_warn, self._suppressed = (key, now), 0

    def _check_incarnation(self, incarnation: str) -> None:
        if incarnation and self.incarnation and incarnation != self.incarnation:
            log.event("coordinator_restarted", coordinator=self.address, incarnation=incarnation)
            self.request_full_sync("new_incarnation")
        if incarnation:
            self.incarnation = incarnation

    # ---- health watch and periodic sync ------------------------------------------------------

    async def _watch(self) -> None:
        backoff = MIN_BACKOFF_S
        broken_at: float | None = None
        while True:
            assert self._health is not None
            try:
                call = self._health.Watch(
                    health_pb2.HealthCheckRequest(service=COORDINATOR_SERVICE), wait_for_ready=False
                )
                async for resp in call:
                    if resp.status == health_pb2.HealthCheckResponse.SERVING:
                        backoff = MIN_BACKOFF_S
                        if broken_at is not None:
                            log.event("coordinator_reachable", coordinator=self.address)
                            # Back after a break: resync, unless a Set got through since or one is
                            # on its way now (if that one fails, it raises the flag again itself).
                            if self.last_set_ok < broken_at and not self._set_in_flight:
                                self.request_full_sync("watch_restored")
                            broken_at = None
                            self._link_up.set()
                    elif broken_at is None:
                        broken_at = time.monotonic()
            except grpc.aio.AioRpcError as err:
                if err.code() == grpc.StatusCode.UNIMPLEMENTED:
                    log.warn("coordinator_health_unavailable", coordinator=self.address)
                    return
            if broken_at is None:
                broken_at = time.monotonic()
                log.warn("coordinator_unreachable", coordinator=self.address)
            await asyncio.sleep(_jitter(backoff))
            backoff = min(backoff * 2, MAX_BACKOFF_S)
            # A fresh channel connects at once instead of waiting out gRPC's reconnect backoff.
            self._open()

    async def _periodic(self) -> None:
        while True:
            await asyncio.sleep(self._sync_interval_s)
            self.request_full_sync("periodic")

    def status(self) -> dict[str, Any]:
        return {
            "coordinator": self.address,
            "incarnation": self.incarnation,
            "synced_fingerprint": self.synced_fingerprint,
            "need_set": self._need_set,
            "queued": len(self._ops),
            **self.stats,
        }
