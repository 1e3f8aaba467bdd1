"""The upstream client (``httpclient.Pool``) against an engine that answers wrong.

A raw-socket fake engine answers each request with exact bytes. Whatever comes back, a call
ends in one of the client's three documented errors, which the Coordinator maps to 502/504
(``Disconnected``, ``UpstreamTimeout``, ``Refused``), or in a correct answer; never a hang,
another exception type, or an error in the log. Bytes past an answer never become the next
request's answer.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator

import pytest

from motor_mesh.common import httpclient
from motor_mesh.common.httpclient import Disconnected, Pool, Refused, UpstreamTimeout
from tests.http.conftest import errors_logged
from tests.http.wire import WAIT_S

Script = Callable[[asyncio.StreamWriter], Awaitable[None]]


class FakeEngine:
    """Reads each request (head and Content-Length body) and answers it with the next of
    ``answers`` (bytes, or a coroutine function that writes to the connection); the last is
    repeated. ``close``: close the connection after each answer."""

    def __init__(self, *answers: bytes | Script, close: bool = False) -> None:
        self.answers = list(answers)
        self.close = close
        self.requests = 0
        self.connections = 0
        self.port = 0
        self._server: asyncio.Server | None = None
        self._writers: list[asyncio.StreamWriter] = []

    async def __aenter__(self) -> FakeEngine:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()
        for w in self._writers:
            w.transport.abort()
        await self._server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        self._writers.append(writer)
        with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError):
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":")[1])
                await reader.readexactly(length)
                answer = self.answers[min(self.requests, len(self.answers) - 1)]
                self.requests += 1
                if isinstance(answer, bytes):
                    writer.write(answer)
                    await writer.drain()
                else:
                    await answer(writer)
                if self.close:
                    writer.close()
                    return


@pytest.fixture
async def pool(caplog: pytest.LogCaptureFixture) -> AsyncIterator[Pool]:
    p = Pool(connect_timeout_s=2.0)
    yield p
    p.close()
    assert not errors_logged(caplog), errors_logged(caplog)


async def call(pool: Pool, port: int, deadline_s: float = WAIT_S) -> tuple[int, bytes]:
    """One POST, read whole: (status, body). Bounded well past ``deadline_s`` so that a client
    that ignores its deadline fails the test instead of hanging it."""
    async with asyncio.timeout(deadline_s + 5):
        deadline = asyncio.get_running_loop().time() + deadline_s
        resp = await pool.request("127.0.0.1", port, b"POST", b"/v1/completions", b"{}", deadline=deadline)
        try:
            body = await resp.read(deadline)
        except BaseException:
            resp.close()
            raise
        resp.release()
        return resp.status, body


OK = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"


async def refused_by_the_client(pool: Pool, answer: bytes) -> None:
    """A fake engine sends ``answer``; the client raises Disconnected, its one error for it."""
    async with FakeEngine(answer) as engine:
        with pytest.raises(Disconnected):
            await call(pool, engine.port)


async def test_a_well_formed_answer_is_read(pool: Pool) -> None:
    """The baseline every other test here departs from."""
    async with FakeEngine(OK) as engine:
        assert await call(pool, engine.port) == (200, b"ok")
        assert await call(pool, engine.port) == (200, b"ok")
        assert engine.connections == 1  # kept alive and reused


@pytest.mark.parametrize(
    "answer",
    [
        b"HTTP/1.1 2x0 OK\r\nContent-Length: 0\r\n\r\n",
        b"HTTP/1.1\r\n\r\n",
        b"HTPT/1.1 200 OK\r\n\r\n",
        b"SSH-2.0-OpenSSH_9.6\r\n",
    ],
    ids=["status-not-digits", "no-status", "not-http", "another-protocol"],
)
async def test_a_bad_status_line_is_disconnected(pool: Pool, answer: bytes) -> None:
    """RFC 9112 4: status-line = HTTP-version SP status-code SP [reason-phrase]."""
    await refused_by_the_client(pool, answer)


@pytest.mark.parametrize("status", [b"099", b"600", b"999"])
async def test_a_status_outside_100_to_599_is_disconnected(pool: Pool, status: bytes) -> None:
    """RFC 9110 15: status codes outside 100..599 are invalid (llhttp takes any three digits,
    and the Coordinator would pass one on to its own client)."""
    await refused_by_the_client(pool, b"HTTP/1.1 %s X\r\nContent-Length: 0\r\n\r\n" % status)


async def test_content_length_with_transfer_encoding_is_disconnected(pool: Pool) -> None:
    """RFC 9112 6.3 (3): both framings "ought to be handled as an error" (response splitting)."""
    answer = (
        b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n"
    )
    await refused_by_the_client(pool, answer)


async def test_two_content_lengths_are_disconnected(pool: Pool) -> None:
    """RFC 9112 6.3 (5): differing Content-Lengths are an unrecoverable error."""
    answer = b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nContent-Length: 6\r\n\r\nhello!"
    await refused_by_the_client(pool, answer)


async def test_a_body_shorter_than_its_content_length_is_disconnected(pool: Pool) -> None:
    """RFC 9112 8: a close before Content-Length octets is an incomplete message, not a body."""
    async with FakeEngine(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nhello", close=True) as engine:
        with pytest.raises(Disconnected) as caught:
            await call(pool, engine.port)
        assert caught.value.answered


async def test_a_chunk_size_overflow_is_disconnected(pool: Pool) -> None:
    """RFC 9112 7.1: a chunk size past 64 bits is refused, not wrapped."""
    answer = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n1" + b"0" * 16 + b"\r\nhello\r\n"
    await refused_by_the_client(pool, answer)


async def _endless_head(writer: asyncio.StreamWriter) -> None:
    writer.write(b"HTTP/1.1 200 OK\r\n")
    for i in range(100_000):
        writer.write(b"X-Slow-%d: v\r\n" % i)
        await writer.drain()
        await asyncio.sleep(0.02)  # the pace of a slow server, not a wait for anything


async def test_a_head_that_never_ends_times_out_at_the_deadline(pool: Pool) -> None:
    """A head trickled forever (each line well inside any idle clock) ends at the caller's
    deadline as UpstreamTimeout."""
    async with FakeEngine(_endless_head) as engine:
        with pytest.raises(UpstreamTimeout):
            await call(pool, engine.port, deadline_s=0.3)


async def test_a_head_past_the_limit_is_disconnected(pool: Pool) -> None:
    """One header field that never ends is refused at MAX_HEAD_BYTES instead of growing in
    memory until the deadline (here far away)."""
    answer = b"HTTP/1.1 200 OK\r\nX-Big: " + b"v" * (2 * httpclient.MAX_HEAD_BYTES)
    await refused_by_the_client(pool, answer)


async def _cut_stream(writer: asyncio.StreamWriter) -> None:
    writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n")
    await writer.drain()
    writer.close()


async def test_a_close_mid_chunked_stream_is_disconnected(pool: Pool) -> None:
    """RFC 9112 7.1: a chunked body ends with the last chunk; a close before it is a cut, and
    the chunks before the cut are still handed over first."""
    async with FakeEngine(_cut_stream) as engine, asyncio.timeout(WAIT_S):
        resp = await pool.request("127.0.0.1", engine.port, b"POST", b"/v1/completions", b"{}")
        assert await resp.next_chunk() == b"hello"
        with pytest.raises(Disconnected):
            await resp.next_chunk()
        resp.close()


async def test_a_protocol_switch_is_disconnected(pool: Pool) -> None:
    """RFC 9110 15.2.2: 101 only answers a request that asked to upgrade; this one did not."""
    answer = b"HTTP/1.1 101 Switching Protocols\r\nConnection: upgrade\r\nUpgrade: h2c\r\n\r\n\x00\x00"
    await refused_by_the_client(pool, answer)


async def test_interim_answers_are_skipped(pool: Pool) -> None:
    """RFC 9110 15.2: a client MUST parse 1xx answers before the final one, even unexpected."""
    answer = b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\nLink: </a>\r\n\r\n" + OK
    async with FakeEngine(answer) as engine:
        assert await call(pool, engine.port) == (200, b"ok")


async def test_a_body_without_framing_ends_at_the_close(pool: Pool) -> None:
    """RFC 9112 6.3 (8): no Content-Length and no Transfer-Encoding: the body is what arrives
    until the server closes."""
    async with FakeEngine(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\n\r\nhello", close=True) as engine:
        assert await call(pool, engine.port) == (200, b"hello")


async def test_trailers_are_not_merged_into_the_headers(pool: Pool) -> None:
    """RFC 9110 6.5.1: trailer fields are not merged into the header section."""
    answer = (
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nok\r\n0\r\nContent-Type: evil\r\n\r\n"
    )
    async with FakeEngine(answer) as engine, asyncio.timeout(WAIT_S):
        resp = await pool.request("127.0.0.1", engine.port, b"POST", b"/x", b"{}")
        assert await resp.read() == b"ok"
        assert b"content-type" not in resp.headers
        resp.release()


async def test_bytes_past_an_answer_are_not_the_next_answer(pool: Pool) -> None:
    """RFC 9112 6.3: a response ends where its framing says. A body longer than its
    Content-Length (or a second, unasked-for answer) means the engine and the client disagree
    on where answers end: the answer stands, the connection is not reused, and the next call
    gets its own answer on a new connection."""
    stale = b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nstale"  # in the same write as OK
    async with FakeEngine(OK + stale, OK) as engine:
        assert await call(pool, engine.port) == (200, b"ok")
        assert await call(pool, engine.port) == (200, b"ok")
        assert engine.connections == 2


async def test_a_malformed_answer_on_a_reused_connection_is_not_sent_again(pool: Pool) -> None:
    """Only a pooled connection that failed before any byte of an answer (the engine had
    closed it while idle) is retried; one that answered garbage reached the engine, which may
    have acted on it: a POST is not sent twice."""
    async with FakeEngine(OK, b"HTTP/1.1 2x0 garbage\r\n\r\n", OK) as engine:
        assert await call(pool, engine.port) == (200, b"ok")
        with pytest.raises(Disconnected):
            await call(pool, engine.port)
        assert engine.requests == 2


@contextlib.contextmanager
def refusing_port() -> Iterator[int]:
    """A loopback port that refuses connections: bound (so no one else takes it), not listening."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        yield s.getsockname()[1]


async def test_a_refused_connection_is_refused(pool: Pool) -> None:
    """Nothing listening: Refused, the Coordinator's signal to take the endpoint out."""
    with refusing_port() as port, pytest.raises(Refused):
        await call(pool, port)
