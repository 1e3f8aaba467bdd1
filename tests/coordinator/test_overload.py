"""Overload protection of the inference port (max_concurrent_requests, max_queued_requests,
queue_timeout_s), against a real simulated engine slow enough that requests overlap.

Timings are only compared with each other (rejections come back before admitted requests
finish; loaded and unloaded medians of the same engine), never with absolute numbers.
"""

from __future__ import annotations

import asyncio
import json
import re
import statistics
import time
from collections.abc import Iterator
from dataclasses import dataclass

import aiohttp
import pytest

from motor_mesh.common.enums import UNION
from motor_mesh.gen.motor.v1 import coordinator_pb2 as pb
from tests.coordinator.conftest import MODEL, Engine, Running, SpawnEngines, StartCoordinator, instance
from tests.http import ERROR_FIELDS
from tests.poll import until

TTFT_MS = 500
SUCCESS = re.compile(r'^vllm:request_success_total\{[^}]*finished_reason="length"[^}]*\} ([0-9.]+)$', re.M)


@pytest.fixture
def slow(spawn_engines: SpawnEngines) -> Iterator[Engine]:
    """A union engine whose every request takes TTFT_MS, and which runs at most 4 at once
    (more queue inside the engine and take longer: what admission must keep from happening)."""
    yield spawn_engines(u=["--ttft-ms", str(TTFT_MS), "--max-num-seqs", "4"])["u"]


@dataclass
class Result:
    status: int
    headers: dict[str, str]
    body: bytes
    started: float
    ended: float

    @property
    def latency(self) -> float:
        return self.ended - self.started

    def error(self) -> dict[str, str]:
        err = json.loads(self.body)["error"]
        assert err.keys() == ERROR_FIELDS
        return dict(err)


async def _coordinator(start: StartCoordinator, engine: Engine, **cfg: object) -> Running:
    coord = await start(**cfg)
    await coord.stub.SetInstances(
        pb.SetInstancesRequest(instances=[instance(1, UNION, engine.port)]), timeout=5
    )
    return coord


async def _burst(coord: Running, n: int) -> list[Result]:
    """``n`` requests at once, each on its own connection."""
    url = f"http://{coord.http}/v1/completions"
    body = {"model": MODEL, "prompt": "overload", "max_tokens": 1}

    async def one(s: aiohttp.ClientSession) -> Result:
        t0 = time.monotonic()
        async with s.post(url, json=body, timeout=aiohttp.ClientTimeout(total=30)) as r:
            data = await r.read()
            return Result(r.status, dict(r.headers), data, t0, time.monotonic())

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, force_close=True)) as s:
        return list(await asyncio.gather(*(one(s) for _ in range(n))))


def _by_status(results: list[Result]) -> dict[int, list[Result]]:
    out: dict[int, list[Result]] = {}
    for r in results:
        out.setdefault(r.status, []).append(r)
    return out


async def _served(engine: Engine) -> float:
    async with aiohttp.ClientSession() as s, s.get(f"{engine.base}/metrics") as r:
        m = SUCCESS.search(await r.text())
    assert m is not None
    return float(m.group(1))


async def test_full_queue_is_429_at_once_and_admitted_requests_succeed(
    start_coordinator: StartCoordinator, slow: Engine
) -> None:
    coord = await _coordinator(start_coordinator, slow, max_concurrent_requests=4, max_queued_requests=4)
    before = await _served(slow)
    results = _by_status(await _burst(coord, 16))
    assert sorted(results) == [200, 429], {k: len(v) for k, v in results.items()}
    # 4 served at once, 4 from the queue; the rest told at once to come back later.
    assert len(results[200]) == 8 and len(results[429]) == 8
    for r in results[429]:
        assert r.headers.get("Retry-After") == "1"
        err = r.error()
        assert err["type"] == "rate_limit_error" and err["code"] == "too_many_requests"
    # "At once": every rejection came back before any admitted request was done.
    assert max(r.ended for r in results[429]) < min(r.ended for r in results[200])
    assert await _served(slow) - before == 8  # the engine never saw the excess
    assert coord.co.inference is not None
    assert coord.co.inference.admission.active == 0 and coord.co.inference.admission.queued == 0


async def test_queue_wait_past_queue_timeout_is_503(
    start_coordinator: StartCoordinator, slow: Engine
) -> None:
    coord = await _coordinator(
        start_coordinator, slow, max_concurrent_requests=4, max_queued_requests=4, queue_timeout_s=0.2
    )
    results = _by_status(await _burst(coord, 16))
    assert sorted(results) == [200, 429, 503], {k: len(v) for k, v in results.items()}
    assert len(results[200]) == 4 and len(results[503]) == 4 and len(results[429]) == 8
    for r in results[503]:
        assert r.headers.get("Retry-After") == "1"
        err = r.error()
        assert err["type"] == "service_unavailable" and err["code"] == "queue_timeout"
        assert "queue_timeout_s" in err["message"]
        # Told when the wait ran out, not when a slot finally came free.
        assert r.ended < min(a.ended for a in results[200])
    # The slots the timed-out requests waited for are all given back.
    results = _by_status(await _burst(coord, 4))
    assert list(results) == [200]


async def test_the_queue_is_first_in_first_out(start_coordinator: StartCoordinator, slow: Engine) -> None:
    coord = await _coordinator(start_coordinator, slow, max_concurrent_requests=1, max_queued_requests=8)
    url = f"http://{coord.http}/v1/completions"
    done: list[int] = []

    async def one(s: aiohttp.ClientSession, i: int) -> None:
        body = {"model": MODEL, "prompt": f"fifo {i}", "max_tokens": 1}
        async with s.post(url, json=body, timeout=aiohttp.ClientTimeout(total=30)) as r:
            assert r.status == 200, await r.text()
        done.append(i)

    assert coord.co.inference is not None
    admission = coord.co.inference.admission
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
        tasks = []
        for i in range(4):
            tasks.append(asyncio.create_task(one(s, i)))
            # Each one in line before the next is sent: arrival order is known.
            await until(lambda n=i + 1: admission.active + admission.queued >= n, timeout=5, every=0.005)
        await asyncio.gather(*tasks)
    assert done == [0, 1, 2, 3]


async def test_admitted_requests_keep_their_latency_under_2x_overload(
    start_coordinator: StartCoordinator, slow: Engine
) -> None:
    # No queue: under overload a request is either served at once or told to come back. The
    # engine runs at most 4 at once, so every request it received beyond that would wait there.
    coord = await _coordinator(start_coordinator, slow, max_concurrent_requests=4, max_queued_requests=0)
    await _burst(coord, 1)  # connections warm

    unloaded: list[float] = []
    loaded: list[float] = []
    for _ in range(3):
        results = await _burst(coord, 4)
        assert {r.status for r in results} == {200}
        unloaded += [r.latency for r in results]
    statuses: list[int] = []
    for _ in range(3):
        results = await _burst(coord, 8)  # twice what may run at once
        statuses += [r.status for r in results]
        loaded += [r.latency for r in results if r.status == 200]
    ratio = statistics.median(loaded) / statistics.median(unloaded)
    assert ratio <= 1.2, (ratio, sorted(unloaded), sorted(loaded))
    assert statuses.count(200) == statuses.count(429) == 12, statuses
