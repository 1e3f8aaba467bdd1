"""The inference API against real simulated engines, through the real ``openai`` SDK.

Which engine served which leg is read from each engine's ``motor_sim_pd_legs_total``.
"""

from __future__ import annotations

import json

import aiohttp
import openai
import pytest
from openai import AsyncOpenAI

from motor_mesh.common.enums import DECODE, PREFILL, UNION
from motor_mesh.gen.motor.v1 import common_pb2 as c
from tests.coordinator.conftest import (
    ENGINE_ARGS,
    MODEL,
    Engine,
    Running,
    StartCoordinator,
    get_text,
    instance,
    legs,
    running,
    set_table,
)
from tests.poll import until
from tests.ports import reserved_port
from tests.procs import SimEngine

MESSAGES = [{"role": "user", "content": "What is 2 + 3?"}]


async def _legs_of(session: aiohttp.ClientSession, engines: dict[str, Engine]) -> dict[str, dict[str, float]]:
    return {name: await legs(session, e) for name, e in engines.items()}


def _delta(
    before: dict[str, dict[str, float]], after: dict[str, dict[str, float]]
) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {}
    for name in after:
        moved = {
            k: v - before[name].get(k, 0.0) for k, v in after[name].items() if v != before[name].get(k, 0.0)
        }
        out[name] = moved
    return out


def _client(coord: Running, key: str = "x") -> AsyncOpenAI:
    return AsyncOpenAI(base_url=f"http://{coord.http}/v1", api_key=key, max_retries=0, timeout=20)


async def _all_four(client: AsyncOpenAI) -> list[str]:
    """Chat and completions, each non-streamed and streamed; returns the four texts and checks
    that no kv_transfer_params reached the client."""
    texts = []
    chat = await client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4)  # type: ignore[arg-type]
    assert "kv_transfer_params" not in (chat.model_extra or {})
    texts.append(chat.choices[0].message.content or "")
    comp = await client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=4)
    assert "kv_transfer_params" not in (comp.model_extra or {})
    texts.append(comp.choices[0].text)
    parts = []
    stream = await client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,  # type: ignore[arg-type]
        max_tokens=4,
        stream=True,
        stream_options={"include_usage": True},
    )
    async for chunk in stream:
        assert "kv_transfer_params" not in (chunk.model_extra or {})
        parts += [ch.delta.content or "" for ch in chunk.choices]
    texts.append("".join(parts))
    parts = []
    cstream = await client.completions.create(
        model=MODEL, prompt="Once upon a time", max_tokens=4, stream=True
    )
    async for cchunk in cstream:
        assert "kv_transfer_params" not in (cchunk.model_extra or {})
        parts += [ch.text for ch in cchunk.choices]
    texts.append("".join(parts))
    assert all(texts), texts
    return texts


async def test_vllm_handoff_prefill_then_decode(
    start_coordinator: StartCoordinator, engines: dict[str, Engine], http: aiohttp.ClientSession
) -> None:
    coord = await start_coordinator()
    p, d = engines["vllm_p"], engines["vllm_d"]
    await set_table(coord, instance(1, PREFILL, p.port), instance(2, DECODE, d.port))
    before = await _legs_of(http, {"p": p, "d": d})
    async with _client(coord) as client:
        texts = await _all_four(client)
    assert texts[0] == texts[2] and texts[1] == texts[3]  # streamed == not streamed
    moved = _delta(before, await _legs_of(http, {"p": p, "d": d}))
    assert moved == {"p": {"prefill/vllm": 4.0}, "d": {"decode/vllm": 4.0}}
    # The raw bytes too: nothing of the hand-off reaches the client.
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 3}
    async with http.post(f"http://{coord.http}/v1/chat/completions", json=body) as resp:
        assert resp.status == 200 and b"kv_transfer_params" not in await resp.read()


async def test_sglang_bootstrap_both_legs(
    start_coordinator: StartCoordinator, engines: dict[str, Engine], http: aiohttp.ClientSession
) -> None:
    coord = await start_coordinator()
    p, d = engines["sgl_p"], engines["sgl_d"]
    assert p.bootstrap_port
    await set_table(
        coord,
        instance(1, PREFILL, p.port, engine_type=c.ENGINE_TYPE_SGLANG, bootstrap=p.bootstrap_port),
        instance(2, DECODE, d.port, engine_type=c.ENGINE_TYPE_SGLANG),
    )
    before = await _legs_of(http, {"p": p, "d": d})
    async with _client(coord) as client:
        await _all_four(client)
    moved = _delta(before, await _legs_of(http, {"p": p, "d": d}))
    assert moved == {"p": {"prefill/sglang": 4.0}, "d": {"decode/sglang": 4.0}}


async def test_pd_protocol_field_overrides_engine_type(
    start_coordinator: StartCoordinator, engines: dict[str, Engine], http: aiohttp.ClientSession
) -> None:
    coord = await start_coordinator()
    p, d = engines["sgl_p"], engines["sgl_d"]
    sglang = c.PD_PROTOCOL_SGLANG
    await set_table(
        coord,
        instance(1, PREFILL, p.port, bootstrap=p.bootstrap_port, pd_protocol=sglang),
        instance(2, DECODE, d.port, pd_protocol=sglang),
    )
    before = await _legs_of(http, {"p": p, "d": d})
    async with _client(coord) as client:
        await client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2)  # type: ignore[arg-type]
    moved = _delta(before, await _legs_of(http, {"p": p, "d": d}))
    assert moved == {"p": {"prefill/sglang": 1.0}, "d": {"decode/sglang": 1.0}}


async def test_union_serves_whole_requests(
    start_coordinator: StartCoordinator, engines: dict[str, Engine], http: aiohttp.ClientSession
) -> None:
    coord = await start_coordinator()
    u = engines["union"]
    await set_table(coord, instance(5, UNION, u.port))
    before = await _legs_of(http, {"u": u})
    async with _client(coord) as client:
        texts = await _all_four(client)
        assert texts[0] == texts[2]
        models = await client.models.list()
        assert [m.id for m in models.data] == [MODEL]
    assert _delta(before, await _legs_of(http, {"u": u})) == {"u": {}}  # no PD legs
    text = await get_text(http, f"http://{coord.http}/metrics")
    assert 'motor_coordinator_requests_total{route="/v1/chat/completions",status="200"} 2.0' in text


async def test_not_routable_then_model_not_found(
    start_coordinator: StartCoordinator, engines: dict[str, Engine], http: aiohttp.ClientSession
) -> None:
    coord = await start_coordinator()
    base = f"http://{coord.http}"
    expected_503 = {
        "error": {
            "message": "no routable instance",
            "type": "service_unavailable",
            "param": None,
            "code": "no_routable_instance",
        }
    }
    for method, path in (
        ("POST", "/v1/chat/completions"),
        ("POST", "/v1/completions"),
        ("GET", "/v1/models"),
    ):
        async with http.request(method, base + path, json={"model": MODEL, "prompt": "x"}) as resp:
            assert resp.status == 503 and resp.headers["Retry-After"] == "1"
            assert json.loads(await resp.read()) == expected_503
    async with http.get(base + "/readiness") as resp:
        assert resp.status == 503
    async with http.get(base + "/health") as resp:
        assert resp.status == 200

    # A prefill alone is not routable; with its decode it is.
    p, d = engines["vllm_p"], engines["vllm_d"]
    await set_table(coord, instance(1, PREFILL, p.port))
    async with http.get(base + "/readiness") as resp:
        assert resp.status == 503
    await set_table(coord, instance(1, PREFILL, p.port), instance(2, DECODE, d.port))
    async with http.get(base + "/readiness") as resp:
        assert resp.status == 200

    async with _client(coord) as client:
        with pytest.raises(openai.NotFoundError) as info:
            await client.chat.completions.create(model="nope", messages=MESSAGES)  # type: ignore[arg-type]
        assert info.value.status_code == 404
        assert info.value.body == {
            "message": "The model `nope` does not exist.",
            "type": "invalid_request_error",
            "param": "model",
            "code": "model_not_found",
        }
        # The engine's own error (bad max_tokens, refused by the prefill engine) passes through.
        with pytest.raises(openai.BadRequestError) as bad:
            await client.completions.create(model=MODEL, prompt="x", max_tokens=-3)
        assert bad.value.status_code == 400 and "max_tokens" in str(bad.value.body)
    async with http.post(
        base + "/v1/completions", data=b"{not json", headers={"Content-Type": "application/json"}
    ) as r:
        assert r.status == 400
        assert (await r.json())["error"]["type"] == "invalid_request_error"


async def test_round_robin_spreads_across_decodes(
    start_coordinator: StartCoordinator, engines: dict[str, Engine], http: aiohttp.ClientSession
) -> None:
    coord = await start_coordinator(decode_policy="round_robin", prefill_policy="round_robin")
    p, d1, d2 = engines["vllm_p"], engines["vllm_d"], engines["vllm_d2"]
    await set_table(
        coord, instance(1, PREFILL, p.port), instance(2, DECODE, d1.port), instance(3, DECODE, d2.port)
    )
    before = await _legs_of(http, {"d1": d1, "d2": d2})
    async with _client(coord) as client:
        for _ in range(4):
            await client.completions.create(model=MODEL, prompt="spread", max_tokens=2)
    moved = _delta(before, await _legs_of(http, {"d1": d1, "d2": d2}))
    assert moved == {"d1": {"decode/vllm": 2.0}, "d2": {"decode/vllm": 2.0}}


async def test_dead_prefill_is_skipped_and_leaves_rotation(
    start_coordinator: StartCoordinator, engines: dict[str, Engine], http: aiohttp.ClientSession
) -> None:
    coord = await start_coordinator(prefill_policy="round_robin")
    p, d = engines["vllm_p2"], engines["vllm_d"]
    await set_table(
        coord,
        instance(1, PREFILL, reserved_port()),
        instance(2, PREFILL, p.port),
        instance(3, DECODE, d.port),
    )
    before = await _legs_of(http, {"p": p})
    async with _client(coord) as client:
        for _ in range(4):
            out = await client.completions.create(model=MODEL, prompt="still served", max_tokens=2)
            assert out.choices[0].text
    assert _delta(before, await _legs_of(http, {"p": p})) == {"p": {"prefill/vllm": 4.0}}
    # Refused once, then out of rotation: no further connection attempts.
    text = await get_text(http, f"http://{coord.http}/metrics")
    assert 'motor_coordinator_upstream_errors_total{kind="connect",role="prefill"} 1.0' in text


async def test_unreachable_everywhere_is_502(start_coordinator: StartCoordinator) -> None:
    coord = await start_coordinator()
    await set_table(coord, instance(1, UNION, reserved_port()))
    async with _client(coord) as client:
        with pytest.raises(openai.APIStatusError) as info:
            await client.completions.create(model=MODEL, prompt="x", max_tokens=2)
    assert info.value.status_code == 502
    assert info.value.body["code"] == "upstream_unreachable"  # type: ignore[index]


async def test_client_disconnect_cancels_the_upstream(
    start_coordinator: StartCoordinator, engines: dict[str, Engine], http: aiohttp.ClientSession
) -> None:
    coord = await start_coordinator()
    p, d = engines["vllm_p"], engines["vllm_d_slow"]
    await set_table(coord, instance(1, PREFILL, p.port), instance(2, DECODE, d.port))
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 400, "stream": True}
    async with aiohttp.ClientSession() as client:
        resp = await client.post(f"http://{coord.http}/v1/chat/completions", json=body)
        assert resp.status == 200
        await resp.content.readline()  # the stream is flowing
        assert await running(http, d) == 1.0
        resp.close()  # the client goes away mid-stream

    async def stopped() -> bool:
        return await running(http, d) == 0.0

    await until(stopped, 10, "the decode engine to stop generating for a gone client")


async def test_api_keys(
    start_coordinator: StartCoordinator, engines: dict[str, Engine], tmp_path: object
) -> None:
    from pathlib import Path

    keys = Path(str(tmp_path)) / "keys"
    keys.write_text("# clients\nalpha\n\nbeta\n")
    keys.chmod(0o600)
    coord = await start_coordinator(api_keys_file=str(keys))
    await set_table(coord, instance(5, UNION, engines["union"].port))
    async with _client(coord, key="beta") as client:
        assert (await client.models.list()).data
    async with _client(coord, key="gamma") as client:
        with pytest.raises(openai.AuthenticationError):
            await client.completions.create(model=MODEL, prompt="x", max_tokens=1)
    async with aiohttp.ClientSession() as s, s.get(f"http://{coord.http}/readiness") as resp:
        assert resp.status == 200  # probes need no key


async def test_refused_endpoint_is_probed_back_into_rotation(
    start_coordinator: StartCoordinator, engines: dict[str, Engine], http: aiohttp.ClientSession
) -> None:
    coord = await start_coordinator(prefill_policy="round_robin")
    port = reserved_port()
    await set_table(
        coord, instance(1, PREFILL, port), instance(2, PREFILL, engines["vllm_p2"].port),
        instance(3, DECODE, engines["vllm_d"].port),
    )  # fmt: skip
    async with _client(coord) as client:
        await client.completions.create(model=MODEL, prompt="x", max_tokens=1)  # takes port out
        revived = SimEngine(MODEL, "--port", str(port), *ENGINE_ARGS["vllm_p"])
        try:
            revived.start()

            async def served_by_revived() -> bool:
                await client.completions.create(model=MODEL, prompt="x", max_tokens=1)
                return (await legs(http, revived)).get("prefill/vllm", 0.0) > 0

            await until(served_by_revived, 15, "the revived prefill back in rotation", every=0.1)
        finally:
            revived.kill()


async def test_sglang_retries_another_pair_when_a_prefill_is_unreachable(
    start_coordinator: StartCoordinator, engines: dict[str, Engine], http: aiohttp.ClientSession
) -> None:
    coord = await start_coordinator(prefill_policy="round_robin")
    p, d = engines["sgl_p"], engines["sgl_d"]
    sg = c.ENGINE_TYPE_SGLANG
    await set_table(
        coord,
        instance(1, PREFILL, reserved_port(), engine_type=sg, bootstrap=reserved_port()),
        instance(2, PREFILL, p.port, engine_type=sg, bootstrap=p.bootstrap_port),
        instance(3, DECODE, d.port, engine_type=sg),
    )
    before = await _legs_of(http, {"p": p, "d": d})
    async with _client(coord) as client:
        for _ in range(3):
            await client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2)  # type: ignore[arg-type]
        # An error answered by an engine passes through with its status.
        with pytest.raises(openai.BadRequestError):
            await client.completions.create(model=MODEL, prompt="x", max_tokens=-3)
    moved = _delta(before, await _legs_of(http, {"p": p, "d": d}))
    assert moved == {"p": {"prefill/sglang": 3.0}, "d": {"decode/sglang": 3.0}}
    text = await get_text(http, f"http://{coord.http}/metrics")
    assert 'motor_coordinator_upstream_errors_total{kind="connect",role="prefill"} 1.0' in text


async def test_decode_that_cannot_connect_is_retried_on_another(
    start_coordinator: StartCoordinator, engines: dict[str, Engine], http: aiohttp.ClientSession
) -> None:
    coord = await start_coordinator(decode_policy="round_robin")
    p, d = engines["vllm_p"], engines["vllm_d2"]
    await set_table(
        coord, instance(1, PREFILL, p.port), instance(2, DECODE, reserved_port()), instance(3, DECODE, d.port)
    )
    before = await _legs_of(http, {"d": d})
    async with _client(coord) as client:
        for _ in range(3):
            stream = await client.completions.create(model=MODEL, prompt="x", max_tokens=2, stream=True)
            assert "".join([ch.choices[0].text async for ch in stream if ch.choices])
    assert _delta(before, await _legs_of(http, {"d": d})) == {"d": {"decode/vllm": 3.0}}


async def test_prefill_only_degraded_mode(
    start_coordinator: StartCoordinator, engines: dict[str, Engine], http: aiohttp.ClientSession
) -> None:
    coord = await start_coordinator()
    # Routable thanks to another model's union instance; motor-sim has a prefill and no decode.
    await set_table(coord, instance(1, PREFILL, engines["vllm_p"].port), instance(2, UNION, 1, model="other"))
    async with _client(coord) as client:
        out = await client.completions.create(model=MODEL, prompt="degraded", max_tokens=3)
        assert out.choices[0].text and out.usage is not None and out.usage.completion_tokens == 3
        assert sorted(m.id for m in (await client.models.list()).data) == [MODEL, "other"]
