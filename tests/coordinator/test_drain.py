"""DrainInstances against one Coordinator and simulated engines: what the RPC answers, what
ListInstances shows, where new requests go, and streams on a drained instance continuing on
another one after the grace with the output a client would have got anyway."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import aiohttp
import grpc
import pytest
from google.protobuf.duration_pb2 import Duration

from motor_mesh.gen.motor.v1 import common_pb2 as c
from motor_mesh.gen.motor.v1 import coordinator_pb2 as pb
from tests.coordinator.conftest import (
    ENGINE_ARGS,
    MODEL,
    Engine,
    Running,
    SpawnEngines,
    StartCoordinator,
    instance,
    legs,
    running,
    set_table,
)
from tests.poll import until

PREFILL, DECODE = c.ROLE_PREFILL, c.ROLE_DECODE
SLOW = ["--tpot-ms", "40"]  # a 60-token stream lasts about 2.4 s
PROMPT = "drain me gently"


def _table(e: dict[str, Engine], d1_pid: int = 0) -> list[c.Instance]:
    """The three instances; ``d1_pid``: the pid instance 2's engine is known by (a relaunch
    changes it)."""
    d1 = instance(2, DECODE, e["d1"].port)
    d1.endpoints[0].pid = d1_pid
    return [instance(1, PREFILL, e["p"].port), d1, instance(3, DECODE, e["d2"].port)]


async def _setup(
    start: StartCoordinator, spawn: SpawnEngines, **cfg: Any
) -> tuple[Running, dict[str, Engine]]:
    e = spawn(
        p=ENGINE_ARGS["vllm_p"],
        d1=[*ENGINE_ARGS["vllm_d"], *SLOW],
        d2=[*ENGINE_ARGS["vllm_d2"], *SLOW],
    )
    coord = await start(**cfg)
    await set_table(coord, *_table(e))
    return coord, e


async def drain(coord: Running, *ids: int, grace_s: float | None = None) -> pb.DrainInstancesResponse:
    req = pb.DrainInstancesRequest(ids=ids)
    if grace_s is not None:
        req.grace.CopyFrom(Duration(seconds=int(grace_s), nanos=int(grace_s % 1 * 1e9)))
    return await coord.stub.DrainInstances(req, timeout=5)


def _body(stream: bool, max_tokens: int = 60) -> dict[str, Any]:
    return {
        "model": MODEL,
        "prompt": PROMPT,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": stream,
        "stream_options": {"include_usage": True} if stream else None,
    }


async def _stream(coord: Running, http: aiohttp.ClientSession, **kw: Any) -> list[Any]:
    """A streamed completion's events, [DONE] as a string."""
    events: list[Any] = []
    url = f"http://{coord.http}/v1/completions"
    async with http.post(url, json=_body(True, **kw), timeout=aiohttp.ClientTimeout(total=60)) as r:
        assert r.status == 200, await r.text()
        async for line in r.content:
            if line.startswith(b"data:"):
                payload = line[5:].strip()
                events.append("[DONE]" if payload == b"[DONE]" else json.loads(payload))
    return events


def _text(events: list[Any]) -> str:
    return "".join(e["choices"][0]["text"] for e in events if isinstance(e, dict) and e.get("choices"))


async def test_drain_answers_the_deadline_and_lists_the_instance_as_unavailable(
    start_coordinator: StartCoordinator, spawn_engines: SpawnEngines
) -> None:
    coord, _ = await _setup(start_coordinator, spawn_engines, drain_grace_s=7)
    before = time.time()
    resp = await drain(coord, 2)
    (d,) = resp.drains
    assert d.instance_id == 2 and d.requests_in_flight == 0
    assert before + 7 - 1 <= d.move_time.ToNanoseconds() / 1e9 <= time.time() + 7
    listed = await coord.stub.ListInstances(pb.CoordinatorListInstancesRequest(), timeout=5)
    assert list(listed.draining_ids) == [2]
    assert [i.id for i in listed.unavailable] == [2] and [i.id for i in listed.available] == [1, 3]
    # Again: the same deadline, nothing changes.
    again = await drain(coord, 2, grace_s=0)
    assert again.drains[0].move_time == d.move_time and again.revision == resp.revision


async def test_a_bad_drain_request_is_refused_and_changes_nothing(
    start_coordinator: StartCoordinator, spawn_engines: SpawnEngines
) -> None:
    coord, _ = await _setup(start_coordinator, spawn_engines)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await drain(coord, 2, 99)
    assert err.value.code() == grpc.StatusCode.NOT_FOUND and "99" in (err.value.details() or "")
    for req in (pb.DrainInstancesRequest(ids=[0]), pb.DrainInstancesRequest(ids=[2, 2])):
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await coord.stub.DrainInstances(req, timeout=5)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    bad = pb.DrainInstancesRequest(ids=[2])
    bad.grace.seconds = -1
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await coord.stub.DrainInstances(bad, timeout=5)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "grace" in (err.value.details() or "")
    listed = await coord.stub.ListInstances(pb.CoordinatorListInstancesRequest(), timeout=5)
    assert list(listed.draining_ids) == [] and len(listed.available) == 3


async def test_new_requests_avoid_a_drained_instance_and_it_comes_back_relaunched_or_resumed(
    start_coordinator: StartCoordinator, spawn_engines: SpawnEngines, http: aiohttp.ClientSession
) -> None:
    coord, e = await _setup(start_coordinator, spawn_engines)
    await drain(coord, 2)
    for _ in range(4):
        events = await _stream(coord, http, max_tokens=2)
        assert events[-1] == "[DONE]"
    assert (await legs(http, e["d1"])).get("decode/vllm", 0) == 0
    assert (await legs(http, e["d2"]))["decode/vllm"] == 4
    # The Controller's full table with the same engines keeps the drain ...
    await set_table(coord, *_table(e))
    listed = await coord.stub.ListInstances(pb.CoordinatorListInstancesRequest(), timeout=5)
    assert list(listed.draining_ids) == [2]
    # ... the instance relaunched (other engine processes) ends it ...
    await set_table(coord, *_table(e, d1_pid=4242))
    listed = await coord.stub.ListInstances(pb.CoordinatorListInstancesRequest(), timeout=5)
    assert list(listed.draining_ids) == [] and [i.id for i in listed.available] == [1, 2, 3]
    # ... and so does ResumeInstances.
    await drain(coord, 3)
    await coord.stub.ResumeInstances(pb.ResumeInstancesRequest(ids=[3]), timeout=5)
    listed = await coord.stub.ListInstances(pb.CoordinatorListInstancesRequest(), timeout=5)
    assert list(listed.draining_ids) == []


async def test_a_stream_on_a_drained_instance_moves_after_the_grace_and_ends_as_it_would_have(
    start_coordinator: StartCoordinator, spawn_engines: SpawnEngines, http: aiohttp.ClientSession
) -> None:
    coord, e = await _setup(start_coordinator, spawn_engines)
    reference = await _stream(coord, http)
    # Only instance 2 may decode while the stream starts.
    await coord.stub.PauseInstances(pb.PauseInstancesRequest(ids=[3]), timeout=5)
    stream = asyncio.ensure_future(_stream(coord, http))
    await until(lambda: running(http, e["d1"]))
    await coord.stub.ResumeInstances(pb.ResumeInstancesRequest(ids=[3]), timeout=5)
    resp = await drain(coord, 2, grace_s=0.5)
    assert resp.drains[0].requests_in_flight == 1
    events = await stream
    assert _text(events) == _text(reference) and events[-1] == "[DONE]"
    ids = {ev["id"] for ev in events if isinstance(ev, dict)}
    assert len(ids) == 1
    assert events[-2]["usage"] == reference[-2]["usage"]
    assert await running(http, e["d1"]) == 0  # the engine saw the client leave
    after = await drain(coord, 2)
    assert after.drains[0].requests_in_flight == 0


async def test_with_inference_workers_the_drain_counts_their_requests_until_they_moved(
    start_coordinator: StartCoordinator, spawn_engines: SpawnEngines, http: aiohttp.ClientSession
) -> None:
    coord, e = await _setup(start_coordinator, spawn_engines, workers=2)
    await coord.stub.PauseInstances(pb.PauseInstancesRequest(ids=[3]), timeout=5)
    stream = asyncio.ensure_future(_stream(coord, http, max_tokens=100))
    await until(lambda: running(http, e["d1"]))
    await coord.stub.ResumeInstances(pb.ResumeInstancesRequest(ids=[3]), timeout=5)
    first = await drain(coord, 2, grace_s=1.5)

    async def in_flight() -> int:
        return (await drain(coord, 2)).drains[0].requests_in_flight

    # The one stream, once each worker has reported since it took the drain (until then a
    # worker counts as one: it may have been sending a request there); the move comes 1.5 s
    # after the first call, and then there is none.
    assert first.drains[0].requests_in_flight >= 1
    await until(lambda: in_flight_is(in_flight, 1))
    await until(lambda: in_flight_is(in_flight, 0))
    events = await stream
    assert events[-1] == "[DONE]" and not [ev for ev in events if isinstance(ev, dict) and "error" in ev]
    assert await running(http, e["d1"]) == 0


async def in_flight_is(read: Any, n: int) -> bool:
    return bool(await read() == n)
