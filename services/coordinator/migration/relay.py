"""Relaying an answer that may continue elsewhere: whole events only, each read into the
request's :class:`Carry`, and a break (the engine lost, silent, failing, or the instance moved
away) raised as :class:`Break` for the router to continue from, instead of ending the answer."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from motor_mesh.common.httpclient import Disconnected, Response, UpstreamTimeout
from motor_mesh.common.httpmessages import Headers, Responder
from motor_mesh.coordinator.bodies import _dumps
from motor_mesh.coordinator.migration.carry import Carry
from motor_mesh.coordinator.migration.flight import Flight, Moved
from motor_mesh.coordinator.migration.sse import complete_end
from motor_mesh.coordinator.upstream import SSE_CT, SSE_HEADERS, Answer, Engines, _ctype

if TYPE_CHECKING:
    from motor_mesh.coordinator.metrics import Metrics
    from motor_mesh.coordinator.routes import Target
    from motor_mesh.coordinator.tracing import Leg


class Break(Exception):
    """The leg answering the client broke; ``reason`` is one of disconnect, closed, timeout,
    status, engine_error, drain, left. ``target``: the instance it was on."""

    def __init__(self, reason: str, target: Target, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason
        self.target = target


def _broke(
    engines: Engines, exc: BaseException, flight: Flight, target: Target, role: str, leg: Leg | None
) -> Break:
    """The Break for a read that failed (or was moved off its instance), counted and traced."""
    if isinstance(exc, Moved) or flight.reason is not None:
        kind = flight.reason or "left"
    else:
        kind = "timeout" if isinstance(exc, UpstreamTimeout) else "disconnect"
    engines.metrics.upstream_error(role, "timeout" if kind == "timeout" else "disconnect")
    if leg is not None:
        leg.failed(kind, str(exc))
    return Break(kind, target, f"the {role} engine {_WHAT[kind]}: {exc}")


_WHAT = {
    "disconnect": "dropped the connection",
    "timeout": "went quiet",
    "drain": "was drained",
    "left": "left the routing table",
}


async def stream(
    engines: Engines,
    out: Responder,
    resp: Response,
    carry: Carry,
    target: Target,
    flight: Flight,
    role: str,
    t0: float,
    reply: Headers,
    leg: Leg | None,
) -> None:
    """Relay an event stream into the client's answer (started on the first event of the first
    leg), complete events only, so a break leaves the client at an event boundary.
    Raises Break."""
    metrics = engines.metrics
    loop = asyncio.get_running_loop()
    idle = engines.deadlines.idle_s
    pending = b""
    try:
        while True:
            if flight.reason is not None:
                raise Moved(flight.reason)
            chunk = await resp.next_chunk(loop.time() + idle)
            if chunk is None:
                break
            pending = pending + chunk if pending else chunk
            end = complete_end(pending)
            if not end:
                continue
            block, pending = (pending, b"") if end == len(pending) else (pending[:end], pending[end:])
            # What the engine sent at once goes to the client at once: one write, not one per
            # event (a socket send each would cost more than everything else together).
            data = carry.feed_block(block)
            if data:
                await _write(out, carry, data, reply, metrics, loop.time(), t0)
            if carry.error is not None:
                await _engine_error(out, carry, target, role, leg, reply)
                return
    except (Disconnected, UpstreamTimeout, Moved) as exc:
        raise _broke(engines, exc, flight, target, role, leg) from None
    if pending.strip():
        last = carry.feed(pending)  # a last event without its blank line
        if last:
            await _write(out, carry, last, reply, metrics, loop.time(), t0)
    if not carry.over:
        if leg is not None:
            leg.failed("closed", "the stream ended before its last event")
        raise Break("closed", target, f"the {role} engine ended the stream before its last event")


async def _write(
    out: Responder, carry: Carry, data: bytes, reply: Headers, metrics: Metrics, now: float, t0: float
) -> None:
    if not carry.started:
        carry.started = True
        out.start(200, SSE_CT, SSE_HEADERS if reply is None else SSE_HEADERS + reply)
        metrics.first_byte(now - t0)
    elif carry.gap_from is not None:
        # The first event after a continuation: the pause across it is not an inter-token gap.
        metrics.migration_gap(now - carry.gap_from)
        carry.gap_from = None
    else:
        metrics.inter_token(now - carry.last)
    carry.last = now
    await out.write(data)


async def _engine_error(
    out: Responder, carry: Carry, target: Target, role: str, leg: Leg | None, reply: Headers
) -> None:
    """An error event: a server-side one (5xx, or no code) breaks the leg; the client's own
    mistake (4xx) ends the answer with it, as the engine meant."""
    err = carry.error or {}
    carry.error = None
    body = err.get("error")
    code = body.get("code") if isinstance(body, dict) else None
    status = code if isinstance(code, int) else 500
    if status >= 500:
        if leg is not None:
            leg.failed("engine_error", str(body)[:200])
        raise Break("engine_error", target, f"the {role} engine sent an error event: {str(body)[:200]}")
    if not carry.started:
        carry.started = True
        out.start(200, SSE_CT, SSE_HEADERS if reply is None else SSE_HEADERS + reply)
    carry.finish = "error"
    await out.write(b"data: " + _dumps(err) + b"\n\n")


async def whole(
    engines: Engines,
    out: Responder,
    resp: Response,
    target: Target,
    flight: Flight,
    role: str,
    t0: float,
    reply: Headers,
    leg: Leg | None,
) -> None:
    """A non-streamed answer, read whole and sent: a 5xx or a read that breaks raises Break
    (the client has seen nothing; the continuation starts the request afresh)."""
    loop = asyncio.get_running_loop()
    idle = engines.deadlines.idle_s
    try:
        if flight.reason is not None:
            raise Moved(flight.reason)
        data = await resp.read(loop.time() + idle)
    except (Disconnected, UpstreamTimeout, Moved) as exc:
        raise _broke(engines, exc, flight, target, role, leg) from None
    if resp.status >= 500:
        engines.metrics.upstream_error(role, "status")
        raise Break("status", target, f"the {role} engine answered {resp.status}")
    if resp.status >= 400:
        engines.metrics.upstream_error(role, "status")
    engines.metrics.first_byte(loop.time() - t0)
    Answer(resp.status, data, _ctype(resp)).send(out, reply)


def is_stream(resp: Response) -> bool:
    return _ctype(resp).startswith(SSE_CT)
