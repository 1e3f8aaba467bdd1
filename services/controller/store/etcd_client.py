"""An asyncio client for the parts of etcd's v3 API the Controller uses: KV, Watch and Lease.

It runs on stubs ``make gen`` builds from etcd_protos/ (a trimmed copy of etcd's own protos), so
it shares Motor's grpcio and protobuf. The published asyncio clients each miss something the
Controller needs (TLS, several endpoints, a deadline per call) or pin old grpcio/protobuf.

Endpoints: one grpc.aio channel each, opened when first needed. A call goes to the endpoint that
answered last; one that does not answer (UNAVAILABLE, or no answer within ``timeout_s``) is
skipped for the next, each endpoint once, and :class:`EtcdUnavailable` says none answered. A
write that failed over may still have been applied by the endpoint that did not answer: the
Controller's writes are transactions whose compares make a repeat harmless or refused.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeAlias, TypeVar

import grpc

from motor_mesh.common import log
from motor_mesh.common.config import ConfigError, read_private_file
from motor_mesh.common.retry import Backoff, RetryPolicy
from motor_mesh.common.server import MAX_TLS_FILE_BYTES, read_public_file
from motor_mesh.gen.etcd.etcdserverpb import rpc_pb2, rpc_pb2_grpc
from motor_mesh.gen.etcd.etcdserverpb.rpc_pb2_grpc import KVStub, LeaseStub, WatchStub
from motor_mesh.gen.etcd.mvccpb import kv_pb2

T = TypeVar("T")
# Status codes that say "this endpoint did not answer": the next one is tried.
_UNANSWERED = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED})
# Before a call's last try on the endpoint it tried first: time for a channel whose connection
# was just reset to see it (seen here: two calls in a row failing on a socket already cut).
RETRY_AFTER_S = 0.1
_OPTIONS: list[tuple[str, Any]] = [
    # An idle watch must notice a dead connection. etcd accepts pings every 5 s or slower while a
    # stream is open (its --grpc-keepalive-min-time) and none without one, so none are sent then.
    ("grpc.keepalive_time_ms", 10000),
    ("grpc.keepalive_timeout_ms", 5000),
    ("grpc.http2.max_pings_without_data", 0),
    # The store reads its whole prefix in one Range at start-up.
    ("grpc.max_receive_message_length", 64 * 1024 * 1024),
    # A restarted etcd is reached again within 2 s, not gRPC's default backoff of up to 120 s.
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 2000),
    ("grpc.use_local_subchannel_pool", 1),
]
_EQUAL = rpc_pb2.Compare.EQUAL


class EtcdUnavailable(Exception):
    """No endpoint answered (each was tried once)."""


class EtcdCompacted(EtcdUnavailable):
    """A watch cannot resume: etcd has compacted away the revision it would resume from. Read the
    keys again and watch from the revision of that read."""


class _StreamEnded(Exception):
    """etcd ended a stream without an error: the stream is of no further use."""


@dataclass
class _Endpoint:
    channel: grpc.aio.Channel
    kv: rpc_pb2_grpc.KVAsyncStub
    lease: rpc_pb2_grpc.LeaseAsyncStub
    watch: rpc_pb2_grpc.WatchAsyncStub


_KeepAliveCall: TypeAlias = (
    "grpc.aio.StreamStreamCall[rpc_pb2.LeaseKeepAliveRequest, rpc_pb2.LeaseKeepAliveResponse]"
)


class EtcdClient:
    def __init__(
        self,
        endpoints: Sequence[str],
        *,
        ca_file: str = "",
        cert_file: str = "",
        key_file: str = "",
        timeout_s: float = 2.0,
    ) -> None:
        if not endpoints:
            raise ValueError("EtcdClient needs at least one endpoint")
        self._targets = list(endpoints)
        self._timeout = timeout_s
        self._creds = _credentials(ca_file, cert_file, key_file)
        self._endpoints: dict[int, _Endpoint] = {}
        self._current = 0  # the endpoint that answered last: every call starts there
        self._closed = False
        # Per lease: the endpoint and the open LeaseKeepAlive stream its renewals go on.
        self._keepalives: dict[int, tuple[_Endpoint, _KeepAliveCall]] = {}
        self._renewing = asyncio.Lock()  # requests and responses of one stream must pair up

    # ---- KV ------------------------------------------------------------------------------------

    async def get(self, key: bytes) -> kv_pb2.KeyValue | None:
        req = rpc_pb2.RangeRequest(key=key)
        resp = await self._call("get", lambda e: e.kv.Range(req, timeout=self._timeout))
        return resp.kvs[0] if resp.kvs else None

    async def get_prefix(self, prefix: bytes) -> tuple[list[kv_pb2.KeyValue], int]:
        """Every key starting with ``prefix``, in key order, and the revision they were read at."""
        req = rpc_pb2.RangeRequest(key=prefix, range_end=prefix_end(prefix))
        resp = await self._call("get_prefix", lambda e: e.kv.Range(req, timeout=self._timeout))
        return list(resp.kvs), resp.header.revision

    async def put(self, key: bytes, value: bytes, lease: int = 0) -> int:
        """The revision of the write."""
        req = rpc_pb2.PutRequest(key=key, value=value, lease=lease)
        resp = await self._call("put", lambda e: e.kv.Put(req, timeout=self._timeout))
        return resp.header.revision

    async def txn(
        self,
        compare: Sequence[rpc_pb2.Compare],
        success: Sequence[rpc_pb2.RequestOp],
        failure: Sequence[rpc_pb2.RequestOp] = (),
    ) -> rpc_pb2.TxnResponse:
        req = rpc_pb2.TxnRequest(compare=compare, success=success, failure=failure)
        return await self._call("txn", lambda e: e.kv.Txn(req, timeout=self._timeout))

    # ---- Lease ---------------------------------------------------------------------------------

    async def grant(self, ttl_s: int) -> int:
        """A new lease of ``ttl_s`` seconds; its id."""
        req = rpc_pb2.LeaseGrantRequest(TTL=ttl_s)
        resp = await self._call("grant", lambda e: e.lease.LeaseGrant(req, timeout=self._timeout))
        return resp.ID

    async def keepalive(self, lease_id: int) -> int:
        """Renew the lease once: its TTL from now, in seconds; 0 when the lease is gone."""
        async with self._renewing:
            return await self._call("keepalive", lambda e: self._renew(e, lease_id))

    async def revoke(self, lease_id: int) -> None:
        """End the lease (its keys are deleted); a lease already gone counts as revoked."""
        self._drop_keepalive(lease_id)
        req = rpc_pb2.LeaseRevokeRequest(ID=lease_id)
        try:
            await self._call("revoke", lambda e: e.lease.LeaseRevoke(req, timeout=self._timeout))
        except grpc.aio.AioRpcError as err:
            if err.code() != grpc.StatusCode.NOT_FOUND:
                raise

    async def _renew(self, e: _Endpoint, lease_id: int) -> int:
        held = self._keepalives.pop(lease_id, None)
        if held is not None and held[0] is e:
            try:
                return await self._renew_on(e, lease_id, held[1])
            except (grpc.aio.AioRpcError, _StreamEnded) as err:
                # Most likely a stream from before etcd restarted: a fresh one below.
                log.event("etcd_keepalive_reopened", lease=lease_id, reason=_describe(err))
        elif held is not None:
            held[1].cancel()
        return await self._renew_on(e, lease_id, e.lease.LeaseKeepAlive())

    async def _renew_on(self, e: _Endpoint, lease_id: int, call: _KeepAliveCall) -> int:
        try:
            async with asyncio.timeout(self._timeout):
                await call.write(rpc_pb2.LeaseKeepAliveRequest(ID=lease_id))
                resp = await call.read()
            if not isinstance(resp, rpc_pb2.LeaseKeepAliveResponse):  # EOF
                raise _StreamEnded("etcd ended the keepalive stream")
        except asyncio.InvalidStateError:  # written to after etcd ended it
            call.cancel()
            raise _StreamEnded("etcd ended the keepalive stream") from None
        except BaseException:
            # Never reused after a request went unanswered: its late response would be taken for
            # the next request's, and the caller would date the renewal too late.
            call.cancel()
            raise
        if resp.TTL <= 0:
            call.cancel()
            return 0
        self._keepalives[lease_id] = (e, call)
        return resp.TTL

    def _drop_keepalive(self, lease_id: int) -> None:
        held = self._keepalives.pop(lease_id, None)
        if held is not None:
            held[1].cancel()

    # ---- Watch ---------------------------------------------------------------------------------

    async def watch(
        self, key: bytes, *, prefix: bool = False, start_revision: int = 0
    ) -> AsyncIterator[list[kv_pb2.Event]]:
        """The events on ``key`` (every key under it with ``prefix``) from ``start_revision`` on
        (0: from now), a list per revision batch. A broken stream is opened again (on the next
        endpoint, after a backoff) from the revision after the last one seen, so no event is lost
        or repeated; :class:`EtcdCompacted` when that revision is no longer kept."""
        create = rpc_pb2.WatchCreateRequest(key=key, range_end=prefix_end(key) if prefix else b"")
        next_revision = start_revision
        backoff = Backoff(0.1, 2.0)
        i = self._current
        while True:
            call = self._endpoint(i).watch.Watch()
            try:
                create.start_revision = next_revision
                await call.write(rpc_pb2.WatchRequest(create_request=create))
                while True:
                    resp = await call.read()
                    if not isinstance(resp, rpc_pb2.WatchResponse):  # EOF
                        raise _StreamEnded("etcd ended the watch stream")
                    if resp.compact_revision:
                        raise EtcdCompacted(
                            f"watch of {key!r}: revision {next_revision} compacted "
                            f"(oldest kept: {resp.compact_revision})"
                        )
                    if resp.canceled:
                        raise EtcdUnavailable(f"etcd cancelled the watch of {key!r}: {resp.cancel_reason}")
                    if resp.created:
                        backoff.reset()
                        # "From now" becomes a revision, so a reconnect misses nothing in between.
                        next_revision = next_revision or resp.header.revision + 1
                    if resp.events:
                        next_revision = resp.events[-1].kv.mod_revision + 1
                        yield list(resp.events)
            except (grpc.aio.AioRpcError, _StreamEnded, asyncio.InvalidStateError) as err:
                if isinstance(err, grpc.aio.AioRpcError) and not RetryPolicy().retryable(err.code()):
                    raise
                log.warn(
                    "etcd_watch_broken",
                    endpoint=self._targets[i],
                    key=key.decode(errors="replace"),
                    resume_revision=next_revision,
                    error=_describe(err),
                )
            finally:
                call.cancel()
            # Where another call last got an answer; else the next endpoint in turn.
            i = (i + 1) % len(self._targets) if i == self._current else self._current
            await backoff.sleep()

    # ---- endpoints -----------------------------------------------------------------------------

    async def _call(self, what: str, attempt: Callable[[_Endpoint], Awaitable[T]]) -> T:
        """``attempt`` on each endpoint in turn, from the one that answered last, until one
        answers; the first one gets a second try at the end, since a connection that was just
        reset fails calls until the channel has seen the reset and reconnected (so does a lone
        endpoint's): that try comes :data:`RETRY_AFTER_S` later."""
        failures = []
        for k in range(len(self._targets) + 1):
            i = (self._current + k) % len(self._targets)
            if k == len(self._targets):
                await asyncio.sleep(RETRY_AFTER_S)
            try:
                result = await attempt(self._endpoint(i))
            except (grpc.aio.AioRpcError, TimeoutError, _StreamEnded) as err:
                if isinstance(err, grpc.aio.AioRpcError) and err.code() not in _UNANSWERED:
                    raise
                failures.append(f"{self._targets[i]}: {_describe(err)}")
                continue
            if i != self._current:
                log.event("etcd_endpoint", endpoint=self._targets[i], previous=self._targets[self._current])
                self._current = i
            return result
        raise EtcdUnavailable(f"etcd {what}: no endpoint answered ({'; '.join(failures)})")

    def _endpoint(self, i: int) -> _Endpoint:
        e = self._endpoints.get(i)
        if e is None:
            if self._closed:  # a watch still iterating must not open channels again
                raise EtcdUnavailable("etcd client closed")
            target = self._targets[i]
            if self._creds is None:
                channel = grpc.aio.insecure_channel(target, options=_OPTIONS)
            else:
                channel = grpc.aio.secure_channel(target, self._creds, options=_OPTIONS)
            e = _Endpoint(channel, KVStub(channel), LeaseStub(channel), WatchStub(channel))
            self._endpoints[i] = e
        return e

    async def close(self) -> None:
        self._closed = True
        for lease_id in list(self._keepalives):
            self._drop_keepalive(lease_id)
        endpoints, self._endpoints = list(self._endpoints.values()), {}
        for e in endpoints:
            await e.channel.close()


# ---- requests and compares for txn() ---------------------------------------------------------


def op_put(key: bytes, value: bytes, lease: int = 0) -> rpc_pb2.RequestOp:
    return rpc_pb2.RequestOp(request_put=rpc_pb2.PutRequest(key=key, value=value, lease=lease))


def op_delete(key: bytes, *, prefix: bool = False, range_end: bytes = b"") -> rpc_pb2.RequestOp:
    """Delete ``key``, every key under it (``prefix``), or every key in [key, range_end)."""
    if prefix and range_end:
        raise ValueError("op_delete takes prefix or range_end, not both")
    req = rpc_pb2.DeleteRangeRequest(key=key, range_end=prefix_end(key) if prefix else range_end)
    return rpc_pb2.RequestOp(request_delete_range=req)


def op_get(key: bytes, *, prefix: bool = False) -> rpc_pb2.RequestOp:
    req = rpc_pb2.RangeRequest(key=key, range_end=prefix_end(key) if prefix else b"")
    return rpc_pb2.RequestOp(request_range=req)


def cmp_create(key: bytes, rev: int) -> rpc_pb2.Compare:
    """``key`` was created at revision ``rev`` (0: it does not exist)."""
    return rpc_pb2.Compare(result=_EQUAL, target=rpc_pb2.Compare.CREATE, key=key, create_revision=rev)


def cmp_mod(key: bytes, rev: int) -> rpc_pb2.Compare:
    """``key`` was last written at revision ``rev`` (0: it does not exist)."""
    return rpc_pb2.Compare(result=_EQUAL, target=rpc_pb2.Compare.MOD, key=key, mod_revision=rev)


def cmp_version(key: bytes, version: int) -> rpc_pb2.Compare:
    """``key`` has been written ``version`` times since its creation (0: it does not exist)."""
    return rpc_pb2.Compare(result=_EQUAL, target=rpc_pb2.Compare.VERSION, key=key, version=version)


def cmp_value(key: bytes, value: bytes) -> rpc_pb2.Compare:
    return rpc_pb2.Compare(result=_EQUAL, target=rpc_pb2.Compare.VALUE, key=key, value=value)


def prefix_end(prefix: bytes) -> bytes:
    """The end of the key range holding every key that starts with ``prefix``: the prefix up to
    its last byte below 0xff, that byte plus one; ``b"\\0"`` (no end) when there is no such byte."""
    for k in range(len(prefix) - 1, -1, -1):
        if prefix[k] < 0xFF:
            return prefix[:k] + bytes([prefix[k] + 1])
    return b"\0"


# ---- helpers ----------------------------------------------------------------------------------


def _credentials(ca_file: str, cert_file: str, key_file: str) -> grpc.ChannelCredentials | None:
    """TLS when a CA or a client certificate is given (None: plaintext). Read once, here."""
    # Checked even when TLS is off: a private key others can read is a leak already.
    key = read_private_file(key_file, "etcd key file", MAX_TLS_FILE_BYTES) if key_file else None
    if bool(cert_file) != bool(key_file):
        raise ConfigError("etcd_cert_file and etcd_key_file go together: set both or neither")
    if not (ca_file or cert_file):
        return None
    return grpc.ssl_channel_credentials(
        # None: the system's trusted roots verify etcd's certificate.
        root_certificates=read_public_file(ca_file, "etcd CA file") if ca_file else None,
        private_key=key,
        certificate_chain=read_public_file(cert_file, "etcd certificate file") if cert_file else None,
    )


def _describe(err: BaseException) -> str:
    if isinstance(err, grpc.aio.AioRpcError):
        return f"{err.code().name}: {err.details()}"
    return str(err) or type(err).__name__
