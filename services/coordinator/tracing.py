"""Spans of the inference path (docs/tracing.md): one SERVER span per completion request and,
when it is recorded, one CLIENT span per leg attempt under it; each engine request carries the
W3C ``traceparent`` of its leg.

Imported only when tracing is on (:mod:`motor_mesh.common.telemetry`): with it off the request
path holds ``None`` where a :class:`RequestTracer` would be, checks that once per request (and
once per leg), and neither OpenTelemetry nor this module is loaded.

The request's parent is the client's ``traceparent``/``tracestate`` (W3C Trace Context), when
valid; the answer carries the server span's context in a ``traceresponse`` header (same format
as ``traceparent``): the W3C name for a trace context in a response, so a client that sent none
can still find its trace, and nothing that forwards request headers can mistake it for one.
"""

from __future__ import annotations

from typing import Any

from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode

from motor_mesh.common import telemetry
from motor_mesh.common.httpmessages import Request
from motor_mesh.coordinator.routes import Upstream
from motor_mesh.coordinator.upstream import JSON_HEADER


def traceparent(ctx: trace.SpanContext) -> str:
    return f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{ctx.trace_flags:02x}"


def _headers(ctx: trace.SpanContext, parent: str | None = None) -> bytes:
    """An engine request's header block naming ``ctx`` (``parent``: its traceparent, if made
    already) as its parent."""
    head = b"%straceparent: %s\r\n" % (JSON_HEADER, (parent or traceparent(ctx)).encode())
    if ctx.trace_state:
        head += b"tracestate: %s\r\n" % ctx.trace_state.to_header().encode("latin-1")
    return head


class RequestTracer:
    """Starts the spans of one process's inference server."""

    def __init__(self, provider: Any) -> None:
        self.tracer = provider.get_tracer("motor.coordinator")

    def start(self, req: Request, scheme: str) -> RequestTrace:
        return RequestTrace(self.tracer, req, scheme)


class RequestTrace:
    """The SERVER span of one completion request and the legs under it.

    A request the sampler left out (its span not recording) makes no leg spans: no sampler
    records the child of a span it did not (the parent-based ones follow the parent, the ratio
    ones decide by the same trace id), so the engines get the request span's own context, with
    its "not sampled" flag, and a trace costs one span."""

    __slots__ = ("_attempts", "_ctx", "_path", "_tracer", "_unrecorded", "reply", "span")

    def __init__(self, tracer: trace.Tracer, req: Request, scheme: str) -> None:
        self._tracer = tracer
        method, path = req.method, req.path
        # What a sampler may look at is there from the start; the rest only when recorded.
        span = tracer.start_span(
            f"{method} {path}",
            context=telemetry.incoming_context(req.headers),
            kind=SpanKind.SERVER,
            attributes={"http.request.method": method, "url.path": path, "url.scheme": scheme},
        )
        ctx = span.get_span_context()
        self.span = span
        named = traceparent(ctx)
        self.reply = [("traceresponse", named)]
        self._path = path
        self._attempts: dict[str, int] = {}
        if span.is_recording():
            attrs: dict[str, Any] = {"http.route": path, "client.address": req.peer}
            agent = req.headers.get(b"user-agent")
            if agent:
                attrs["user_agent.original"] = agent.decode("latin-1")
            span.set_attributes(attrs)
            self._ctx: Any = trace.set_span_in_context(span)
            self._unrecorded: Leg | None = None
        else:
            self._ctx = None
            self._unrecorded = Leg(_headers(ctx, named))

    def model(self, name: str) -> None:
        self.span.set_attribute("gen_ai.request.model", name)

    def leg(self, role: str, ep: Upstream) -> Leg:
        """A new attempt of a ``role`` leg, on endpoint ``ep``."""
        if self._unrecorded is not None:
            return self._unrecorded
        n = self._attempts.get(role, 0) + 1
        self._attempts[role] = n
        return RecordedLeg(self._tracer, self._ctx, role, ep, self._path, n)

    def continuation(self, n: int, reason: str, delivered: int) -> Any:
        """A span for the ``n``-th continuation of this request (ended by the caller): from the
        break to the end of the legs that continue it, which are its siblings under the request."""
        if self._unrecorded is not None:
            return None
        attrs: dict[str, Any] = {
            "motor.migration.attempt": n,
            "motor.migration.reason": reason,
            "motor.migration.tokens_delivered": delivered,
        }
        return self._tracer.start_span(
            "continuation", context=self._ctx, kind=SpanKind.INTERNAL, attributes=attrs
        )

    def end(self, status: int, cancelled: bool = False) -> None:
        """Record the status the client got (``cancelled``: none, the client went away)."""
        span = self.span
        if span.is_recording():
            if cancelled:
                span.set_attribute("error.type", "cancelled")
                span.set_status(Status(StatusCode.ERROR, "the client went away"))
            else:
                span.set_attribute("http.response.status_code", status)
                if status >= 500:  # a 4xx is the client's error, not the server's
                    span.set_attribute("error.type", str(status))
                    span.set_status(Status(StatusCode.ERROR))
        span.end()


class Leg:
    """One attempt of one leg on one engine endpoint: the header block its engine request
    carries (``traceparent``, and the client's ``tracestate``). Records nothing itself."""

    __slots__ = ("headers",)

    def __init__(self, headers: bytes) -> None:
        self.headers = headers

    def answered(self, status: int) -> None:
        """The engine's answer began with ``status``."""

    def failed(self, kind: str, message: str) -> None:
        """No answer, or a broken one: ``kind`` is connect, disconnect or timeout."""

    def end(self) -> None:
        """Idempotent."""


class RecordedLeg(Leg):
    """A leg with a CLIENT span of its own, whose context its engine gets."""

    __slots__ = ("_done", "_outcome", "span")

    def __init__(
        self, tracer: trace.Tracer, parent: Any, role: str, ep: Upstream, path: str, attempt: int
    ) -> None:
        attrs: dict[str, Any] = {
            "http.request.method": "POST",
            "server.address": ep.host,
            "server.port": ep.port,
            "url.full": ep.base + path,
            "motor.instance_id": ep.owner.id,
            "motor.attempt": attempt,
        }
        span = tracer.start_span(role, context=parent, kind=SpanKind.CLIENT, attributes=attrs)
        super().__init__(_headers(span.get_span_context()))
        self.span = span
        self._outcome = self._done = False

    def answered(self, status: int) -> None:
        self._outcome = True
        span = self.span
        span.set_attribute("http.response.status_code", status)
        if status >= 400:  # a client span's error: the engine refused or failed the leg
            span.set_attribute("error.type", str(status))
            span.set_status(Status(StatusCode.ERROR))

    def failed(self, kind: str, message: str) -> None:
        self._outcome = True
        self.span.set_attribute("error.type", kind)
        self.span.set_status(Status(StatusCode.ERROR, message))

    def end(self) -> None:
        """A leg that ends with no outcome was cancelled: the client went away, or the other
        leg of its pair failed first."""
        if self._done:
            return
        self._done = True
        if not self._outcome:
            self.failed("cancelled", "cancelled before the engine answered")
        self.span.end()
