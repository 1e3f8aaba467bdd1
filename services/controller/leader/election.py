"""Leader election among Controllers that share an etcd store (``controller.store = "etcd"``).

The leader holds ``<etcd_prefix>/leader`` (its advertise address) attached to an etcd lease of
``leader_lease_s`` (rounded up to whole seconds, etcd's unit). The key's create revision is the
leader's **term**: it grows with every election, so it orders leaders without a clock.

Two things make a paused or cut-off old leader harmless (fencing):

- every write to etcd is a transaction conditioned on the leader key still having this term's
  create revision (:meth:`Leadership.compares`), so once the lease has expired and another
  Controller has won, no write of the old one can land;
- every push to a Coordinator carries the term (``x-motor-leader-term`` metadata), and a Coordinator
  refuses a term lower than one it has seen.

And the leader stops acting before its lease could be granted to anyone else: etcd starts a
renewed lease's TTL when it *receives* the renewal, which is after this process sent it, so
``send time + TTL`` (less a margin) is a deadline that etcd's own expiry can only come after.
Past it — renewals failing, etcd unreachable, or this process paused (CLOCK_MONOTONIC keeps
running while a process is stopped) — :meth:`valid` is false at once, every fenced action
refuses, and ``ended`` is set; the service then exits and its supervisor (``motor up``,
Kubernetes) starts it again as a standby, as kube-controller-manager does on a lost lease.

A standby waits on a watch of the key (and looks again every TTL, so a lost watch event costs
at most one period) and campaigns the moment it is gone.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time

import grpc

from motor_mesh.common import log
from motor_mesh.common.interceptors import LEADER_TERM_METADATA
from motor_mesh.common.retry import Backoff
from motor_mesh.controller.store.etcd_client import EtcdClient, EtcdUnavailable, cmp_create, op_get, op_put
from motor_mesh.controller.store.interface import NotLeader
from motor_mesh.gen.etcd.etcdserverpb import rpc_pb2

# Stop acting this long before the renewed lease's earliest possible expiry.
MARGIN_S = 0.25
# Renewals per TTL: two can fail and the third still lands in time.
RENEWALS_PER_TTL = 3
# A failed renewal is retried this soon, not a whole renewal interval later.
RETRY_RENEW_S = 0.2

_ETCD_FAILED = (EtcdUnavailable, grpc.aio.AioRpcError, TimeoutError)


def leader_key(prefix: str) -> bytes:
    return f"{prefix.rstrip('/')}/leader".encode()


class Leadership:
    def __init__(self, client: EtcdClient, prefix: str, address: str, lease_s: float) -> None:
        self._client = client
        self.key = leader_key(prefix)
        self.address = address
        self.ttl = max(1, math.ceil(lease_s))
        self.term = 0  # the leader key's create revision while this process leads; 0 otherwise
        self.lease_id = 0
        self._deadline = 0.0  # monotonic; acting is allowed strictly before it
        self.leader_address = ""  # who leads, as last seen (what a standby names)
        self.ended = asyncio.Event()  # set once when a held leadership is lost
        self.elections_won = 0

    # ---- the fence ------------------------------------------------------------------------------

    def valid(self) -> bool:
        """Whether this process may act as leader right now."""
        if self.term == 0 or self.ended.is_set():
            return False
        if time.monotonic() >= self._deadline:
            self._lose("lease deadline passed without a renewal")
            return False
        return True

    def compares(self) -> list[rpc_pb2.Compare]:
        """The condition every etcd write carries; raises NotLeader when no write may be sent."""
        if not self.valid():
            raise NotLeader("etcd write", "this Controller's leadership has ended")
        return [cmp_create(self.key, self.term)]

    def lost(self) -> None:
        """A fenced write was refused by etcd: another Controller holds the key."""
        self._lose("a write's leader condition failed in etcd")

    def push_metadata(self) -> tuple[tuple[str, str], ...]:
        """Metadata for a push to a Coordinator; raises NotLeader when no push may be sent."""
        if not self.valid():
            raise NotLeader("push to a Coordinator", "this Controller's leadership has ended")
        return ((LEADER_TERM_METADATA, str(self.term)),)

    def _lose(self, why: str) -> None:
        if self.ended.is_set():
            return
        self.ended.set()
        log.error("leadership_lost", term=self.term, reason=why)

    # ---- standing for election ----------------------------------------------------------------

    async def campaign(self) -> None:
        """Return once this process is the leader."""
        backoff = Backoff(0.2, 1.0)
        while True:
            try:
                revision = await self._try_acquire()
                if revision == 0:
                    return
                backoff.reset()
                await self._wait_for_vacancy(revision)
            except _ETCD_FAILED as err:
                log.warn("leader_campaign_failed", error=_describe(err))
                await backoff.sleep()

    async def _try_acquire(self) -> int:
        """0 when this process won; otherwise the revision the current leader was read at."""
        started = time.monotonic()
        lease = await self._client.grant(self.ttl)
        try:
            resp = await self._client.txn(
                [cmp_create(self.key, 0)],
                [op_put(self.key, self.address.encode(), lease)],
                [op_get(self.key)],
            )
        except BaseException:
            with contextlib.suppress(*_ETCD_FAILED):
                await self._client.revoke(lease)
            raise
        if resp.succeeded:
            self.lease_id = lease
            self.term = resp.header.revision
            self._deadline = started + self.ttl - MARGIN_S
            self.leader_address = self.address
            self.elections_won += 1
            log.event("leader_elected", address=self.address, term=self.term, lease_s=self.ttl)
            return 0
        await self._client.revoke(lease)
        kvs = resp.responses[0].response_range.kvs
        seen = kvs[0].value.decode(errors="replace") if kvs else ""
        if seen != self.leader_address:
            log.event("leader_seen", leader=seen or "none")
        self.leader_address = seen
        return resp.header.revision

    async def _wait_for_vacancy(self, revision: int) -> None:
        """Until the leader key is deleted (lease expired or revoked), or one TTL passed."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(self.ttl):
                async for events in self._client.watch(self.key, start_revision=revision + 1):
                    for ev in events:
                        if ev.type == ev.DELETE:
                            self.leader_address = ""
                            return
                        self.leader_address = ev.kv.value.decode(errors="replace")

    # ---- holding it ---------------------------------------------------------------------------

    async def keep(self) -> None:
        """Renew the lease until leadership is lost (then ``ended`` is set and this returns)."""
        interval = self.ttl / RENEWALS_PER_TTL
        wait = interval
        while self.valid():
            await asyncio.sleep(min(wait, max(0.0, self._deadline - time.monotonic())))
            if not self.valid():
                return
            sent = time.monotonic()
            try:
                async with asyncio.timeout(max(0.05, self._deadline - sent)):
                    ttl = await self._client.keepalive(self.lease_id)
            except _ETCD_FAILED as err:
                log.warn("leader_renew_failed", term=self.term, error=_describe(err))
                wait = RETRY_RENEW_S
                continue
            if ttl <= 0:
                self._lose("etcd says the lease is gone")
                return
            self._deadline = sent + ttl - MARGIN_S
            wait = interval

    async def resign(self) -> None:
        """A graceful stop: give the lease back so a standby takes over at once."""
        if self.term == 0 or self.ended.is_set():
            return
        self.ended.set()
        with contextlib.suppress(*_ETCD_FAILED):
            await self._client.revoke(self.lease_id)
            log.event("leader_resigned", term=self.term)


def _describe(err: BaseException) -> str:
    if isinstance(err, grpc.aio.AioRpcError):
        return f"{err.code().name}: {err.details()}"
    return str(err) or type(err).__name__
