"""Every error of the simulated engine has the OpenAI shape: a handler's bug, the server's own errors.

The engine runs in this process so that a failure can be injected into what a handler calls.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest

from motor_mesh.common.httpserver import HttpServer
from motor_mesh.simengine import app as sim_app
from motor_mesh.simengine import completion
from motor_mesh.simengine.config import EngineConfig
from tests.http import ERROR_FIELDS, assert_internal_error, json_request


@pytest.fixture
async def engine() -> AsyncIterator[sim_app.Engine]:
    eng = sim_app.Engine(EngineConfig(tpot_ms=1.0))  # streams pace their tokens
    yield eng
    await eng.close()


@pytest.fixture
async def base(engine: sim_app.Engine) -> AsyncIterator[str]:
    server = HttpServer(engine.handler(), max_body_bytes=1024)
    port = await server.listen("127.0.0.1", 0)
    yield f"http://127.0.0.1:{port}"
    await server.close(1.0)


async def test_a_handler_bug_answers_500_without_its_text_and_logs_the_traceback(
    base: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def broken_response(*args: Any, **kwargs: Any) -> bytes:
        raise RuntimeError("response builder broke reading /etc/motor/secret")

    monkeypatch.setattr(completion, "full_response", broken_response)
    request = {"model": "motor-sim", "prompt": "x", "max_tokens": 1}
    status, _, body = await json_request("POST", base + "/v1/completions", json=request)
    assert_internal_error(status, body, caplog.text, "RuntimeError: response builder broke")
    async with aiohttp.ClientSession() as s, s.get(base + "/health") as resp:
        assert resp.status == 200  # still serving


async def test_a_bug_mid_stream_drops_the_connection_instead_of_a_second_response(
    engine: sim_app.Engine, base: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def broken_check() -> bool:
        raise RuntimeError("fault check broke mid-stream")

    # Consulted between two tokens, after the stream's first event went out.
    monkeypatch.setattr(engine.faults, "hanging", broken_check)
    request = {"model": "motor-sim", "prompt": "x", "max_tokens": 4, "stream": True}
    timeout = aiohttp.ClientTimeout(total=10)
    async with (
        aiohttp.ClientSession(timeout=timeout) as s,
        s.post(base + "/v1/completions", json=request) as resp,
    ):
        assert resp.status == 200 and resp.content_type == "text/event-stream"
        with pytest.raises(aiohttp.ClientPayloadError):
            await resp.read()
    assert "RuntimeError: fault check broke mid-stream" in caplog.text


async def test_unknown_route_wrong_method_and_oversized_body_have_the_openai_shape(base: str) -> None:
    status, _, body = await json_request("POST", base + "/v1/embeddings", json={})
    assert status == 404 and body["error"].keys() == ERROR_FIELDS
    assert body["error"]["type"] == "invalid_request_error" and body["error"]["code"] == "unknown_route"

    status, headers, body = await json_request("DELETE", base + "/sim/fault")
    assert status == 405 and body["error"].keys() == ERROR_FIELDS
    assert body["error"]["code"] == "method_not_allowed" and "POST" in headers["Allow"]

    big = json.dumps({"model": "motor-sim", "prompt": "x" * 4096})
    status, _, body = await json_request("POST", base + "/v1/completions", data=big)
    assert status == 413 and body["error"].keys() == ERROR_FIELDS
    assert body["error"]["code"] == "request_too_large"
