"""Request framing (RFC 9112 sections 2.2, 5, 6, 7): where a request ends must never be in doubt.

A request whose framing two parsers could read two ways is the raw material of request
smuggling: a proxy in front takes one reading, this server another, and the bytes in between
become a request no one checked. Each such request is refused 400 (or 501) and the connection
closed, and a request pipelined behind it (``SMUGGLED``) never reaches a handler. What the RFC
requires a server to accept (chunk extensions, trailers) is accepted, with the body intact.
"""

from __future__ import annotations

import pytest

from tests.http.wire import Served, post, request

SMUGGLED = request("GET", "/smuggled", "Host: t")
CHUNKED = "Transfer-Encoding: chunked"


async def refused(served: Served, data: bytes, status: int = 400) -> None:
    """``data`` (then a smuggled request) gets ``status`` and the connection closes; no handler
    ran, and the server counted the refusal."""
    c = await served.client()
    await c.send(data + SMUGGLED)
    answers = await c.closed()
    assert [a.status for a in answers] == [status], [a.body for a in answers]
    assert served.seen == []
    assert [s for _, s in served.rejected] == [status]


async def test_content_length_with_transfer_encoding_is_refused(served: Served) -> None:
    """RFC 9112 6.3 (3): both framings at once "ought to be handled as an error"; a server MUST
    close the connection after such a request (6.1)."""
    body = b"0\r\n\r\n"
    await refused(served, request("POST", "/echo", "Host: t", "Content-Length: 5", CHUNKED, body=body))


async def test_transfer_encoding_before_content_length_is_refused(served: Served) -> None:
    """RFC 9112 6.3 (3), the fields the other way round (parsers that stop at the first differ)."""
    body = b"0\r\n\r\n"
    await refused(served, request("POST", "/echo", "Host: t", CHUNKED, "Content-Length: 5", body=body))


async def test_two_different_content_lengths_are_refused(served: Served) -> None:
    """RFC 9112 6.3 (5): differing Content-Length values are unrecoverable: 400 and close."""
    data = request("POST", "/echo", "Host: t", "Content-Length: 5", "Content-Length: 6", body=b"hello!")
    await refused(served, data)


async def test_a_content_length_list_is_refused(served: Served) -> None:
    """RFC 9112 6.3 (5): a list of lengths in one field ("5, 6") is invalid too."""
    await refused(served, request("POST", "/echo", "Host: t", "Content-Length: 5, 6", body=b"hello!"))


@pytest.mark.parametrize("value", ["-1", "+5", "0x5", "5 5"])
async def test_a_content_length_that_is_not_digits_is_refused(served: Served, value: str) -> None:
    """RFC 9112 6.3 (5) and RFC 9110 8.6: Content-Length is 1*DIGIT; anything else is invalid."""
    await refused(served, request("POST", "/echo", "Host: t", f"Content-Length: {value}", body=b"hello"))


@pytest.mark.parametrize("fold", [" ", "\t"])
async def test_obs_fold_continuation_line_is_refused(served: Served, fold: str) -> None:
    """RFC 9112 5.2: a server that receives obs-fold in a request MUST reject it (400) unless it
    replaces the fold with spaces; llhttp rejects it."""
    await refused(served, request("GET", "/", "Host: t", "X-A: one", f"{fold}two"))


async def test_whitespace_between_field_name_and_colon_is_refused(served: Served) -> None:
    """RFC 9112 5.1: a server MUST reject, with 400, a request with whitespace between a field
    name and its colon ("Transfer-Encoding : chunked" is a classic smuggling vector)."""
    await refused(
        served, request("POST", "/echo", "Host: t", "Transfer-Encoding : chunked", body=b"0\r\n\r\n")
    )


@pytest.mark.parametrize(
    "data",
    [
        b"GET / HTTP/1.1\nHost: t\n\n",  # every line
        b"GET / HTTP/1.1\r\nHost: t\nX-A: b\r\n\r\n",  # one header line
        b"GET / HTTP/1.1\r\nHost: t\r\n\n",  # the empty line ending the head
    ],
    ids=["all-lines", "one-header", "head-end"],
)
async def test_bare_lf_line_endings_are_refused(served: Served, data: bytes) -> None:
    """RFC 9112 2.2: a recipient MAY take a bare LF as a line end, or refuse it. llhttp (strict,
    as this server runs it) refuses: 400 and close, never a reading that differs line by line
    from a proxy's, which is where the leniency becomes a smuggling vector."""
    await refused(served, data)


async def test_a_bare_cr_is_refused(served: Served) -> None:
    """RFC 9112 2.2: a bare CR outside the content MUST be taken as invalid (or replaced by SP)."""
    await refused(served, b"GET / HTTP/1.1\r\nHost: t\rX-A: b\r\n\r\n")


async def test_chunk_size_overflow_is_refused(served: Served) -> None:
    """RFC 9112 7.1: a recipient MUST anticipate huge chunk sizes and guard against overflow;
    a size past 64 bits (which would wrap to a small one) is refused."""
    body = b"1" + b"0" * 16 + b"\r\nhello\r\n0\r\n\r\n"  # 2^64
    await refused(served, request("POST", "/echo", "Host: t", CHUNKED, body=body))


async def test_a_chunk_size_that_is_not_hex_is_refused(served: Served) -> None:
    """RFC 9112 7.1: chunk-size is 1*HEXDIG."""
    await refused(served, request("POST", "/echo", "Host: t", CHUNKED, body=b"zz\r\nhello\r\n0\r\n\r\n"))


async def test_a_chunk_longer_than_its_size_is_refused(served: Served) -> None:
    """RFC 9112 7.1: the chunk data is exactly chunk-size octets, then CRLF."""
    await refused(served, request("POST", "/echo", "Host: t", CHUNKED, body=b"3\r\nabcdef\r\n0\r\n\r\n"))


async def test_transfer_encoding_twice_is_refused(served: Served) -> None:
    """RFC 9112 6.1: chunked MUST NOT be applied more than once."""
    data = request("POST", "/echo", "Host: t", CHUNKED, CHUNKED, body=b"0\r\n\r\n")
    await refused(served, data)


async def test_a_transfer_coding_other_than_chunked_is_not_implemented(served: Served) -> None:
    """RFC 9112 6.1: a server that receives a transfer coding it does not understand SHOULD
    answer 501 and then close. ("gzip, chunked" is framed right, so llhttp lets it through,
    but the handler would be given gzip bytes as the body.)"""
    data = request("POST", "/echo", "Host: t", "Transfer-Encoding: gzip, chunked", body=b"0\r\n\r\n")
    await refused(served, data, 501)


async def test_transfer_encoding_in_an_http10_request_is_refused(served: Served) -> None:
    """RFC 9112 6.1: an HTTP/1.0 message with Transfer-Encoding MUST be treated as having faulty
    framing (an HTTP/1.0 hop in between may not have understood it)."""
    data = request("POST", "/echo", "Host: t", CHUNKED, body=b"5\r\nhello\r\n0\r\n\r\n", version="HTTP/1.0")
    await refused(served, data)


@pytest.mark.parametrize("version", ["HTTP/2.0", "HTTP/0.9"])
async def test_a_version_other_than_1x_is_refused_505(served: Served, version: str) -> None:
    """RFC 9110 15.6.6 and RFC 9112 2.3: 505 refuses the major version the client asked for;
    llhttp parses these request lines, and answering them as HTTP/1.1 would be a guess."""
    await refused(served, request("GET", "/", "Host: t", version=version), 505)


async def test_an_upgrade_with_a_body_is_refused(served: Served) -> None:
    """RFC 9110 7.8: the server may ignore Upgrade, but llhttp reads what follows this head as
    the new protocol's bytes, body included: the request is refused rather than served with an
    empty body (and answered a second time)."""
    data = post("/echo", b"hello", "Connection: Upgrade", "Upgrade: h2c")
    await refused(served, data)


async def test_an_upgrade_without_a_body_is_served_as_http11(served: Served) -> None:
    """RFC 9110 7.8: a server MAY ignore a received Upgrade header field (curl --http2 sends
    one with each request to an http:// URL); the request is answered once, as HTTP/1.1, and
    the connection goes on."""
    c = await served.client()
    upgrade = request("GET", "/up", "Host: t", "Connection: Upgrade, HTTP2-Settings", "Upgrade: h2c")
    await c.send(upgrade + request("GET", "/after", "Host: t"))
    assert ((await c.answer()).status, (await c.answer()).body) == (200, b"/after")
    assert served.paths == ["/up", "/after"]
    c.close()


async def test_chunk_extensions_are_accepted(served: Served) -> None:
    """RFC 9112 7.1.1: a recipient MUST ignore chunk extensions it does not understand."""
    c = await served.client()
    body = b'5;foo=bar\r\nhello\r\n6;a;b="q s"\r\n world\r\n0;last\r\n\r\n'
    await c.send(request("POST", "/echo", "Host: t", CHUNKED, body=body))
    answer = await c.answer()
    assert (answer.status, answer.body) == (200, b"hello world")
    c.close()


async def test_trailers_are_accepted_and_not_merged_into_the_headers(served: Served) -> None:
    """RFC 9112 7.1.2 / RFC 9110 6.5.1: trailer fields after the last chunk are read (the body is
    intact and the connection stays in step), and a recipient MUST NOT merge them into the
    header section unless their definition allows it."""
    c = await served.client()
    body = b"5\r\nhello\r\n0\r\nX-Checksum: 1\r\nAuthorization: Bearer smuggled\r\n\r\n"
    await c.send(request("POST", "/echo", "Host: t", CHUNKED, body=body) + request("GET", "/next", "Host: t"))
    answer = await c.answer()
    assert (answer.status, answer.body) == (200, b"hello")
    assert (await c.answer()).body == b"/next"
    headers = served.seen[0].headers
    assert b"x-checksum" not in headers and b"authorization" not in headers
    c.close()


async def test_a_body_longer_than_declared_starts_the_next_request(served: Served) -> None:
    """RFC 9112 6.3 (6): Content-Length ends the body; the bytes after it are the next request,
    so garbage there is a malformed request: the first is answered, then 400, then close."""
    c = await served.client()
    await c.send(post("/echo", b"hello") + b"EXTRA garbage\r\n\r\n" + SMUGGLED)
    answers = await c.closed()
    assert [(a.status, a.body[:5]) for a in answers] == [(200, b"hello"), (400, b'{"err')]
    assert served.paths == ["/echo"]


async def test_leading_empty_lines_before_a_request_are_ignored(served: Served) -> None:
    """RFC 9112 2.2: a server SHOULD ignore at least one empty line received before the
    request-line."""
    c = await served.client()
    await c.send(b"\r\n\r\n" + request("GET", "/x", "Host: t"))
    assert (await c.answer()).body == b"/x"
    c.close()
