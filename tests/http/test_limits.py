"""Limits in size and in time (RFC 9110 15.5.15, 15.5.9, 15.5.14; RFC 6585 5): what a client may
make the server hold is bounded before any handler runs.

Sizes: the request target (414), the number and bytes of header fields (431), the body (413).
Time (slowloris): each phase of a request has its own clock, counted from the phase's start
and not from the last byte, so a client that keeps sending a byte at a time is closed all the
same. The servers here run with clocks of a fraction of a second; the tests wait for the close
(bounded by ``WAIT_S``), never assert how fast it came.
"""

from __future__ import annotations

import asyncio

from motor_mesh.common import httpserver
from tests.http.conftest import Serve
from tests.http.wire import MAX_BODY, Served, request

SHORT_S = 0.4  # a clock a test makes short enough to run out
CHUNKED = "Transfer-Encoding: chunked"


async def answered_then_closed(served: Served, data: bytes, status: int) -> None:
    c = await served.client()
    await c.send(data)
    answers = await c.closed()
    assert [a.status for a in answers] == [status]
    assert served.seen == []
    assert [s for _, s in served.rejected] == [status]  # counted once


# -- sizes -----------------------------------------------------------------------------------------


async def test_too_many_header_fields_is_431(served: Served) -> None:
    """RFC 6585 5: 431 when the header fields are too large, here too many of them."""
    fields = [f"X-F{i}: v" for i in range(httpserver.MAX_HEADERS + 1)]
    await answered_then_closed(served, request("GET", "/", *fields), 431)


async def test_as_many_header_fields_as_allowed_are_served(served: Served) -> None:
    """The limit is a limit, not an off-by-one: MAX_HEADERS fields are served."""
    c = await served.client()
    await c.send(request("GET", "/ok", *[f"X-F{i}: v" for i in range(httpserver.MAX_HEADERS)]))
    assert (await c.answer()).status == 200
    c.close()


async def test_header_bytes_past_the_limit_is_431(served: Served) -> None:
    """RFC 6585 5: 431 when the header section is too large, over several fields."""
    value = "v" * 8000
    fields = [f"X-F{i}: {value}" for i in range(httpserver.MAX_HEADER_BYTES // 8000 + 1)]
    await answered_then_closed(served, request("GET", "/", *fields), 431)


async def test_one_huge_header_field_is_431(served: Served) -> None:
    """RFC 6585 5: one field larger than the whole header limit."""
    await answered_then_closed(
        served, request("GET", "/", "X-Big: " + "v" * (httpserver.MAX_HEADER_BYTES + 1)), 431
    )


async def test_a_header_field_that_never_ends_is_431_without_waiting_for_the_clock(served: Served) -> None:
    """RFC 6585 5. llhttp holds a field until its line ends, so a field that never ends would
    grow (and be copied, quadratically) until the head deadline; the raw bytes of a head are
    bounded as they arrive instead. The server here has the production head clock (20 s), far
    longer than this test waits."""
    c = await served.client()
    piece = b"v" * 16384
    head = b"GET / HTTP/1.1\r\nX-Endless: "
    answers = await c.trickled_until_closed([head, *[piece] * 64], 0.001)
    # The 431 may be lost to the reset that closing on unread bytes sends; the close is not.
    assert [a.status for a in answers] in ([431], [])
    assert [s for _, s in served.rejected] == [431]


async def test_a_request_target_past_the_limit_is_414(served: Served) -> None:
    """RFC 9110 15.5.15: 414 when the target is longer than the server will interpret."""
    await answered_then_closed(served, request("GET", "/" + "a" * httpserver.MAX_URL_BYTES), 414)


async def test_a_request_target_at_the_limit_is_served(served: Served) -> None:
    """A target of exactly MAX_URL_BYTES is served."""
    c = await served.client()
    target = "/" + "a" * (httpserver.MAX_URL_BYTES - 1)
    await c.send(request("GET", target, "Host: t"))
    assert (await c.answer()).body == target.encode()
    c.close()


async def test_a_declared_body_past_the_limit_is_413_before_it_is_sent(served: Served) -> None:
    """RFC 9110 15.5.14: 413, answered from the Content-Length alone."""
    head = request("POST", "/echo", "Host: t", f"Content-Length: {MAX_BODY + 1}")
    await answered_then_closed(served, head, 413)


async def test_a_body_past_the_limit_behind_a_request_in_flight_is_413_after_its_answer(
    served: Served,
) -> None:
    """RFC 9110 15.5.14 with RFC 9112 9.3.2: the refusal of a pipelined request waits for the
    answer ahead of it, and is still the 413 it was, not some later parse error's 400."""
    c = await served.client()
    too_large = request("POST", "/echo", "Host: t", f"Content-Length: {MAX_BODY + 1}", body=b"x" * 100)
    await c.send(request("GET", "/gate", "Host: t") + too_large)
    await asyncio.wait_for(served.at_gate.wait(), 10)
    served.gate.set()
    assert [a.status for a in await c.closed()] == [200, 413]
    assert [s for _, s in served.rejected] == [413]


async def test_a_chunked_body_past_the_limit_is_413(served: Served) -> None:
    """RFC 9110 15.5.14: a chunked body has no declared size; it is cut when it passes the limit."""
    chunk = b"%x\r\n%s\r\n" % (MAX_BODY, b"a" * MAX_BODY)
    await answered_then_closed(served, request("POST", "/echo", "Host: t", CHUNKED, body=chunk * 2), 413)


# -- time --------------------------------------------------------------------------------------------


async def test_a_head_trickled_past_the_head_deadline_is_closed(serve: Serve) -> None:
    """Slowloris: a head that arrives one line at a time, each line well inside any idle clock,
    is closed when the head deadline, counted from its first byte, passes (RFC 9110 15.5.9: 408
    for a request not received in time), although bytes keep arriving."""
    served = await serve(head_timeout_s=SHORT_S)
    c = await served.client()
    # Far more lines than the deadline lets through (10 000 at SHORT_S / 8 apart).
    lines = [b"GET / HTTP/1.1\r\n", *[b"X-Slow-%d: v\r\n" % i for i in range(10_000)]]
    answers = await c.trickled_until_closed(lines, SHORT_S / 8)
    assert [a.status for a in answers] in ([408], [])  # the 408 may be lost to the reset
    assert served.seen == [] and [s for _, s in served.rejected] == [408]


async def test_a_head_trickled_byte_by_byte_is_closed(serve: Serve) -> None:
    """Slowloris, one byte at a time: the request line itself never ends in time."""
    served = await serve(head_timeout_s=SHORT_S)
    c = await served.client()
    line = b"GET /" + b"a" * 5000
    answers = await c.trickled_until_closed((line[i : i + 1] for i in range(len(line))), 0.02)
    assert [a.status for a in answers] in ([408], [])
    assert [s for _, s in served.rejected] == [408]


async def test_a_head_trickled_inside_the_head_deadline_is_served(serve: Serve) -> None:
    """The head clock closes only the slow: a head sent in pieces, complete well inside its
    deadline, is served."""
    served = await serve(head_timeout_s=30.0)
    c = await served.client()
    await c.trickle([b"GET /slow HTTP/1.1\r\n", b"Host: t\r\n", b"X-A: b\r\n", b"\r\n"], 0.05)
    assert (await c.answer()).body == b"/slow"
    c.close()


async def test_a_body_below_the_minimum_rate_is_closed(serve: Serve) -> None:
    """Slowloris on the body (RUDY): a body that arrives slower than the minimum rate, though a
    byte arrives every few milliseconds, is closed (408) once its grace and the time its bytes
    earned run out."""
    served = await serve(body_timeout_s=SHORT_S, min_body_rate=1000)
    c = await served.client()
    head = request("POST", "/echo", "Host: t", "Content-Length: 3000")
    answers = await c.trickled_until_closed([head, *[b"b"] * 3000], 0.02)  # 50 bytes/s
    assert [a.status for a in answers] in ([408], [])
    assert served.seen == [] and [s for _, s in served.rejected] == [408]


async def test_a_body_above_the_minimum_rate_is_served_past_the_body_grace(serve: Serve) -> None:
    """The rate, not the duration, is what is bounded: a body that keeps above the minimum rate
    is served though it takes longer than ``body_timeout_s``."""
    served = await serve(body_timeout_s=0.1, min_body_rate=100)
    c = await served.client()
    head = request("POST", "/echo", "Host: t", "Content-Length: 3000")
    # 300 bytes every 50 ms: each piece earns 3 s of time; the first goes with the head.
    await c.trickle([head + b"b" * 300, *[b"b" * 300] * 9], 0.05)
    answer = await c.answer()
    assert (answer.status, len(answer.body)) == (200, 3000)
    c.close()


async def test_an_idle_keep_alive_connection_is_closed_without_an_answer(serve: Serve) -> None:
    """RFC 9112 9.5: a server may close an idle connection at any time; with no request begun,
    nothing is owed and nothing is sent (a 408 here could be read as the answer to a request
    the client sends at that moment)."""
    served = await serve(idle_timeout_s=SHORT_S)
    c = await served.client()
    await c.send(request("GET", "/first", "Host: t"))
    assert (await c.answer()).status == 200
    assert await c.closed() == []
    assert served.rejected == []


async def test_empty_lines_do_not_keep_an_idle_connection_open(serve: Serve) -> None:
    """RFC 9112 2.2 lets a server skip empty lines before a request; a client that sends only
    those, forever, is still idle and is closed by the idle clock."""
    served = await serve(idle_timeout_s=SHORT_S)
    c = await served.client()
    assert await c.trickled_until_closed([b"\r\n"] * 10_000, SHORT_S / 8) == []
