"""PD legs served from a kept plan: a router repeats one request, and every leg after the first
is answered from the plan found by the body with its hand-off field cut out. Those answers must
be exactly what a fresh plan gives: a fresh ticket per vLLM prefill, the leg's own ticket
redeemed and its own room waited for, the same text, every counter moved.

The engines run in this process so that the test can see which answers the kept plans gave.
"""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
import pytest

from motor_mesh.common.httpserver import HttpServer
from motor_mesh.simengine import app as sim_app
from motor_mesh.simengine.completion import cut_handoff
from motor_mesh.simengine.config import EngineConfig
from motor_mesh.simengine.openai_api import dumps
from tests.simengine.test_sim_pd import PREFILL_KV

from .conftest import metric

pytestmark = pytest.mark.timeout(60)

CLIENT = {
    "model": "motor-sim",
    "messages": [{"role": "user", "content": "What is 6 x 7? Answer briefly."}],
    "max_tokens": 12,
}


def compact(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


def splice(raw: bytes, extra: dict[str, Any]) -> bytes:
    """What Motor's Coordinator sends a decode (and both SGLang legs): the client's bytes with
    the hand-off fields added before the closing brace."""
    return raw[:-1] + b"," + compact(extra)[1:]


class Served:
    """One in-process engine on an ephemeral port (and its bootstrap port, for an SGLang prefill)."""

    def __init__(self, engine: sim_app.Engine, base: str, bootstrap_port: int) -> None:
        self.engine = engine
        self.base = base
        self.bootstrap_port = bootstrap_port

    @property
    def hits(self) -> int:
        return self.engine.completions.leg_hits

    async def post(self, s: aiohttp.ClientSession, body: bytes, path: str = "/v1/chat/completions") -> Any:
        headers = {"Content-Type": "application/json"}
        async with s.post(self.base + path, data=body, headers=headers) as r:
            raw = await r.read()
            return r.status, raw

    async def metrics(self, s: aiohttp.ClientSession) -> str:
        async with s.get(self.base + "/metrics") as r:
            return await r.text()


@asynccontextmanager
async def serve(**cfg: Any) -> AsyncIterator[Served]:
    engine = sim_app.Engine(EngineConfig(**cfg))
    server = HttpServer(engine.handler(), max_body_bytes=1 << 20)
    engine.port = await server.listen("127.0.0.1", 0)
    servers = [server]
    boot_port = 0
    if engine.rendezvous is not None:
        boot = HttpServer(engine.rendezvous.handler(), max_body_bytes=1 << 20)
        boot_port = await boot.listen("127.0.0.1", 0)
        servers.append(boot)
    try:
        yield Served(engine, f"http://127.0.0.1:{engine.port}", boot_port)
    finally:
        for srv in servers:
            await srv.close(1.0)
        await engine.close()


def well_spelled(raw: bytes) -> dict[str, Any]:
    """The answer, checked to be spelled exactly as the engine's encoder spells a fresh one."""
    obj: dict[str, Any] = json.loads(raw)
    assert dumps(obj) == raw
    return obj


async def test_repeated_vllm_legs_get_fresh_tickets_and_redeem_their_own() -> None:
    raw = compact(CLIENT)
    prefill = compact({**CLIENT, "stream": False, "max_tokens": 1, "kv_transfer_params": PREFILL_KV})
    async with serve(engine_id="p-1") as eng, aiohttp.ClientSession() as s:
        _, direct = await eng.post(s, raw)
        text = well_spelled(direct)["choices"][0]["message"]["content"]
        tickets, blocks, ids = set(), [], set()
        rounds = 6
        for _ in range(rounds):
            status, pre_raw = await eng.post(s, prefill)
            assert status == 200
            pre = well_spelled(pre_raw)
            kv = pre["kv_transfer_params"]
            assert list(kv) == [
                "do_remote_prefill",
                "do_remote_decode",
                "remote_engine_id",
                "remote_block_ids",
                "remote_host",
                "remote_port",
                "remote_request_id",
                "tp_size",
            ]
            assert kv["do_remote_prefill"] is True and kv["do_remote_decode"] is False
            assert kv["remote_engine_id"] == "p-1" and kv["tp_size"] == 1
            assert kv["remote_host"] == "127.0.0.1" and kv["remote_port"] == eng.engine.port
            assert isinstance(kv["remote_request_id"], str) and len(kv["remote_request_id"]) == 32
            assert pre["usage"] == {"prompt_tokens": 8, "completion_tokens": 1, "total_tokens": 9}
            assert pre["choices"][0]["message"]["content"] == " 42" and text.startswith(" 42 ")
            tickets.add(kv["remote_request_id"])
            blocks.append(kv["remote_block_ids"])
            ids.add(pre["id"])
            # The decode leg carries this very ticket back, spliced in as a router does.
            status, dec_raw = await eng.post(s, splice(raw, {"kv_transfer_params": kv}))
            assert status == 200
            dec = well_spelled(dec_raw)
            assert "kv_transfer_params" not in dec and dec["choices"][0]["message"]["content"] == text
            assert dec["usage"]["completion_tokens"] == 12
            ids.add(dec["id"])
        m = await eng.metrics(s)
    assert len(tickets) == rounds and len(ids) == 2 * rounds
    assert blocks == [[b] for b in range(blocks[0][0], blocks[0][0] + rounds)]  # one block each, fresh
    # Every ticket was its leg's own: all of them known, none redeemed twice.
    assert metric(m, "motor_sim_kv_tickets_total", result="known") == rounds
    assert metric(m, "motor_sim_kv_tickets_total", result="unknown") == 0
    assert metric(m, "motor_sim_pd_legs_total", side="prefill", protocol="vllm") == rounds
    assert metric(m, "motor_sim_pd_legs_total", side="decode", protocol="vllm") == rounds
    assert metric(m, "vllm:request_success_total", finished_reason="length") == 2 * rounds + 1
    # Only the first leg of each side was planned in full.
    assert eng.hits == 2 * (rounds - 1)


async def test_vllm_prefill_stream_and_spaced_bodies_take_the_fast_path_too() -> None:
    """Bodies spelled with spaces (Python's json.dumps, as other routers send them) and a streamed
    prefill leg: the ticket lands in the last event, fresh every time."""
    async with serve() as eng, aiohttp.ClientSession() as s:
        seen = set()
        for i in range(4):
            kv = {**PREFILL_KV, "request_tag": f"r-{i}"}  # a prefill field that differs per request
            body = json.dumps({**CLIENT, "stream": True, "max_tokens": 1, "kv_transfer_params": kv})
            status, raw = await eng.post(s, body.encode())
            assert status == 200
            events = [json.loads(e[6:]) for e in raw.decode().split("\n\n") if e.startswith("data: {")]
            assert "kv_transfer_params" not in events[0]
            ticket = events[-1]["kv_transfer_params"]
            seen.add(ticket["remote_request_id"])
            assert raw.endswith(b"data: [DONE]\n\n")
        assert len(seen) == 4 and eng.hits == 3
        m = await eng.metrics(s)
    assert metric(m, "motor_sim_pd_legs_total", side="prefill", protocol="vllm") == 4


async def test_sglang_pair_repeats_wait_for_their_own_rooms() -> None:
    async with (
        serve(protocol="sglang", role="prefill", engine_id="sg-p") as p,
        serve(protocol="sglang", role="decode", bootstrap_timeout_s=1.5) as d,
        serve(protocol="sglang") as union,
        aiohttp.ClientSession() as s,
    ):
        raw = compact(CLIENT)
        _, direct = await union.post(s, raw)
        text = json.loads(direct)["choices"][0]["message"]["content"]
        rounds = 5
        for i in range(rounds):
            body = splice(
                raw,
                {
                    "bootstrap_host": "127.0.0.1",
                    "bootstrap_port": p.bootstrap_port,
                    "bootstrap_room": random.getrandbits(63),
                },
            )
            if i % 2:  # the decode leg first: it waits until the prefill fills its room
                dec_task = asyncio.ensure_future(d.post(s, body))
                await asyncio.sleep(0.05)
                assert not dec_task.done()
                (ps, pre_raw), (ds, dec_raw) = await asyncio.gather(p.post(s, body), dec_task)
            else:
                (ps, pre_raw), (ds, dec_raw) = await asyncio.gather(p.post(s, body), d.post(s, body))
            assert ps == 200 and ds == 200
            pre, dec = well_spelled(pre_raw), well_spelled(dec_raw)
            assert pre["usage"]["completion_tokens"] == 1 and "kv_transfer_params" not in pre
            assert dec["choices"][0]["message"]["content"] == text
        assert p.hits == rounds - 1 and d.hits == rounds - 1
        # A room nobody registers, on a kept plan: the decode still waits for *its* room.
        lone = splice(
            raw, {"bootstrap_host": "127.0.0.1", "bootstrap_port": p.bootstrap_port, "bootstrap_room": 7}
        )
        status, err = await d.post(s, lone)
        assert status == 504 and "room 7 " in json.loads(err)["error"]["message"]
        assert d.hits == rounds
        pm, dm = await p.metrics(s), await d.metrics(s)
    assert metric(pm, "motor_sim_pd_legs_total", side="prefill", protocol="sglang") == rounds
    assert metric(dm, "motor_sim_pd_legs_total", side="decode", protocol="sglang") == rounds
    assert metric(dm, "motor_sim_bootstrap_timeouts_total") == 1


async def test_look_alike_and_broken_handoff_fields_take_the_full_path() -> None:
    async with serve() as eng, aiohttp.ClientSession() as s:
        # The field's name inside a nested object is no hand-off: a plain request, every time.
        nested = {**CLIENT, "messages": [{**CLIENT["messages"][0], "kv_transfer_params": PREFILL_KV}]}
        for _ in range(3):
            status, raw = await eng.post(s, compact(nested))
            assert status == 200 and b"kv_transfer_params" not in raw
        # A later duplicate spelled with an escape is the one a JSON parser keeps: a decode leg.
        dup = compact({**CLIENT, "kv_transfer_params": PREFILL_KV})[:-1] + (
            b',"kv\\u005ftransfer_params":{"do_remote_prefill":true,"remote_request_id":"t"}}'
        )
        for _ in range(3):
            status, raw = await eng.post(s, dup)
            assert status == 200 and b"kv_transfer_params" not in raw
        assert eng.hits == 0
        m = await eng.metrics(s)
        assert metric(m, "motor_sim_pd_legs_total", side="decode", protocol="vllm") == 3
        assert metric(m, "motor_sim_pd_legs_total", side="prefill", protocol="vllm") == 0
        # A kept decode plan, then the same body with a broken or contradictory field: 400s.
        good = {"do_remote_prefill": True, "remote_request_id": "x"}
        for _ in range(2):
            assert (await eng.post(s, splice(compact(CLIENT), {"kv_transfer_params": good})))[0] == 200
        assert eng.hits == 1
        for bad in (
            b'{"do_remote_prefill":true,}',
            b'{"do_remote_prefill":true,"do_remote_decode":true}',
            b'"nope"',
        ):
            status, raw = await eng.post(s, compact(CLIENT)[:-1] + b',"kv_transfer_params":' + bad + b"}")
            assert status == 400, raw
        assert eng.hits == 1


async def test_sglang_room_values_only_integers_take_the_fast_path() -> None:
    async with serve(protocol="sglang", role="prefill") as p, aiohttp.ClientSession() as s:
        boot = {"bootstrap_host": "127.0.0.1", "bootstrap_port": p.bootstrap_port}
        for room in (1, 2):
            assert (await p.post(s, splice(compact(CLIENT), {**boot, "bootstrap_room": room})))[0] == 200
        assert p.hits == 1
        for room in (True, "3", 1.5):
            status, _ = await p.post(s, splice(compact(CLIENT), {**boot, "bootstrap_room": room}))
            assert status == 400
        status, _ = await p.post(s, splice(compact(CLIENT), {**boot, "bootstrap_room": [4, 5]}))
        assert status == 200  # a batch of rooms: planned in full
        assert p.hits == 1
        m = await p.metrics(s)
    assert metric(m, "motor_sim_pd_legs_total", side="prefill", protocol="sglang") == 3


def test_cut_finds_only_a_lone_well_formed_field() -> None:
    kv = compact({**CLIENT, "kv_transfer_params": PREFILL_KV})
    cut = cut_handoff(kv)
    assert cut is not None and cut.value == PREFILL_KV and cut.verified()
    assert cut.text[: cut.start] + compact(PREFILL_KV).decode() + cut.text[cut.end :] == kv.decode()
    spaced = json.dumps({**CLIENT, "bootstrap_room": 12, "bootstrap_port": 1}).encode()
    cut = cut_handoff(spaced)
    assert cut is not None and cut.value == 12 and cut.verified()
    assert cut_handoff(compact(CLIENT)) is None  # a plain request
    both = compact({**CLIENT, "kv_transfer_params": PREFILL_KV, "bootstrap_room": 1})
    assert cut_handoff(both) is None
    twice = kv[:-1] + b',"kv_transfer_params":{}}'
    assert cut_handoff(twice) is None
    in_text = compact({**CLIENT, "messages": [{"role": "user", "content": '"bootstrap_room": 5'}]})
    assert cut_handoff(in_text) is None  # the quotes are escaped in the string
    nested = compact({"a": {"bootstrap_room": 5}, **CLIENT})
    cut = cut_handoff(nested)
    assert cut is not None and not cut.verified()  # found, but not the top-level field
