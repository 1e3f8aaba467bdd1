"""motor_coordinator_inter_token_seconds: the gaps between the chunks of a streamed answer as the
client gets them, against simulated engines that pace their tokens (``--tpot-ms``). Both relays
count them (``migration_limit`` 0: the plain one; > 0: the one a continuation can resume), a
non-streamed answer adds nothing, the pause across a continuation is the migration gap's and not
an inter-token gap, and with inference workers /metrics and GetEngineMetrics' coordinator
families add up every worker's gaps."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from motor_mesh.gen.motor.v1 import common_pb2 as c
from motor_mesh.gen.motor.v1 import coordinator_pb2 as pb
from tests.coordinator.conftest import (
    MODEL,
    Engine,
    Running,
    SpawnEngines,
    StartCoordinator,
    get_text,
    instance,
    running,
    set_table,
)
from tests.poll import until
from tests.procs import SimEngine

ITL = "motor_coordinator_inter_token_seconds"
GAP = "motor_coordinator_migration_gap_seconds"
TPOT_MS = 20
TOKENS = 20
PACED = ["--tpot-ms", str(TPOT_MS)]


@dataclass(frozen=True)
class Hist:
    count: float
    sum: float
    buckets: dict[float, float]  # upper bound -> cumulative count

    @property
    def mean(self) -> float:
        return self.sum / self.count


def _hist(text: str, name: str = ITL) -> Hist:
    for fam in text_string_to_metric_families(text):
        if fam.name == name:
            got = {s.name: s.value for s in fam.samples if s.name != name + "_bucket"}
            buckets = {float(s.labels["le"]): s.value for s in fam.samples if s.name == name + "_bucket"}
            return Hist(got[name + "_count"], got[name + "_sum"], buckets)
    raise AssertionError(f"{name} is not in the exposition")


async def _metrics(http: aiohttp.ClientSession, coord: Running, name: str = ITL) -> Hist:
    return _hist(await get_text(http, f"http://{coord.http}/metrics"), name)


def _body(stream: bool, max_tokens: int = TOKENS) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": MODEL,
        "prompt": "count the gaps",
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": stream,
    }
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body


async def _complete(coord: Running, stream: bool, max_tokens: int = TOKENS) -> list[Any]:
    """One completion on a connection of its own; a stream's events ([DONE] as a string), or
    the whole answer as the one element."""
    async with (
        aiohttp.ClientSession() as s,
        s.post(
            f"http://{coord.http}/v1/completions",
            json=_body(stream, max_tokens),
            timeout=aiohttp.ClientTimeout(total=60),
        ) as r,
    ):
        assert r.status == 200, await r.text()
        data = await r.read()
    if not stream:
        return [json.loads(data)]
    events: list[Any] = []
    for line in data.split(b"\n"):
        if line.startswith(b"data:"):
            payload = line[5:].strip()
            events.append("[DONE]" if payload == b"[DONE]" else json.loads(payload))
    return events


def _tokens(events: list[Any]) -> int:
    return sum(1 for e in events if isinstance(e, dict) and e.get("choices") and e["choices"][0]["text"])


@pytest.fixture(scope="module")
def paced() -> Iterator[Engine]:
    """A union engine that sends one token every TPOT_MS."""
    eng = SimEngine("serve", MODEL, "--host", "127.0.0.1", "--port", "0", *PACED)
    try:
        yield eng.start()
    finally:
        eng.kill()


@pytest.mark.parametrize("migration_limit", [0, 3], ids=["plain_relay", "continuable_relay"])
async def test_a_paced_stream_is_observed_gap_by_gap_and_a_whole_answer_not_at_all(
    start_coordinator: StartCoordinator,
    http: aiohttp.ClientSession,
    paced: Engine,
    migration_limit: int,
) -> None:
    coord = await start_coordinator(migration_limit=migration_limit)
    await set_table(coord, instance(1, c.ROLE_UNION, paced.port))
    empty = await _metrics(http, coord)
    assert empty.count == 0 and set(empty.buckets) >= {0.005, 0.01, 0.02, 0.05, 0.1, 0.5, float("inf")}

    (whole,) = await _complete(coord, stream=False)
    assert whole["usage"]["completion_tokens"] == TOKENS
    assert (await _metrics(http, coord)).count == 0  # read whole: no gaps

    events = await _complete(coord, stream=True)
    assert _tokens(events) == TOKENS and events[-1] == "[DONE]"
    h = await _metrics(http, coord)
    # One gap before each token after the first; the last events may follow in a chunk of their own.
    assert TOKENS - 1 <= h.count <= TOKENS + 2, h
    assert 0.010 <= h.mean <= 0.200, h
    assert h.buckets[0.005] < h.count / 2  # most gaps are the engine's pace, not back-to-back writes


async def test_inference_workers_add_up_and_get_engine_metrics_lists_it(
    start_coordinator: StartCoordinator, http: aiohttp.ClientSession, paced: Engine
) -> None:
    coord = await start_coordinator(workers=2, engine_metrics_interval_s=3600)
    await set_table(coord, instance(1, c.ROLE_UNION, paced.port))
    n = 6  # on as many connections: they land on both workers
    answers = await asyncio.gather(*(_complete(coord, stream=True) for _ in range(n)))
    assert all(_tokens(events) == TOKENS for events in answers)

    # Each worker publishes what it counted within a second; any of them answers with the sum.
    async def all_seen() -> Hist | None:
        h = await _metrics(http, coord)
        return h if h.count >= n * (TOKENS - 1) else None

    h = await until(all_seen, timeout=10)
    assert h.count <= n * (TOKENS + 2) and 0.010 <= h.mean <= 0.200, h

    resp = await coord.stub.GetEngineMetrics(pb.GetEngineMetricsRequest(include_coordinator=True), timeout=5)
    (fam,) = [f for f in resp.coordinator_families if f.name == ITL]
    assert fam.type == pb.METRIC_TYPE_HISTOGRAM and "inter-token latency" in fam.help
    (count,) = [s.value for s in fam.samples if s.name == ITL + "_count"]
    assert count >= n * (TOKENS - 1)


async def test_the_pause_across_a_continuation_is_not_an_inter_token_gap(
    start_coordinator: StartCoordinator, spawn_engines: SpawnEngines, http: aiohttp.ClientSession
) -> None:
    e = spawn_engines(d1=PACED, d2=PACED)
    # A continuation waits migration_delay_s first: a pause no paced token gap comes near.
    coord = await start_coordinator(migration_limit=3, migration_delay_s=1.5)
    await set_table(coord, instance(1, c.ROLE_UNION, e["d1"].port), instance(2, c.ROLE_UNION, e["d2"].port))
    answer = asyncio.ensure_future(_complete(coord, stream=True, max_tokens=40))

    async def busy() -> str | None:
        for name in ("d1", "d2"):
            if await running(http, e[name]):
                return name
        return None

    victim = await until(busy)
    fault = {"mode": "die_after_tokens", "after_tokens": 5}
    async with http.post(f"{e[victim].base}/sim/fault", json=fault) as r:
        assert r.status == 200, await r.text()
    events = await answer
    assert _tokens(events) == 40 and events[-1] == "[DONE]"
    assert e[victim].popen.poll() is not None  # it really died mid-answer

    gap = await _metrics(http, coord, GAP)
    assert gap.count == 1 and gap.sum >= 1.5
    h = await _metrics(http, coord)
    assert 40 - 2 <= h.count <= 40 + 2, h  # every gap but the one across the continuation
    assert h.buckets[1.0] == h.count, h  # ... and that one is not among them
