"""A lean HTTP/1.1 server on asyncio protocols with the httptools (llhttp) parser.

The inference port pays for every byte of framework it runs, so this is all it does: parse
with llhttp, hand a complete :class:`Request` to a handler task, and write each answer with as
few ``transport.write`` calls as possible (a non-streamed answer is one write). Keep-alive and
pipelined requests are served in order on one connection; a client that goes away cancels its
handler task, which closes whatever the handler had open upstream.

Limits are enforced before a handler runs: ``max_body_bytes`` (413), header bytes (431), and an
idle timeout for connections that send nothing. Errors are OpenAI-style JSON bodies.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import ssl
import time
from collections.abc import Callable
from typing import cast

import httptools

from motor_mesh.common import log
from motor_mesh.common.http_errors import OpenAIError, internal_error, invalid_request
from motor_mesh.common.httpmessages import Handler, Request, Responder

MAX_HEADER_BYTES = 64 * 1024
IDLE_TIMEOUT_S = 75.0  # keep-alive connections with nothing in flight (nginx's default)
READ_TIMEOUT_S = 60.0  # a request whose head or body does not arrive (slowloris)
SWEEP_S = 5.0
PIPELINE_MAX = 16  # parsed requests waiting behind the current one before reading pauses


class _Connection(asyncio.Protocol):
    __slots__ = (
        "_body",
        "_body_bytes",
        "_broken",
        "_busy",
        "_header_bytes",
        "_headers",
        "_in_message",
        "_name",
        "_parser",
        "_paused_reading",
        "_peer",
        "_queue",
        "_rejected",
        "_task",
        "_url",
        "_write_ready",
        "last_active",
        "pending_head",
        "server",
        "transport",
    )

    def __init__(self, server: HttpServer) -> None:
        self.server = server
        self.transport: asyncio.Transport | None = None
        self._parser = httptools.HttpRequestParser(self)
        self._url = b""
        self._headers: dict[bytes, bytes] = {}
        self._header_bytes = 0
        self._name = b""
        self._body: list[bytes] = []
        self._body_bytes = 0
        self._queue: collections.deque[Request] = collections.deque()
        self._busy = False
        # The stream stopped parsing (malformed, too large): what is still owed is the answers
        # to the requests before the bad one, then ``_rejected``, then the connection closes.
        self._broken = False
        self._rejected: OpenAIError | None = None
        self._task: asyncio.Task[None] | None = None
        self._write_ready: asyncio.Future[None] | None = None
        self._paused_reading = False
        self._in_message = False
        self._peer = ""
        self.pending_head = b""
        self.last_active = time.monotonic()

    # -- transport callbacks ------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass
        peer = transport.get_extra_info("peername")
        self._peer = str(peer[0]) if peer else ""
        self.server.connections.add(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self.server.connections.discard(self)
        self.transport = None
        self._queue.clear()
        if self._task is not None and not self._task.done():
            self._task.cancel()  # the client left: its upstream legs close with the handler
        if self._write_ready is not None and not self._write_ready.done():
            self._write_ready.set_exception(ConnectionResetError("client went away"))

    def data_received(self, data: bytes) -> None:
        self.last_active = time.monotonic()
        if self._broken:
            return  # past a rejected request nothing can be trusted to start a request
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._reject(400, "protocol upgrades are not supported", "bad_request")
        except httptools.HttpParserError as exc:
            self._reject(400, f"malformed HTTP request: {exc}", "bad_request")
        except _Rejected:
            pass

    def pause_writing(self) -> None:
        if self._write_ready is None or self._write_ready.done():
            self._write_ready = asyncio.get_running_loop().create_future()

    def resume_writing(self) -> None:
        if self._write_ready is not None and not self._write_ready.done():
            self._write_ready.set_result(None)

    # -- parser callbacks ---------------------------------------------------------------------

    def on_message_begin(self) -> None:
        self._in_message = True
        self._url = b""
        self._headers = {}
        self._header_bytes = 0
        self._body = []
        self._body_bytes = 0

    def on_url(self, url: bytes) -> None:
        self._url += url
        self._count(len(url))

    def on_header(self, name: bytes, value: bytes) -> None:
        self._count(len(name) + len(value))
        self._headers[name.lower()] = value

    def on_headers_complete(self) -> None:
        length = self._headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.server.max_body_bytes:
            self._too_large()

    def on_body(self, body: bytes) -> None:
        self._body.append(body)
        self._body_bytes += len(body)
        if self._body_bytes > self.server.max_body_bytes:
            self._too_large()

    def on_message_complete(self) -> None:
        self._in_message = False
        parser = self._parser
        url = self._url
        q = url.find(b"?")
        path, query = (url, b"") if q < 0 else (url[:q], url[q + 1 :])
        body = self._body[0] if len(self._body) == 1 else b"".join(self._body)
        req = Request(
            parser.get_method().decode("ascii", "replace"),
            path.decode("utf-8", "replace"),
            query.decode("utf-8", "replace"),
            self._headers,
            body,
            parser.should_keep_alive(),
            self._peer,
        )
        if self._busy:
            self._queue.append(req)
            if len(self._queue) >= PIPELINE_MAX and self.transport is not None and not self._paused_reading:
                self._paused_reading = True
                self.transport.pause_reading()
        else:
            self._dispatch(req)

    # -- serving ------------------------------------------------------------------------------

    def _count(self, n: int) -> None:
        self._header_bytes += n
        if self._header_bytes > MAX_HEADER_BYTES:
            self._reject(431, "request headers too large", "request_header_fields_too_large")
            raise _Rejected

    def _too_large(self) -> None:
        limit = self.server.max_body_bytes
        self._reject(413, f"request body larger than {limit} bytes", "request_too_large")
        raise _Rejected

    def _reject(self, status: int, message: str, code: str) -> None:
        """Answer an unparseable or over-limit request and close: the rest of the stream cannot
        be trusted to start at a request boundary. Requests that arrived whole before it (a
        pipelined GET, then garbage) are answered first, in order; the refusal comes last."""
        hook = self.server.on_reject
        if hook is not None:
            hook(self._url.split(b"?", 1)[0].decode("utf-8", "replace"), status)
        self._broken = True
        if self.transport is None:
            return
        err = invalid_request(message, code, status=status)
        if self._busy:
            self._rejected = err
            if not self._paused_reading:
                self._paused_reading = True
                self.transport.pause_reading()
            return
        self._answer_rejection(err)

    def _answer_rejection(self, err: OpenAIError) -> None:
        if self.transport is None:
            return
        Responder(self, True).error(err)
        self.transport.close()

    def _dispatch(self, req: Request) -> None:
        self._busy = True
        close = not req.keep_alive or self.server.closing
        resp = Responder(self, close, head_only=req.method == "HEAD")
        self._task = self.server.loop.create_task(self._serve(req, resp))

    async def _serve(self, req: Request, resp: Responder) -> None:
        server = self.server
        server.in_flight += 1
        try:
            await server.handler(req, resp)
        except asyncio.CancelledError:
            resp.finished = True
            raise
        except OpenAIError as err:
            if not resp.started:
                resp.error(err)
            else:
                self.abort()
        except Exception:
            log.exception("http_handler_failed", method=req.method, path=req.path)
            if not resp.started:
                resp.error(internal_error())
            else:
                self.abort()  # a second answer cannot follow the first one's bytes
        finally:
            server.in_flight -= 1
            if server.closing and not server.in_flight:
                server.drained.set()
        if not resp.finished:
            if resp.started:
                resp.end()
            else:
                resp.error(internal_error())
        self.last_active = time.monotonic()
        self._busy = False
        self._task = None
        if resp.close_after:
            if self.transport is not None:
                self.transport.close()
            return
        if self._queue:
            self._dispatch(self._queue.popleft())
        elif self._rejected is not None:
            self._answer_rejection(self._rejected)
            return
        if self._broken:
            return
        if self._paused_reading and len(self._queue) < PIPELINE_MAX and self.transport is not None:
            self._paused_reading = False
            self.transport.resume_reading()

    def abort(self) -> None:
        if self.transport is not None:
            self.transport.abort()

    def write(self, data: bytes) -> None:
        t = self.transport
        if t is None:
            raise ConnectionResetError("client went away")
        if self.pending_head:
            data = self.pending_head + data
            self.pending_head = b""
        t.write(data)

    async def drain(self) -> None:
        w = self._write_ready
        if w is not None and not w.done():
            await w
        if self.transport is None:
            raise ConnectionResetError("client went away")

    @property
    def idle(self) -> bool:
        return not self._busy

    @property
    def receiving(self) -> bool:
        """A request has begun arriving but is not complete."""
        return self._in_message


class _Rejected(Exception):
    """Raised out of a parser callback to stop parsing a connection already answered."""


class HttpServer:
    """Serves one ``handler`` on any number of listeners."""

    def __init__(self, handler: Handler, *, max_body_bytes: int) -> None:
        self.handler = handler
        self.max_body_bytes = max_body_bytes
        self.loop = asyncio.get_running_loop()
        self.connections: set[_Connection] = set()
        self.in_flight = 0
        self.closing = False
        self.drained = asyncio.Event()
        # Told (path, status) of requests refused before any handler ran (413, 431, 400).
        self.on_reject: Callable[[str, int], None] | None = None
        self._servers: list[asyncio.AbstractServer] = []
        self._sweeper: asyncio.Task[None] | None = None

    async def listen(
        self,
        host: str,
        port: int,
        *,
        ssl_context: ssl.SSLContext | None = None,
        reuse_port: bool = False,
        backlog: int = 2048,
    ) -> int:
        """Bind and start serving; returns the bound port (useful with port 0)."""
        server = await self.loop.create_server(
            lambda: _Connection(self),
            host,
            port,
            ssl=ssl_context,
            reuse_port=reuse_port or None,
            backlog=backlog,
        )
        self._servers.append(server)
        if self._sweeper is None:
            self._sweeper = self.loop.create_task(self._sweep())
        sock = server.sockets[0]
        return int(sock.getsockname()[1])

    async def _sweep(self) -> None:
        """Close connections that went quiet: idle keep-alives and requests that never finish
        arriving. One pass every few seconds costs less than a timer per request."""
        while True:
            await asyncio.sleep(SWEEP_S)
            try:
                now = time.monotonic()
                for c in list(self.connections):
                    quiet = now - c.last_active
                    if c.idle and quiet > (READ_TIMEOUT_S if c.receiving else IDLE_TIMEOUT_S):
                        if c.transport is not None:
                            c.transport.close()
            except Exception:  # never let one bad connection end the sweeping
                log.exception("http_sweep_failed")

    async def close(self, grace_s: float) -> None:
        """Stop accepting; let requests in flight finish for up to ``grace_s``; then close
        every connection (handlers still running are cancelled)."""
        self.closing = True
        for s in self._servers:
            s.close()
        for c in list(self.connections):
            if c.idle and c.transport is not None:
                c.transport.close()
        if self.in_flight:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.drained.wait(), grace_s)
        for c in list(self.connections):
            if c.transport is not None:
                c.transport.abort()
        if self._sweeper is not None:
            self._sweeper.cancel()
            await asyncio.gather(self._sweeper, return_exceptions=True)
        for s in self._servers:
            await s.wait_closed()
        await asyncio.sleep(0)  # connection_lost callbacks run, handler tasks see their cancel
