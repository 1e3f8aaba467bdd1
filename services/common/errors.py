"""Rich gRPC errors (google.rpc details) raised by handlers and turned into statuses by the
method wrapper in ``motor_mesh.common.rpc``.

Handlers ``raise`` a :class:`MotorError` built by the helpers below instead of calling
``context.abort`` themselves, so the same code runs under tests without a gRPC context and every
error carries a detail that names what was wrong.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import grpc
from google.protobuf import any_pb2, duration_pb2
from google.protobuf.message import Message
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status

DOMAIN = "motor"

# The status travels in trailers (grpc-message, percent-encoded, and grpc-status-details-bin,
# base64), and a gRPC client drops a call whose metadata passes its limit (8 KiB by default):
# the caller would see RESOURCE_EXHAUSTED "Stream removed" instead of the real status. Error
# texts quote what the request held (a 100 kB host name, thousands of bad elements), so both are
# bounded: the message, every string inside a detail, and the entries of a repeated detail field.
MAX_MESSAGE_BYTES = 512
MAX_DETAIL_TEXT_BYTES = 160
MAX_DETAIL_ENTRIES = 8


def clip(text: str, limit: int) -> str:
    """``text`` cut to at most ``limit`` UTF-8 bytes (whole characters), saying how much went."""
    raw = text.encode("utf-8", "surrogatepass")
    if len(raw) <= limit:
        return text
    marker = f"... ({len(raw)} bytes)"
    kept = raw[: max(0, limit - len(marker))].decode("utf-8", "ignore")
    return kept + marker


def _bounded(detail: Message) -> Message:
    """A copy of ``detail`` whose strings and repeated entries fit the trailer budget."""
    out = type(detail)()
    out.CopyFrom(detail)
    _bound(out)
    return out


def _bound(msg: Message) -> None:
    for field, value in msg.ListFields():
        name = field.name
        if field.type == field.TYPE_STRING:
            if field.is_repeated:
                kept = [clip(v, MAX_DETAIL_TEXT_BYTES) for v in value[:MAX_DETAIL_ENTRIES]]
                del value[:]
                value.extend(kept)
            else:
                setattr(msg, name, clip(value, MAX_DETAIL_TEXT_BYTES))
        elif field.type == field.TYPE_MESSAGE:
            entry = field.message_type
            if entry is not None and entry.GetOptions().map_entry:  # ErrorInfo.metadata
                items = list(value.items())
                value.clear()
                for k, v in items[:MAX_DETAIL_ENTRIES]:
                    if isinstance(v, str):
                        value[clip(k, MAX_DETAIL_TEXT_BYTES)] = clip(v, MAX_DETAIL_TEXT_BYTES)
            elif field.is_repeated:
                extra = len(value) - MAX_DETAIL_ENTRIES
                del value[MAX_DETAIL_ENTRIES:]
                for item in value:
                    _bound(item)
                if extra > 0 and isinstance(msg, error_details_pb2.BadRequest):
                    value.add(field="", description=f"and {extra} more problems")
            else:
                _bound(value)


class MotorError(Exception):
    """An RPC failure with a precise code, a one-line message and google.rpc details.

    The message and the details are bounded (:data:`MAX_MESSAGE_BYTES` and friends) so the
    status always reaches the caller."""

    def __init__(self, code: grpc.StatusCode, message: str, details: Iterable[Message] = ()) -> None:
        message = clip(message, MAX_MESSAGE_BYTES)
        super().__init__(message)
        self.code = code
        self.message = message
        self.details = list(details)

    def to_status(self) -> grpc.Status:
        packed = []
        for d in self.details:
            a = any_pb2.Any()
            a.Pack(_bounded(d))
            packed.append(a)
        proto = status_pb2.Status(code=self.code.value[0], message=self.message, details=packed)
        return rpc_status.to_status(proto)

    def __repr__(self) -> str:
        return f"MotorError({self.code.name}, {self.message!r})"


def bad_request(violations: Iterable[tuple[str, str]], message: str | None = None) -> MotorError:
    """INVALID_ARGUMENT naming each bad field (``instances[0].endpoints[1].port``)."""
    items = list(violations)
    detail = error_details_pb2.BadRequest(
        field_violations=[
            error_details_pb2.BadRequest.FieldViolation(field=f, description=d) for f, d in items
        ]
    )
    if message is None:
        message = "; ".join(f"{f}: {d}" if f else d for f, d in items) or "invalid request"
    return MotorError(grpc.StatusCode.INVALID_ARGUMENT, message, [detail])


def malformed_protobuf(method: str) -> MotorError:
    detail = error_details_pb2.BadRequest(
        field_violations=[
            error_details_pb2.BadRequest.FieldViolation(field="", description="malformed protobuf")
        ]
    )
    return MotorError(
        grpc.StatusCode.INVALID_ARGUMENT, f"malformed protobuf in request to {method}", [detail]
    )


def unknown_fields(method: str, found: list[tuple[str, str]]) -> MotorError:
    """INVALID_ARGUMENT for a request carrying fields its schema does not know: ``found`` is
    (field path, problem) per message that carries some (``motor_mesh.common.rpc``)."""
    return bad_request(found, f"unknown fields in request to {method}: " + "; ".join(d for _, d in found))


def error_info(code: grpc.StatusCode, reason: str, message: str, **metadata: str) -> MotorError:
    detail = error_details_pb2.ErrorInfo(reason=reason, domain=DOMAIN, metadata=metadata)
    return MotorError(code, message, [detail])


def already_exists(reason: str, message: str, **metadata: str) -> MotorError:
    return error_info(grpc.StatusCode.ALREADY_EXISTS, reason, message, **metadata)


def precondition(type_: str, subject: str, message: str) -> MotorError:
    """FAILED_PRECONDITION with a PreconditionFailure (``STALE_SESSION``, ``NODE_MISMATCH`` …)."""
    detail = error_details_pb2.PreconditionFailure(
        violations=[
            error_details_pb2.PreconditionFailure.Violation(type=type_, subject=subject, description=message)
        ]
    )
    return MotorError(grpc.StatusCode.FAILED_PRECONDITION, message, [detail])


def not_found(resource_type: str, name: str, message: str | None = None) -> MotorError:
    detail = error_details_pb2.ResourceInfo(resource_type=resource_type, resource_name=name)
    return MotorError(grpc.StatusCode.NOT_FOUND, message or f"{resource_type} {name} not found", [detail])


def unavailable(message: str, retry_after_s: float | None = 1.0) -> MotorError:
    details: list[Message] = []
    if retry_after_s is not None:
        details.append(_retry_info(retry_after_s))
    return MotorError(grpc.StatusCode.UNAVAILABLE, message, details)


def resource_exhausted(message: str, retry_after_s: float = 1.0) -> MotorError:
    return MotorError(grpc.StatusCode.RESOURCE_EXHAUSTED, message, [_retry_info(retry_after_s)])


def unimplemented(capability: str) -> MotorError:
    return MotorError(grpc.StatusCode.UNIMPLEMENTED, f"not implemented yet: {capability}")


def internal(method: str) -> MotorError:
    """What a caller sees when a handler fails unexpectedly: the server logs the traceback; the
    caller gets no exception text (it may hold paths, addresses or secrets)."""
    return error_info(
        grpc.StatusCode.INTERNAL, "INTERNAL", f"internal error in {method}; see the server log", method=method
    )


def _retry_info(seconds: float) -> error_details_pb2.RetryInfo:
    whole = int(seconds)
    return error_details_pb2.RetryInfo(
        retry_delay=duration_pb2.Duration(seconds=whole, nanos=int((seconds - whole) * 1e9))
    )


_DETAIL_TYPES = (
    error_details_pb2.BadRequest,
    error_details_pb2.ErrorInfo,
    error_details_pb2.PreconditionFailure,
    error_details_pb2.ResourceInfo,
    error_details_pb2.RetryInfo,
)


def details_of(err: grpc.aio.AioRpcError | grpc.RpcError) -> list[Message]:
    """Unpack the google.rpc details of a received error (for clients and tests)."""
    trailers: Any = err.trailing_metadata() or ()
    for key, value in trailers:
        if key == "grpc-status-details-bin":
            status = status_pb2.Status.FromString(value)
            out: list[Message] = []
            for any_ in status.details:
                for cls in _DETAIL_TYPES:
                    if any_.Is(cls.DESCRIPTOR):
                        msg = cls()
                        any_.Unpack(msg)
                        out.append(msg)
            return out
    return []


class RpcFailure(Exception):
    """A call a peer answered with an error, as a client sees it: the status code, the message,
    and what the google.rpc details say — ``reason`` (ErrorInfo reason, or the PreconditionFailure
    type such as ``NODE_MISMATCH`` or ``STALE_SESSION``), ``metadata`` (the ErrorInfo's, such as
    the ``leader`` a standby Controller names) and ``retry_after`` (RetryInfo, seconds).
    """

    def __init__(
        self,
        code: grpc.StatusCode,
        message: str,
        reason: str = "",
        retry_after: float | None = None,
        metadata: dict[str, str] | None = None,
    ) -> None:
        super().__init__(f"{code.name}: {message}" if message else code.name)
        self.code = code
        self.message = message
        self.reason = reason
        self.retry_after = retry_after
        self.metadata = metadata or {}

    @classmethod
    def of(cls, err: grpc.RpcError) -> RpcFailure:
        code = err.code() if callable(getattr(err, "code", None)) else None
        message = err.details() if callable(getattr(err, "details", None)) else ""
        reason, retry_after, metadata = "", None, {}
        for d in details_of(err) if callable(getattr(err, "trailing_metadata", None)) else []:
            if isinstance(d, error_details_pb2.ErrorInfo) and not reason:
                reason, metadata = d.reason, dict(d.metadata)
            elif isinstance(d, error_details_pb2.PreconditionFailure) and d.violations and not reason:
                reason = d.violations[0].type
            elif isinstance(d, error_details_pb2.RetryInfo):
                retry_after = d.retry_delay.seconds + d.retry_delay.nanos / 1e9
        return cls(code or grpc.StatusCode.UNKNOWN, message or "", reason, retry_after, metadata)
