"""The HTTP parsers' entry points fuzzed with hypothesis: the server connection's
``data_received`` and the client's response reading.

Server: random bytes, and well-formed requests mutated (bytes cut, inserted, flipped, line ends
changed, lines doubled), pipelined, fed to a real ``_Connection`` in random pieces. Whatever
arrives, what the server writes back parses as complete answers with a status the server may
give; no exception escapes; nothing is logged as an error; the same bytes cut into other
pieces get the same answers; and once the clocks run out the connection is closed (nothing
can hold it open). A real socket adds nothing to what these properties see but time.

Client: the same kinds of input as an engine's answer, over a real socket from a fake engine
that then closes. A call returns an answer or raises ``Disconnected``, and nothing else.

Bounded and reproducible (derandomized, no example database), a few seconds in all.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httptools
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from motor_mesh.common.httpclient import Disconnected, Pool
from motor_mesh.common.httpserver import _Connection
from tests.http.test_client import FakeEngine, call
from tests.http.wire import MAX_BODY, Served
from tests.poll import until

FUZZ = settings(
    max_examples=150,
    derandomize=True,
    database=None,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
# What the server may answer: success, 100 Continue, and its own refusals. 500 is a bug.
SERVER_STATUSES = {100, 200, 400, 408, 413, 414, 431, 501, 505}
CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"


class _Errors(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@contextmanager
def no_errors_logged() -> Iterator[None]:
    """Fail if anything logs an error (a traceback, asyncio's "exception never retrieved")."""
    handler = _Errors()
    root = logging.getLogger()
    root.addHandler(handler)
    try:
        yield
    finally:
        root.removeHandler(handler)
    assert not handler.records, [r.getMessage() for r in handler.records]


# -- generating bytes ------------------------------------------------------------------------------


def mutated(base: st.SearchStrategy[bytes]) -> st.SearchStrategy[bytes]:
    """``base`` with up to three edits of the kinds that break HTTP framing."""

    @st.composite
    def edit(draw: st.DrawFn) -> bytes:
        data = draw(base)
        for _ in range(draw(st.integers(0, 3))):
            at = draw(st.integers(0, len(data)))
            kind = draw(st.sampled_from(["cut", "insert", "flip", "lf", "cr", "double", "ws"]))
            if kind == "cut":
                data = data[:at] + data[at + draw(st.integers(1, 8)) :]
            elif kind == "insert":
                data = data[:at] + draw(st.binary(min_size=1, max_size=8)) + data[at:]
            elif kind == "flip" and at < len(data):
                data = data[:at] + bytes([data[at] ^ (1 << draw(st.integers(0, 7)))]) + data[at + 1 :]
            elif kind == "lf":
                data = (
                    data.replace(b"\r\n", b"\n", 1) if draw(st.booleans()) else data.replace(b"\r\n", b"\n")
                )
            elif kind == "cr":
                data = data[:at] + b"\r" + data[at:]
            elif kind == "double":  # a line twice: duplicate fields, repeated request lines
                start = data.rfind(b"\r\n", 0, at) + 2 if b"\r\n" in data[:at] else 0
                end = data.find(b"\r\n", at)
                if end > 0:
                    data = data[:end] + b"\r\n" + data[start:end] + data[end:]
            elif kind == "ws":
                data = data[:at] + draw(st.sampled_from([b" ", b"\t", b"\x00", b"\x7f", b"\xff"])) + data[at:]
        return data

    return edit()


HEADERS = [
    b"Host: t",
    b"Content-Type: application/json",
    b"Connection: close",
    b"Connection: keep-alive",
    b"Connection: Upgrade",
    b"Upgrade: h2c",
    b"Expect: 100-continue",
    b"Transfer-Encoding: chunked",
    b"Transfer-Encoding: gzip, chunked",
    b"Content-Length: 0",
    b"Content-Length: 3",
    b"Content-Length: " + str(MAX_BODY + 1).encode(),
    b"X-A: b",
    b"X-Long: " + b"v" * 300,
]


@st.composite
def one_request(draw: st.DrawFn) -> bytes:
    method = draw(st.sampled_from([b"GET", b"POST", b"HEAD", b"PUT", b"CONNECT", b"OPTIONS"]))
    target = draw(
        st.sampled_from([b"/", b"/echo", b"/echo", b"/stream", b"/x?q=1", b"*"] * 3 + [b"/" + b"a" * 9000])
    )
    version = draw(st.sampled_from([b"HTTP/1.1"] * 4 + [b"HTTP/1.0", b"HTTP/2.0"]))
    headers = draw(st.lists(st.sampled_from(HEADERS), max_size=4))
    body = draw(st.sampled_from([b"", b"hello", b"5;x=y\r\nhello\r\n0\r\n\r\n", b"0\r\nX-T: 1\r\n\r\n"]))
    if draw(st.booleans()):  # a framing that matches the body
        chunked = body.endswith(b"\r\n\r\n")
        headers.append(b"Transfer-Encoding: chunked" if chunked else b"Content-Length: %d" % len(body))
    return (
        method
        + b" "
        + target
        + b" "
        + version
        + b"\r\n"
        + b"".join(h + b"\r\n" for h in headers)
        + b"\r\n"
        + body
    )


requests_bytes = st.one_of(
    st.binary(max_size=600),
    mutated(st.lists(one_request(), min_size=1, max_size=3).map(b"".join)),
    st.lists(one_request(), min_size=1, max_size=3).map(b"".join),
)


@st.composite
def cut(draw: st.DrawFn, data: bytes) -> list[bytes]:
    """``data`` in pieces cut at random places."""
    points = sorted(draw(st.lists(st.integers(0, len(data)), max_size=6)))
    edges = [0, *points, len(data)]
    return [data[a:b] for a, b in itertools.pairwise(edges) if b > a]


# -- the server --------------------------------------------------------------------------------------


class FakeTransport:
    """What ``_Connection`` writes to, recorded; closing calls ``connection_lost`` as asyncio's
    transports do (soon, not at once)."""

    def __init__(self, conn: _Connection) -> None:
        self.conn = conn
        self.out = b""
        self.closed = False
        self.lost = False  # connection_lost has run

    def write(self, data: bytes) -> None:
        assert not self.closed, "a write after close"
        self.out += data

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            asyncio.get_running_loop().call_soon(self._lose)

    def _lose(self) -> None:
        self.conn.connection_lost(None)
        self.lost = True

    abort = close

    def is_closing(self) -> bool:
        return self.closed

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass

    def get_extra_info(self, name: str, default: object = None) -> object:
        return ("127.0.0.1", 40000) if name == "peername" else default


class _Answers:
    def __init__(self, data: bytes) -> None:
        self.statuses: list[int] = []
        self.bodies: list[bytes] = []
        self._body = b""
        self.parser = httptools.HttpResponseParser(self)
        self.parser.feed_data(data)  # a malformed answer fails the property here

    def on_body(self, body: bytes) -> None:
        self._body += body

    def on_message_complete(self) -> None:
        self.statuses.append(self.parser.get_status_code())
        self.bodies.append(self._body)
        self._body = b""


async def feed(pieces: list[bytes]) -> tuple[bytes, FakeTransport, _Connection]:
    """``pieces`` to a fresh connection, the loop running between them, until every answer
    owed has been written."""
    served = Served().make()
    conn = _Connection(served.server)
    transport = FakeTransport(conn)
    conn.connection_made(transport)  # type: ignore[arg-type]
    for piece in pieces:
        if transport.closed:
            break
        conn.data_received(piece)
        await asyncio.sleep(0)  # one turn of the loop between reads, as from a real socket
    # Every handler here finishes within a few turns of the loop.
    await until(lambda: not served.server.in_flight and conn.idle, 10, "the answers", every=0)
    await until(lambda: transport.lost or not transport.closed, 10, "connection_lost after a close", every=0)
    return transport.out, transport, conn


def judge(out: bytes) -> _Answers:
    answers = _Answers(out)
    assert set(answers.statuses) <= SERVER_STATUSES, (answers.statuses, out[:500])
    return answers


@FUZZ
@given(data=st.data(), raw=requests_bytes)
async def test_server_answers_or_closes_whatever_arrives(data: st.DataObject, raw: bytes) -> None:
    """Any bytes: valid answers only, no error logged, the same answers however the bytes are
    cut, and closed once the clocks run out."""
    with no_errors_logged():
        whole, _, _ = await feed([raw])
        pieces = data.draw(cut(raw))
        out, transport, conn = await feed(pieces)
        answers = judge(out)
        event(f"answers: {sorted(set(answers.statuses))}")
        # Cut elsewhere, the same answers (a 100 Continue may go or not: the body can come in
        # the same read as the head, and then none is owed).
        again = judge(whole)
        drop = [i for i, s in enumerate(answers.statuses) if s != 100]
        drop_again = [i for i, s in enumerate(again.statuses) if s != 100]
        assert [answers.statuses[i] for i in drop] == [again.statuses[i] for i in drop_again]
        assert [answers.bodies[i] for i in drop] == [again.bodies[i] for i in drop_again]
        # Nothing holds a connection open past its clocks: idle, head, body alike.
        if not transport.closed:
            conn.expire(time.monotonic() + 100_000)
        assert transport.closed
        await until(lambda: transport.lost, 10, "connection_lost after the close", every=0)


# -- the client --------------------------------------------------------------------------------------

OK_CL = b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhello"
OK_CHUNKED = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5;e=1\r\nhello\r\n0\r\nX-T: 1\r\n\r\n"
OK_CLOSE = b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\n\r\nhello"
INTERIM = b"HTTP/1.1 103 Early Hints\r\nLink: </a>\r\n\r\n" + OK_CL
NO_BODY = b"HTTP/1.1 204 No Content\r\n\r\n"

BASES = st.sampled_from([OK_CL, OK_CHUNKED, OK_CLOSE, INTERIM, NO_BODY])
answers_bytes = st.one_of(
    st.binary(max_size=400),
    st.binary(max_size=200).map(lambda b: b"HTTP/1.1 200 OK\r\n" + b),
    BASES,  # each once: hypothesis does not repeat an example
    mutated(BASES),
    mutated(BASES),
)


@FUZZ
@given(answer=answers_bytes)
async def test_client_returns_an_answer_or_raises_disconnected(answer: bytes) -> None:
    """Any answer from an engine that then closes: a status in 200..599 (1xx are skipped) and a
    body, or Disconnected; never another exception, never a hang, no error logged."""
    with no_errors_logged():
        async with FakeEngine(answer, close=True) as engine:
            pool = Pool(connect_timeout_s=2.0)
            try:
                status, _ = await call(pool, engine.port, deadline_s=5.0)
            except Disconnected:
                event("Disconnected")
                return
            finally:
                pool.close()
            assert 200 <= status <= 599
            event(f"answered {status}")
