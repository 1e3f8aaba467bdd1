"""Server interceptors: the management key and the access log.

Both apply to motor.v1 methods only: health and reflection never need a key, and logging every
health probe would drown the log.
"""

from __future__ import annotations

import asyncio
import hmac
import inspect
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

import grpc

from motor_mesh.common import log

KEY_METADATA = "x-motor-management-key"
# The pushing Controller's leader term (etcd store): Coordinators refuse an older one.
LEADER_TERM_METADATA = "x-motor-leader-term"
_MOTOR_PREFIX = "/motor.v1."


def _same_kind(handler: grpc.RpcMethodHandler, behaviour: Callable) -> grpc.RpcMethodHandler:
    """A handler of the same cardinality as ``handler`` running ``behaviour``."""
    kw = {
        "request_deserializer": handler.request_deserializer,
        "response_serializer": handler.response_serializer,
    }
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(behaviour, **kw)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(behaviour, **kw)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(behaviour, **kw)
    return grpc.unary_unary_rpc_method_handler(behaviour, **kw)


def _behaviour(handler: grpc.RpcMethodHandler) -> Callable:
    return handler.unary_unary or handler.unary_stream or handler.stream_unary or handler.stream_stream  # type: ignore[return-value]


class ManagementKeyInterceptor(grpc.aio.ServerInterceptor):
    """Requires ``x-motor-management-key`` on every motor.v1 RPC, compared in constant time."""

    def __init__(self, key: str) -> None:
        self._key = key.encode()

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[Any]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None or not details.method.startswith(_MOTOR_PREFIX):
            return handler
        presented = None
        for k, v in details.invocation_metadata or ():
            if k == KEY_METADATA:
                presented = v.encode() if isinstance(v, str) else v
        if presented is not None and hmac.compare_digest(presented, self._key):
            return handler
        code, msg = (
            (grpc.StatusCode.UNAUTHENTICATED, "management key required (metadata x-motor-management-key)")
            if presented is None
            else (grpc.StatusCode.PERMISSION_DENIED, "management key does not match")
        )
        log.warn("auth_denied", method=details.method, code=code.name)

        if handler.response_streaming:

            async def deny_stream(request: Any, context: grpc.aio.ServicerContext) -> Any:
                await context.abort(code, msg)
                yield  # pragma: no cover - makes this an async generator

            return _same_kind(handler, deny_stream)

        async def deny(request: Any, context: grpc.aio.ServicerContext) -> Any:
            await context.abort(code, msg)

        return _same_kind(handler, deny)


# Reads that clients poll every second or two (`motor up` following the desired counts, `motor
# top`): logged only when they fail, or at debug level, so they do not drown the other lines.
POLLED_METHODS = frozenset(
    {
        "/motor.v1.Controller/ListDesiredInstances",
        "/motor.v1.Controller/GetPlannerStatus",
        "/motor.v1.Coordinator/GetEngineMetrics",
    }
)


class AccessLogInterceptor(grpc.aio.ServerInterceptor):
    """One ``event=rpc`` line per finished motor.v1 call: method, code, duration, peer."""

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[Any]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None or not details.method.startswith(_MOTOR_PREFIX):
            return handler
        inner = _behaviour(handler)
        method = details.method

        def record(
            context: grpc.aio.ServicerContext, start: float, exc: BaseException | None, peer: str
        ) -> None:
            code = context.code()  # set by abort(); None when the handler just returned or raised
            if not isinstance(code, grpc.StatusCode):
                cancelled = isinstance(exc, asyncio.CancelledError)
                code = (
                    grpc.StatusCode.OK
                    if exc is None
                    else (grpc.StatusCode.CANCELLED if cancelled else grpc.StatusCode.UNKNOWN)
                )
            if code in (grpc.StatusCode.OK, grpc.StatusCode.CANCELLED):
                level = logging.DEBUG if method in POLLED_METHODS else logging.INFO
            else:
                level = logging.WARNING
            fields = {
                "method": method,
                "code": code.name,
                "ms": round((time.perf_counter() - start) * 1000, 2),
                "peer": peer,
            }
            log.emit(level, "rpc", fields)

        if handler.response_streaming and inspect.isasyncgenfunction(inner):

            async def logged_stream(request: Any, context: grpc.aio.ServicerContext) -> Any:
                # Read the peer while the call is alive: context.peer() on a stream whose call
                # the core already released (a cancelled stream finalized later) segfaults.
                start, exc, peer = time.perf_counter(), None, context.peer()
                try:
                    async for item in inner(request, context):
                        yield item
                except BaseException as e:
                    exc = e
                    raise
                finally:
                    record(context, start, exc, peer)

            return _same_kind(handler, logged_stream)

        # Unary calls, and streams served with read/write (one coroutine for the whole stream).
        async def logged(request: Any, context: grpc.aio.ServicerContext) -> Any:
            start, exc, peer = time.perf_counter(), None, context.peer()
            try:
                return await inner(request, context)
            except BaseException as e:
                exc = e
                raise
            finally:
                record(context, start, exc, peer)

        return _same_kind(handler, logged)
