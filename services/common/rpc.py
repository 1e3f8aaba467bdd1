"""Registering motor.v1 services with raw-bytes deserialisation.

grpc's own deserialiser turns a ``DecodeError`` into UNKNOWN with a Python class name; we take the
bytes ourselves so malformed input becomes INVALID_ARGUMENT "malformed protobuf". The same wrapper
runs the service's request validators and converts :class:`MotorError` into a rich status, so
handlers just ``return`` or ``raise``.

A servicer subclasses the generated ``*Servicer`` class and has one coroutine per RPC:
- unary: ``async def Method(self, request, context) -> Response``
- server streaming: ``async def Method(self, request, context)`` async generator of responses
- bidi streaming: ``async def Method(self, stream, context)`` with ``await stream.read()`` (None at
  the end) and ``await stream.write(response)``: see :class:`BidiStream`
It may define ``VALIDATORS = {"Method": fn}`` where ``fn(request) -> [(field_path, problem)]``.

Any other exception a handler raises is a bug: its traceback goes to the log (``event=rpc_failed``)
and the caller gets INTERNAL with an ``ErrorInfo`` (reason ``INTERNAL``), never the exception text.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any

import grpc
from google.protobuf import message_factory
from google.protobuf.descriptor import MethodDescriptor, ServiceDescriptor
from google.protobuf.message import DecodeError, Message

from motor_mesh.common import errors, log

Validator = Callable[[Any], list[tuple[str, str]]]


async def abort(context: grpc.aio.ServicerContext, err: errors.MotorError) -> None:
    status = err.to_status()
    await context.abort(status.code, status.details, status.trailing_metadata)


def _parse(cls: type[Message], raw: bytes, method: str) -> Message:
    try:
        return cls.FromString(raw)
    except (DecodeError, RuntimeWarning, ValueError) as exc:
        raise errors.malformed_protobuf(method) from exc


def _check(validator: Validator | None, request: Message) -> None:
    if validator is not None:
        problems = validator(request)
        if problems:
            raise errors.bad_request(problems)


async def _fail(context: grpc.aio.ServicerContext, exc: Exception, name: str) -> None:
    """End the call for an exception a handler raised: a MotorError becomes its rich status; any
    other exception is a bug, logged with its traceback and answered INTERNAL with an ErrorInfo
    (never the exception's text). An abort the handler already issued passes through."""
    if isinstance(exc, grpc.aio.AbortError):
        raise exc
    if isinstance(exc, errors.MotorError):
        await abort(context, exc)
        return
    log.exception("rpc_failed", method=name)
    await abort(context, errors.internal(name))


def _unary_unary(fn: Callable, req_cls: type[Message], validator: Validator | None, name: str) -> Callable:
    async def behaviour(raw: bytes, context: grpc.aio.ServicerContext) -> Any:
        try:
            request = _parse(req_cls, raw, name)
            _check(validator, request)
            return await fn(request, context)
        except Exception as exc:
            await _fail(context, exc, name)

    return behaviour


def _unary_stream(fn: Callable, req_cls: type[Message], validator: Validator | None, name: str) -> Callable:
    async def behaviour(raw: bytes, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        try:
            request = _parse(req_cls, raw, name)
            _check(validator, request)
            async for response in fn(request, context):
                yield response
        except Exception as exc:
            await _fail(context, exc, name)

    return behaviour


class BidiStream:
    """The request side of a bidi stream, parsed and validated message by message.

    Bidi handlers use read/write rather than async generators: each generator layer costs a
    resume per message, and the heartbeat stream is the Controller's hottest path.
    """

    __slots__ = ("_cls", "_context", "_name", "_validator", "write")

    def __init__(
        self, context: grpc.aio.ServicerContext, cls: type[Message], validator: Validator | None, name: str
    ) -> None:
        self._context, self._cls, self._validator, self._name = context, cls, validator, name
        self.write = context.write

    async def read(self) -> Any:
        """The next request, or None once the client half-closed."""
        raw = await self._context.read()
        if raw is grpc.aio.EOF:
            return None
        request = _parse(self._cls, raw, self._name)
        _check(self._validator, request)
        return request


def _stream_stream(fn: Callable, req_cls: type[Message], validator: Validator | None, name: str) -> Callable:
    # gRPC passes its request iterator too; BidiStream reads from the context instead.
    async def behaviour(_requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext) -> None:
        try:
            await fn(BidiStream(context, req_cls, validator, name), context)
        except Exception as exc:
            await _fail(context, exc, name)

    return behaviour


def service_handler(service: ServiceDescriptor, servicer: object) -> grpc.GenericRpcHandler:
    """A generic handler serving every method of ``service`` from ``servicer``."""
    validators: Mapping[str, Validator] = getattr(servicer, "VALIDATORS", {})
    handlers: dict[str, grpc.RpcMethodHandler] = {}
    for method in service.methods:
        handlers[method.name] = _method_handler(method, servicer, validators.get(method.name))
    return grpc.method_handlers_generic_handler(service.full_name, handlers)


def _method_handler(method: MethodDescriptor, servicer: object, validator: Validator | None) -> Any:
    req_cls = message_factory.GetMessageClass(method.input_type)
    resp_cls = message_factory.GetMessageClass(method.output_type)
    fn = getattr(servicer, method.name)
    full = f"/{method.containing_service.full_name}/{method.name}"
    serialize = resp_cls.SerializeToString
    if method.client_streaming and method.server_streaming:
        return grpc.stream_stream_rpc_method_handler(
            _stream_stream(fn, req_cls, validator, full), response_serializer=serialize
        )
    if method.client_streaming:
        raise NotImplementedError(f"{full}: client-streaming RPCs are not used by motor.v1")
    if method.server_streaming:
        return grpc.unary_stream_rpc_method_handler(
            _unary_stream(fn, req_cls, validator, full), response_serializer=serialize
        )
    return grpc.unary_unary_rpc_method_handler(
        _unary_unary(fn, req_cls, validator, full), response_serializer=serialize
    )
