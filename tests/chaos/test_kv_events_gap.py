"""Losing a stretch of an engine's KV cache events: the Coordinator's subscription notices the gap
and replays it from the engine's buffer, so its index ends up as if nothing had been lost; when
the buffer no longer reaches back that far, it starts over and claims only blocks the engine holds.

A real simulated engine publishes its events (a small prefix cache, so blocks are evicted too)
while clients send it distinct completions. The Coordinator's own subscription code follows it
through a TCP proxy; cutting the proxy's connections drops the batches published until the
subscriber has reconnected (a PUB socket keeps nothing for a subscriber it is not connected to).
"""

from __future__ import annotations

import asyncio
import itertools
import json
from collections.abc import AsyncIterator, Callable, Iterator

import aiohttp
import pytest
import zmq
import zmq.asyncio

from motor_mesh.common import tasks
from motor_mesh.coordinator.kv.index import KvIndex
from motor_mesh.coordinator.kv.subscriber import Subscription
from motor_mesh.coordinator.kv.wire import SEQ_END, Batch, Removed
from tests.chaos.proxy import TcpProxy
from tests.poll import until
from tests.procs import SimEngine

pytestmark = pytest.mark.timeout(120)

BS = 4
CAPACITY = 64  # blocks: a few dozen requests fill it, then every request evicts
WORKERS = 4
KEY = "engine"
WAIT_S = 30.0


def start_engine(buffer_steps: int) -> SimEngine:
    config = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": "tcp://*:0",
        "replay_endpoint": "tcp://*:0",
        "buffer_steps": buffer_steps,
    }
    return SimEngine(
        "--port", "0", "--block-size", str(BS), "--num-gpu-blocks-override", str(CAPACITY),
        "--kv-events-config", json.dumps(config),
    ).start()  # fmt: skip


def event_ports(eng: SimEngine) -> tuple[int, int]:
    """(publish, replay) ports, as the engine's listening line gives them."""
    fields = eng.listen_fields()
    return int(fields["kv_events"].rsplit(":", 1)[1]), int(fields["kv_replay"].rsplit(":", 1)[1])


def prompt(i: int) -> str:
    """Distinct from every other; three of four continue one of three shared two-block prefixes
    (their stored blocks name a parent the index must know)."""
    family = i % 4
    shared = [f"family{family}w{k}" for k in range(2 * BS)] if family else []
    return " ".join([*shared, *(f"r{i}w{k}" for k in range(3 * BS))])


class Load:
    """Distinct completions from ``WORKERS`` concurrent clients until ``stop()``."""

    def __init__(self, eng: SimEngine) -> None:
        self.url = eng.v1 + "/completions"
        self.sent = 0
        self._n = itertools.count()
        self._stop = asyncio.Event()
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10))
        self._workers: list[asyncio.Task[None]] = []

    def start(self) -> Load:
        self._workers = [asyncio.create_task(self._worker()) for _ in range(WORKERS)]
        return self

    async def one(self) -> None:
        """One request: its prefill publishes one batch (new blocks, and the evictions they cause)."""
        body = {"prompt": prompt(next(self._n)), "max_tokens": 1}
        async with self._session.post(self.url, json=body) as r:
            assert r.status == 200, await r.text()
            await r.read()
        self.sent += 1

    async def _worker(self) -> None:
        while not self._stop.is_set():
            await self.one()

    async def stop(self) -> None:
        self._stop.set()
        await asyncio.gather(*self._workers)  # a failed request fails the test here

    async def close(self) -> None:
        self._stop.set()
        for w in self._workers:
            await tasks.cancel_quietly(w)
        await self._session.close()


class Follower:
    """A Subscription feeding a KvIndex as the Coordinator's routing feeds its own (a reset drops
    the endpoint's blocks), with the replay outcomes and resets it reports."""

    def __init__(self, ctx: zmq.asyncio.Context, port: int, replay_port: int) -> None:
        self.index = KvIndex()
        self.outcomes: list[str] = []
        self.resets: list[str] = []
        self.removed = 0  # BlockRemoved events applied: evictions
        self.sub = Subscription(
            ctx, KEY, "127.0.0.1", port, replay_port, self._apply, self._drop, self, replay_timeout_s=5.0
        )
        self.task = asyncio.create_task(self.sub.run())

    def _apply(self, key: str, batch: Batch) -> None:
        for event in batch.events:
            self.index.apply(key, event)
            self.removed += isinstance(event, Removed)

    def _drop(self, key: str, reason: str) -> None:
        self.index.drop(key)

    # Stats
    def batch(self, lag_s: float, events: int) -> None:
        return None

    def replay(self, outcome: str) -> None:
        self.outcomes.append(outcome)

    def reset(self, reason: str) -> None:
        self.resets.append(reason)

    def blocks(self) -> frozenset[int]:
        return self.index.blocks(KEY)


@pytest.fixture
async def followers() -> AsyncIterator[Callable[..., Follower]]:
    made: list[Follower] = []

    def make(ctx: zmq.asyncio.Context, port: int, replay_port: int) -> Follower:
        made.append(Follower(ctx, port, replay_port))
        return made[-1]

    yield make
    for f in made:
        await tasks.cancel_quietly(f.task)


@pytest.fixture
def engines() -> Iterator[Callable[[int], SimEngine]]:
    started: list[SimEngine] = []

    def start(buffer_steps: int) -> SimEngine:
        started.append(start_engine(buffer_steps))
        return started[-1]

    yield start
    for eng in started:
        eng.kill()


@pytest.fixture
def proxies() -> Iterator[Callable[[int], TcpProxy]]:
    started: list[TcpProxy] = []

    def start(port: int) -> TcpProxy:
        started.append(TcpProxy("127.0.0.1", port).start())
        return started[-1]

    yield start
    for p in started:
        p.close()


@pytest.fixture
async def loads() -> AsyncIterator[Callable[[SimEngine], Load]]:
    made: list[Load] = []

    def make(eng: SimEngine) -> Load:
        made.append(Load(eng))
        return made[-1]

    yield make
    for load in made:
        await load.close()


async def latest_seq(ctx: zmq.asyncio.Context, replay_port: int) -> int:
    """The engine's last published batch: the last one its replay buffer holds."""
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    try:
        dealer.connect(f"tcp://127.0.0.1:{replay_port}")
        await dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        last = -1
        while True:
            _, seq, _ = await asyncio.wait_for(dealer.recv_multipart(), 10)
            if seq == SEQ_END:
                return last
            last = int.from_bytes(seq, "big")
    finally:
        dealer.close(linger=0)


async def subscribed(load: Load, *fs: Follower) -> None:
    """Each follower caught up with the (empty) buffer, then got a batch over its SUB socket (one
    is lost until the subscription reaches the engine: ask again)."""
    await until(lambda: all(f.outcomes for f in fs), WAIT_S, "the catch-ups")

    async def got_one() -> bool:
        if all(f.sub.last_seq >= 0 for f in fs):
            return True
        await load.one()
        return False

    await until(got_one, WAIT_S, "a batch to each subscription", every=0.2)


async def cut_until(proxy: TcpProxy, seen: Callable[[], bool], what: str) -> int:
    """Cut the proxy's connections until ``seen()`` (a cut may fall where nothing was published);
    returns how many cuts it took."""
    cuts = 0

    async def cut() -> bool:
        nonlocal cuts
        if seen():
            return True
        await asyncio.to_thread(proxy.cut)
        cuts += 1
        return False

    await until(cut, WAIT_S, what, every=0.5)
    return cuts


async def settle(
    ctx: zmq.asyncio.Context, replay_port: int, load: Load, followed: Follower, fresh: Follower
) -> int:
    """Wait until both followers applied the engine's last batch; returns its number. A stretch
    lost to the last cut shows only when a later batch arrives: send one while they differ."""

    async def caught_up() -> int | None:
        latest = await latest_seq(ctx, replay_port)
        if followed.sub.last_seq == fresh.sub.last_seq == latest:
            return latest + 1  # truthy even for batch 0
        await load.one()
        return None

    return int(await until(caught_up, WAIT_S, "both subscriptions at the engine's last batch", every=0.2)) - 1


async def test_a_gap_is_replayed_and_the_index_equals_a_fresh_rebuild(
    ctx, engines, proxies, loads, followers
) -> None:
    eng = engines(100_000)  # the buffer holds every batch of the test
    port, replay_port = event_ports(eng)
    proxy = proxies(port)  # the publish port only: replays go straight to the engine
    followed = followers(ctx, proxy.port, replay_port)
    load = loads(eng)
    await subscribed(load, followed)
    load.start()
    await until(lambda: followed.sub.last_seq >= 50, WAIT_S, "the stream under way")
    gaps = followed.sub.gaps
    cuts = await cut_until(proxy, lambda: followed.sub.gaps > gaps, "a gap in the stream")
    mark = followed.sub.last_seq
    await until(lambda: followed.sub.last_seq >= mark + 50, WAIT_S, "the stream going on")
    await load.stop()

    fresh = followers(ctx, port, replay_port)  # direct: its catch-up replays from batch 0
    latest = await settle(ctx, replay_port, load, followed, fresh)
    assert cuts >= 1 and proxy.connections > cuts  # it reconnected after every cut
    assert followed.sub.gaps > gaps and followed.sub.replays >= 2  # the catch-up, then the gap's
    assert set(followed.outcomes) == {"ok"}, followed.outcomes
    assert followed.resets == [] and followed.sub.resets == 0
    assert fresh.outcomes[0] == "ok" and fresh.resets == []
    assert followed.blocks() == fresh.blocks()
    assert 0 < len(fresh.blocks()) <= CAPACITY
    assert followed.removed > 0  # evictions were in the stream too
    assert latest == load.sent - 1  # one batch per request (each stores new blocks), from 0


async def test_a_gap_past_the_buffer_resets_to_blocks_the_engine_holds(
    ctx, engines, proxies, loads, followers
) -> None:
    eng = engines(5)  # far fewer batches than a cut loses
    port, replay_port = event_ports(eng)
    proxy = proxies(port)
    followed = followers(ctx, proxy.port, replay_port)
    # What the engine holds: a subscription that is never cut (no reset, so every batch applied).
    truth = followers(ctx, port, replay_port)
    load = loads(eng)
    await subscribed(load, followed, truth)
    load.start()
    await until(lambda: followed.sub.last_seq >= 50, WAIT_S, "the stream under way")
    await cut_until(proxy, lambda: "gap" in followed.resets, "a gap the replay cannot fill")
    mark = followed.sub.last_seq
    await until(lambda: followed.sub.last_seq >= mark + 50, WAIT_S, "the stream going on")
    await load.stop()

    fresh = followers(ctx, port, replay_port)  # a rebuild from the last 5 batches
    await until(lambda: fresh.outcomes, WAIT_S, "the fresh catch-up")
    await settle(ctx, replay_port, load, followed, truth)
    # The replay answered (short of the gap) rather than leaving the subscriber to time out.
    assert "truncated" in followed.outcomes and "timeout" not in followed.outcomes, followed.outcomes
    assert set(followed.resets) == {"gap"}
    assert truth.resets == [] and truth.sub.resets == 0, truth.outcomes
    held = truth.blocks()
    assert 0 < len(held) <= CAPACITY
    # Rebuilt from the batches after the reset: never a block the engine does not hold ...
    assert followed.blocks() and followed.blocks() <= held
    assert fresh.blocks() <= held
    # ... and missing the shared prefixes, cached before the reset and only touched since.
    assert followed.blocks() < held and followed.index.orphans > 0
