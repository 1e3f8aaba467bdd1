"""The engine health check of ``motor register``: ``/v1/models`` must list exactly one model."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from motor_mesh.cli.engine_check import instance_model
from motor_mesh.cli.standalone import EndpointSpec, InputError


async def _engine(body: Any, status: int = 200) -> TestServer:
    async def models(_: web.Request) -> web.Response:
        if isinstance(body, str):
            return web.Response(text=body, status=status)
        return web.json_response(body, status=status)

    app = web.Application()
    app.router.add_get("/v1/models", models)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    return server


@pytest.fixture
async def engines() -> AsyncIterator[Callable[..., Any]]:
    started: list[TestServer] = []

    async def start(body: Any, status: int = 200) -> EndpointSpec:
        server = await _engine(body, status)
        started.append(server)
        assert server.port is not None
        return EndpointSpec("127.0.0.1", server.port)

    yield start
    for server in started:
        await server.close()


def _models(*ids: str) -> dict[str, Any]:
    return {"object": "list", "data": [{"id": i, "object": "model"} for i in ids]}


async def test_one_model_is_healthy_and_names_the_instance(engines: Callable[..., Any]) -> None:
    a, b = await engines(_models("llama")), await engines(_models("llama"))
    assert await instance_model([a, b], 5.0) == "llama"


@pytest.mark.parametrize(
    ("body", "status", "words"),
    [
        (_models(), 200, "must list exactly one model, lists none"),
        (_models("a", "b"), 200, "lists 'a', 'b'"),
        ({"data": "x"}, 200, "has no model list"),
        ("not json", 200, "not JSON"),
        (_models("a"), 503, "answered 503"),
    ],
)
async def test_unhealthy_answers(engines: Callable[..., Any], body: Any, status: int, words: str) -> None:
    ep = await engines(body, status)
    with pytest.raises(InputError, match=words) as err:
        await instance_model([ep], 5.0)
    assert f"engine {ep.address} is not healthy" in str(err.value)


async def test_endpoints_serving_different_models_are_refused(engines: Callable[..., Any]) -> None:
    a, b = await engines(_models("a")), await engines(_models("b"))
    with pytest.raises(InputError, match="serve different models"):
        await instance_model([a, b], 5.0)


async def test_nothing_listening(unused_tcp_port: int) -> None:
    with pytest.raises(InputError, match="cannot connect"):
        await instance_model([EndpointSpec("127.0.0.1", unused_tcp_port)], 5.0)
