"""The simulated engine's OpenAI surface, driven by the real openai SDK."""

from __future__ import annotations

import asyncio
import json
import re
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import openai
import pytest
from openai import AsyncOpenAI

from tests.poll import until
from tests.procs import SimEngine

from .conftest import metric

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def engine() -> Iterator[SimEngine]:
    eng = SimEngine("serve", "sim-model", "--port", "0", "--served-model-name", "sim-model").start()
    yield eng
    eng.kill()


def client(eng: SimEngine) -> AsyncOpenAI:
    return AsyncOpenAI(base_url=eng.v1, api_key="x", max_retries=0, timeout=10)


async def get(url: str) -> tuple[int, str]:
    async with aiohttp.ClientSession() as s, s.get(url) as r:
        return r.status, await r.text()


async def post(url: str, data: bytes | str) -> tuple[int, dict]:
    async with aiohttp.ClientSession() as s, s.post(url, data=data) as r:
        return r.status, await r.json(content_type=None)


async def test_chat_non_stream_usage_and_determinism(engine: SimEngine) -> None:
    c = client(engine)
    msgs = [{"role": "user", "content": "tell me about disaggregated serving"}]
    a = await c.chat.completions.create(model="sim-model", messages=msgs, max_tokens=7)
    b = await c.chat.completions.create(model="sim-model", messages=msgs, max_tokens=7)
    assert a.choices[0].message.content == b.choices[0].message.content
    assert a.choices[0].finish_reason == "length"
    assert a.usage is not None and a.usage.completion_tokens == 7
    assert a.usage.prompt_tokens >= 5
    assert a.usage.total_tokens == a.usage.prompt_tokens + 7
    assert a.model == "sim-model"
    other = await c.chat.completions.create(
        model="sim-model", messages=[{"role": "user", "content": "something else"}], max_tokens=7
    )
    assert other.choices[0].message.content != a.choices[0].message.content
    default = await c.chat.completions.create(model="sim-model", messages=msgs)
    assert default.usage is not None and default.usage.completion_tokens == 16
    mct = await c.chat.completions.create(model="sim-model", messages=msgs, max_completion_tokens=3)
    assert mct.usage is not None and mct.usage.completion_tokens == 3


async def test_chat_stream_with_usage_and_logprobs(engine: SimEngine) -> None:
    c = client(engine)
    msgs = [{"role": "user", "content": "stream me"}]
    full = await c.chat.completions.create(model="sim-model", messages=msgs, max_tokens=5)
    stream = await c.chat.completions.create(
        model="sim-model",
        messages=msgs,
        max_tokens=5,
        stream=True,
        stream_options={"include_usage": True},
        logprobs=True,
        top_logprobs=3,
    )
    text, reasons, usage, entries = "", [], None, []
    async for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for ch in chunk.choices:
            text += ch.delta.content or ""
            if ch.finish_reason:
                reasons.append(ch.finish_reason)
            if ch.logprobs and ch.logprobs.content:
                entries += ch.logprobs.content
    assert text == full.choices[0].message.content
    assert reasons == ["length"]
    assert usage is not None and usage.completion_tokens == 5
    assert len(entries) == 5
    assert all(len(e.top_logprobs) == 3 and e.top_logprobs[0].token == e.token for e in entries)
    assert all(-1 < e.logprob < 0 for e in entries)


async def test_chat_logprobs_non_stream(engine: SimEngine) -> None:
    c = client(engine)
    r = await c.chat.completions.create(
        model="sim-model",
        messages=[{"role": "user", "content": "logprobs please"}],
        max_tokens=4,
        logprobs=True,
        top_logprobs=2,
    )
    content = r.choices[0].logprobs.content
    assert [e.token for e in content] and "".join(e.token for e in content) == r.choices[0].message.content
    for e in content:
        assert len(e.top_logprobs) == 2
        assert e.top_logprobs[0].logprob == e.logprob > e.top_logprobs[1].logprob


async def test_completions_stream_and_non_stream(engine: SimEngine) -> None:
    c = client(engine)
    r = await c.completions.create(model="sim-model", prompt="once upon a time", max_tokens=6, logprobs=2)
    ch = r.choices[0]
    assert ch.finish_reason == "length" and r.usage.completion_tokens == 6 and r.usage.prompt_tokens == 4
    assert ch.logprobs is not None
    assert len(ch.logprobs.tokens) == 6 and "".join(ch.logprobs.tokens) == ch.text
    assert all(
        len(top) == 2 and tok in top
        for tok, top in zip(ch.logprobs.tokens, ch.logprobs.top_logprobs, strict=True)
    )
    stream = await c.completions.create(
        model="sim-model",
        prompt="once upon a time",
        max_tokens=6,
        stream=True,
        stream_options={"include_usage": True},
    )
    text, usage = "", None
    async for chunk in stream:
        text += "".join(x.text for x in chunk.choices)
        usage = chunk.usage or usage
    assert text == ch.text and usage is not None and usage.total_tokens == 10
    batch = await c.completions.create(model="sim-model", prompt=["a b", "c d e"], max_tokens=2)
    assert [x.index for x in batch.choices] == [0, 1] and batch.usage.prompt_tokens == 5


async def test_probe_question_answered(engine: SimEngine) -> None:
    c = client(engine)
    r = await c.chat.completions.create(
        model="sim-model", messages=[{"role": "user", "content": "What is 12+30? Answer with a number."}]
    )
    assert "42" in r.choices[0].message.content


async def test_models_health_and_errors(engine: SimEngine) -> None:
    c = client(engine)
    models = await c.models.list()
    assert [m.id for m in models.data] == ["sim-model"] and models.data[0].owned_by == "motor-sim"
    assert await get(engine.base + "/health") == (200, "")
    with pytest.raises(openai.NotFoundError) as err:
        await c.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])
    assert err.value.body["code"] == "model_not_found"
    status, body = await post(engine.v1 + "/chat/completions", "{not json")
    assert status == 400 and body["error"]["type"] == "invalid_request_error"
    status, body = await post(engine.v1 + "/chat/completions", '{"model": "sim-model"}')
    assert status == 400 and body["error"]["param"] == "messages"
    status, body = await post(
        engine.v1 + "/completions", '{"model": "sim-model", "max_tokens": 0, "prompt": "x"}'
    )
    assert status == 400 and body["error"]["param"] == "max_tokens"
    with pytest.raises(openai.BadRequestError):
        await c.completions.create(model="sim-model", prompt=None)  # type: ignore[arg-type]


async def test_metrics_count_requests(engine: SimEngine) -> None:
    _, before = await get(engine.base + "/metrics")
    c = client(engine)
    await c.completions.create(model="sim-model", prompt="count me", max_tokens=3)
    _, after = await get(engine.base + "/metrics")
    name = "vllm:request_success_total"
    assert metric(after, name, finished_reason="length") == metric(before, name, finished_reason="length") + 1
    assert metric(after, "vllm:time_to_first_token_seconds_count", model_name="sim-model") == (
        metric(before, "vllm:time_to_first_token_seconds_count", model_name="sim-model") + 1
    )
    assert metric(after, "vllm:generation_tokens_total") == metric(before, "vllm:generation_tokens_total") + 3
    for gauge in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"):
        assert metric(after, gauge, model_name="sim-model") == 0
    assert re.search(r"vllm:time_per_output_token_seconds_bucket\{", after)
    assert metric(after, "motor_sim_pd_legs_total", side="prefill", protocol="sglang") == 0


def test_local_directory_model_is_reported_by_path(spawn_engine, tmp_path: Path) -> None:
    eng = spawn_engine("--model-path", str(tmp_path))
    with urllib.request.urlopen(eng.v1 + "/models", timeout=5) as r:
        data = json.load(r)["data"]
    assert [m["id"] for m in data] == [str(tmp_path)]


async def test_max_num_seqs_queues(spawn_engine) -> None:
    eng = spawn_engine("--max-num-seqs", "1", "--ttft-ms", "400")
    c = client(eng)
    tasks = [
        asyncio.create_task(
            c.chat.completions.create(
                model="motor-sim", messages=[{"role": "user", "content": f"q{i}"}], max_tokens=1
            )
        )
        for i in range(3)
    ]

    async def queued() -> bool:
        _, text = await get(eng.base + "/metrics")
        return (
            metric(text, "vllm:num_requests_waiting") >= 1 and metric(text, "vllm:num_requests_running") == 1
        )

    await until(queued, 10, "a request to queue behind --max-num-seqs 1")
    results = await asyncio.gather(*tasks)
    assert all(r.choices[0].finish_reason == "length" for r in results)
    _, text = await get(eng.base + "/metrics")
    assert metric(text, "vllm:num_requests_waiting") == 0 and metric(text, "vllm:num_requests_running") == 0
