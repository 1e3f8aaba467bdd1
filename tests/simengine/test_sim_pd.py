"""PD hand-off: vLLM kv_transfer_params and the SGLang bootstrap rendezvous."""

from __future__ import annotations

import asyncio
import random
from typing import Any

import aiohttp
import pytest
from openai import AsyncOpenAI

from tests.poll import until
from tests.procs import SimEngine

from .conftest import metric

pytestmark = pytest.mark.timeout(60)

PREFILL_KV = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


async def chat(session: aiohttp.ClientSession, eng: SimEngine, **body: Any) -> tuple[int, dict]:
    body.setdefault("model", "motor-sim")
    body.setdefault("messages", [{"role": "user", "content": "a prompt of exactly seven words here"}])
    async with session.post(eng.v1 + "/chat/completions", json=body) as r:
        return r.status, await r.json()


async def metrics(session: aiohttp.ClientSession, eng: SimEngine) -> str:
    async with session.get(eng.base + "/metrics") as r:
        return await r.text()


async def test_vllm_handoff_between_two_engines(spawn_engine) -> None:
    p = spawn_engine(
        "serve", "motor-sim", "--kv-transfer-config", '{"kv_role":"kv_producer","engine_id":"p-1"}'
    )
    d = spawn_engine(
        "serve", "motor-sim", "--kv-transfer-config", '{"kv_role":"kv_consumer","engine_id":"d-1"}'
    )
    async with aiohttp.ClientSession() as s:
        status, pre = await chat(s, p, max_tokens=1, kv_transfer_params=PREFILL_KV)
        assert status == 200
        kv = pre["kv_transfer_params"]
        assert kv["do_remote_prefill"] is True and kv["do_remote_decode"] is False
        assert kv["remote_engine_id"] == "p-1"
        assert kv["remote_host"] == "127.0.0.1" and kv["remote_port"] == p.port
        assert isinstance(kv["remote_block_ids"], list) and kv["remote_block_ids"]
        assert isinstance(kv["remote_request_id"], str)
        assert pre["usage"]["completion_tokens"] == 1
        status, dec = await chat(s, d, max_tokens=6, kv_transfer_params=kv)
        assert status == 200 and "kv_transfer_params" not in dec
        assert dec["usage"]["completion_tokens"] == 6
        status, direct = await chat(s, d, max_tokens=6)
        assert dec["choices"][0]["message"]["content"] == direct["choices"][0]["message"]["content"]
        pm, dm = await metrics(s, p), await metrics(s, d)
    assert metric(pm, "motor_sim_pd_legs_total", side="prefill", protocol="vllm") == 1
    assert metric(dm, "motor_sim_pd_legs_total", side="decode", protocol="vllm") == 1
    # The ticket came from another process: accepted, and counted as such.
    assert metric(dm, "motor_sim_kv_tickets_total", result="unknown") == 1


async def test_vllm_handoff_on_one_engine_redeems_its_ticket(spawn_engine) -> None:
    eng = spawn_engine()
    async with aiohttp.ClientSession() as s:
        _, pre = await chat(s, eng, max_tokens=1, kv_transfer_params=PREFILL_KV)
        status, dec = await chat(s, eng, stream=False, kv_transfer_params=pre["kv_transfer_params"])
        assert status == 200 and dec["usage"]["completion_tokens"] == 16
        m = await metrics(s, eng)
        status, bad = await chat(s, eng, kv_transfer_params="nope")
        assert status == 400 and bad["error"]["param"] == "kv_transfer_params"
    assert metric(m, "motor_sim_kv_tickets_total", result="known") == 1
    assert metric(m, "motor_sim_pd_legs_total", side="prefill", protocol="vllm") == 1
    assert metric(m, "motor_sim_pd_legs_total", side="decode", protocol="vllm") == 1


def sglang_pair(spawn_engine, *extra: str) -> tuple[SimEngine, SimEngine]:
    p = spawn_engine("--protocol", "sglang", "--disaggregation-mode", "prefill")
    d = spawn_engine("--protocol", "sglang", "--disaggregation-mode", "decode", *extra)
    assert p.bootstrap_port > 0 and d.bootstrap_port == 0
    return p, d


def boot(p: SimEngine, room: int | None = None) -> dict[str, Any]:
    return {
        "bootstrap_host": "127.0.0.1",
        "bootstrap_port": p.bootstrap_port,
        "bootstrap_room": random.getrandbits(63) if room is None else room,
    }


async def test_sglang_concurrent_legs_with_openai_sdk(spawn_engine) -> None:
    p, d = sglang_pair(spawn_engine)
    pc = AsyncOpenAI(base_url=p.v1, api_key="x", max_retries=0, timeout=10)
    dc = AsyncOpenAI(base_url=d.v1, api_key="x", max_retries=0, timeout=10)
    msgs = [{"role": "user", "content": "rendezvous"}]
    for _ in range(3):
        b = boot(p)
        pre, dec = await asyncio.gather(
            pc.chat.completions.create(model="motor-sim", messages=msgs, max_tokens=8, extra_body=b),
            dc.chat.completions.create(model="motor-sim", messages=msgs, max_tokens=8, extra_body=b),
        )
        assert pre.usage.completion_tokens == 1 and dec.usage.completion_tokens == 8
    b = boot(p)

    async def decode_stream() -> str:
        stream = await dc.chat.completions.create(
            model="motor-sim", messages=msgs, max_tokens=8, stream=True, extra_body=b
        )
        return "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])

    text, _ = await asyncio.gather(
        decode_stream(), pc.chat.completions.create(model="motor-sim", messages=msgs, extra_body=b)
    )
    assert text == dec.choices[0].message.content
    async with aiohttp.ClientSession() as s:
        pm, dm = await metrics(s, p), await metrics(s, d)
    assert metric(pm, "motor_sim_pd_legs_total", side="prefill", protocol="sglang") == 4
    assert metric(dm, "motor_sim_pd_legs_total", side="decode", protocol="sglang") == 4


async def test_sglang_decode_first_then_prefill(spawn_engine) -> None:
    p, d = sglang_pair(spawn_engine)
    b = boot(p)
    async with aiohttp.ClientSession() as s:
        dtask = asyncio.create_task(chat(s, d, max_tokens=4, **b))

        async def decode_waiting() -> bool:
            return metric(await metrics(s, d), "vllm:num_requests_running") == 1

        await until(decode_waiting, 10, "the decode leg to wait for its room")
        assert not dtask.done()
        status, _ = await chat(s, p, max_tokens=4, **b)
        assert status == 200
        status, dec = await dtask
        assert status == 200 and dec["usage"]["completion_tokens"] == 4
        # prefill first, decode later: the room waits for its decode leg
        b = boot(p)
        assert (await chat(s, p, **b))[0] == 200
        assert (await chat(s, d, **b))[0] == 200


async def test_sglang_room_timeout_is_a_clear_error(spawn_engine) -> None:
    p, d = sglang_pair(spawn_engine, "--bootstrap-timeout-s", "0.5")
    async with aiohttp.ClientSession() as s:
        status, body = await chat(s, d, **boot(p, room=123456789))
        assert status == 504
        assert "123456789" in body["error"]["message"] and body["error"]["code"] == "bootstrap_timeout"
        # a port that serves no rendezvous at all
        b = {"bootstrap_host": "127.0.0.1", "bootstrap_port": d.port, "bootstrap_room": 7}
        status, body = await chat(s, d, **b)
        assert status == 504 and "room 7" in body["error"]["message"]
        status, body = await chat(s, d, bootstrap_room=5)
        assert status == 400
        status, body = await chat(s, d, bootstrap_room="x", bootstrap_host="h", bootstrap_port=1)
        assert status == 400 and body["error"]["param"] == "bootstrap_room"
        m = await metrics(s, d)
    assert metric(m, "motor_sim_bootstrap_timeouts_total") == 2
    assert metric(m, "motor_sim_pd_legs_total", side="decode", protocol="sglang") == 0


async def test_sglangs_fake_bootstrap_host_is_served_alone_on_either_role(spawn_engine) -> None:
    """What SGLang's warm-up and the NodeManager's inference probe send: no rendezvous, no wait
    for a peer (the decode has no prefill to meet here), one answer of its own."""
    p, d = sglang_pair(spawn_engine, "--bootstrap-timeout-s", "30")
    fake = {"bootstrap_host": "2.2.2.2", "bootstrap_room": random.getrandbits(63)}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as s:
        for eng in (p, d):
            body = {"model": "motor-sim", "prompt": "1", "max_tokens": 1, **fake}
            async with s.post(eng.v1 + "/completions", json=body) as r:
                answer = await r.json()
            assert r.status == 200 and answer["usage"]["completion_tokens"] == 1
            assert "kv_transfer_params" not in answer
        pm, dm = await metrics(s, p), await metrics(s, d)
    assert metric(pm, "motor_sim_pd_legs_total", side="prefill", protocol="sglang") == 0
    assert metric(dm, "motor_sim_pd_legs_total", side="decode", protocol="sglang") == 0
    assert metric(dm, "motor_sim_bootstrap_timeouts_total") == 0


async def test_bootstrap_port_flag_and_manual_room(spawn_engine) -> None:
    p = spawn_engine(
        "--protocol", "sglang", "--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port", "0"
    )
    async with aiohttp.ClientSession() as s:
        url = f"http://127.0.0.1:{p.bootstrap_port}/room/42"
        waiter = asyncio.create_task(s.get(url + "?timeout_s=5"))
        async with s.post(url, json={"note": "by hand"}) as r:
            assert r.status == 200
        resp = await waiter
        assert resp.status == 200 and (await resp.json())["room"] == 42
        resp.release()
        async with s.get(f"http://127.0.0.1:{p.bootstrap_port}/room/43?timeout_s=0.1") as r:
            assert r.status == 408
