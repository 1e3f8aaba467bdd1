"""Never stale, end to end: a Coordinator routing prefills with ``kv_aware`` (one process, or
inference workers reading the management process's index) and real simulated engines, the
prefill engine's KV event ports reached through loopback TCP proxies (tests/chaos/proxy.py), as
its table entry says. Stalling both proxies (the publisher wedged as far as the Coordinator can
tell; nothing published or replayed gets through) while requests keep flowing makes the
Coordinator stop crediting that engine's blocks within ``kv_events_stale_s``; letting the bytes
through again credits them again.

The witnesses are the Coordinator's own /metrics: the stale gauge, the index's block count, and
the cached prompt tokens kv_aware credits the requests it routes with (the prefix hit count)."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import time
from collections.abc import AsyncIterator, Callable

import aiohttp
import pytest

from motor_mesh.gen.motor.v1 import common_pb2 as c
from tests.chaos.proxy import TcpProxy
from tests.chaos.test_kv_events_gap import event_ports
from tests.coordinator.conftest import (
    ENGINE_ARGS,
    MODEL,
    Engine,
    Running,
    SpawnEngines,
    StartCoordinator,
    instance,
    set_table,
)
from tests.metrics import Scrape, ascrape
from tests.poll import until

pytestmark = pytest.mark.timeout(120)

BS = 4
STALE_S = 1.0
PREFIX = [f"shared{k}" for k in range(10 * BS)]  # ten blocks every request begins with
SUFFIX = 2 * BS  # then words of its own
TOKENS = len(PREFIX) + SUFFIX
FLUSH_WAIT_S = 3.0  # for a request's prompt tokens to reach the counters (flushed every second)
WAIT_S = 30.0
STALE_GAUGE = "motor_coordinator_kv_events_stale_endpoints"
PROMPT = "motor_coordinator_kv_prompt_tokens_total"
CACHED = "motor_coordinator_kv_cached_prompt_tokens_total"


def kv_events_args() -> list[str]:
    config = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": "tcp://*:0",
              "replay_endpoint": "tcp://*:0"}  # fmt: skip
    return ["--block-size", str(BS), "--kv-events-config", json.dumps(config)]


class Client:
    """Completions through the Coordinator, each the shared prefix and words of its own: TOKENS
    prompt tokens (the simulated engine's built-in tokenizer: one per word)."""

    def __init__(self, coord: Running, http: aiohttp.ClientSession) -> None:
        self.url = f"http://{coord.http}/v1/completions"
        self.metrics_url = f"http://{coord.http}/metrics"
        self.http = http
        self.sent = 0
        self.uncounted = 0  # sent before kv_aware could read prompts (no tokenizer yet)
        self._n = itertools.count()

    async def one(self) -> None:
        n = next(self._n)
        body = {"model": MODEL, "prompt": " ".join([*PREFIX, *(f"own{n}w{k}" for k in range(SUFFIX))]),
                "max_tokens": 2}  # fmt: skip
        async with self.http.post(self.url, json=body, timeout=aiohttp.ClientTimeout(total=20)) as r:
            assert r.status == 200, await r.text()
            await r.read()
        self.sent += 1

    async def metrics(self) -> Scrape:
        return await ascrape(self.metrics_url)

    async def until_metric(
        self, what: str, check: Callable[[Scrape], bool], wait_s: float = WAIT_S
    ) -> Scrape:
        async def once() -> Scrape | None:
            m = await self.metrics()
            return m if check(m) else None

        return await until(once, wait_s, what)

    async def counted(self) -> Scrape:
        """/metrics once every request sent so far is in the kv_aware counts (each process
        flushes them into the counters every second)."""
        want = (self.sent - self.uncounted) * TOKENS
        return await self.until_metric(
            f"the prompt tokens of {self.sent - self.uncounted} requests counted",
            lambda m: m.value(PROMPT, role="prefill") == want,
        )

    async def warm_up(self, streak: int = 4) -> None:
        """Send requests one at a time until ``streak`` in a row were each counted: every
        process routing them reads their prompts (it loads the tokenizer once the instance is in
        its table, after the table is acknowledged)."""
        counted = 0
        while counted < streak:
            await self.one()
            try:
                await self.counted_within(FLUSH_WAIT_S)
            except AssertionError:
                self.uncounted = (
                    self.sent - int((await self.metrics()).value(PROMPT, role="prefill")) // TOKENS
                )
                counted = 0
            else:
                counted += 1

    async def counted_within(self, wait_s: float) -> None:
        want = (self.sent - self.uncounted) * TOKENS
        await self.until_metric(
            "this request counted", lambda m: m.value(PROMPT, role="prefill") == want, wait_s
        )

    async def cached_of(self, n: int) -> float:
        """Send ``n`` requests one after another: the prompt tokens kv_aware credited them with."""
        before = (await self.counted()).value(CACHED, role="prefill")
        for _ in range(n):
            await self.one()
        return (await self.counted()).value(CACHED, role="prefill") - before


@contextlib.asynccontextmanager
async def proxied(port: int) -> AsyncIterator[TcpProxy]:
    proxy = TcpProxy("127.0.0.1", port).start()
    try:
        yield proxy
    finally:
        await asyncio.to_thread(proxy.close)


@contextlib.asynccontextmanager
async def flowing(client: Client) -> AsyncIterator[None]:
    """Requests one after another until the block ends, the last one finished then (every
    request sent is counted whole)."""
    stop = asyncio.Event()

    async def loop() -> None:
        while not stop.is_set():
            await client.one()

    task = asyncio.create_task(loop())
    try:
        yield
    finally:
        stop.set()
        await task  # a failed request fails the test here


@pytest.mark.parametrize("workers", [1, 2])
async def test_a_stalled_event_stream_stops_crediting_its_engine_until_it_flows_again(
    start_coordinator: StartCoordinator,
    spawn_engines: SpawnEngines,
    http: aiohttp.ClientSession,
    workers: int,
) -> None:
    engines: dict[str, Engine] = spawn_engines(
        p=[*ENGINE_ARGS["vllm_p"], *kv_events_args()], d=[*ENGINE_ARGS["vllm_d"], "--block-size", str(BS)]
    )
    p, d = engines["p"], engines["d"]
    pub_port, replay_port = event_ports(p)
    async with proxied(pub_port) as pub, proxied(replay_port) as replay:
        coord = await start_coordinator(prefill_policy="kv_aware", kv_events_stale_s=STALE_S, workers=workers)
        ep = c.Endpoint(
            host=p.host,
            port=p.port,
            pid=p.pid,
            kv_events_port=pub.port,
            kv_events_replay_port=replay.port,
        )
        prefill = c.Instance(
            id=1,
            role=c.ROLE_PREFILL,
            job_name="p",
            model_name=MODEL,
            engine_type=c.ENGINE_TYPE_SIM,
            endpoints=[ep],
        )
        await set_table(coord, prefill, instance(2, c.ROLE_DECODE, d.port))
        client = Client(coord, http)
        await client.until_metric(
            "the prefill engine's events followed",
            lambda m: m.value("motor_coordinator_kv_subscriptions") == 1,
        )

        # The first requests cache the prefix; the next ones are credited with it.
        await client.warm_up()
        await client.until_metric(
            "the prefix indexed", lambda m: m.value("motor_coordinator_kv_index_blocks") >= len(PREFIX) // BS
        )
        assert await client.cached_of(3) >= 3 * len(PREFIX)

        # The engine's event stream stalls (its replay too) while it keeps serving.
        async with flowing(client):
            stalled = time.monotonic()
            await asyncio.to_thread(pub.stall)
            await asyncio.to_thread(replay.stall)
            # The gauge and the counter are set together but live in separate multiprocess
            # files, which one scrape reads one after the other: the poll waits for both.
            m = await client.until_metric(
                "the engine found stale",
                lambda m: (
                    m.value(STALE_GAUGE) == 1
                    and m.value("motor_coordinator_kv_index_resets_total", reason="stale") >= 1
                ),
            )
            took = time.monotonic() - stalled
            assert m.value("motor_coordinator_kv_index_resets_total", reason="stale") == 1
            # Batches arrived until the stall (a request's prefill publishes one). A probe goes
            # out after STALE_S / 2 of silence, the verdict after STALE_S, on a reconcile beat;
            # then a scrape.
            assert STALE_S - 0.5 <= took < STALE_S + 3.0, took
            await client.until_metric(
                "its blocks gone from the index", lambda m: m.value("motor_coordinator_kv_index_blocks") == 0
            )
        # Routed by load alone: the prefix it holds is not credited.
        assert await client.cached_of(3) == 0
        assert (await client.metrics()).value(STALE_GAUGE) == 1

        # The bytes flow again: what the engine published and replays arrives, the engine rejoins.
        await asyncio.to_thread(pub.resume)
        await asyncio.to_thread(replay.resume)
        await client.until_metric(
            "the engine rejoined",
            lambda m: (
                m.value(STALE_GAUGE) == 0
                and m.value("motor_coordinator_kv_index_blocks") >= len(PREFIX) // BS
            ),
        )
        assert await client.cached_of(3) >= 3 * len(PREFIX)
        assert (await client.metrics()).value(STALE_GAUGE) == 0
