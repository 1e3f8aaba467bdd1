"""The simulated engine's context (``--max-model-len``): reported by /v1/models and enforced as
vLLM enforces it, in vLLM's words, before anything is computed. The engine runs in this process."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest

from motor_mesh.common.httpserver import HttpServer
from motor_mesh.simengine import app as sim_app
from motor_mesh.simengine.cli import parse
from motor_mesh.simengine.config import DEFAULT_MAX_MODEL_LEN, EngineConfig
from tests.http import json_request
from tests.simengine.conftest import metric

CONTEXT = 20


@pytest.fixture
async def base() -> AsyncIterator[str]:
    engine = sim_app.Engine(EngineConfig(max_model_len=CONTEXT))
    server = HttpServer(engine.handler(), max_body_bytes=1 << 20)
    port = await server.listen("127.0.0.1", 0)
    yield f"http://127.0.0.1:{port}"
    await server.close(1.0)
    await engine.close()


async def post(base: str, path: str, **body: Any) -> tuple[int, Any]:
    status, _, answer = await json_request("POST", base + path, json={"model": "motor-sim", **body})
    return status, answer


def test_the_flag_in_vllms_and_sglangs_spelling() -> None:
    assert parse([])[0].max_model_len == DEFAULT_MAX_MODEL_LEN
    assert parse(["--max-model-len", "4096"])[0].max_model_len == 4096
    assert parse(["--context-length", "2048"])[0].max_model_len == 2048
    with pytest.raises(SystemExit):
        parse(["--max-model-len", "0"])


async def test_models_report_the_context(base: str) -> None:
    status, _, body = await json_request("GET", base + "/v1/models")
    assert status == 200 and [m["max_model_len"] for m in body["data"]] == [CONTEXT]


async def test_what_fits_is_answered_and_a_missing_limit_is_cut_to_the_room(base: str) -> None:
    messages = [{"role": "user", "content": "a b c d"}]  # "user: a b c d": 5 tokens
    status, body = await post(base, "/v1/chat/completions", messages=messages, max_tokens=CONTEXT - 5)
    assert status == 200 and body["usage"]["total_tokens"] == CONTEXT
    # No limit: the default (16) when it fits, else what the context leaves.
    status, body = await post(base, "/v1/chat/completions", messages=messages)
    assert status == 200 and body["usage"]["completion_tokens"] == CONTEXT - 5 < 16
    status, body = await post(base, "/v1/completions", prompt="a b")
    assert status == 200 and body["usage"]["completion_tokens"] == 16


@pytest.mark.parametrize("name", ["max_tokens", "max_completion_tokens"])
async def test_a_limit_past_the_context_is_refused_in_vllms_words(base: str, name: str) -> None:
    messages = [{"role": "user", "content": "a b c d"}]
    status, body = await post(base, "/v1/chat/completions", messages=messages, **{name: 16})
    assert status == 400
    assert body["error"]["message"] == (
        "'max_tokens' or 'max_completion_tokens' is too large: 16. This model's maximum context "
        f"length is {CONTEXT} tokens and your request has 5 input tokens (16 > {CONTEXT} - 5)."
    )


async def test_a_prompt_that_fills_the_context_is_refused_whatever_the_limit(base: str) -> None:
    for prompt in (
        " ".join(["w"] * CONTEXT),
        ["short", " ".join(["w"] * (CONTEXT + 3))],
        list(range(CONTEXT)),
    ):
        status, body = await post(base, "/v1/completions", prompt=prompt, max_tokens=1)
        assert status == 400, prompt
        n = CONTEXT + 3 if isinstance(prompt, list) and isinstance(prompt[0], str) else CONTEXT
        assert body["error"]["message"] == (
            f"This model's maximum context length is {CONTEXT} tokens. However, your request has "
            f"{n} input tokens. Please reduce the length of the input messages."
        )
    # A PD prefill leg (one token) is held to the same rule.
    kv = {"do_remote_decode": True, "do_remote_prefill": False}
    status, _ = await post(
        base, "/v1/completions", prompt=" ".join(["w"] * CONTEXT), max_tokens=1, kv_transfer_params=kv
    )
    assert status == 400
    status, _ = await post(
        base, "/v1/completions", prompt=" ".join(["w"] * (CONTEXT - 1)), max_tokens=1, kv_transfer_params=kv
    )
    assert status == 200
    # Every request counts as received, refused ones too.
    async with aiohttp.ClientSession() as s, s.get(base + "/metrics") as resp:
        text = await resp.text()
    assert metric(text, "motor_sim_completion_requests_total") == 5
