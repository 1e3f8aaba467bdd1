"""The simulated engine on its lean HTTP server: zero-latency answers are complete and well
framed (also when served from a cached plan), `hang` stalls inference and nothing else, the
bootstrap port's routes and errors."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp
import pytest

from tests.procs import SimEngine

from .conftest import metric

pytestmark = pytest.mark.timeout(60)


async def sse(url: str, body: dict[str, Any]) -> tuple[aiohttp.ClientResponse, list[Any]]:
    """POST a streamed request; every event decoded (the `[DONE]` sentinel as a string)."""
    async with aiohttp.ClientSession() as s, s.post(url, json=body) as r:
        raw = (await r.read()).decode()
    assert raw.endswith("data: [DONE]\n\n"), raw[-200:]
    events: list[Any] = []
    for block in raw.split("\n\n")[:-1]:
        assert block.startswith("data: "), block
        data = block[len("data: ") :]
        events.append(data if data == "[DONE]" else json.loads(data))
    assert events[-1] == "[DONE]" and "[DONE]" not in events[:-1]
    return r, events


async def post(url: str, body: dict[str, Any]) -> dict[str, Any]:
    async with aiohttp.ClientSession() as s, s.post(url, json=body) as r:
        assert r.status == 200
        out: dict[str, Any] = await r.json()
        return out


async def test_zero_latency_chat_stream_is_complete_and_well_formed(shared_engine: SimEngine) -> None:
    url = shared_engine.v1 + "/chat/completions"
    body = {
        "model": "motor-sim",
        "messages": [{"role": "user", "content": "Say something short."}],
        "max_tokens": 16,
    }
    full = await post(url, body)
    ids = set()
    for _ in range(3):  # the first answer is planned, the repeats reuse the plan
        r, events = await sse(url, {**body, "stream": True})
        assert r.status == 200 and r.headers["Content-Type"] == "text/event-stream"
        assert r.headers["Transfer-Encoding"] == "chunked" and r.headers["Cache-Control"] == "no-cache"
        chunks = events[:-1]
        assert len(chunks) == 1 + 16  # the role delta, then one event per token
        assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        assert {c["id"] for c in chunks} == {chunks[0]["id"]} and chunks[0]["id"].startswith("chatcmpl-")
        assert all(c["object"] == "chat.completion.chunk" and isinstance(c["created"], int) for c in chunks)
        text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
        assert text == full["choices"][0]["message"]["content"]
        assert [c["choices"][0]["finish_reason"] for c in chunks][-1] == "length"
        ids.add(chunks[0]["id"])
    assert len(ids) == 3 and full["id"] not in ids


async def test_zero_latency_completion_stream_with_usage_and_logprobs(shared_engine: SimEngine) -> None:
    url = shared_engine.v1 + "/completions"
    body = {"model": "motor-sim", "prompt": ["a b", "c d e"], "max_tokens": 3, "logprobs": 2, "n": 2}
    full = await post(url, body)
    for _ in range(2):
        _, events = await sse(url, {**body, "stream": True, "stream_options": {"include_usage": True}})
        chunks, usage = events[:-2], events[-2]
        assert usage["choices"] == [] and usage["usage"] == full["usage"]
        texts = ["", "", "", ""]
        for c in chunks:
            assert c["object"] == "text_completion" and c["id"] == chunks[0]["id"]
            for ch in c["choices"]:
                texts[ch["index"]] += ch["text"]
                assert ch["logprobs"]["tokens"] == [ch["text"]]
        assert texts == [ch["text"] for ch in full["choices"]]


async def test_repeated_bodies_count_every_request(spawn_engine) -> None:
    eng = spawn_engine()
    body = {"model": "motor-sim", "prompt": "one two three", "max_tokens": 5}
    answers = [await post(eng.v1 + "/completions", body) for _ in range(4)]
    assert len({a["id"] for a in answers}) == 4
    assert len({a["choices"][0]["text"] for a in answers}) == 1
    async with aiohttp.ClientSession() as s, s.get(eng.base + "/metrics") as r:
        text = await r.text()
    assert metric(text, "vllm:request_success_total", finished_reason="length") == 4
    assert metric(text, "vllm:prompt_tokens_total") == 12
    assert metric(text, "vllm:generation_tokens_total") == 20


async def test_hang_stalls_inference_while_every_other_route_answers(spawn_engine) -> None:
    eng = spawn_engine("--protocol", "sglang", "--disaggregation-mode", "prefill")
    timeout = aiohttp.ClientTimeout(total=0.5)
    async with aiohttp.ClientSession(timeout=timeout) as s:
        async with s.post(eng.base + "/sim/fault", json={"mode": "hang"}) as r:
            assert r.status == 200 and (await r.json())["active"] is True
        # A wedged scheduler: whatever generates never answers...
        for method, path, body in [
            ("POST", "/v1/completions", {"prompt": "x"}),
            ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}),
            ("GET", "/health_generate", None),  # SGLang's runs a generation
        ]:
            with pytest.raises(asyncio.TimeoutError):
                async with s.request(method, eng.base + path, json=body) as r:
                    await r.read()
        # ... while the API server answers everything else, /health first of all.
        for method, path in [
            ("GET", "/health"),
            ("GET", "/metrics"),
            ("GET", "/v1/models"),
            ("GET", "/get_server_info"),
            ("GET", "/version"),
            ("POST", "/flush_cache"),
            ("GET", "/sim/fault"),
        ]:
            async with s.request(method, eng.base + path) as r:
                assert r.status == 200, path
        # The bootstrap port keeps answering (a hung prefill just registers no more rooms).
        async with s.get(f"http://127.0.0.1:{eng.bootstrap_port}/health") as r:
            assert r.status == 200
    assert eng.alive()
    assert eng.stop() == 0


async def test_bootstrap_port_routes_and_errors(spawn_engine) -> None:
    eng = spawn_engine("--protocol", "sglang", "--disaggregation-mode", "prefill")
    base = f"http://127.0.0.1:{eng.bootstrap_port}"
    async with aiohttp.ClientSession() as s:
        for method, path, status, code in [
            ("GET", "/nope", 404, "unknown_route"),
            ("GET", "/room/", 404, "unknown_route"),
            ("GET", "/room/1/x", 404, "unknown_route"),
            ("DELETE", "/room/1", 405, "method_not_allowed"),
            ("POST", "/health", 405, "method_not_allowed"),
            ("GET", "/room/abc", 400, "invalid_room"),
            ("GET", "/room/1?timeout_s=soon", 400, "invalid_timeout"),
            ("GET", "/room/1?timeout_s=0", 408, "bootstrap_timeout"),
        ]:
            async with s.request(method, base + path) as r:
                assert r.status == status, path
                assert (await r.json())["error"]["code"] == code, path
        async with s.post(base + "/room/-5", data=b"[1]") as r:
            assert r.status == 400 and (await r.json())["error"]["code"] == "invalid_json"
        async with s.post(base + "/room/-5") as r:  # no body: a room with no details
            assert r.status == 200 and await r.json() == {"room": -5}
        async with s.get(base + "/room/-5?timeout_s=1") as r:
            info = await r.json()
        assert r.status == 200 and info["room"] == -5 and info["engine_id"]
