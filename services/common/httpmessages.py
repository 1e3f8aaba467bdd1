"""What an HTTP handler sees: the :class:`Request`, the :class:`Responder` it answers with, and
a route table. The connection machinery is in :mod:`motor_mesh.common.httpserver`."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from http import HTTPStatus
from typing import Protocol

from motor_mesh.common.http_errors import OpenAIError, invalid_request


class Wire(Protocol):
    """The connection a Responder writes to."""

    pending_head: bytes

    def write(self, data: bytes) -> None: ...

    async def drain(self) -> None: ...

    def abort(self) -> None: ...


JSON_CT = b"application/json"

_REASONS = {s.value: s.phrase.encode() for s in HTTPStatus}


def status_line(status: int) -> bytes:
    return b"HTTP/1.1 %d %s\r\n" % (status, _REASONS.get(status, b"Unknown"))


_STATUS_LINES = {s: status_line(s) for s in _REASONS}


class Request:
    """One complete request. Header names are lower-case bytes, values bytes. ``http10``: it
    came as HTTP/1.0 (else 1.1), which changes how an answer may be framed."""

    __slots__ = ("body", "headers", "http10", "keep_alive", "method", "path", "peer", "query")

    def __init__(
        self,
        method: str,
        path: str,
        query: str,
        headers: dict[bytes, bytes],
        body: bytes,
        keep_alive: bool,
        peer: str,
        http10: bool = False,
    ) -> None:
        self.method = method
        self.path = path
        self.query = query
        self.headers = headers
        self.body = body
        self.keep_alive = keep_alive
        self.peer = peer
        self.http10 = http10


Headers = list[tuple[str, str]] | None


def _head(status: int, headers: Headers, extra: bytes) -> bytes:
    line = _STATUS_LINES.get(status) or status_line(status)
    if headers:
        extra += b"".join(f"{k}: {v}\r\n".encode("latin-1") for k, v in headers)
    return line + extra


class Responder:
    """How a handler answers: :meth:`send` once, or :meth:`start` then :meth:`write`...

    ``head_only``: the answer to a HEAD request, which is the head alone (RFC 9110 9.3.2); a
    body after it would be read as the next response on a keep-alive connection.

    ``http10``: the answer to an HTTP/1.0 request. Such a client has no chunked coding (RFC 9112
    6.1: a server MUST NOT send it Transfer-Encoding), so a streamed answer goes out as it is
    and the close of the connection ends it; and it keeps a connection only when the answer
    says ``Connection: keep-alive`` (RFC 9112 9.3)."""

    __slots__ = ("_conn", "close_after", "finished", "head_only", "http10", "started", "status")

    def __init__(self, conn: Wire, close: bool, head_only: bool = False, http10: bool = False) -> None:
        self._conn = conn
        self.close_after = close
        self.head_only = head_only
        self.http10 = http10
        self.started = False
        self.finished = False
        self.status = 0

    def send(self, status: int, body: bytes, content_type: bytes = JSON_CT, headers: Headers = None) -> None:
        """The whole answer in one write."""
        if self.started:
            raise RuntimeError("response already started")
        self.started = self.finished = True
        self.status = status
        if self.close_after:
            conn = b"Connection: close\r\n"
        else:
            conn = b"Connection: keep-alive\r\n" if self.http10 else b""
        extra = b"Content-Type: %s\r\nContent-Length: %d\r\n%s" % (content_type, len(body), conn)
        self._conn.write(_head(status, headers, extra) + b"\r\n" + (b"" if self.head_only else body))

    def error(self, err: OpenAIError) -> None:
        headers = list(err.headers.items()) if err.headers else None
        self.send(err.status, err.body(), JSON_CT, headers)

    def start(self, status: int, content_type: bytes, headers: Headers = None) -> None:
        """Begin a chunked answer; the head goes out with the first chunk."""
        if self.started:
            raise RuntimeError("response already started")
        self.started = True
        self.status = status
        if self.http10:
            self.close_after = True  # the close is what ends the body
            extra = b"Content-Type: %s\r\nConnection: close\r\n" % content_type
            self._conn.pending_head = _head(status, headers, extra) + b"\r\n"
            return
        conn = b"Connection: close\r\n" if self.close_after else b""
        extra = b"Content-Type: %s\r\nTransfer-Encoding: chunked\r\n%s" % (content_type, conn)
        self._conn.pending_head = _head(status, headers, extra) + b"\r\n"

    async def write(self, data: bytes) -> None:
        if self.head_only:
            self._flush_head()
        elif data:
            self._conn.write(data if self.http10 else b"%x\r\n%s\r\n" % (len(data), data))
            await self._conn.drain()

    def _flush_head(self) -> None:
        if self._conn.pending_head:
            self._conn.write(b"")  # the connection prepends the pending head

    def abort(self) -> None:
        """Drop the connection without finishing the answer (the client sees it cut)."""
        self.finished = True
        self.close_after = True
        self._conn.abort()

    def end(self, data: bytes = b"") -> None:
        """Finish a chunked answer, with its last ``data`` in the same write."""
        if not self.finished:
            self.finished = True
            if self.head_only:
                self._flush_head()
                return
            if self.http10:
                self._conn.write(data)  # (with the head, if nothing went before)
                return
            last = b"%x\r\n%s\r\n" % (len(data), data) if data else b""
            self._conn.write(last + b"0\r\n\r\n")


Handler = Callable[[Request, Responder], Awaitable[None]]


def not_found(req: Request) -> OpenAIError:
    return invalid_request(f"no route {req.method} {req.path}", "unknown_route", status=404)


def method_not_allowed(req: Request, allow: str) -> OpenAIError:
    return invalid_request(
        f"method {req.method} is not allowed on {req.path}",
        "method_not_allowed",
        status=405,
        headers={"Allow": allow},
    )


def route_table(routes: dict[tuple[str, str], Handler]) -> Handler:
    """One handler dispatching on (method, path): 404 for an unknown path, 405 for a method
    the path does not take (with ``Allow``). A path that takes GET takes HEAD too (the server
    leaves out the body)."""
    by_path: dict[str, dict[str, Handler]] = {}
    for (method, path), h in routes.items():
        by_path.setdefault(path, {})[method] = h
    for methods in by_path.values():
        if "GET" in methods:
            methods.setdefault("HEAD", methods["GET"])

    async def dispatch(req: Request, resp: Responder) -> None:
        methods = by_path.get(req.path)
        if methods is None:
            raise not_found(req)
        h = methods.get(req.method)
        if h is None:
            raise method_not_allowed(req, ", ".join(sorted(methods)))
        await h(req, resp)

    return dispatch
