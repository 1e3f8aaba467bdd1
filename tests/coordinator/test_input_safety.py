"""Input safety of the inference port: hand-off fields a client sends never reach an engine, and
bodies too large or nested too deep are refused with OpenAI-shaped errors, never a 500.

What an engine RECEIVED is read from a recording engine: a small aiohttp server in this test
that keeps every request body and answers the way vLLM and SGLang engines would.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from hypothesis import given, settings
from hypothesis import strategies as st

from motor_mesh.common.enums import DECODE, PREFILL, UNION
from motor_mesh.coordinator import bodies
from motor_mesh.gen.motor.v1 import common_pb2 as c
from tests.coordinator.conftest import MODEL, Running, StartCoordinator, instance, set_table
from tests.http import ERROR_FIELDS
from tests.ports import reserved_port

HANDOFF = ("kv_transfer_params", "bootstrap_host", "bootstrap_port", "bootstrap_room")
EVIL_KV = {
    "do_remote_prefill": True,
    "do_remote_decode": False,
    "remote_engine_id": "evil",
    "remote_block_ids": [1, 2, 3],
    "remote_host": "203.0.113.7",
    "remote_port": 6666,
    "remote_request_id": "client-ticket",
}
EVIL_ROOM = 424242
TICKET = {
    "do_remote_prefill": True,
    "do_remote_decode": False,
    "remote_engine_id": "recorder-p",
    "remote_block_ids": [0],
    "remote_host": "127.0.0.1",
    "remote_port": 1,
    "remote_request_id": "coordinator-ticket",
}
SGL_BOOTSTRAP_PORT = 4242  # advertised only: the recording engines never rendezvous


class Recorder:
    """A fake engine: records each completion body, answers like vLLM / SGLang."""

    def __init__(self, ticket: bool) -> None:
        self.ticket = ticket  # a vLLM prefill leg is answered with kv_transfer_params
        self.bodies: list[dict[str, Any]] = []
        self.port = 0
        self._runner: web.AppRunner | None = None

    async def start(self) -> None:
        app = web.Application()
        app.router.add_post("/v1/completions", self._completion)
        app.router.add_post("/v1/chat/completions", self._completion)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/health", self._health)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.port = int(self._runner.addresses[0][1])

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response()

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": MODEL, "object": "model"}]})

    async def _completion(self, request: web.Request) -> web.StreamResponse:
        body = json.loads(await request.read())
        self.bodies.append(body)
        chat = request.path.endswith("/chat/completions")
        kv = body.get("kv_transfer_params")
        prefill_leg = isinstance(kv, dict) and kv.get("do_remote_decode") is True
        extra = {"kv_transfer_params": TICKET} if prefill_leg and self.ticket else {}
        if body.get("stream") and not prefill_leg:
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            delta: dict[str, Any] = {"delta": {"content": "ok"}} if chat else {"text": "ok"}
            chunk = {"id": "x", "object": "chunk", "model": MODEL, "choices": [{"index": 0, **delta}]}
            await resp.write(b"data: " + json.dumps(chunk).encode() + b"\n\ndata: [DONE]\n\n")
            await resp.write_eof()
            return resp
        choice: dict[str, Any] = (
            {"message": {"role": "assistant", "content": "ok"}} if chat else {"text": "ok"}
        )
        answer = {
            "id": "x",
            "object": "chat.completion" if chat else "text_completion",
            "model": MODEL,
            "choices": [{"index": 0, "finish_reason": "length", **choice}],
            "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
            **extra,
        }
        return web.json_response(answer)


MakeRecorder = Callable[..., Awaitable[Recorder]]


@pytest.fixture
async def recorder() -> AsyncIterator[MakeRecorder]:
    made: list[Recorder] = []

    async def make(ticket: bool = True) -> Recorder:
        r = Recorder(ticket)
        await r.start()
        made.append(r)
        return r

    yield make
    for r in made:
        await r.stop()


def _client_body(path: str, stream: bool) -> dict[str, Any]:
    body: dict[str, Any] = {"model": MODEL, "max_tokens": 3, "stream": stream}
    if path.endswith("/chat/completions"):
        body["messages"] = [{"role": "user", "content": "hi"}]
    else:
        body["prompt"] = "hi"
    body.update(
        kv_transfer_params=EVIL_KV,
        bootstrap_host="203.0.113.7",
        bootstrap_port=6666,
        bootstrap_room=EVIL_ROOM,
    )
    return body


def _encode(body: dict[str, Any], spelling: str) -> bytes:
    """The client's bytes. ``escaped``: the hand-off keys spelt with JSON \\u escapes (the same
    keys to any JSON parser, an engine's included, but not the same bytes)."""
    raw = json.dumps(body)
    if spelling == "escaped":
        raw = raw.replace('"kv_transfer_params"', '"kv\\u005ftransfer_params"')
        raw = raw.replace('"bootstrap_', '"bootstr\\u0061p_')
    elif spelling == "duplicated":
        # A harmless first copy, the client's values last (where JSON parsers take them from).
        raw = '{"kv_transfer_params": {}, "bootstrap_room": 1, ' + raw[1:]
    return raw.encode()


async def _post(http: aiohttp.ClientSession, coord: Running, path: str, raw: bytes) -> tuple[int, bytes]:
    async with http.post(
        f"http://{coord.http}{path}", data=raw, headers={"Content-Type": "application/json"}
    ) as resp:
        return resp.status, await resp.read()


def _no_handoff(body: dict[str, Any], *, allow: tuple[str, ...] = ()) -> None:
    for field in HANDOFF:
        if field not in allow:
            assert field not in body, f"{field} reached the engine: {body.get(field)!r}"


SPELLINGS = ["plain", "escaped", "duplicated"]
PATHS = ["/v1/completions", "/v1/chat/completions"]


@pytest.mark.parametrize("spelling", SPELLINGS)
@pytest.mark.parametrize("path", PATHS)
async def test_vllm_pd_legs_carry_only_the_coordinators_handoff(
    start_coordinator: StartCoordinator,
    recorder: MakeRecorder,
    http: aiohttp.ClientSession,
    path: str,
    spelling: str,
) -> None:
    coord = await start_coordinator()
    p, d = await recorder(), await recorder()
    await set_table(coord, instance(1, PREFILL, p.port), instance(2, DECODE, d.port))
    for stream in (False, True):
        status, answer = await _post(http, coord, path, _encode(_client_body(path, stream), spelling))
        assert status == 200, answer
        assert b"kv_transfer_params" not in answer and b"coordinator-ticket" not in answer
    assert len(p.bodies) == len(d.bodies) == 2
    for pb_, db in zip(p.bodies, d.bodies, strict=True):
        # Prefill: exactly the Coordinator's "compute and keep the KV" request.
        assert pb_["kv_transfer_params"] == bodies.PREFILL_KV
        _no_handoff(pb_, allow=("kv_transfer_params",))
        # Decode: the prefill's own ticket, nothing of the client's.
        assert db["kv_transfer_params"] == TICKET
        _no_handoff(db, allow=("kv_transfer_params",))
    assert [b["stream"] for b in d.bodies] == [False, True]


@pytest.mark.parametrize("spelling", SPELLINGS)
async def test_vllm_decode_without_a_ticket_gets_no_client_params(
    start_coordinator: StartCoordinator, recorder: MakeRecorder, http: aiohttp.ClientSession, spelling: str
) -> None:
    coord = await start_coordinator()
    p, d = await recorder(ticket=False), await recorder()
    await set_table(coord, instance(1, PREFILL, p.port), instance(2, DECODE, d.port))
    for path in PATHS:
        status, answer = await _post(http, coord, path, _encode(_client_body(path, False), spelling))
        assert status == 200, answer
    assert len(p.bodies) == len(d.bodies) == 2
    for pb_, db in zip(p.bodies, d.bodies, strict=True):
        assert pb_["kv_transfer_params"] == bodies.PREFILL_KV
        _no_handoff(pb_, allow=("kv_transfer_params",))
        _no_handoff(db)  # the decode computes the prompt itself


@pytest.mark.parametrize("spelling", SPELLINGS)
async def test_sglang_legs_carry_the_coordinators_bootstrap(
    start_coordinator: StartCoordinator, recorder: MakeRecorder, http: aiohttp.ClientSession, spelling: str
) -> None:
    coord = await start_coordinator()
    p, d = await recorder(), await recorder()
    sg = c.ENGINE_TYPE_SGLANG
    await set_table(
        coord,
        instance(1, PREFILL, p.port, engine_type=sg, bootstrap=SGL_BOOTSTRAP_PORT),
        instance(2, DECODE, d.port, engine_type=sg),
    )
    for path in PATHS:
        for stream in (False, True):
            status, answer = await _post(http, coord, path, _encode(_client_body(path, stream), spelling))
            assert status == 200, answer
    assert len(p.bodies) == len(d.bodies) == 4
    rooms = set()
    for pb_, db in zip(p.bodies, d.bodies, strict=True):
        for leg in (pb_, db):
            assert "kv_transfer_params" not in leg
            assert leg["bootstrap_host"] == "127.0.0.1"
            assert leg["bootstrap_port"] == SGL_BOOTSTRAP_PORT
            assert isinstance(leg["bootstrap_room"], int) and leg["bootstrap_room"] != EVIL_ROOM
        assert pb_["bootstrap_room"] == db["bootstrap_room"]  # one rendezvous per request
        rooms.add(pb_["bootstrap_room"])
    assert len(rooms) == 4  # a new room each time


@pytest.mark.parametrize("spelling", SPELLINGS)
@pytest.mark.parametrize("mode", ["union", "prefill_only"])
async def test_whole_requests_carry_no_handoff_fields(
    start_coordinator: StartCoordinator,
    recorder: MakeRecorder,
    http: aiohttp.ClientSession,
    mode: str,
    spelling: str,
) -> None:
    coord = await start_coordinator()
    e = await recorder()
    if mode == "union":
        await set_table(coord, instance(1, UNION, e.port))
    else:  # a prefill with no decode serves whole requests; routable thanks to another model
        await set_table(
            coord, instance(1, PREFILL, e.port), instance(2, UNION, reserved_port(), model="other")
        )
    for path in PATHS:
        for stream in (False, True):
            status, answer = await _post(http, coord, path, _encode(_client_body(path, stream), spelling))
            assert status == 200, answer
    assert len(e.bodies) == 4
    for body in e.bodies:
        _no_handoff(body)
        assert body["model"] == MODEL and body["max_tokens"] == 3  # the rest of the request intact


async def test_the_body_is_parsed_once(
    start_coordinator: StartCoordinator,
    recorder: MakeRecorder,
    http: aiohttp.ClientSession,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    coord = await start_coordinator()
    e = await recorder()
    await set_table(coord, instance(1, UNION, e.port))
    parsed: list[bytes] = []
    real = bodies.loads

    def counting(raw: bytes) -> Any:
        parsed.append(bytes(raw))
        return real(raw)

    monkeypatch.setattr(bodies, "loads", counting)
    raw = _encode(_client_body("/v1/completions", False), "plain")
    status, _ = await _post(http, coord, "/v1/completions", raw)
    assert status == 200
    assert parsed == [raw]


# -- limits -----------------------------------------------------------------------------------


def _nested(depth: int, closed: bool = True) -> bytes:
    """A request whose body nests ``depth`` levels (the object itself is level 1)."""
    inner = depth - 1
    tail = b"]" * inner + b"}" if closed else b""
    return b'{"model": "' + MODEL.encode() + b'", "prompt": "x", "max_tokens": 1, "x": ' + b"[" * inner + tail


async def _error(
    http: aiohttp.ClientSession, coord: Running, raw: bytes, **kw: Any
) -> tuple[int, dict[str, Any]]:
    async with http.post(
        f"http://{coord.http}/v1/completions", data=raw, headers={"Content-Type": "application/json"}, **kw
    ) as resp:
        assert resp.content_type == "application/json"
        return resp.status, json.loads(await resp.read())


async def _still_serving(http: aiohttp.ClientSession, coord: Running) -> None:
    async with http.get(f"http://{coord.http}/health") as resp:
        assert resp.status == 200
    body = json.dumps({"model": MODEL, "prompt": "after", "max_tokens": 1}).encode()
    status, answer = await _post(http, coord, "/v1/completions", body)
    assert status == 200, answer


async def test_body_over_max_body_bytes_is_413(
    start_coordinator: StartCoordinator, recorder: MakeRecorder, http: aiohttp.ClientSession
) -> None:
    coord = await start_coordinator(max_body_bytes=2048)
    e = await recorder()
    await set_table(coord, instance(1, UNION, e.port))
    big = json.dumps({"model": MODEL, "prompt": "x" * 4096}).encode()

    async def chunked() -> AsyncIterator[bytes]:  # no Content-Length: the size shows as it arrives
        for i in range(0, len(big), 512):
            yield big[i : i + 512]

    for data in (big, chunked()):
        status, err = await _error(http, coord, data)  # type: ignore[arg-type]
        assert status == 413
        assert err["error"].keys() == ERROR_FIELDS
        assert err["error"]["type"] == "invalid_request_error"
        assert err["error"]["code"] == "request_too_large"
    fits = json.dumps({"model": MODEL, "prompt": "x" * 1500}).encode()
    assert len(fits) <= 2048
    assert (await _post(http, coord, "/v1/completions", fits))[0] == 200
    assert len(e.bodies) == 1  # nothing over the limit reached the engine
    await _still_serving(http, coord)


async def test_nesting_deeper_than_max_json_depth_is_400(
    start_coordinator: StartCoordinator, recorder: MakeRecorder, http: aiohttp.ClientSession
) -> None:
    coord = await start_coordinator(max_json_depth=8)
    e = await recorder()
    await set_table(coord, instance(1, UNION, e.port))
    assert (await _post(http, coord, "/v1/completions", _nested(8)))[0] == 200  # at the limit
    for raw in (_nested(9), _nested(2000), _nested(100_000), _nested(100_000, closed=False)):
        status, err = await _error(http, coord, raw)
        assert status == 400, (len(raw), err)
        assert err["error"].keys() == ERROR_FIELDS
        assert err["error"]["type"] == "invalid_request_error"
        assert err["error"]["code"] == "invalid_json"
    assert len(e.bodies) == 1
    await _still_serving(http, coord)


async def test_a_100k_deep_body_is_400_with_the_default_limits(
    start_coordinator: StartCoordinator, recorder: MakeRecorder, http: aiohttp.ClientSession
) -> None:
    coord = await start_coordinator()
    e = await recorder()
    await set_table(coord, instance(1, UNION, e.port))
    for raw in (_nested(65), _nested(100_000), b"[" * 100_000 + b"]" * 100_000, b"{" * 100_000):
        status, err = await _error(http, coord, raw)
        assert status == 400, (len(raw), err)
        assert err["error"]["code"] == "invalid_json"
        assert "max_json_depth" in err["error"]["message"] or "invalid JSON" in err["error"]["message"]
    assert not e.bodies
    await _still_serving(http, coord)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200) | st.text(alphabet="{[]}x", max_size=200).map(str.encode), st.integers(0, 40))
def test_the_bracket_bound_is_the_count_of_opening_brackets(raw: bytes, limit: int) -> None:
    assert bodies._brackets_exceed(raw, limit) == (raw.count(b"{") + raw.count(b"[") > limit)


@pytest.mark.parametrize("mode", ["vllm_pd", "union"])
async def test_json_only_the_standard_library_reads_is_passed_on_not_a_500(
    start_coordinator: StartCoordinator, recorder: MakeRecorder, http: aiohttp.ClientSession, mode: str
) -> None:
    """A lone surrogate escape is valid JSON text that orjson refuses: the body is read the
    slower way and passed on as the client wrote it, the engine judges it, never a 500."""
    coord = await start_coordinator()
    a, b = await recorder(), await recorder()
    if mode == "vllm_pd":
        await set_table(coord, instance(1, PREFILL, a.port), instance(2, DECODE, b.port))
    else:
        await set_table(coord, instance(1, UNION, b.port))
    body = _client_body("/v1/completions", False)  # hand-off fields too: the body is re-written
    body["prompt"] = "a\ud800b"
    raw = json.dumps(body).encode()  # ASCII, the surrogate as \ud800
    status, answer = await _post(http, coord, "/v1/completions", raw)
    assert status == 200, answer
    legs = [*a.bodies, *b.bodies]
    assert len(legs) == (2 if mode == "vllm_pd" else 1)
    for leg in legs:
        assert leg["prompt"] == "a\ud800b"
    _no_handoff(b.bodies[0], allow=("kv_transfer_params",) if mode == "vllm_pd" else ())
