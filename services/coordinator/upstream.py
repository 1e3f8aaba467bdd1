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

from services.common import log
from services.common.http_errors import server_error
from services.common.httpclient import Disconnected, Pool, Refused, Response, UpstreamTimeout
from services.common.httpmessages import JSON_CT, Responder
from services.coordinator.bodies import SseFilter, strip_kv
from services.coordinator.metrics import Metrics
from services.coordinator.routes import Upstream

CONNECT_S = 5.0
SSE_CT = b"text/event-stream"
SSE_HEADERS = [("Cache-Control", "no-cache")]


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

    def send(self, out: Responder) -> None:
        out.send(self.status, strip_kv(self.body), self.content_type)


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

    def _unreachable(self, role: str, ep: Upstream, exc: Exception) -> Unreachable:
        if isinstance(exc, Refused):
            self.metrics.upstream_error(role, "connect")
            self.on_refused(ep, role)
        else:
            self.metrics.upstream_error(role, "disconnect")
        return Unreachable(role, ep, exc)

    def _timeout(self, role: str, ep: Upstream, setting: str, seconds: float) -> PhaseTimeout:
        self.metrics.upstream_error(role, "timeout")
        return PhaseTimeout(role, ep, setting, seconds)

    async def open(self, ep: Upstream, path: bytes, body: bytes, role: str) -> Response:
        """POST and wait for the response head, within ``decode_first_byte_timeout_s``.
        Raises Unreachable / PhaseTimeout."""
        limit = self.deadlines.first_byte_s
        deadline = asyncio.get_running_loop().time() + limit
        try:
            return await self.pool.request(ep.host, ep.port, b"POST", path, body, deadline=deadline)
        except (Refused, Disconnected) as exc:
            raise self._unreachable(role, ep, exc) from None
        except UpstreamTimeout:
            raise self._timeout(role, ep, "decode_first_byte_timeout_s", limit) from None

    async def call(
        self, ep: Upstream, path: bytes, body: bytes, role: str, limit: float | None = None
    ) -> Answer:
        """POST and read the whole answer within ``limit`` (default ``prefill_timeout_s``)."""
        if limit is None:
            limit = self.deadlines.prefill_s
        setting = "prefill_timeout_s" if limit == self.deadlines.prefill_s else "the request's deadline"
        resp: Response | None = None
        deadline = asyncio.get_running_loop().time() + limit
        try:
            resp = await self.pool.request(ep.host, ep.port, b"POST", path, body, deadline=deadline)
            data = await resp.read(deadline)
        except (Refused, Disconnected) as exc:
            if resp is not None:
                resp.close()
            raise self._unreachable(role, ep, exc) from None
        except UpstreamTimeout:
            if resp is not None:
                resp.close()
            raise self._timeout(role, ep, setting, limit) from None
        except BaseException:
            if resp is not None:
                resp.close()
            raise
        resp.release()
        if resp.status >= 400:
            self.metrics.upstream_error(role, "status")
        return Answer(resp.status, data, _ctype(resp))

    async def relay(self, out: Responder, resp: Response, role: str, t0: float) -> None:
        """Send an engine's answer to the client: an event stream chunk by chunk as it arrives,
        anything else read whole. kv_transfer_params are removed either way. ``t0`` is when the
        client's request arrived (time to first byte is measured from it)."""
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
                    out.error(server_error(504, msg, "upstream_timeout"))
                else:
                    msg = f"the {role} engine dropped the connection mid-answer"
                    out.error(server_error(502, msg, "upstream_disconnected"))
                return
            if resp.status >= 400:
                self.metrics.upstream_error(role, "status")
            self.metrics.first_byte(loop.time() - t0)
            Answer(resp.status, data, ctype).send(out)
            return
        await self._stream(out, resp, role, t0, idle)

    async def _stream(self, out: Responder, resp: Response, role: str, t0: float, idle: float) -> None:
        loop = asyncio.get_running_loop()
        out.start(resp.status, SSE_CT, SSE_HEADERS)
        filt = SseFilter()
        first = True
        try:
            while (chunk := await resp.next_chunk(loop.time() + idle)) is not None:
                data = filt.feed(chunk)
                if data:
                    if first:
                        first = False
                        self.metrics.first_byte(loop.time() - t0)
                    await out.write(data)
            rest = filt.flush()
            if rest:
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
                err = server_error(502, f"the {role} engine dropped the stream", "upstream_disconnected")
            await out.write(b"data: " + err.body() + b"\n\n")
        out.end()
