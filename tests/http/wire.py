"""Raw-socket tools of the HTTP conformance suite: a real :class:`HttpServer` with trivial
handlers, and a client that writes exact bytes and reports what came back on the wire.

Reads are bounded (``WAIT_S``): a test that expects an answer or a close and gets neither fails
with "still open" instead of hanging until pytest's timeout.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import httptools

from motor_mesh.common.httpmessages import Request, Responder
from motor_mesh.common.httpserver import HttpServer

WAIT_S = 10.0  # far past any deadline a test sets; only reached when the server got it wrong
MAX_BODY = 4096


@dataclass
class Answer:
    status: int
    headers: dict[bytes, bytes]
    body: bytes


class _Reader:
    """llhttp's response parser over what the server sends: complete answers, in order."""

    def __init__(self) -> None:
        self.parser = httptools.HttpResponseParser(self)
        self.answers: list[Answer] = []
        self._headers: dict[bytes, bytes] = {}
        self._body = b""

    def on_message_begin(self) -> None:
        self._headers, self._body = {}, b""

    def on_header(self, name: bytes, value: bytes) -> None:
        self._headers[name.lower()] = value

    def on_body(self, body: bytes) -> None:
        self._body += body

    def on_message_complete(self) -> None:
        self.answers.append(Answer(self.parser.get_status_code(), self._headers, self._body))


class RawClient:
    """One TCP connection to the server under test."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self._parsed = _Reader()
        self._taken = 0
        self.raw = b""  # every byte received, for the tests that read the wire themselves
        self.eof = False

    @classmethod
    async def open(cls, port: int) -> RawClient:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        return cls(reader, writer)

    async def send(self, data: bytes) -> None:
        self.writer.write(data)
        await self.writer.drain()

    async def trickle(self, pieces: Iterable[bytes], every_s: float) -> None:
        """Send ``pieces`` one at a time, ``every_s`` apart, until they run out or the server
        closes (the slow client never notices the close until a write fails)."""
        with contextlib.suppress(ConnectionError):
            for piece in pieces:
                self.writer.write(piece)
                await self.writer.drain()
                await asyncio.sleep(every_s)

    async def trickled_until_closed(self, pieces: Iterable[bytes], every_s: float) -> list[Answer]:
        """A slow client: ``trickle`` while reading, until the server closes; its answers."""
        sender = asyncio.create_task(self.trickle(pieces, every_s))
        try:
            return await self.closed()
        finally:
            sender.cancel()

    async def _read_more(self) -> None:
        try:
            chunk = await self.reader.read(65536)
        except ConnectionResetError:
            chunk = b""  # a close with our bytes unread comes as a reset: closed all the same
        if not chunk:
            self.eof = True
            return
        self.raw += chunk
        self._parsed.parser.feed_data(chunk)  # a malformed answer fails the test here

    async def answer(self, wait_s: float = WAIT_S) -> Answer:
        """The next complete answer; fails if the connection closes or stays silent first."""
        async with asyncio.timeout(wait_s):
            while self._taken >= len(self._parsed.answers):
                assert not self.eof, f"closed without an answer (got {self.raw[-300:]!r})"
                await self._read_more()
        self._taken += 1
        return self._parsed.answers[self._taken - 1]

    async def closed(self, wait_s: float = WAIT_S) -> list[Answer]:
        """Read until the server closes the connection; the answers not taken before it."""
        try:
            async with asyncio.timeout(wait_s):
                while not self.eof:
                    await self._read_more()
        except TimeoutError:
            raise AssertionError(f"the connection is still open after {wait_s} s") from None
        rest = self._parsed.answers[self._taken :]
        self._taken = len(self._parsed.answers)
        return rest

    async def read_to_eof(self, wait_s: float = WAIT_S) -> bytes:
        """Every byte until the close, unparsed (an answer only the close can end)."""
        async with asyncio.timeout(wait_s):
            while chunk := await self.reader.read(65536):
                self.raw += chunk
        self.eof = True
        return self.raw

    def reset(self) -> None:
        """Close with a TCP RST (SO_LINGER 0): what a crashed or killed client looks like."""
        sock = self.writer.get_extra_info("socket")
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.writer.transport.abort()

    def close(self) -> None:
        self.writer.close()


def request(
    method: str = "GET", target: str = "/", *headers: str, body: bytes = b"", version: str = "HTTP/1.1"
) -> bytes:
    """A request's bytes exactly: nothing is added (no Host, no Content-Length)."""
    head = f"{method} {target} {version}\r\n" + "".join(h + "\r\n" for h in headers) + "\r\n"
    return head.encode("latin-1") + body


def post(target: str, body: bytes, *headers: str) -> bytes:
    """A well-formed POST with a Content-Length."""
    return request("POST", target, "Host: t", f"Content-Length: {len(body)}", *headers, body=body)


class Served:
    """A server under test, and what its handler saw and its ``on_reject`` hook was told."""

    def __init__(self) -> None:
        self.server: HttpServer
        self.port = 0
        self.seen: list[Request] = []
        self.rejected: list[tuple[str, int]] = []
        self.gate = asyncio.Event()  # opens /gate's answer
        self.at_gate = asyncio.Event()  # a request is waiting at /gate
        self.stream_cancelled = asyncio.Event()  # /forever saw its client leave

    def make(self, **kw: Any) -> Served:
        """The server, with these :class:`HttpServer` arguments, not listening yet (the fuzz
        tests feed its connections directly)."""
        kw.setdefault("max_body_bytes", MAX_BODY)
        self.server = HttpServer(self.handler, **kw)
        self.server.on_reject = lambda path, status: self.rejected.append((path, status))
        return self

    async def start(self, **kw: Any) -> Served:
        """Listen on 127.0.0.1 port 0."""
        self.make(**kw)
        self.port = await self.server.listen("127.0.0.1", 0)
        return self

    @property
    def paths(self) -> list[str]:
        return [r.path for r in self.seen]

    async def client(self) -> RawClient:
        return await RawClient.open(self.port)

    async def still_serving(self) -> None:
        """A fresh connection gets a normal answer: nothing before broke the server."""
        c = await self.client()
        try:
            await c.send(request("GET", "/still", "Host: t"))
            assert (await c.answer()).status == 200
        finally:
            c.close()

    async def handler(self, req: Request, resp: Responder) -> None:
        """/echo: the body back; /stream: three chunks; /forever: chunks until the client
        goes; /gate: waits for the test to open ``gate``; anything else: 200 with the path.
        HEAD anywhere: 200 with an empty body (so its Content-Length, 0, frames it either way,
        and a reader need not know which answers were to HEAD)."""
        self.seen.append(req)
        if req.method == "HEAD":
            resp.send(200, b"", b"text/plain")
        elif req.path == "/echo":
            resp.send(200, req.body, b"application/octet-stream")
        elif req.path == "/stream":
            resp.start(200, b"text/plain")
            for i in range(3):
                await resp.write(b"chunk %d\n" % i)
                await asyncio.sleep(0)  # each chunk its own write, as an engine's tokens
            resp.end()
        elif req.path == "/forever":
            resp.start(200, b"text/plain")
            try:
                while True:
                    await resp.write(b"x" * 1024)
                    await asyncio.sleep(0.005)  # an endless stream's pace
            except asyncio.CancelledError:
                self.stream_cancelled.set()
                raise
        elif req.path == "/gate":
            self.at_gate.set()
            await self.gate.wait()
            resp.send(200, b"gate", b"text/plain")
        else:
            resp.send(200, req.path.encode(), b"text/plain")
