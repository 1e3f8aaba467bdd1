"""Every error of the inference port has the OpenAI shape: a handler's bug, aiohttp's own errors."""

from __future__ import annotations

import json
from typing import Any

import aiohttp
import pytest

from motor_mesh.common.enums import UNION
from motor_mesh.common.http_errors import (
    OpenAIError,
    internal_error,
    invalid_request,
    model_not_found,
    server_error,
)
from motor_mesh.coordinator import http_app
from motor_mesh.gen.motor.v1 import coordinator_pb2 as pb
from tests.coordinator.conftest import MODEL, Running, StartCoordinator, instance
from tests.http import ERROR_FIELDS, assert_internal_error, json_request
from tests.ports import reserved_port


async def _routable(coord: Running) -> None:
    """A union instance nobody listens on: enough to get past routing checks, never reached."""
    await coord.stub.SetInstances(
        pb.SetInstancesRequest(instances=[instance(5, UNION, reserved_port())]), timeout=5
    )


async def test_a_handler_bug_answers_500_without_its_text_and_logs_the_traceback(
    start_coordinator: StartCoordinator, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    coord = await start_coordinator()
    await _routable(coord)

    def broken_estimate(req: dict[str, Any]) -> tuple[int, int]:
        raise RuntimeError("estimator broke reading /etc/motor/secret")

    monkeypatch.setattr(http_app, "estimate_tokens", broken_estimate)
    base = f"http://{coord.http}"
    status, _, body = await json_request(
        "POST", base + "/v1/completions", json={"model": MODEL, "prompt": "x"}
    )
    assert_internal_error(status, body, caplog.text, "RuntimeError: estimator broke")
    # Counted as the 500 the client got, and the server goes on serving.
    async with aiohttp.ClientSession() as s, s.get(base + "/metrics") as resp:
        assert (
            'motor_coordinator_requests_total{route="/v1/completions",status="500"} 1.0' in await resp.text()
        )
    async with aiohttp.ClientSession() as s, s.get(base + "/health") as resp:
        assert resp.status == 200


async def test_unknown_route_wrong_method_and_oversized_body_have_the_openai_shape(
    start_coordinator: StartCoordinator,
) -> None:
    coord = await start_coordinator(max_body_bytes=1024)
    await _routable(coord)
    base = f"http://{coord.http}"

    status, _, body = await json_request("GET", base + "/v1/embeddings")
    assert status == 404 and body["error"].keys() == ERROR_FIELDS
    assert body["error"]["type"] == "invalid_request_error" and body["error"]["code"] == "unknown_route"
    assert "/v1/embeddings" in body["error"]["message"]

    status, headers, body = await json_request("GET", base + "/v1/chat/completions")
    assert status == 405 and body["error"].keys() == ERROR_FIELDS
    assert body["error"]["code"] == "method_not_allowed" and "POST" in headers["Allow"]

    big = json.dumps({"model": MODEL, "prompt": "x" * 4096})
    status, _, body = await json_request("POST", base + "/v1/completions", data=big)
    assert status == 413 and body["error"].keys() == ERROR_FIELDS
    assert body["error"]["type"] == "invalid_request_error" and body["error"]["code"] == "request_too_large"
    async with aiohttp.ClientSession() as s, s.get(base + "/metrics") as resp:
        assert (
            'motor_coordinator_requests_total{route="/v1/completions",status="413"} 1.0' in await resp.text()
        )


def test_every_builder_makes_the_one_openai_body() -> None:
    def answer(err: OpenAIError) -> tuple[int, dict[str, Any]]:
        return err.status, json.loads(err.body())

    assert answer(invalid_request("bad n", "invalid_n", "n")) == (
        400,
        {"error": {"message": "bad n", "type": "invalid_request_error", "param": "n", "code": "invalid_n"}},
    )
    assert answer(invalid_request("never came", "bootstrap_timeout", status=408))[0] == 408
    assert answer(model_not_found("m")) == (
        404,
        {"error": {"message": "The model `m` does not exist.", "type": "invalid_request_error",
                   "param": "model", "code": "model_not_found"}},
    )  # fmt: skip
    assert answer(server_error(502, "gone", "upstream_unreachable")) == (
        502,
        {"error": {"message": "gone", "type": "server_error", "param": None, "code": "upstream_unreachable"}},
    )
    status, body = answer(internal_error())
    assert status == 500 and body["error"]["code"] == "internal_error"
    assert body["error"]["message"] == "internal server error; see the server log"
