"""Talking to engines: one shared aiohttp session, per-phase deadlines, the circuit breaker's
"refused connection" signal, and relaying an engine's answer to the client.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import aiohttp
from aiohttp import web

from services.common import log
from services.common.http_errors import JSON_CT, OpenAIError
from services.coordinator.bodies import SseFilter, strip_kv
from services.coordinator.metrics import Metrics
from services.coordinator.routes import Upstream

JSON_HEADERS = {"Content-Type": JSON_CT}
SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}

# Each phase has its own deadline. A prefill is bounded as a whole; a decode may stream for as
# long as it keeps producing, so only the gap between two reads is bounded.
CONNECT_S = 5.0
PREFILL_TIMEOUT = aiohttp.ClientTimeout(total=600.0, sock_connect=CONNECT_S)
DECODE_TIMEOUT = aiohttp.ClientTimeout(total=None, sock_connect=CONNECT_S, sock_read=600.0)


class Unreachable(Exception):
    """The engine could not be reached (or dropped the connection before answering)."""

    def __init__(self, role: str, ep: Upstream, cause: BaseException) -> None:
        super().__init__(f"{role} engine {ep.base} unreachable: {type(cause).__name__}: {cause}")
        self.role = role
        self.ep = ep


class PhaseTimeout(Exception):
    def __init__(self, role: str, ep: Upstream) -> None:
        super().__init__(f"{role} engine {ep.base} did not answer in time")
        self.role = role


@dataclass(slots=True)
class Answer:
    """A fully read engine answer."""

    status: int
    body: bytes
    content_type: str

    def response(self) -> web.Response:
        return web.Response(
            status=self.status, body=strip_kv(self.body), headers={"Content-Type": self.content_type}
        )


class Engines:
    """The shared client session plus the breaker hook (``on_refused`` takes an endpoint out)."""

    def __init__(self, metrics: Metrics, on_refused: Callable[[Upstream, str], None]) -> None:
        self.metrics = metrics
        self.on_refused = on_refused
        self.session = aiohttp.ClientSession(
            # Keep-alive pool shared by every request; no per-host cap (the clients bound it).
            connector=aiohttp.TCPConnector(limit=0, ttl_dns_cache=300, keepalive_timeout=30),
            auto_decompress=False,
            skip_auto_headers=("User-Agent",),
        )

    async def close(self) -> None:
        await self.session.close()

    async def open(
        self, ep: Upstream, path: str, body: bytes, deadline: aiohttp.ClientTimeout, role: str
    ) -> aiohttp.ClientResponse:
        """POST and wait for the response head. Raises Unreachable / PhaseTimeout."""
        try:
            return await self.session.post(ep.base + path, data=body, headers=JSON_HEADERS, timeout=deadline)
        except (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError) as exc:
            self.metrics.upstream_error(role, "connect")
            self.on_refused(ep, role)
            raise Unreachable(role, ep, exc) from exc
        except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError) as exc:
            # A pooled keep-alive connection the engine had closed, or an engine that died on
            # this request: nothing reached the client, so another instance may take it.
            self.metrics.upstream_error(role, "disconnect")
            raise Unreachable(role, ep, exc) from exc
        except TimeoutError as exc:
            self.metrics.upstream_error(role, "timeout")
            raise PhaseTimeout(role, ep) from exc

    async def call(
        self, ep: Upstream, path: str, body: bytes, deadline: aiohttp.ClientTimeout, role: str
    ) -> Answer:
        """POST and read the whole answer."""
        resp = await self.open(ep, path, body, deadline, role)
        try:
            data = await resp.read()
        except (aiohttp.ClientPayloadError, aiohttp.ClientConnectionError) as exc:
            self.metrics.upstream_error(role, "disconnect")
            raise Unreachable(role, ep, exc) from exc
        except TimeoutError as exc:
            self.metrics.upstream_error(role, "timeout")
            raise PhaseTimeout(role, ep) from exc
        finally:
            resp.release()
        if resp.status >= 400:
            self.metrics.upstream_error(role, "status")
        return Answer(resp.status, data, resp.headers.get("Content-Type", JSON_CT))

    async def relay(
        self, request: web.Request, resp: aiohttp.ClientResponse, role: str
    ) -> web.StreamResponse:
        """Send an engine's answer to the client: streamed through chunk by chunk when it is an
        event stream, otherwise read whole. kv_transfer_params are removed either way."""
        ctype = resp.headers.get("Content-Type", JSON_CT)
        if resp.status >= 400 or not ctype.startswith("text/event-stream"):
            try:
                data = await resp.read()
            except (aiohttp.ClientPayloadError, aiohttp.ClientConnectionError, TimeoutError) as exc:
                self.metrics.upstream_error(role, "disconnect")
                log.warn("upstream_broken", role=role, error=type(exc).__name__)
                msg = f"the {role} engine dropped the connection mid-answer"
                # Returned, not raised: the caller's bookkeeping follows what the engine
                # answered (an SGLang prefill leg is left to finish, as for any answer).
                return OpenAIError(502, msg, "server_error", "upstream_disconnected").response()
            if resp.status >= 400:
                self.metrics.upstream_error(role, "status")
            return Answer(resp.status, data, ctype).response()
        out = web.StreamResponse(status=resp.status, headers=SSE_HEADERS)
        await out.prepare(request)
        filt = SseFilter()
        try:
            async for chunk in resp.content.iter_any():
                data = filt.feed(chunk)
                if data:
                    await out.write(data)
            rest = filt.flush()
            if rest:
                await out.write(rest)
        except (aiohttp.ClientPayloadError, aiohttp.ClientConnectionError, TimeoutError) as exc:
            # Headers are gone: the only way left to tell the client is an error event.
            self.metrics.upstream_error(role, "disconnect")
            log.warn("upstream_broken", role=role, error=type(exc).__name__, streaming=True)
            err = OpenAIError(
                502, f"the {role} engine dropped the stream", "server_error", "upstream_disconnected"
            )
            await out.write(b"data: " + err.body() + b"\n\n")
        await out.write_eof()
        return out


def discard(task: asyncio.Task[Any]) -> None:
    """Done-callback for legs left to finish on their own: retrieve the outcome so a failure is
    logged once instead of as 'Task exception was never retrieved'."""
    if task.cancelled():
        return
    exc = task.exception()
    if exc is not None:
        log.warn("background_leg_failed", error=str(exc))
