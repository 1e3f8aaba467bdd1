"""Registering motor.v1 services with raw-bytes deserialisation.

grpc's own deserialiser turns a ``DecodeError`` into UNKNOWN with a Python class name; we take the
bytes ourselves so malformed input becomes INVALID_ARGUMENT "malformed protobuf". The same wrapper
runs the service's request validators and converts :class:`MotorError` into a rich status, so
handlers just ``return`` or ``raise``.

A request carrying a field number its schema does not know, at any depth, is refused too
(INVALID_ARGUMENT naming the message, where it sits and the number): the parser would keep it
and every handler would ignore it, so a stale client's removed field (or a newer client's new
one) would be dropped without a word. One request message of a stream counts the same: it ends
the stream.

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
from google.protobuf.descriptor import FieldDescriptor, MethodDescriptor, ServiceDescriptor
from google.protobuf.message import DecodeError, Message
from google.protobuf.unknown_fields import UnknownFieldSet

from motor_mesh.common import errors, log

Validator = Callable[[Any], list[tuple[str, str]]]
_MESSAGE_TYPES = (FieldDescriptor.TYPE_MESSAGE, FieldDescriptor.TYPE_GROUP)


async def abort(context: grpc.aio.ServicerContext, err: errors.MotorError) -> None:
    status = err.to_status()
    await context.abort(status.code, status.details, status.trailing_metadata)


def _parse(cls: type[Message], raw: bytes, method: str) -> Message:
    try:
        request = cls.FromString(raw)
    except (DecodeError, RuntimeWarning, ValueError) as exc:
        raise errors.malformed_protobuf(method) from exc
    if _drop_unknown_fields(request):
        # Dropped, so parsed again to say where they were (only a refused request pays for it).
        raise errors.unknown_fields(method, unknown_fields(cls.FromString(raw)))
    return request


def _drop_unknown_fields(message: Message) -> bool:
    """Whether ``message`` carried unknown fields at any depth; it carries none after. Both
    steps run in protobuf's C code, so a request without any (every one a Motor client sends)
    costs a few microseconds rather than a walk over its messages in Python: dropping an
    unknown field always shrinks the encoding, which ``ByteSize`` measures on the message as
    parsed, whatever the encoding it came in."""
    size = message.ByteSize()
    message.DiscardUnknownFields()
    return message.ByteSize() != size


def unknown_fields(message: Message) -> list[tuple[str, str]]:
    """(field path, problem) for ``message`` and every message inside it, depth first, that
    carries unknown fields: ``("instances[0].endpoints[1]", "motor.v1.Endpoint
    (instances[0].endpoints[1]) has unknown field 15")``; the path is ``""`` for ``message``."""
    found: list[tuple[str, str]] = []
    _collect_unknown(message, "", found)
    return found


def _collect_unknown(message: Message, path: str, found: list[tuple[str, str]]) -> None:
    unknown = UnknownFieldSet(message)
    numbers = sorted({unknown[i].field_number for i in range(len(unknown))})
    if numbers:
        where = f" ({path})" if path else ""
        plural = "s" if len(numbers) > 1 else ""
        listed = ", ".join(map(str, numbers))
        found.append((path, f"{message.DESCRIPTOR.full_name}{where} has unknown field{plural} {listed}"))
    for field, value in message.ListFields():
        if field.type not in _MESSAGE_TYPES:
            continue
        name = f"{path}.{field.name}" if path else field.name
        entry = field.message_type
        assert entry is not None  # a message field always has its type
        if entry.GetOptions().map_entry:
            if entry.fields_by_name["value"].type in _MESSAGE_TYPES:
                for key, item in value.items():
                    shown = f'"{key}"' if isinstance(key, str) else key
                    _collect_unknown(item, f"{name}[{shown}]", found)
        elif field.is_repeated:
            for i, item in enumerate(value):
                _collect_unknown(item, f"{name}[{i}]", found)
        else:
            _collect_unknown(value, name, found)


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
