"""A lean HTTP/1.1 server on asyncio protocols with the httptools (llhttp) parser.

The inference port pays for every byte of framework it runs, so this is all it does: parse
with llhttp, hand a complete :class:`Request` to a handler task, and write each answer with as
few ``transport.write`` calls as possible (a non-streamed answer is one write). Keep-alive and
pipelined requests are served in order on one connection; a client that goes away cancels its
handler task, which closes whatever the handler had open upstream.

Limits are enforced before a handler runs: ``max_body_bytes`` (413), the request target (414),
header count and bytes (431), transfer codings other than chunked (501), HTTP versions other
than 1.0 and 1.1 (505). Slow clients are bounded in
time, each phase by its own clock: an idle keep-alive connection by ``idle_timeout_s`` from the
end of its last answer, a request head by ``head_timeout_s`` from its first byte (however the
rest trickles in: slowloris), a body by ``body_timeout_s`` plus one second per
``min_body_rate`` bytes received. Errors are OpenAI-style JSON bodies.
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

MAX_HEADER_BYTES = 64 * 1024  # names and values of one request's headers (431)
MAX_HEADERS = 100  # header fields in one request (431; Apache's LimitRequestFields)
MAX_URL_BYTES = 8 * 1024  # the request target (414; Apache's LimitRequestLine, nginx's 8k buffer)
# The bytes a request head may take on the wire: the target, the header fields, and room for
# the request line, separators and a little optional whitespace.
MAX_HEAD_RAW = MAX_URL_BYTES + MAX_HEADER_BYTES + 16 * MAX_HEADERS + 1024
IDLE_TIMEOUT_S = 75.0  # keep-alive connections with nothing in flight (nginx's default)
# Slowloris. The clocks count from the start of a phase, not from the last byte: a client that
# sends one byte a second must not hold a connection (and its buffers) forever.
HEAD_TIMEOUT_S = 20.0  # a request head, from its first byte (Apache's mod_reqtimeout header=20)
BODY_TIMEOUT_S = 20.0  # a body gets this long, plus a second for every MIN_BODY_RATE bytes
MIN_BODY_RATE = 1024  # bytes/s: a body slower than this on average (past the above) is cut
SWEEP_S = 5.0
PIPELINE_MAX = 16  # parsed requests waiting behind the current one before reading pauses
CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"


class _Connection(asyncio.Protocol):
    __slots__ = (
        "_body",
        "_body_bytes",
        "_body_start",
        "_broken",
        "_busy",
        "_continue_owed",
        "_head_done",
        "_head_raw",
        "_head_start",
        "_header_bytes",
        "_header_count",
        "_headers",
        "_http10",
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
        "idle_since",
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
        self._header_count = 0
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
        self._head_done = False
        self._http10 = False
        # A 100 Continue that must wait for the answers ahead of it on the wire.
        self._continue_owed = False
        self._peer = ""
        self.pending_head = b""
        # The clocks of the sweep (monotonic): the latest bytes, the end of the last answer,
        # the first byte of the request head, the end of that head.
        self.last_active = self.idle_since = time.monotonic()
        self._head_start = self._body_start = 0.0
        # Bytes received since the head began (less the read it began in): llhttp buffers a
        # header field that has not ended yet, so on_header() sees nothing of one that never does.
        self._head_raw = 0

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
        if self._in_message and not self._head_done:
            self._head_raw += len(data)
        try:
            self._feed(data)
        except httptools.HttpParserError as exc:
            if isinstance(exc, httptools.HttpParserCallbackError):
                if isinstance(exc.__context__, _Rejected):
                    return  # a callback refused the request and has answered it
                # One of the callbacks below failed: the server's bug, not a malformed request.
                log.exception("http_parse_failed")
                self._refuse(internal_error())
                return
            self._reject(400, f"malformed HTTP request: {exc}", "bad_request")
            return
        if self._in_message and not self._head_done and self._head_raw > MAX_HEAD_RAW:
            self._reject(431, "request headers too large", "request_header_fields_too_large")

    def _feed(self, data: bytes) -> None:
        while True:
            try:
                self._parser.feed_data(data)
                return
            except httptools.HttpParserUpgrade as exc:
                # Only a request without a body gets this far (on_headers_complete refuses the
                # others): its Upgrade is ignored, as RFC 9110 7.8 lets a server do, and the
                # request was served as plain HTTP/1.1. llhttp stopped at its end and stays in
                # "upgraded" mode: a fresh parser reads on from the message boundary.
                data = data[exc.args[0] :]
                self._parser = httptools.HttpRequestParser(self)
                if not data:
                    return

    def pause_writing(self) -> None:
        if self._write_ready is None or self._write_ready.done():
            self._write_ready = asyncio.get_running_loop().create_future()

    def resume_writing(self) -> None:
        if self._write_ready is not None and not self._write_ready.done():
            self._write_ready.set_result(None)

    # -- parser callbacks ---------------------------------------------------------------------

    def on_message_begin(self) -> None:
        self._in_message = True
        self._head_done = False
        self._head_start = self.last_active
        self._head_raw = 0
        self._url = b""
        self._headers = {}
        self._header_bytes = 0
        self._header_count = 0
        self._body = []
        self._body_bytes = 0

    def on_url(self, url: bytes) -> None:
        self._url += url
        if len(self._url) > MAX_URL_BYTES:
            self._reject(414, f"request target longer than {MAX_URL_BYTES} bytes", "uri_too_long")
            raise _Rejected

    def on_header(self, name: bytes, value: bytes) -> None:
        self._header_bytes += len(name) + len(value)
        self._header_count += 1
        if self._header_bytes > MAX_HEADER_BYTES or self._header_count > MAX_HEADERS:
            self._reject(431, "request headers too large", "request_header_fields_too_large")
            raise _Rejected
        if self._head_done:
            # A trailer field, after a chunked body: counted, not merged into the headers (RFC
            # 9110 6.5.1), or a field a proxy in front never checked (Authorization, say) would
            # reach the handler as if it had been sent in the head.
            return
        self._headers[name.lower()] = value

    def on_headers_complete(self) -> None:
        self._head_done = True
        self._body_start = self.last_active
        parser = self._parser
        version = parser.get_http_version()
        if version != "1.1" and version != "1.0":  # llhttp takes 0.9 and 2.0 too
            self._reject(505, f"HTTP/{version} is not supported", "http_version_not_supported")
            raise _Rejected
        self._http10 = version == "1.0"
        headers = self._headers
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.server.max_body_bytes:
            self._too_large()
        coding = headers.get(b"transfer-encoding")
        if coding is not None:
            if self._http10:
                # RFC 9112 6.1: an HTTP/1.0 message with Transfer-Encoding has faulty framing
                # (a 1.0 intermediary may have passed on what it could not decode).
                self._reject(400, "Transfer-Encoding in an HTTP/1.0 request", "bad_request")
                raise _Rejected
            if coding.lower() != b"chunked":
                # llhttp lets "gzip, chunked" through and would hand the handler gzip bytes.
                self._reject(501, "only the chunked transfer coding is supported", "not_implemented")
                raise _Rejected
        has_body = coding is not None or (length is not None and length != b"0")
        if parser.should_upgrade() and (has_body or parser.get_method() == b"CONNECT"):
            # What follows the head would be another protocol's bytes (see _feed).
            self._reject(400, "protocol upgrades are not supported", "bad_request")
            raise _Rejected
        expect = headers.get(b"expect")
        if expect is not None and has_body and not self._http10 and expect.lower() == b"100-continue":
            # The client waits (curl a second) before sending the body (RFC 9110 10.1.1); an
            # HTTP/1.0 client cannot read a 1xx, so its expectation is ignored. A body over
            # the limit was answered 413 above instead, which ends the wait too.
            if self._busy:
                self._continue_owed = True  # after the answers in flight, in order
            elif self.transport is not None:
                self.transport.write(CONTINUE)

    def on_body(self, body: bytes) -> None:
        self._continue_owed = False  # the client did not wait for it
        self._body.append(body)
        self._body_bytes += len(body)
        if self._body_bytes > self.server.max_body_bytes:
            self._too_large()

    def on_message_complete(self) -> None:
        self._in_message = False
        self._continue_owed = False
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
            self._http10,
        )
        if self._busy:
            self._queue.append(req)
            if len(self._queue) >= PIPELINE_MAX and self.transport is not None and not self._paused_reading:
                self._paused_reading = True
                self.transport.pause_reading()
        else:
            self._dispatch(req)

    # -- serving ------------------------------------------------------------------------------

    def _too_large(self) -> None:
        limit = self.server.max_body_bytes
        self._reject(413, f"request body larger than {limit} bytes", "request_too_large")
        raise _Rejected

    def _reject(self, status: int, message: str, code: str) -> None:
        self._refuse(invalid_request(message, code, status=status))

    def _refuse(self, err: OpenAIError) -> None:
        """Answer an unparseable, over-limit or too slow request and close: the rest of the
        stream cannot be trusted to start at a request boundary. Requests that arrived whole
        before it (a pipelined GET, then garbage) are answered first, in order; the refusal
        comes last."""
        if self._broken:
            return  # one refusal per connection: it is the last answer
        self._broken = True
        hook = self.server.on_reject
        if hook is not None:
            hook(self._url.split(b"?", 1)[0].decode("utf-8", "replace"), err.status)
        if self.transport is None:
            return
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
        resp = Responder(self, close, head_only=req.method == "HEAD", http10=req.http10)
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
            if self.transport is None:
                pass  # the client left: no one to tell
            elif not resp.started:
                resp.error(err)
            else:
                self.abort()
        except Exception as exc:
            if isinstance(exc, ConnectionResetError) and self.transport is None:
                pass  # a write after the client left, before the cancel reached the handler
            else:
                log.exception("http_handler_failed", method=req.method, path=req.path)
            if self.transport is None:
                pass
            elif not resp.started:
                resp.error(internal_error())
            else:
                self.abort()  # a second answer cannot follow the first one's bytes
        finally:
            server.in_flight -= 1
            if server.closing and not server.in_flight:
                server.drained.set()
        if self.transport is None:
            return  # the client left while the handler finished
        if not resp.finished:
            if resp.started:
                resp.end()
            else:
                resp.error(internal_error())
        self.idle_since = time.monotonic()
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
        elif self._continue_owed:
            self._continue_owed = False
            self.transport.write(CONTINUE)
        if self._broken:
            return
        if self._paused_reading and len(self._queue) < PIPELINE_MAX and self.transport is not None:
            self._paused_reading = False
            self.transport.resume_reading()

    def expire(self, now: float) -> None:
        """Close the connection if it overstayed the clock of the phase it is in (the sweep
        calls this for connections with no answer in flight)."""
        server = self.server
        if not self._in_message:
            if now - self.idle_since > server.idle_timeout_s and self.transport is not None:
                self.transport.close()  # nothing owed: a plain close, as for any keep-alive
            return
        if not self._head_done:
            late = now - self._head_start > server.head_timeout_s
        else:
            late = now > self._body_start + server.body_timeout_s + self._body_bytes / server.min_body_rate
        if late:
            # 408 and close, rather than a silent close: the request has begun, so the client
            # is waiting on an answer to it, and a slow but honest client (a congested link)
            # is told why instead of seeing what looks like a crash. It costs the attacker
            # nothing more than the close would; the on_reject hook counts it.
            what = "request head" if not self._head_done else "request body"
            self._reject(408, f"the {what} did not arrive in time", "request_timeout")

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


class _Rejected(Exception):
    """Raised out of a parser callback to stop parsing a connection already answered."""


class HttpServer:
    """Serves one ``handler`` on any number of listeners.

    The clocks default to the module's constants; a request over one is answered 408 and its
    connection closed (an idle connection is just closed). ``min_body_rate`` is in bytes/s."""

    def __init__(
        self,
        handler: Handler,
        *,
        max_body_bytes: int,
        head_timeout_s: float = HEAD_TIMEOUT_S,
        body_timeout_s: float = BODY_TIMEOUT_S,
        min_body_rate: float = MIN_BODY_RATE,
        idle_timeout_s: float = IDLE_TIMEOUT_S,
    ) -> None:
        self.handler = handler
        self.max_body_bytes = max_body_bytes
        self.head_timeout_s = head_timeout_s
        self.body_timeout_s = body_timeout_s
        self.min_body_rate = min_body_rate
        self.idle_timeout_s = idle_timeout_s
        # A clock fires up to one sweep late: short ones (a test's) are swept more often.
        self.sweep_s = min(SWEEP_S, head_timeout_s / 2, body_timeout_s / 2, idle_timeout_s / 2)
        self.loop = asyncio.get_running_loop()
        self.connections: set[_Connection] = set()
        self.in_flight = 0
        self.closing = False
        self.drained = asyncio.Event()
        # Told (path, status) of requests refused before any handler ran (400, 408, 413, 414,
        # 431, 501, 505).
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
        """Close connections that overstay a clock: idle keep-alives, and requests whose head or
        body does not arrive in time. One pass every few seconds costs less than a timer per
        request. Connections with an answer in flight are the handler's business."""
        while True:
            await asyncio.sleep(self.sweep_s)
            try:
                now = time.monotonic()
                for c in list(self.connections):
                    if c.idle and c.transport is not None:
                        c.expire(now)
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
