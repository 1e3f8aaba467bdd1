"""A decode engine that dies in the middle of an answer (the simulated engine's die_after_tokens
fault: a real SIGKILL of itself), goes quiet, or fails: the request continues on the other
decode instance, and the client gets exactly the answer a fault-free run gives; requests that
cannot continue end as they always did, with the reason logged and counted."""

from __future__ import annotations

import asyncio
import json
import logging
import re
from typing import Any

import aiohttp
import pytest
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from motor_mesh.gen.motor.v1 import common_pb2 as c
from motor_mesh.gen.motor.v1 import coordinator_pb2 as pb
from tests.coordinator.conftest import (
    ENGINE_ARGS,
    MODEL,
    Engine,
    Running,
    SpawnEngines,
    StartCoordinator,
    get_text,
    instance,
    running,
    set_table,
)
from tests.poll import until

PREFILL, DECODE = c.ROLE_PREFILL, c.ROLE_DECODE
SLOW = ["--tpot-ms", "30"]
CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"


@pytest.fixture(autouse=True)
def events_logged(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="motor")


async def _cluster(
    start: StartCoordinator, spawn: SpawnEngines, d: list[str] = SLOW, **cfg: Any
) -> tuple[Running, dict[str, Engine]]:
    """A vLLM prefill and two decodes (extra flags ``d``), behind a Coordinator of their own."""
    e = spawn(p=ENGINE_ARGS["vllm_p"], d1=[*ENGINE_ARGS["vllm_d"], *d], d2=[*ENGINE_ARGS["vllm_d2"], *d])
    coord = await start(**cfg)
    await set_table(
        coord,
        instance(1, PREFILL, e["p"].port),
        instance(2, DECODE, e["d1"].port),
        instance(3, DECODE, e["d2"].port),
    )
    return coord, e


def _body(path: str, stream: bool, max_tokens: int = 40, **extra: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"model": MODEL, "max_tokens": max_tokens, "temperature": 0, "stream": stream}
    if path == CHAT:
        body["messages"] = [{"role": "user", "content": "tell me about continuation"}]
    else:
        body["prompt"] = "tell me about continuation"
    if stream:
        body["stream_options"] = {"include_usage": True}
    body.update(extra)
    return body


async def _post(coord: Running, path: str, body: dict[str, Any]) -> tuple[int, bytes]:
    async with (
        aiohttp.ClientSession() as s,
        s.post(f"http://{coord.http}{path}", json=body, timeout=aiohttp.ClientTimeout(total=60)) as r,
    ):
        return r.status, await r.read()


def _events(data: bytes) -> list[Any]:
    out: list[Any] = []
    for line in data.split(b"\n"):
        if line.startswith(b"data:"):
            payload = line[5:].strip()
            out.append("[DONE]" if payload == b"[DONE]" else json.loads(payload))
    return out


def _text(path: str, events: list[Any]) -> str:
    parts = []
    for e in events:
        if isinstance(e, dict):
            for ch in e.get("choices") or ():
                parts.append(ch["delta"].get("content") or "" if path == CHAT else ch["text"])
    return "".join(parts)


def _finish(events: list[Any]) -> list[str]:
    return [
        ch["finish_reason"]
        for e in events
        if isinstance(e, dict)
        for ch in e.get("choices") or ()
        if ch.get("finish_reason")
    ]


async def _busy(http: aiohttp.ClientSession, e: dict[str, Engine]) -> str:
    """The decode engine serving the one request in flight."""

    async def which() -> str | None:
        for name in ("d1", "d2"):
            if await running(http, e[name]):
                return name
        return None

    return await until(which)


async def _arm(http: aiohttp.ClientSession, engine: Engine, body: dict[str, Any]) -> None:
    async with http.post(f"{engine.base}/sim/fault", json=body, timeout=aiohttp.ClientTimeout(total=5)) as r:
        assert r.status == 200, await r.text()


async def _migrations(http: aiohttp.ClientSession, coord: Running) -> dict[tuple[str, str], float]:
    text = await get_text(http, f"http://{coord.http}/metrics")
    found = re.findall(
        r'^motor_coordinator_migrations_total\{outcome="(\w+)",reason="(\w+)"\} ([0-9.]+)$', text, re.M
    )
    return {(reason, outcome): float(n) for outcome, reason, n in found if float(n)}


def _logged(caplog: pytest.LogCaptureFixture, event: str) -> list[dict[str, Any]]:
    """The fields of each ``event`` line logged."""
    return [r.fields for r in caplog.records if r.getMessage() == event]  # type: ignore[attr-defined]


async def _killed_mid_answer(
    coord: Running,
    e: dict[str, Engine],
    http: aiohttp.ClientSession,
    path: str,
    body: dict[str, Any],
    after: int = 5,
) -> tuple[int, bytes, str]:
    """Send ``body``; once a decode serves it, that engine dies after ``after`` more tokens.
    Returns the answer and which engine died."""
    answer = asyncio.ensure_future(_post(coord, path, body))
    victim = await _busy(http, e)
    await _arm(http, e[victim], {"mode": "die_after_tokens", "after_tokens": after})
    status, data = await answer
    return status, data, victim


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
async def test_a_stream_whose_decode_dies_continues_elsewhere_token_for_token(
    start_coordinator: StartCoordinator,
    spawn_engines: SpawnEngines,
    http: aiohttp.ClientSession,
    caplog: pytest.LogCaptureFixture,
    path: str,
) -> None:
    coord, e = await _cluster(start_coordinator, spawn_engines)
    body = _body(path, stream=True)
    status, ref_data = await _post(coord, path, body)
    reference = _events(ref_data)
    assert status == 200 and reference[-1] == "[DONE]"

    status, data, victim = await _killed_mid_answer(coord, e, http, path, body)
    events = _events(data)
    assert status == 200
    assert not [ev for ev in events if isinstance(ev, dict) and "error" in ev]
    assert _text(path, events) == _text(path, reference) and events[-1] == "[DONE]"
    assert _finish(events) == _finish(reference) == ["length"]
    assert len({ev["id"] for ev in events if isinstance(ev, dict)}) == 1  # one answer
    assert events[-2]["usage"] == reference[-2]["usage"]  # the whole answer, the prompt once
    roles = [
        ev
        for ev in events
        if isinstance(ev, dict) and ev["choices"] and "role" in ev["choices"][0].get("delta", {})
    ]
    assert len(roles) == (1 if path == CHAT else 0)
    assert not any(
        "token_ids" in ch or "prompt_token_ids" in ch
        for ev in events
        if isinstance(ev, dict)
        for ch in ev["choices"]
    )
    assert e[victim].popen.poll() is not None  # it really died
    assert (await _migrations(http, coord)) == {("disconnect", "continued"): 1}
    (line,) = _logged(caplog, "request_migrated")
    assert line["migrated"] == 1 and line["ended"] == "length"


async def test_a_non_streamed_request_whose_decode_dies_gets_the_whole_answer(
    start_coordinator: StartCoordinator, spawn_engines: SpawnEngines, http: aiohttp.ClientSession
) -> None:
    coord, e = await _cluster(start_coordinator, spawn_engines)
    body = _body(CHAT, stream=False)
    status, ref = await _post(coord, CHAT, body)
    assert status == 200
    status, data, victim = await _killed_mid_answer(coord, e, http, CHAT, body)
    assert status == 200, data
    got, want = json.loads(data), json.loads(ref)
    assert got["choices"][0]["message"] == want["choices"][0]["message"]
    assert got["usage"] == want["usage"]
    assert e[victim].popen.poll() is not None


async def test_a_decode_that_goes_quiet_is_left_for_another_after_the_idle_deadline(
    start_coordinator: StartCoordinator, spawn_engines: SpawnEngines, http: aiohttp.ClientSession
) -> None:
    coord, e = await _cluster(start_coordinator, spawn_engines, decode_idle_timeout_s=0.5)
    body = _body(COMPLETIONS, stream=True)
    _, ref = await _post(coord, COMPLETIONS, body)
    answer = asyncio.ensure_future(_post(coord, COMPLETIONS, body))
    victim = await _busy(http, e)
    await _arm(http, e[victim], {"mode": "hang"})
    status, data = await answer
    events = _events(data)
    assert status == 200 and _text(COMPLETIONS, events) == _text(COMPLETIONS, _events(ref))
    assert (await _migrations(http, coord)) == {("timeout", "continued"): 1}


async def test_a_stream_whose_instance_leaves_the_table_moves_at_once(
    start_coordinator: StartCoordinator, spawn_engines: SpawnEngines, http: aiohttp.ClientSession
) -> None:
    coord, e = await _cluster(start_coordinator, spawn_engines)
    body = _body(CHAT, stream=True, max_tokens=60)
    _, ref = await _post(coord, CHAT, body)
    answer = asyncio.ensure_future(_post(coord, CHAT, body))
    victim = await _busy(http, e)
    gone = 2 if victim == "d1" else 3
    await coord.stub.DeleteInstances(pb.DeleteInstancesRequest(instances=[c.Instance(id=gone)]), timeout=5)
    status, data = await answer
    assert status == 200 and _text(CHAT, _events(data)) == _text(CHAT, _events(ref))
    assert await running(http, e[victim]) == 0  # left at once: the engine saw the client go
    assert (await _migrations(http, coord)) == {("left", "continued"): 1}


# Each kind of request that cannot continue: the stream ends as without continuation (an error
# event after the output delivered), and the log and the metrics say why.
REFUSED = [
    ("n", COMPLETIONS, {"n": 2}),
    ("best_of", COMPLETIONS, {"best_of": 2}),
    ("guided_decoding", COMPLETIONS, {"guided_regex": "[a-z ]+"}),
    ("response_format", CHAT, {"response_format": {"type": "json_object"}}),
    (
        "tool_choice",
        CHAT,
        {
            "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
            "tool_choice": "required",
        },
    ),
    ("echo_logprobs", COMPLETIONS, {"echo": True, "logprobs": 1}),
    ("seed", CHAT, {"seed": 7, "temperature": 0.7}),
    ("penalty", CHAT, {"frequency_penalty": 0.5}),
]


@pytest.mark.parametrize(("why", "path", "extra"), REFUSED, ids=[r[0] for r in REFUSED])
async def test_a_request_that_cannot_continue_ends_with_an_error_event_and_its_reason(
    start_coordinator: StartCoordinator,
    spawn_engines: SpawnEngines,
    http: aiohttp.ClientSession,
    caplog: pytest.LogCaptureFixture,
    why: str,
    path: str,
    extra: dict[str, Any],
) -> None:
    coord, e = await _cluster(start_coordinator, spawn_engines)
    status, data, _ = await _killed_mid_answer(coord, e, http, path, _body(path, stream=True, **extra))
    events = _events(data)
    assert status == 200 and _text(path, events)  # output was delivered, then
    assert events[-1]["error"]["code"] == "upstream_disconnected"
    (line,) = _logged(caplog, "migration_refused")
    assert line["why"] == why
    assert (await _migrations(http, coord)) == {("disconnect", "refused"): 1}


async def test_past_the_state_bound_a_request_does_not_continue(
    start_coordinator: StartCoordinator,
    spawn_engines: SpawnEngines,
    http: aiohttp.ClientSession,
    caplog: pytest.LogCaptureFixture,
) -> None:
    # The whole bound is less than this request's prompt: nothing of it can be kept.
    coord, e = await _cluster(start_coordinator, spawn_engines, max_migration_state_total_bytes=1024)
    long = [{"role": "user", "content": "a long question " * 100}]
    status, data, _ = await _killed_mid_answer(coord, e, http, CHAT, _body(CHAT, stream=True, messages=long))
    assert status == 200 and _events(data)[-1]["error"]["code"] == "upstream_disconnected"
    (line,) = _logged(caplog, "migration_refused")
    assert line["why"] == "state_total_bytes"


async def test_a_small_state_bound_still_lets_small_requests_continue(
    start_coordinator: StartCoordinator, spawn_engines: SpawnEngines, http: aiohttp.ClientSession
) -> None:
    coord, e = await _cluster(start_coordinator, spawn_engines, max_migration_state_total_bytes=4096)
    body = _body(CHAT, stream=True)
    _, ref = await _post(coord, CHAT, body)
    status, data, _ = await _killed_mid_answer(coord, e, http, CHAT, body)
    assert status == 200 and _text(CHAT, _events(data)) == _text(CHAT, _events(ref))
    assert (await _migrations(http, coord)) == {("disconnect", "continued"): 1}


async def test_a_request_continues_at_most_migration_limit_times(
    start_coordinator: StartCoordinator, spawn_engines: SpawnEngines, http: aiohttp.ClientSession
) -> None:
    # Both decodes fail every stream after a few tokens (an engine error event, a 5xx).
    coord, e = await _cluster(start_coordinator, spawn_engines, migration_limit=2, migration_delay_s=0.05)
    for name in ("d1", "d2"):
        await _arm(http, e[name], {"mode": "error", "status": 503})
    status, data = await _post(coord, CHAT, _body(CHAT, stream=True))
    # Nothing had reached the client: it gets the error as a status.
    assert status == 502 and json.loads(data)["error"]["code"] == "upstream_disconnected"
    counted = await _migrations(http, coord)
    assert counted == {("status", "continued"): 2, ("status", "exhausted"): 1}, (counted, data)


async def test_a_continuation_is_a_span_of_the_request_beside_its_legs(
    start_coordinator: StartCoordinator,
    spawn_engines: SpawnEngines,
    http: aiohttp.ClientSession,
    spans: InMemorySpanExporter,
) -> None:
    coord, e = await _cluster(start_coordinator, spawn_engines)
    status, _, _ = await _killed_mid_answer(coord, e, http, CHAT, _body(CHAT, stream=True))
    assert status == 200

    def server() -> ReadableSpan | None:  # the request's span ends just after its last byte
        return next((s for s in spans.get_finished_spans() if s.kind == SpanKind.SERVER), None)

    request = await until(server)
    finished = spans.get_finished_spans()
    (cont,) = [s for s in finished if s.name == "continuation"]
    assert cont.parent is not None and request.context is not None
    assert (cont.parent.span_id, cont.context.trace_id) == (request.context.span_id, request.context.trace_id)
    attrs = dict(cont.attributes or {})
    assert attrs["motor.migration.reason"] == "disconnect" and attrs["motor.migration.attempt"] == 1
    assert attrs["motor.migration.tokens_delivered"] > 0
    decodes = sorted((s for s in finished if s.name == "decode"), key=lambda s: s.start_time or 0)
    assert [dict(s.attributes or {}).get("error.type") for s in decodes] == ["disconnect", None]


async def test_a_request_waiting_on_a_hung_engine_moves_when_its_instance_leaves(
    start_coordinator: StartCoordinator, spawn_engines: SpawnEngines, http: aiohttp.ClientSession
) -> None:
    # A wedged scheduler never answers a non-streamed request, not even its head: the request
    # waits (decode_first_byte_timeout_s is long) until the instance leaves the table.
    coord, e = await _cluster(start_coordinator, spawn_engines)
    body = _body(COMPLETIONS, stream=False, max_tokens=8)
    _, ref = await _post(coord, COMPLETIONS, body)
    for name in ("d1", "d2"):
        await _arm(http, e[name], {"mode": "hang"})
    answer = asyncio.ensure_future(_post(coord, COMPLETIONS, body))

    def decoding() -> int | None:  # the decode instance the Coordinator sent it to
        return next((i for i in (2, 3) if coord.co.view.legs().get(i)), None)

    gone = await until(decoding)
    await _arm(http, e["d2" if gone == 2 else "d1"], {"mode": "none"})
    await coord.stub.DeleteInstances(pb.DeleteInstancesRequest(instances=[c.Instance(id=gone)]), timeout=5)
    status, data = await answer
    assert status == 200, data
    assert json.loads(data)["choices"][0]["text"] == json.loads(ref)["choices"][0]["text"]
    assert (await _migrations(http, coord)) == {("left", "continued"): 1}


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
async def test_an_sglang_stream_continues_from_the_text_delivered(
    start_coordinator: StartCoordinator,
    spawn_engines: SpawnEngines,
    http: aiohttp.ClientSession,
    caplog: pytest.LogCaptureFixture,
    path: str,
) -> None:
    # SGLang returns no token ids: the continuation carries the text delivered (a chat's partial
    # assistant message with continue_final_message, a completion's prompt plus the text).
    # The simulated engine's tokenizer reads text back as the same tokens, so it is exact here.
    sg = c.ENGINE_TYPE_SGLANG
    e = spawn_engines(
        p=ENGINE_ARGS["sgl_p"], d1=[*ENGINE_ARGS["sgl_d"], *SLOW], d2=[*ENGINE_ARGS["sgl_d"], *SLOW]
    )
    coord = await start_coordinator()
    await set_table(
        coord,
        instance(1, PREFILL, e["p"].port, engine_type=sg, bootstrap=e["p"].bootstrap_port),
        instance(2, DECODE, e["d1"].port, engine_type=sg),
        instance(3, DECODE, e["d2"].port, engine_type=sg),
    )
    body = _body(path, stream=True)
    status, ref = await _post(coord, path, body)
    assert status == 200
    status, data, victim = await _killed_mid_answer(coord, e, http, path, body)
    events = _events(data)
    assert status == 200 and events[-1] == "[DONE]", events[-3:]
    assert _text(path, events) == _text(path, _events(ref))
    assert events[-2]["usage"] == _events(ref)[-2]["usage"]
    assert e[victim].popen.poll() is not None
    (line,) = _logged(caplog, "request_migrated")
    assert line["migrated"] == 1
