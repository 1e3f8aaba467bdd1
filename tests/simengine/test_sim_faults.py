"""Fault injection: start flags, the /sim/fault runtime API, and every mode."""

from __future__ import annotations

import socket
from typing import Any

import aiohttp
import openai
import pytest
from openai import AsyncOpenAI

from tests.poll import until
from tests.procs import SimEngine, exited

from .conftest import metric

pytestmark = pytest.mark.timeout(60)
MSGS = [{"role": "user", "content": "What is 12+30? Answer with a number."}]


def client(eng: SimEngine, timeout: float = 10) -> AsyncOpenAI:
    return AsyncOpenAI(base_url=eng.v1, api_key="x", max_retries=0, timeout=timeout)


async def ask(eng: SimEngine, **kw: Any) -> Any:
    kw.setdefault("max_tokens", 4)
    return await client(eng).chat.completions.create(model="motor-sim", messages=MSGS, **kw)


async def http(method: str, url: str, within: float = 10, **kw: Any) -> tuple[int, Any]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=within)) as s:
        async with s.request(method, url, **kw) as r:
            if r.content_type == "application/json":
                return r.status, await r.json()
            return r.status, await r.text()


async def test_crash_after_requests_exits_1_and_workers_follow(spawn_engine) -> None:
    eng = spawn_engine("--workers", "2", "--fault", "crash", "--fault-after-requests", "1")
    workers = eng.worker_pids()
    assert len(workers) == 2 and not any(map(exited, workers))
    await ask(eng)
    with pytest.raises(openai.APIConnectionError):
        await ask(eng)
    assert await eng.await_exit() == 1
    await until(lambda: all(map(exited, workers)), 10, "workers to exit")


async def test_runtime_crash_answers_then_exits(spawn_engine) -> None:
    eng = spawn_engine("--workers", "1")
    status, state = await http("POST", eng.base + "/sim/fault", json={"mode": "crash"})
    assert status == 200 and state["mode"] == "crash" and state["active"] is True
    assert await eng.await_exit() == 1
    await until(lambda: exited(eng.worker_pids()[0]), 10, "worker to exit")


async def test_hang_wedges_inference_while_health_and_models_answer(spawn_engine) -> None:
    eng = spawn_engine("--fault", "hang", "--fault-after-requests", "1")
    assert "42" in (await ask(eng)).choices[0].message.content
    with pytest.raises(openai.APITimeoutError):
        await client(eng, timeout=0.5).chat.completions.create(model="motor-sim", messages=MSGS)
    with pytest.raises(openai.APITimeoutError):
        await client(eng, timeout=0.5).completions.create(model="motor-sim", prompt="1", max_tokens=1)
    # The API server is fine: only a real request tells (the NodeManager's inference probe).
    assert await http("GET", eng.base + "/health") == (200, "")
    status, models = await http("GET", eng.base + "/v1/models")
    assert status == 200 and [m["id"] for m in models["data"]] == ["motor-sim"]
    status, state = await http("GET", eng.base + "/sim/fault")
    assert status == 200 and (state["mode"], state["active"]) == ("hang", True)
    assert eng.alive()
    assert eng.stop() == 0  # a hung engine still stops cleanly on SIGTERM


async def test_unhealthy_keeps_serving(spawn_engine) -> None:
    eng = spawn_engine("--fault", "unhealthy")
    assert (await http("GET", eng.base + "/health"))[0] == 503
    assert (await ask(eng)).choices[0].finish_reason == "length"


async def test_error_answers_fault_status(spawn_engine) -> None:
    eng = spawn_engine("--fault", "error", "--fault-status", "503")
    with pytest.raises(openai.APIStatusError) as err:
        await ask(eng)
    assert err.value.status_code == 503
    status, body = await http("POST", eng.v1 + "/completions", json={"prompt": "x"})
    assert status == 503 and body["error"]["type"] == "server_error"
    assert (await http("GET", eng.base + "/health"))[0] == 200
    status, text = await http("GET", eng.base + "/metrics")
    assert metric(text, "motor_sim_fault_injections_total", mode="error") == 2


async def test_disconnect_non_stream_and_stream(spawn_engine) -> None:
    eng = spawn_engine("--fault", "disconnect")
    with pytest.raises(openai.APIConnectionError):
        await ask(eng)
    stream = await client(eng).chat.completions.create(
        model="motor-sim", messages=MSGS, stream=True, max_tokens=8
    )
    got: list[str] = []
    with pytest.raises(openai.APIError):
        async for chunk in stream:
            got += [c.delta.content or "" for c in chunk.choices]
    assert got and len(got) < 8
    assert (await http("GET", eng.base + "/health"))[0] == 200


async def test_precision_garbles_output_and_fails_the_probe(spawn_engine) -> None:
    eng = spawn_engine("--fault", "precision")
    r = await ask(eng, logprobs=True, top_logprobs=2, max_tokens=8)
    text = r.choices[0].message.content
    assert "42" not in text and "\ufffd" in text
    assert all(e.logprob <= -5 for e in r.choices[0].logprobs.content)
    c = await client(eng).completions.create(
        model="motor-sim", prompt="What is 2+2?", max_tokens=6, logprobs=1
    )
    assert "4" not in c.choices[0].text and all(lp <= -5 for lp in c.choices[0].logprobs.token_logprobs)


async def test_runtime_fault_api_counts_completions_only(spawn_engine) -> None:
    eng = spawn_engine()
    sim = eng.base + "/sim/fault"
    status, state = await http("GET", sim)
    assert status == 200 and state["mode"] == "none" and state["armed"] is False
    status, state = await http("POST", sim, json={"mode": "error", "after_requests": 2})
    assert status == 200 and state["armed"] is True and state["active"] is False
    for _ in range(2):
        await ask(eng)
        await http("GET", eng.base + "/health")
        await http("GET", eng.base + "/metrics")
    status, state = await http("GET", sim)
    assert state["requests"] == 2 and state["active"] is True
    with pytest.raises(openai.InternalServerError):
        await ask(eng)
    status, state = await http("POST", sim, json={"mode": "none"})
    assert status == 200 and state["mode"] == "none"
    await ask(eng)
    # after_s: armed but not yet due, then due
    _, state = await http("POST", sim, json={"mode": "unhealthy", "after_s": 600})
    assert state["active"] is False and (await http("GET", eng.base + "/health"))[0] == 200
    await http("POST", sim, json={"mode": "unhealthy", "after_s": 0.2})

    async def unhealthy() -> bool:
        return (await http("GET", eng.base + "/health"))[0] == 503

    await until(unhealthy, 10, "the armed fault to become due")


@pytest.mark.parametrize(
    "body",
    [
        b"{oops",
        b"[]",
        b'{"mode": "explode"}',
        b'{"mode": "error", "after_requests": -1}',
        b'{"mode": "error", "x": 1}',
    ],
)
async def test_fault_api_rejects_bad_bodies(shared_engine: SimEngine, body: bytes) -> None:
    status, reply = await http("POST", shared_engine.base + "/sim/fault", data=body)
    assert status == 400 and reply["error"]["message"]
    _, state = await http("GET", shared_engine.base + "/sim/fault")
    assert state["mode"] == "none"


def _non_loopback_ip() -> str | None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.1", 9))  # no packet is sent: this only picks a route
            ip = s.getsockname()[0]
        except OSError:
            return None
    return None if ip.startswith("127.") else ip


async def test_fault_api_refuses_non_loopback_clients(spawn_engine) -> None:
    ip = _non_loopback_ip()
    if ip is None:
        pytest.skip("no non-loopback address on this machine")
    eng = spawn_engine("--host", "0.0.0.0")
    status, reply = await http("GET", f"http://{ip}:{eng.port}/sim/fault")
    assert status == 403 and "loopback" in reply["error"]["message"]
    status, _ = await http("POST", f"http://{ip}:{eng.port}/sim/fault", json={"mode": "crash"})
    assert status == 403 and eng.alive()
    assert (await http("GET", f"http://{ip}:{eng.port}/health"))[0] == 200


async def test_startup_window_keeps_health_at_503(spawn_engine) -> None:
    eng = spawn_engine("--startup-s", "3")
    assert (await http("GET", eng.base + "/health"))[0] == 503

    async def healthy() -> bool:
        return (await http("GET", eng.base + "/health"))[0] == 200

    await until(healthy, 15, "the start-up window to end")
