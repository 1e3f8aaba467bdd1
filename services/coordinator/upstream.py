"""Talking to engines: the keep-alive pool, per-phase deadlines, the circuit breaker's
"refused connection" signal, and relaying an engine's answer to the client.

Deadlines (docs/configuration.md): a prefill leg is bounded as a whole
(``prefill_timeout_s``); a decode leg (or a whole request on one instance) must begin answering
within ``decode_first_byte_timeout_s`` and may then go quiet for at most
``decode_idle_timeout_s`` between two reads, so a long stream that keeps producing is never cut.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from motor_mesh.common import log
from motor_mesh.common.http_errors import server_error
from motor_mesh.common.httpclient import Disconnected, Interrupt, Pool, Refused, Response, UpstreamTimeout
from motor_mesh.common.httpmessages import JSON_CT, Headers, Responder
from motor_mesh.coordinator.bodies import SseFilter, strip_kv
from motor_mesh.coordinator.metrics import Metrics
from motor_mesh.coordinator.routes import Upstream

if TYPE_CHECKING:  # loaded only when tracing is on
    from motor_mesh.coordinator.tracing import Leg

CONNECT_S = 5.0
SSE_CT = b"text/event-stream"
SSE_HEADERS = [("Cache-Control", "no-cache")]
JSON_HEADER = b"Content-Type: application/json\r\n"


@dataclass(frozen=True, slots=True)
class Deadlines:
    prefill_s: float
    first_byte_s: float
    idle_s: float


class Unreachable(Exception):
    """The engine could not be reached, or dropped the connection before answering."""

    def __init__(self, role: str, ep: Upstream, cause: BaseException) -> None:
        super().__init__(f"{role} engine {ep.base} unreachable: {cause}")
        self.role = role
        self.ep = ep


class PhaseTimeout(Exception):
    def __init__(self, role: str, ep: Upstream, setting: str, seconds: float) -> None:
        super().__init__(f"the {role} engine {ep.base} did not answer within {setting} ({seconds:g} s)")
        self.role = role


@dataclass(slots=True)
class Answer:
    """A fully read engine answer."""

    status: int
    body: bytes
    content_type: bytes

    def send(self, out: Responder, headers: Headers = None) -> None:
        out.send(self.status, strip_kv(self.body), self.content_type, headers)


def _ctype(resp: Response) -> bytes:
    return resp.headers.get(b"content-type", JSON_CT)


class Engines:
    """The shared pool plus the breaker hook (``on_refused`` takes an endpoint out)."""

    def __init__(
        self, metrics: Metrics, on_refused: Callable[[Upstream, str], None], deadlines: Deadlines
    ) -> None:
        self.metrics = metrics
        self.on_refused = on_refused
        self.deadlines = deadlines
        self.pool = Pool(CONNECT_S)

    def close(self) -> None:
        self.pool.close()

    def _unreachable(self, role: str, ep: Upstream, exc: Exception, leg: Leg | None) -> Unreachable:
        if isinstance(exc, Refused):
            kind = "connect"
            self.on_refused(ep, role)
        else:
            kind = "disconnect"
        self.metrics.upstream_error(role, kind)
        err = Unreachable(role, ep, exc)
        if leg is not None:
            leg.failed(kind, str(err))
        return err

    def _timeout(
        self, role: str, ep: Upstream, setting: str, seconds: float, leg: Leg | None
    ) -> PhaseTimeout:
        self.metrics.upstream_error(role, "timeout")
        err = PhaseTimeout(role, ep, setting, seconds)
        if leg is not None:
            leg.failed("timeout", str(err))
        return err

    async def open(
        self,
        ep: Upstream,
        path: bytes,
        body: bytes,
        role: str,
        leg: Leg | None = None,
        interrupt: Interrupt | None = None,
    ) -> Response:
        """POST and wait for the response head, within ``decode_first_byte_timeout_s``.
        Raises Unreachable / PhaseTimeout, or what ``interrupt`` is given meanwhile. ``leg``:
        the attempt's span (its context is sent, the outcome recorded; the caller ends it)."""
        limit = self.deadlines.first_byte_s
        deadline = asyncio.get_running_loop().time() + limit
        headers = JSON_HEADER if leg is None else leg.headers
        try:
            resp = await self.pool.request(
                ep.host, ep.port, b"POST", path, body, headers, deadline, interrupt
            )
        except (Refused, Disconnected) as exc:
            raise self._unreachable(role, ep, exc, leg) from None
        except UpstreamTimeout:
            raise self._timeout(role, ep, "decode_first_byte_timeout_s", limit, leg) from None
        if leg is not None:
            leg.answered(resp.status)
        return resp

    async def call(
        self,
        ep: Upstream,
        path: bytes,
        body: bytes,
        role: str,
        limit: float | None = None,
        leg: Leg | None = None,
    ) -> Answer:
        """POST and read the whole answer within ``limit`` (default ``prefill_timeout_s``)."""
        if limit is None:
            limit = self.deadlines.prefill_s
        setting = "prefill_timeout_s" if limit == self.deadlines.prefill_s else "the request's deadline"
        resp: Response | None = None
        deadline = asyncio.get_running_loop().time() + limit
        headers = JSON_HEADER if leg is None else leg.headers
        try:
            resp = await self.pool.request(ep.host, ep.port, b"POST", path, body, headers, deadline)
            data = await resp.read(deadline)
        except (Refused, Disconnected) as exc:
            if resp is not None:
                resp.close()
            raise self._unreachable(role, ep, exc, leg) from None
        except UpstreamTimeout:
            if resp is not None:
                resp.close()
            raise self._timeout(role, ep, setting, limit, leg) from None
        except BaseException:
            if resp is not None:
                resp.close()
            raise
        resp.release()
        if resp.status >= 400:
            self.metrics.upstream_error(role, "status")
        if leg is not None:
            leg.answered(resp.status)
        return Answer(resp.status, data, _ctype(resp))

    async def relay(
        self,
        out: Responder,
        resp: Response,
        role: str,
        t0: float,
        reply: Headers = None,
        leg: Leg | None = None,
    ) -> None:
        """Send an engine's answer to the client: an event stream chunk by chunk as it arrives,
        anything else read whole. kv_transfer_params are removed either way. ``t0`` is when the
        client's request arrived (time to first byte is measured from it); ``reply``: headers
        the answer carries besides the engine's content type (the trace's)."""
        ctype = _ctype(resp)
        idle = self.deadlines.idle_s
        loop = asyncio.get_running_loop()
        if resp.status >= 400 or not ctype.startswith(SSE_CT):
            try:
                data = await resp.read(loop.time() + idle)
            except (Disconnected, UpstreamTimeout) as exc:
                kind = "timeout" if isinstance(exc, UpstreamTimeout) else "disconnect"
                self.metrics.upstream_error(role, kind)
                log.warn("upstream_broken", role=role, error=kind)
                if kind == "timeout":
                    msg = f"the {role} engine went quiet for decode_idle_timeout_s ({idle:g} s)"
                    err = server_error(504, msg, "upstream_timeout")
                else:
                    msg = f"the {role} engine dropped the connection mid-answer"
                    err = server_error(502, msg, "upstream_disconnected")
                if leg is not None:
                    leg.failed(kind, msg)
                out.send(err.status, err.body(), JSON_CT, reply)
                return
            if resp.status >= 400:
                self.metrics.upstream_error(role, "status")
            self.metrics.first_byte(loop.time() - t0)
            Answer(resp.status, data, ctype).send(out, reply)
            return
        await self._stream(out, resp, role, t0, idle, reply, leg)

    async def _stream(
        self,
        out: Responder,
        resp: Response,
        role: str,
        t0: float,
        idle: float,
        reply: Headers,
        leg: Leg | None,
    ) -> None:
        loop = asyncio.get_running_loop()
        out.start(resp.status, SSE_CT, SSE_HEADERS if reply is None else SSE_HEADERS + reply)
        filt = SseFilter()
        first = True
        inter_token = self.metrics.inter_token
        last = 0.0  # loop time the previous chunk went to the client
        try:
            while (chunk := await resp.next_chunk(loop.time() + idle)) is not None:
                data = filt.feed(chunk)
                if data:
                    now = loop.time()
                    if first:
                        first = False
                        self.metrics.first_byte(now - t0)
                    else:
                        inter_token(now - last)
                    last = now
                    await out.write(data)
            rest = filt.flush()
            if rest:
                if not first:
                    inter_token(loop.time() - last)
                await out.write(rest)
        except (Disconnected, UpstreamTimeout) as exc:
            # The head is gone: the only way left to tell the client is an error event.
            kind = "timeout" if isinstance(exc, UpstreamTimeout) else "disconnect"
            self.metrics.upstream_error(role, kind)
            log.warn("upstream_broken", role=role, error=kind, streaming=True)
            if kind == "timeout":
                msg = f"the {role} engine went quiet for decode_idle_timeout_s ({idle:g} s)"
                err = server_error(504, msg, "upstream_timeout")
            else:
                msg = f"the {role} engine dropped the stream"
                err = server_error(502, msg, "upstream_disconnected")
            if leg is not None:
                leg.failed(kind, msg)
            await out.write(b"data: " + err.body() + b"\n\n")
        out.end()
