"""A lean HTTP/1.1 client on asyncio protocols with the httptools (llhttp) parser, and a
keep-alive pool per upstream endpoint.

Used on the inference path, where every request makes one or two upstream calls: a pooled
connection is reused LIFO (the warmest socket), a request goes out in one write, and a response
body is handed over as the parser produces it (streams pass through without re-framing of
their content). Deadlines are absolute loop times checked by one sweep per pool every
``SWEEP_S`` instead of a timer per call: a deadline fires up to that much late, and the hot
path allocates no timer at all.

A pooled connection that the engine closed while idle fails before any byte of an answer; that
request is sent once more on a fresh connection, so a keep-alive race never reaches the caller
as an engine failure. A fresh connection that fails is the caller's signal (:class:`Refused`,
:class:`Disconnected`).

Every way an answer can be wrong ends in one of the three errors: a response llhttp will not
parse (bad status line, both Content-Length and Transfer-Encoding, two Content-Lengths, a chunk
size past 64 bits), a head past ``MAX_HEAD_BYTES``, a protocol switch, a body cut short are
:class:`Disconnected`; a head that never ends is :class:`UpstreamTimeout` at the deadline. Bytes
the engine sends beyond its answer (a body longer than its Content-Length, a second answer) are
not read as the next request's answer: the connection is closed instead of pooled.
"""

from __future__ import annotations

import asyncio
import collections
import math
from typing import Any, cast

import httptools

from motor_mesh.common import log

PAUSE_AT_BYTES = 1 << 20  # buffered upstream bytes the consumer has not taken yet
# A response head (and any 1xx before it) longer than this is refused: llhttp buffers a header
# field until it ends, so one that never does would grow without bound until the deadline.
MAX_HEAD_BYTES = 64 * 1024
MAX_IDLE_PER_ENDPOINT = 256
SWEEP_S = 0.05
NEVER = math.inf


class Refused(Exception):
    """No connection could be made (refused, unreachable, or the connect timed out)."""


class UpstreamTimeout(TimeoutError):
    """A deadline passed while waiting on the engine."""


class Disconnected(Exception):
    """The connection ended before the answer was complete, or the answer was malformed.
    ``answered``: some of an answer had arrived (so the request reached the engine)."""

    def __init__(self, message: str, answered: bool) -> None:
        super().__init__(message)
        self.answered = answered


class _Unsolicited(Exception):
    """Raised out of the parser when a response begins that no request is waiting for."""


class _Malformed(Exception):
    """Raised out of the parser for what llhttp lets through but no answer may be."""


class _Conn(asyncio.Protocol):
    __slots__ = (
        "_buffered",
        "_interim",
        "_paused",
        "_received",
        "_until_close",
        "_waiter",
        "chunks",
        "complete",
        "deadline",
        "error",
        "head_seen",
        "headers",
        "keep_alive",
        "key",
        "parser",
        "pool",
        "status",
        "transport",
    )

    def __init__(self, pool: Pool, key: tuple[str, int]) -> None:
        self.pool = pool
        self.key = key
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self._waiter: asyncio.Future[None] | None = None
        self._buffered = 0
        self._paused = False
        self.chunks: collections.deque[bytes] = collections.deque()
        self.headers: dict[bytes, bytes] = {}
        self.status = 0
        self.head_seen = False
        self.complete = False
        self.keep_alive = False
        self.error: Exception | None = None
        self.deadline = NEVER
        self._received = 0  # bytes of the current exchange's answer
        self._interim = False  # the parser is in a 1xx response
        self._until_close = False  # the body has no framing: it ends when the engine closes

    def reset(self) -> None:
        self.chunks.clear()
        self.headers = {}
        self.status = 0
        self.head_seen = False
        self.complete = False
        self.keep_alive = False
        self.error = None
        self._buffered = 0
        self._received = 0
        self._interim = False
        self._until_close = False

    # -- transport callbacks -----------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass

    def data_received(self, data: bytes) -> None:
        self._received += len(data)
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserCallbackError as exc:
            if not isinstance(exc.__context__, _Unsolicited):
                self._fail(f"malformed HTTP response: {exc.__context__ or exc}")
                return
            # More than the answer: the engine and this connection disagree on where answers
            # end. What was complete stands; the connection is not reused.
            self.keep_alive = False
            if self.transport is not None:
                self.transport.abort()
            return
        except httptools.HttpParserError as exc:
            self._fail(f"malformed HTTP response: {exc}")
            return
        except httptools.HttpParserUpgrade:
            self._fail("the engine switched protocols")  # 101 to a request that asked for none
            return
        if not self.head_seen and self._received > MAX_HEAD_BYTES:
            self._fail(f"response head longer than {MAX_HEAD_BYTES} bytes")

    def _fail(self, message: str) -> None:
        # Bytes came back, so the request reached the engine: it is not sent again.
        self.error = Disconnected(message, True)
        self._wake()
        if self.transport is not None:
            self.transport.abort()

    def eof_received(self) -> bool | None:
        return None  # close the transport: connection_lost follows

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        self.pool.discard(self)
        if self.head_seen and self._until_close and exc is None and not self.complete:
            self.complete = True  # RFC 9112 6.3 (8): the close ends a body without framing
        if not self.complete and self.error is None:
            why = f": {exc}" if exc else ""
            answered = self.head_seen or self._received > 0
            self.error = Disconnected(f"connection closed by the engine{why}", answered)
        self._wake()

    # -- parser callbacks --------------------------------------------------------------------

    def on_message_begin(self) -> None:
        if self.complete or self not in self.pool.active:
            raise _Unsolicited

    def on_header(self, name: bytes, value: bytes) -> None:
        if not self.head_seen:  # else a trailer field: not merged into the head (RFC 9110 6.5.1)
            self.headers[name.lower()] = value

    def on_headers_complete(self) -> None:
        status = self.parser.get_status_code()
        if not 100 <= status <= 599:  # llhttp takes any three digits (RFC 9110 15: invalid)
            raise _Malformed(f"status code {status}")
        if status < 200:
            # An interim answer (103 Early Hints, an unasked-for 100 Continue): the final one
            # follows on the same connection (RFC 9110 15.2: a client MUST parse them). A 101
            # goes this way too, and then llhttp raises HttpParserUpgrade: a Disconnected.
            self._interim = True
            self.headers = {}
            return
        self.status = status
        h = self.headers
        self._until_close = b"content-length" not in h and b"transfer-encoding" not in h
        self.head_seen = True
        self._wake()

    def on_body(self, body: bytes) -> None:
        self.chunks.append(body)
        self._buffered += len(body)
        if self._buffered > PAUSE_AT_BYTES and not self._paused and self.transport is not None:
            self._paused = True
            self.transport.pause_reading()
        self._wake()

    def on_message_complete(self) -> None:
        if self._interim:
            self._interim = False
            return
        self.complete = True
        self.keep_alive = self.parser.should_keep_alive()
        self._wake()

    # -- waiting -----------------------------------------------------------------------------

    def _wake(self) -> None:
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)

    def expire(self) -> None:
        if self.complete:
            return
        self.error = UpstreamTimeout("the engine did not answer in time")
        self.deadline = NEVER
        self._wake()

    async def wait(self) -> None:
        """Until the parser or the transport has news, or the deadline passes."""
        self._waiter = w = asyncio.get_running_loop().create_future()
        try:
            await w
        finally:
            self._waiter = None

    def take(self) -> bytes:
        data = self.chunks.popleft()
        self._buffered -= len(data)
        if self._paused and self._buffered < PAUSE_AT_BYTES // 2 and self.transport is not None:
            self._paused = False
            self.transport.resume_reading()
        return data


class Interrupt:
    """Lets other code stop a request that waits for its answer's head: the wait raises the
    exception given (how a request is moved off an engine that has not answered yet)."""

    __slots__ = ("conn", "error")

    def __init__(self) -> None:
        self.conn: _Conn | None = None  # the connection waiting for the head, while one is
        self.error: Exception | None = None

    def __call__(self, exc: Exception) -> None:
        self.error = exc
        c = self.conn
        if c is not None and not c.head_seen and c.error is None:
            c.error = exc
            c._wake()


class Response:
    """An answer whose head has arrived; the body follows through :meth:`read` or
    :meth:`next_chunk`. Give it back with :meth:`release` (reuse if complete) or :meth:`close`."""

    __slots__ = ("_conn", "_done", "headers", "status")

    def __init__(self, conn: _Conn) -> None:
        self._conn = conn
        self.status = conn.status
        self.headers = conn.headers
        self._done = False

    def header(self, name: bytes, default: bytes = b"") -> bytes:
        return self.headers.get(name, default)

    @property
    def at_eof(self) -> bool:
        c = self._conn
        return c.complete and not c.chunks

    async def read(self, deadline: float = NEVER) -> bytes:
        """The whole body, by loop time ``deadline``."""
        c = self._conn
        c.deadline = deadline
        while not c.complete:
            if c.error is not None:
                raise c.error
            await c.wait()
        data = b"".join(c.chunks)
        c.chunks.clear()
        return data

    async def next_chunk(self, deadline: float = NEVER) -> bytes | None:
        """The next piece of the body as it arrived, by loop time ``deadline``; None at its end."""
        c = self._conn
        c.deadline = deadline
        while True:
            if c.chunks:
                return c.take()
            if c.complete:
                return None
            if c.error is not None:
                raise c.error
            await c.wait()

    def interrupt(self, exc: Exception) -> None:
        """Make a pending or the next :meth:`read` / :meth:`next_chunk` raise ``exc`` once the
        bytes already received are taken (the caller then closes the response): how a stream
        is moved off an engine that is still answering."""
        c = self._conn
        if not self._done and not c.complete and c.error is None:
            c.error = exc
            c._wake()

    def release(self) -> None:
        """Back to the pool when the answer was read to its end, else closed."""
        if self._done:
            return
        self._done = True
        c = self._conn
        c.pool.active.discard(c)
        if c.complete and c.keep_alive and not c.chunks and c.transport is not None:
            c.pool.put(c)
        elif c.transport is not None:
            c.transport.close()

    def close(self) -> None:
        """Close the connection (the engine sees the client leave)."""
        if not self._done:
            self._done = True
            self._conn.pool.active.discard(self._conn)
            if self._conn.transport is not None:
                self._conn.transport.abort()


class Pool:
    """Keep-alive connections per (host, port), reused last-in first-out."""

    def __init__(self, connect_timeout_s: float) -> None:
        self.connect_timeout_s = connect_timeout_s
        self._idle: dict[tuple[str, int], list[_Conn]] = {}
        self._heads: dict[tuple[str, int], bytes] = {}
        self._closed = False
        self.active: set[_Conn] = set()  # exchanges under way, whose deadlines the sweep checks
        self._sweeper: asyncio.Task[None] | None = None

    async def _sweep(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(SWEEP_S)
            now = loop.time()
            try:
                for c in [c for c in self.active if c.deadline <= now]:
                    c.expire()
            except Exception:  # a deadline that never fires is a hang: keep sweeping
                log.exception("http_client_sweep_failed")

    def put(self, conn: _Conn) -> None:
        idle = self._idle.setdefault(conn.key, [])
        if self._closed or len(idle) >= MAX_IDLE_PER_ENDPOINT:
            if conn.transport is not None:
                conn.transport.close()
            return
        idle.append(conn)

    def discard(self, conn: _Conn) -> None:
        idle = self._idle.get(conn.key)
        if idle and conn in idle:
            idle.remove(conn)

    async def _connect(self, key: tuple[str, int], deadline: float) -> _Conn:
        """A new connection (rare: the pool keeps them), bounded by the connect timeout and
        the caller's deadline, whichever comes first."""
        loop = asyncio.get_running_loop()
        remaining = deadline - loop.time()
        try:
            async with asyncio.timeout(min(remaining, self.connect_timeout_s)):
                _, proto = await loop.create_connection(lambda: _Conn(self, key), key[0], key[1])
        except TimeoutError:
            if remaining < self.connect_timeout_s:
                raise UpstreamTimeout("the deadline passed while connecting") from None
            raise Refused(f"connect to {key[0]}:{key[1]} timed out") from None
        except OSError as exc:
            raise Refused(f"connect to {key[0]}:{key[1]} failed: {exc.strerror or exc}") from None
        return proto

    def _head(self, key: tuple[str, int]) -> bytes:
        host = self._heads.get(key)
        if host is None:
            h, p = key
            netloc = f"[{h}]:{p}" if ":" in h else f"{h}:{p}"
            host = self._heads[key] = f"Host: {netloc}\r\n".encode()
        return host

    async def request(
        self,
        host: str,
        port: int,
        method: bytes,
        path: bytes,
        body: bytes = b"",
        headers: bytes = b"Content-Type: application/json\r\n",
        deadline: float = NEVER,
        interrupt: Interrupt | None = None,
    ) -> Response:
        """Send one request and wait for its response head until loop time ``deadline``.
        Raises Refused / Disconnected / UpstreamTimeout, or what ``interrupt`` was given."""
        if self._sweeper is None:
            self._sweeper = asyncio.get_running_loop().create_task(self._sweep())
        key = (host, port)
        data = b"%s %s HTTP/1.1\r\n%s%sContent-Length: %d\r\n\r\n%s" % (
            method, path, self._head(key), headers, len(body), body,
        )  # fmt: skip
        idle = self._idle.get(key)
        while idle:
            conn = idle.pop()
            if conn.transport is None or conn.transport.is_closing():
                continue
            try:
                return await self._exchange(conn, data, deadline, interrupt)
            except Disconnected as exc:
                if exc.answered:
                    raise
                # The engine had closed this idle connection: try a fresh one.
                break
        return await self._exchange(await self._connect(key, deadline), data, deadline, interrupt)

    async def _exchange(
        self, conn: _Conn, data: bytes, deadline: float, interrupt: Interrupt | None = None
    ) -> Response:
        conn.reset()
        conn.deadline = deadline
        assert conn.transport is not None
        if interrupt is not None:
            if interrupt.error is not None:  # while it connected
                self.put(conn)
                raise interrupt.error
            interrupt.conn = conn
        conn.transport.write(data)
        self.active.add(conn)
        try:
            while not conn.head_seen:
                if conn.error is not None:
                    raise conn.error
                await conn.wait()
        except BaseException:
            self.active.discard(conn)
            if conn.transport is not None:
                conn.transport.abort()
            raise
        finally:
            if interrupt is not None:
                interrupt.conn = None
        return Response(conn)

    def close(self) -> None:
        self._closed = True
        if self._sweeper is not None:
            self._sweeper.cancel()
        for idle in self._idle.values():
            for c in idle:
                if c.transport is not None:
                    c.transport.close()
        self._idle.clear()


def header_block(headers: dict[str, str] | list[tuple[str, str]] | Any) -> bytes:
    """Extra request headers as the bytes :meth:`Pool.request` takes."""
    items = headers.items() if isinstance(headers, dict) else headers
    return b"".join(f"{k}: {v}\r\n".encode("latin-1") for k, v in items)
