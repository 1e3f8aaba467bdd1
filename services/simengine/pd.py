"""Prefill/decode hand-off: vLLM `kv_transfer_params` tickets and the SGLang bootstrap rendezvous.

vLLM: the prefill leg answers `kv_transfer_params` naming a ticket (`remote_request_id`) and the
blocks it "holds"; the decode leg carries them back. The decode engine is usually another
process, so an unknown ticket is accepted (and counted), never refused.

SGLang: both legs carry (bootstrap_host, bootstrap_port, bootstrap_room). The prefill engine runs
a tiny HTTP rendezvous server on its bootstrap port and registers the room once its prefill is
done; the decode engine long-polls `GET /room/{room}?timeout_s=T` on that server. Either leg may
arrive first. A request naming SGLang's fake bootstrap host (2.2.2.2, what SGLang's warm-up and
the NodeManager's inference probe send) runs alone on either role, with no rendezvous. Protocol
(bootstrap port):
  GET  /room/{room}?timeout_s=T  200 {"room", "engine_id", "prompt_tokens", ...} once registered
                                 (the room is consumed), 408 OpenAI error body after T seconds
  POST /room/{room}              register a room by hand (body: optional JSON object)
  GET  /health                   200
"""

from __future__ import annotations

import asyncio
import itertools
import json
import math
import os
import time
from collections import OrderedDict
from typing import Any
from urllib.parse import parse_qs, unquote

from motor_mesh.common.http_errors import invalid_request
from motor_mesh.common.httpclient import Disconnected, Pool, Refused, UpstreamTimeout
from motor_mesh.common.httpmessages import Handler, Request, Responder, method_not_allowed, not_found

BLOCK_SIZE = 16
MAX_POLL_S = 600.0
CONNECT_TIMEOUT_S = 5.0  # a decode's connect to a bootstrap server (also bounded by its deadline)
FAKE_BOOTSTRAP_HOST = "2.2.2.2"  # SGLang's: no KV transfer, the request is served alone


class TicketStore:
    """Tickets issued by vLLM-style prefill legs, redeemable once by a decode leg."""

    def __init__(self, ttl_s: float = 300.0, max_size: int = 100_000) -> None:
        self._ttl_s = ttl_s
        self._max_size = max_size
        # An OrderedDict: a plain dict whose oldest entries keep being deleted makes finding the
        # oldest one a walk over their tombstones (prefill engines never see their tickets
        # redeemed, so theirs is always full).
        self._tickets: OrderedDict[str, float] = OrderedDict()
        self._next_block = 0
        # Ticket ids: 32 hex digits like a uuid4's, a random half for this process and a count
        # (unique without the cost of a uuid per prefill leg).
        self._prefix = os.urandom(8).hex()
        self._count = itertools.count(int.from_bytes(os.urandom(4), "big"))

    def issue(self, prompt_tokens: int) -> tuple[str, list[int]]:
        ticket, start, n = self.issue_range(prompt_tokens)
        return ticket, list(range(start, start + n))

    def issue_range(self, prompt_tokens: int) -> tuple[str, int, int]:
        """A new ticket and its blocks as (first block, count)."""
        now = time.monotonic()
        self._expire(now)
        ticket = f"{self._prefix}{next(self._count) & 0xFFFFFFFFFFFFFFFF:016x}"
        n = max(1, math.ceil(prompt_tokens / BLOCK_SIZE))
        start = self._next_block
        self._next_block = (start + n) % (1 << 31)
        self._tickets[ticket] = now
        return ticket, start, n

    def redeem(self, ticket: object) -> bool:
        return isinstance(ticket, str) and self._tickets.pop(ticket, None) is not None

    def _expire(self, now: float) -> None:
        # Insertion order: the oldest tickets are first.
        tickets = self._tickets
        while tickets:
            oldest = next(iter(tickets))
            if len(tickets) < self._max_size and now - tickets[oldest] < self._ttl_s:
                break
            tickets.popitem(last=False)


class RoomTimeout(Exception):
    pass


class Rendezvous:
    """The prefill side of the SGLang bootstrap: rooms registered by finished prefills.

    A room is kept as the bytes its GET answers (JSON of {"room", "engine_id", ...info})."""

    def __init__(self, engine_id: str, ttl_s: float = 300.0) -> None:
        self.engine_id = engine_id
        self._ttl_s = ttl_s
        self._rooms: dict[int, tuple[float, bytes]] = {}
        self._waiters: dict[int, list[asyncio.Future[bytes]]] = {}
        # What register_prefill answers, as json.dumps spells it: the same bytes, no encoder run.
        self._prefill_fmt = (
            b'{"room": %d, "engine_id": '
            + json.dumps(engine_id).encode().replace(b"%", b"%%")
            + b', "prompt_tokens": %d}'
        )

    def register(self, room: int, info: dict[str, Any]) -> None:
        self._fill(room, json.dumps({"room": room, "engine_id": self.engine_id, **info}).encode())

    def register_prefill(self, room: int, prompt_tokens: int) -> None:
        """What a finished prefill leg registers: its prompt's token count."""
        self._fill(room, self._prefill_fmt % (room, prompt_tokens))

    def _fill(self, room: int, info: bytes) -> None:
        waiters = self._waiters.pop(room, None)
        if waiters:
            for fut in waiters:
                if not fut.done():
                    fut.set_result(info)
            return
        now = time.monotonic()
        # A room nobody claims (its decode leg was cancelled) must not live forever.
        while self._rooms:
            oldest = next(iter(self._rooms))
            if now - self._rooms[oldest][0] < self._ttl_s:
                break
            del self._rooms[oldest]
        self._rooms[room] = (now, info)

    async def wait(self, room: int, timeout_s: float) -> bytes:
        """The room's info (JSON bytes) once registered; RoomTimeout after ``timeout_s``."""
        found = self._rooms.pop(room, None)
        if found is not None:
            return found[1]
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[bytes] = loop.create_future()
        self._waiters.setdefault(room, []).append(fut)
        timer = loop.call_later(timeout_s, _time_out, fut, room, timeout_s)
        try:
            return await fut
        finally:
            timer.cancel()
            waiters = self._waiters.get(room)
            if waiters is not None and fut in waiters:
                waiters.remove(fut)
                if not waiters:
                    del self._waiters[room]

    def handler(self) -> Handler:
        """The bootstrap port's routes (see the module docstring)."""

        async def dispatch(req: Request, out: Responder) -> None:
            path = req.path
            if path == "/health":
                if req.method != "GET":
                    raise method_not_allowed(req, "GET")
                out.send(200, b"", b"text/plain; charset=utf-8")
                return
            name = path[len("/room/") :]
            if not path.startswith("/room/") or not name or "/" in name:
                raise not_found(req)
            room = parse_room(unquote(name))
            if req.method not in ("GET", "POST"):
                raise method_not_allowed(req, "GET, POST")
            if room is None:
                raise invalid_request("room must be an integer", "invalid_room")
            if req.method == "GET":
                await self._get_room(room, req, out)
            else:
                self._post_room(room, req, out)

        return dispatch

    async def _get_room(self, room: int, req: Request, out: Responder) -> None:
        q = req.query
        if q.startswith("timeout_s=") and not any(c in q for c in "&;%+"):
            raw = q[len("timeout_s=") :]  # what every decode sends: no need for parse_qs
        else:
            raw = parse_qs(q, keep_blank_values=True).get("timeout_s", ["30"])[0]
        try:
            timeout_s = min(MAX_POLL_S, max(0.0, float(raw)))
        except ValueError:
            raise invalid_request("timeout_s must be a number", "invalid_timeout") from None
        try:
            info = await self.wait(room, timeout_s)
        except RoomTimeout as exc:
            raise invalid_request(str(exc), "bootstrap_timeout", status=408) from None
        out.send(200, info)

    def _post_room(self, room: int, req: Request, out: Responder) -> None:
        info: Any = {}
        if req.body:
            try:
                info = json.loads(req.body)
            except ValueError:
                raise invalid_request("body must be JSON", "invalid_json") from None
            if not isinstance(info, dict):
                raise invalid_request("body must be a JSON object", "invalid_json")
        self.register(room, info)
        out.send(200, json.dumps({"room": room}).encode())


def parse_room(value: object) -> int | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, str) and value.lstrip("-").isdigit():
        return int(value)
    return None


def _time_out(fut: asyncio.Future[bytes], room: int, timeout_s: float) -> None:
    if not fut.done():
        fut.set_exception(RoomTimeout(f"bootstrap room {room} was not registered within {timeout_s:g} s"))


async def wait_for_room(pool: Pool, host: str, port: int, room: int, timeout_s: float) -> bytes:
    """Decode side: wait until the prefill engine at host:port registered `room`; its info (JSON).

    The long polls go over ``pool``'s keep-alive connections. Connection failures are retried
    until the deadline: the prefill engine may still be starting, and the router sends both
    legs at once."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    netloc = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    path = b"/room/%d?timeout_s=" % room
    delay = 0.02
    last_error = ""
    while True:
        remaining = deadline - loop.time()
        if remaining <= 0:
            break
        try:
            # The client's own deadline is a second past the server's, as the server answers
            # 408 itself at its end.
            resp = await pool.request(
                host, port, b"GET", path + b"%.3f" % remaining, headers=b"", deadline=deadline + 1.0
            )
            try:
                info = await resp.read(deadline + 1.0)
            finally:
                resp.release()
            if resp.status == 200:
                return info
            if resp.status == 408:
                break
            last_error = f"bootstrap server answered HTTP {resp.status}"
        except UpstreamTimeout:
            break
        except (Refused, Disconnected, OSError, ValueError) as exc:  # ValueError: a host IDNA refuses
            last_error = f"{type(exc).__name__}: {exc}"
        await asyncio.sleep(min(delay, max(0.0, deadline - loop.time())))
        delay = min(delay * 2, 0.5)
    detail = f" (last error: {last_error})" if last_error else ""
    raise RoomTimeout(
        f"bootstrap room {room} was not filled by the prefill engine at {netloc} "
        f"within {timeout_s:g} s{detail}"
    )
