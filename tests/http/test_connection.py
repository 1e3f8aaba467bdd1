"""Connection management (RFC 9112 9, RFC 9110 10.1.1): persistence, pipelining, 100-continue,
HTTP/1.0, and clients that leave in the middle of things.

Whatever a client does to its end of the connection, the server logs no error and goes on
serving (checked after every test by the ``serve`` fixture).
"""

from __future__ import annotations

import asyncio

from tests.http.wire import MAX_BODY, Served, post, request


async def test_pipelined_requests_are_answered_in_order(served: Served) -> None:
    """RFC 9112 9.3.2: a server MAY process pipelined requests in parallel, but MUST send the
    responses in the order the requests were received."""
    c = await served.client()
    await c.send(
        request("GET", "/stream", "Host: t")  # a streamed answer first: the others queue behind it
        + post("/echo", b"second")
        + request("GET", "/third", "Host: t")
    )
    answers = [await c.answer() for _ in range(3)]
    assert [a.body for a in answers] == [b"chunk 0\nchunk 1\nchunk 2\n", b"second", b"/third"]
    c.close()


async def test_expect_100_continue_gets_100_before_the_body_is_sent(served: Served) -> None:
    """RFC 9110 10.1.1: a client that sends ``Expect: 100-continue`` waits for 100 (Continue)
    before the body; the server sends it on reading the head, then the final answer."""
    c = await served.client()
    await c.send(request("POST", "/echo", "Host: t", "Content-Length: 5", "Expect: 100-continue"))
    assert (await c.answer()).status == 100  # sent while the body has not been
    await c.send(b"hello")
    answer = await c.answer()
    assert (answer.status, answer.body) == (200, b"hello")
    c.close()


async def test_expect_100_continue_with_a_body_too_large_gets_the_final_status(served: Served) -> None:
    """RFC 9110 10.1.1: a server MAY answer the final status instead of 100, which spares the
    client sending a body that would be refused: 413 at once, and no 100."""
    c = await served.client()
    head = request("POST", "/echo", "Host: t", f"Content-Length: {MAX_BODY + 1}", "Expect: 100-continue")
    await c.send(head)
    assert [a.status for a in await c.closed()] == [413]


async def test_expect_100_continue_behind_a_request_in_flight_waits_its_turn(served: Served) -> None:
    """RFC 9112 9.3.2 with RFC 9110 10.1.1: the 100 belongs to a later request; it follows the
    answer in flight rather than landing in the middle of it."""
    c = await served.client()
    head = request("POST", "/echo", "Host: t", "Content-Length: 5", "Expect: 100-continue")
    await c.send(request("GET", "/gate", "Host: t") + head)
    await asyncio.wait_for(served.at_gate.wait(), 10)
    served.gate.set()
    assert [(await c.answer()).status, (await c.answer()).status] == [200, 100]
    await c.send(b"hello")
    assert (await c.answer()).body == b"hello"
    c.close()


async def test_expect_100_continue_from_an_http10_client_is_ignored(served: Served) -> None:
    """RFC 9110 10.1.1: a server that receives 100-continue in an HTTP/1.0 request MUST ignore
    it (the client cannot read a 1xx)."""
    c = await served.client()
    data = request(
        "POST", "/echo", "Content-Length: 5", "Expect: 100-continue", body=b"hello", version="HTTP/1.0"
    )
    await c.send(data)
    assert [(a.status, a.body) for a in await c.closed()] == [(200, b"hello")]


async def test_http10_without_keep_alive_is_closed_after_the_answer(served: Served) -> None:
    """RFC 9112 9.3: an HTTP/1.0 request without the keep-alive option is not persistent."""
    c = await served.client()
    await c.send(request("GET", "/one", version="HTTP/1.0") + request("GET", "/two", version="HTTP/1.0"))
    assert [a.body for a in await c.closed()] == [b"/one"]
    assert served.paths == ["/one"]


async def test_http10_with_keep_alive_stays_open(served: Served) -> None:
    """RFC 9112 9.3: an HTTP/1.0 request with ``Connection: keep-alive`` persists, and the
    answer says so (a 1.0 client keeps the connection only if it does)."""
    c = await served.client()
    await c.send(request("GET", "/one", "Connection: keep-alive", version="HTTP/1.0"))
    first = await c.answer()
    assert (first.body, first.headers.get(b"connection", b"").lower()) == (b"/one", b"keep-alive")
    await c.send(request("GET", "/two", "Connection: keep-alive", version="HTTP/1.0"))
    assert (await c.answer()).body == b"/two"
    c.close()


async def test_a_streamed_answer_to_http10_is_not_chunked(served: Served) -> None:
    """RFC 9112 6.1: a server MUST NOT send Transfer-Encoding in an answer to an HTTP/1.0
    request; the body goes out as it is and the close ends it (RFC 9112 6.3 (8))."""
    c = await served.client()
    await c.send(request("GET", "/stream", "Connection: keep-alive", version="HTTP/1.0"))
    raw = await c.read_to_eof()
    head, _, body = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200 ")
    assert b"transfer-encoding" not in head.lower() and b"connection: close" in head.lower()
    assert body == b"chunk 0\nchunk 1\nchunk 2\n"


async def test_connection_close_on_http11_is_closed_after_the_answer(served: Served) -> None:
    """RFC 9112 9.6: a server that receives ``Connection: close`` MUST close after the answer
    to that request, and the answer says it closes."""
    c = await served.client()
    await c.send(request("GET", "/one", "Host: t", "Connection: close") + request("GET", "/two", "Host: t"))
    answers = await c.closed()
    assert [a.body for a in answers] == [b"/one"]
    assert answers[0].headers[b"connection"] == b"close"
    assert served.paths == ["/one"]


async def test_http11_is_persistent_by_default(served: Served) -> None:
    """RFC 9112 9.3: without ``close``, an HTTP/1.1 connection persists."""
    c = await served.client()
    for path in ("/one", "/two"):
        await c.send(request("GET", path, "Host: t"))
        answer = await c.answer()
        assert answer.body == path.encode() and b"connection" not in answer.headers
    c.close()


async def test_a_body_shorter_than_declared_then_half_close_is_not_served(served: Served) -> None:
    """RFC 9112 8: a message that ends before its Content-Length is incomplete; the server
    never hands it to a handler as if it were whole (it closes, answering nothing)."""
    c = await served.client()
    await c.send(request("POST", "/echo", "Host: t", "Content-Length: 10", body=b"hello"))
    c.writer.write_eof()
    assert await c.closed() == []
    assert served.seen == []


async def test_a_body_shorter_than_declared_then_close_is_not_served(served: Served) -> None:
    """RFC 9112 8, the client closing outright."""
    c = await served.client()
    await c.send(request("POST", "/echo", "Host: t", "Content-Length: 10", body=b"hello"))
    c.close()
    await c.writer.wait_closed()
    await served.still_serving()
    assert served.paths == ["/still"]


async def test_a_reset_mid_body_is_forgotten(served: Served) -> None:
    """A client that resets (TCP RST) halfway through its body: no handler runs, nothing is
    logged as an error, the server goes on serving."""
    c = await served.client()
    await c.send(request("POST", "/echo", "Host: t", "Content-Length: 1000", body=b"x" * 10))
    c.reset()
    await served.still_serving()
    assert served.paths == ["/still"]


async def test_a_reset_mid_stream_cancels_the_handler(served: Served) -> None:
    """A client that resets while its answer streams: the handler is cancelled (its upstream
    work stops with it), nothing is logged as an error, the server goes on serving."""
    c = await served.client()
    await c.send(request("GET", "/forever", "Host: t"))
    await c.reader.readuntil(b"xxxx")  # the stream is flowing
    c.reset()
    await asyncio.wait_for(served.stream_cancelled.wait(), 10)
    await served.still_serving()


async def test_a_reset_with_pipelined_requests_queued_is_forgotten(served: Served) -> None:
    """A reset while answers are queued behind one in flight: none of them is sent anywhere,
    and the server goes on serving."""
    c = await served.client()
    await c.send(request("GET", "/forever", "Host: t") + request("GET", "/queued", "Host: t") * 3)
    await c.reader.readuntil(b"xxxx")
    c.reset()
    await asyncio.wait_for(served.stream_cancelled.wait(), 10)
    await served.still_serving()
    assert "/queued" not in served.paths
