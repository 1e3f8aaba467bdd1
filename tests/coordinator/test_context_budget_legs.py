"""The context budget (coordinator.clamp_max_tokens) on every way a request is routed: an
in-process Coordinator in front of simulated engines with a 32-token context
(``--max-model-len 32``), which refuse what does not fit as vLLM does. A clamped request is
answered in full where it would have been refused; a prompt that fills the context is refused
before any engine sees it; and it turns on and off with a reload."""

from __future__ import annotations

import json
import re
from typing import Any

import aiohttp
import openai
import pytest
from openai import AsyncOpenAI

from motor_mesh.common.enums import DECODE, PREFILL, UNION
from motor_mesh.coordinator.kv.prompt import Tokens
from motor_mesh.gen.motor.v1 import common_pb2 as c
from tests.coordinator.conftest import (
    ENGINE_ARGS,
    MODEL,
    Engine,
    Running,
    SpawnEngines,
    StartCoordinator,
    get_text,
    instance,
    legs,
    set_table,
)
from tests.metrics import ascrape, scrape_until

CONTEXT = 32
SMALL = ["--max-model-len", str(CONTEXT)]
MESSAGES = [{"role": "user", "content": "tell me about the context"}]  # "user: ..." is 6 tokens
PROMPT_TOKENS = 6
LONG = [{"role": "user", "content": " ".join(["word"] * 40)}]
RECEIVED = re.compile(r"^motor_sim_completion_requests_total ([0-9.]+)$", re.M)


def _client(coord: Running) -> AsyncOpenAI:
    return AsyncOpenAI(base_url=f"http://{coord.http}/v1", api_key="x", max_retries=0, timeout=30)


async def _received(http: aiohttp.ClientSession, *engines: Engine) -> list[float]:
    """Completion requests each engine received, refused ones too."""
    out = []
    for e in engines:
        m = RECEIVED.search(await get_text(http, f"{e.base}/metrics"))
        assert m is not None
        out.append(float(m.group(1)))
    return out


async def _knows(coord: Running, endpoints: int) -> None:
    """Until the Coordinator has read every engine's max_model_len."""
    await scrape_until(
        f"http://{coord.http}/metrics",
        lambda m: m.value("motor_coordinator_context_lengths_known") == endpoints,
        retry=(AssertionError,),
    )


async def _routed(coord: Running) -> float:
    m = await ascrape(f"http://{coord.http}/metrics")
    return sum(s.value for s in m.samples if s.name == "motor_coordinator_routed_total")


async def _fits(client: AsyncOpenAI, **extra: Any) -> None:
    """A chat and a completion asking far more than the context leaves get what it leaves,
    streamed and not."""
    chat = await client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=1000, **extra)  # type: ignore[arg-type]
    assert chat.usage is not None and chat.choices[0].finish_reason == "length"
    assert (chat.usage.prompt_tokens, chat.usage.completion_tokens) == (
        PROMPT_TOKENS,
        CONTEXT - PROMPT_TOKENS,
    )
    stream = await client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,  # type: ignore[arg-type]
        max_completion_tokens=1000,
        stream=True,
        stream_options={"include_usage": True},
        **extra,
    )
    usage, finish = None, []
    async for chunk in stream:
        usage = chunk.usage or usage
        finish += [ch.finish_reason for ch in chunk.choices if ch.finish_reason]
    assert usage is not None and usage.completion_tokens == CONTEXT - PROMPT_TOKENS and finish == ["length"]
    comp = await client.completions.create(model=MODEL, prompt="one two three", max_tokens=1000, **extra)
    assert comp.usage is not None and comp.usage.completion_tokens == CONTEXT - 3


async def _refused(client: AsyncOpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        await client.chat.completions.create(model=MODEL, messages=LONG, max_tokens=4)  # type: ignore[arg-type]
    body: Any = err.value.body
    assert body["code"] == "context_length_exceeded" and body["param"] == "messages"
    assert f"maximum context length is {CONTEXT} tokens" in body["message"]
    assert "resulted in 41 tokens" in body["message"]


async def test_a_vllm_pair_answers_what_fits_and_never_sees_a_prompt_that_does_not(
    start_coordinator: StartCoordinator, spawn_engines: SpawnEngines, http: aiohttp.ClientSession
) -> None:
    e = spawn_engines(p=[*ENGINE_ARGS["vllm_p"], *SMALL], d=[*ENGINE_ARGS["vllm_d"], *SMALL])
    coord = await start_coordinator(clamp_max_tokens=True)
    await set_table(coord, instance(1, PREFILL, e["p"].port), instance(2, DECODE, e["d"].port))
    await _knows(coord, 2)
    async with _client(coord) as client:
        await _fits(client)
        assert (await legs(http, e["p"]))["prefill/vllm"] == 3.0
        assert (await legs(http, e["d"]))["decode/vllm"] == 3.0
        received, routed = await _received(http, e["p"], e["d"]), await _routed(coord)
        await _refused(client)
        with pytest.raises(openai.BadRequestError) as err:
            await client.completions.create(
                model=MODEL, prompt=["short", " ".join(["w"] * CONTEXT)], max_tokens=1
            )
        assert (err.value.body or {})["param"] == "prompt"  # type: ignore[call-overload]
    assert await _received(http, e["p"], e["d"]) == received  # no leg was sent
    assert await _routed(coord) == routed
    m = await ascrape(f"http://{coord.http}/metrics")
    assert m.value("motor_coordinator_context_length_exceeded_total") == 2
    assert m.value("motor_coordinator_max_tokens_clamped_total", why="over") == 3


@pytest.mark.parametrize("kind", ["sglang", "union"])
async def test_every_leg_of_sglang_and_union_gets_the_clamped_request(
    kind: str, start_coordinator: StartCoordinator, spawn_engines: SpawnEngines
) -> None:
    # An SGLang pair sends the client's request to both engines: either would refuse it.
    coord = await start_coordinator(clamp_max_tokens=True)
    if kind == "sglang":
        # (Simulated engines on SGLang's protocol: their prompts are counted as they count them.)
        e = spawn_engines(p=[*ENGINE_ARGS["sgl_p"], *SMALL], d=[*ENGINE_ARGS["sgl_d"], *SMALL])
        sglang = c.PD_PROTOCOL_SGLANG
        await set_table(
            coord,
            instance(1, PREFILL, e["p"].port, pd_protocol=sglang, bootstrap=e["p"].bootstrap_port),
            instance(2, DECODE, e["d"].port, pd_protocol=sglang),
        )
        await _knows(coord, 2)
    else:
        e = spawn_engines(u=SMALL)
        await set_table(coord, instance(1, UNION, e["u"].port))
        await _knows(coord, 1)
    async with _client(coord) as client:
        await _fits(client)
        await _refused(client)


async def test_kv_aware_routes_by_the_prompt_the_budget_counted(
    start_coordinator: StartCoordinator, spawn_engines: SpawnEngines, monkeypatch: pytest.MonkeyPatch
) -> None:
    reads: list[dict[str, Any]] = []
    real = Tokens.prompt

    async def counted(self: Tokens, req: dict[str, Any], chat: bool, held: Any = None) -> Any:
        reads.append(req)
        return await real(self, req, chat, held)

    monkeypatch.setattr(Tokens, "prompt", counted)
    e = spawn_engines(p=[*ENGINE_ARGS["vllm_p"], *SMALL], d=[*ENGINE_ARGS["vllm_d"], *SMALL])
    coord = await start_coordinator(clamp_max_tokens=True, prefill_policy="kv_aware")
    await set_table(coord, instance(1, PREFILL, e["p"].port), instance(2, DECODE, e["d"].port))
    await _knows(coord, 2)
    async with _client(coord) as client:
        reads.clear()
        chat = await client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=1000)  # type: ignore[arg-type]
        assert chat.usage is not None and chat.usage.completion_tokens == CONTEXT - PROMPT_TOKENS
    assert len(reads) == 1  # tokenized once, for both
    coord.co.metrics.flush()
    m = await ascrape(f"http://{coord.http}/metrics")
    assert m.value("motor_coordinator_kv_prompt_tokens_total", role="prefill") == PROMPT_TOKENS


async def test_a_continuation_keeps_to_the_clamped_limit(
    start_coordinator: StartCoordinator, spawn_engines: SpawnEngines
) -> None:
    # The first decode engine dies after 5 tokens; the answer continues on the second with the
    # tokens delivered added to its prompt and taken off the limit: the clamped one, or the
    # continuation would be refused.
    die = ["--fault", "die_after_tokens", "--fault-after-tokens", "5"]
    e = spawn_engines(
        p=[*ENGINE_ARGS["vllm_p"], *SMALL],
        d1=[*ENGINE_ARGS["vllm_d"], *SMALL, *die],
        d2=[*ENGINE_ARGS["vllm_d2"], *SMALL],
    )
    coord = await start_coordinator(clamp_max_tokens=True, decode_policy="round_robin")
    await set_table(
        coord,
        instance(1, PREFILL, e["p"].port),
        instance(2, DECODE, e["d1"].port),
        instance(3, DECODE, e["d2"].port),
    )
    await _knows(coord, 3)
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 1000, "stream": True}
    async with (
        aiohttp.ClientSession() as s,
        s.post(f"http://{coord.http}/v1/chat/completions", json=body) as resp,
    ):
        assert resp.status == 200
        data = await resp.read()
    events = [json.loads(line[5:]) for line in data.split(b"\n") if line.startswith(b"data: {")]
    tokens = sum(1 for ev in events for ch in ev["choices"] if ch["delta"].get("content"))
    finish = [ch["finish_reason"] for ev in events for ch in ev["choices"] if ch.get("finish_reason")]
    assert (tokens, finish) == (CONTEXT - PROMPT_TOKENS, ["length"])
    assert data.endswith(b"data: [DONE]\n\n")
    m = await ascrape(f"http://{coord.http}/metrics")
    assert (
        sum(
            s.value
            for s in m.samples
            if s.name == "motor_coordinator_migrations_total" and s.labels["outcome"] == "continued"
        )
        == 1
    )


async def test_off_the_engine_refuses_after_the_prefill_and_a_reload_turns_it_on(
    start_coordinator: StartCoordinator, spawn_engines: SpawnEngines, http: aiohttp.ClientSession
) -> None:
    e = spawn_engines(p=[*ENGINE_ARGS["vllm_p"], *SMALL], d=[*ENGINE_ARGS["vllm_d"], *SMALL])
    coord = await start_coordinator()  # clamp_max_tokens off, the default
    await set_table(coord, instance(1, PREFILL, e["p"].port), instance(2, DECODE, e["d"].port))

    async def refused_by_the_engine(client: AsyncOpenAI) -> None:
        with pytest.raises(openai.BadRequestError) as err:
            await client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=1000)  # type: ignore[arg-type]
        message = (err.value.body or {})["message"]  # type: ignore[call-overload]
        assert message.startswith("'max_tokens' or 'max_completion_tokens' is too large: 1000.")

    async with _client(coord) as client:
        await refused_by_the_engine(client)
        # ... after the prefill engine computed the prompt for nothing.
        assert (await legs(http, e["p"]))["prefill/vllm"] == 1.0
        text = await get_text(http, f"http://{coord.http}/metrics")
        assert "motor_coordinator_max_tokens_clamped" not in text  # nothing of it exists when off
        inference = coord.co.inference
        assert inference is not None
        inference.clamp(True)  # what a reload of clamp_max_tokens does
        await _knows(coord, 2)
        await _fits(client)
        inference.clamp(False)
        await refused_by_the_engine(client)
