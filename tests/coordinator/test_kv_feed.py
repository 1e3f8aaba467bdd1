"""The management process's KV feed: it follows a real engine's events into its index and mirrors
them into the tables its inference workers map; an endpoint that leaves takes its table along."""

from __future__ import annotations

import contextlib
import json
import os
import threading
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import pytest

from motor_mesh.common.config import load
from motor_mesh.common.enums import PREFILL
from motor_mesh.common.tokenizer import Builtin
from motor_mesh.coordinator.kv.feed import KvFeed
from motor_mesh.coordinator.kv.hashing import chain
from motor_mesh.coordinator.kv.shared import MIN_CAPACITY, SharedReader, SharedWriter, Table
from motor_mesh.coordinator.metrics import Metrics, use_own_process
from motor_mesh.coordinator.routes import DownCount, RoutingView, Target
from motor_mesh.gen.motor.v1 import common_pb2 as c
from tests.chaos.test_kv_events_gap import event_ports
from tests.coordinator.conftest import MODEL
from tests.coordinator.test_kv_shared import follow
from tests.poll import until
from tests.procs import SimEngine

pytestmark = pytest.mark.timeout(60)

BS = 4
WORDS = [f"w{i}" for i in range(12)]  # the built-in tokenizer: one token per word, 3 blocks


@pytest.fixture
def engine() -> Iterator[SimEngine]:
    config = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": "tcp://*:0",
              "replay_endpoint": "tcp://*:0"}  # fmt: skip
    eng = SimEngine("--port", "0", "--block-size", str(BS), "--kv-events-config", json.dumps(config)).start()
    yield eng
    eng.kill()


def view_of(eng: SimEngine) -> RoutingView:
    pub, replay = event_ports(eng)
    ep = c.Endpoint(
        host=eng.host, port=eng.port, pid=eng.pid, kv_events_port=pub, kv_events_replay_port=replay
    )
    inst = c.Instance(
        id=1, role=PREFILL, job_name="p", model_name=MODEL, engine_type=c.ENGINE_TYPE_SIM, endpoints=[ep]
    )
    return RoutingView(revision=1, targets=(Target(inst, DownCount()),))


def feed_for(tmp_path: Path, view: list[RoutingView]) -> KvFeed:
    use_own_process()
    cfg = load(None, env={}).coordinator
    writer = SharedWriter(str(tmp_path), cfg.kv_index_max_blocks)
    return KvFeed(cfg, lambda: view[0], Metrics().kv, {PREFILL}, writer)


@dataclass
class Following:
    """A feed following ``engine`` and a worker's reader of its tables."""

    view: list[RoutingView]
    feed: KvFeed
    writer: SharedWriter
    reader: SharedReader
    key: str

    def sees(self, hashes: list[int], blocks: int) -> bool:
        follow(self.reader)  # what a worker's refresh does
        return self.reader.match(hashes) == {self.key: blocks}


@contextlib.asynccontextmanager
async def following(tmp_path: Path, engine: SimEngine) -> AsyncIterator[Following]:
    view = [view_of(engine)]
    feed = feed_for(tmp_path, view)
    assert feed.writer is not None
    f = Following(view, feed, feed.writer, SharedReader(str(tmp_path)), view[0].targets[0].endpoints[0].base)
    await feed.start()
    try:
        await until(lambda: f.writer.table(f.key) is not None, 20, "the engine's table")
        yield f
    finally:
        f.reader.close()
        await feed.stop()


async def cache(engine: SimEngine, words: list[str]) -> list[int]:
    """Have ``engine`` cache a prompt of ``words``; its block hashes."""
    async with aiohttp.ClientSession() as s:
        body = {"model": MODEL, "prompt": " ".join(words), "max_tokens": 1}
        async with s.post(f"{engine.v1}/completions", json=body) as resp:
            assert resp.status == 200
    return chain(Builtin().encode(" ".join(words)), BS)


async def test_a_worker_reads_what_the_engine_cached_until_the_engine_leaves(
    tmp_path: Path, engine: SimEngine
) -> None:
    async with following(tmp_path, engine) as f:
        hashes = await cache(engine, WORDS)
        await until(lambda: f.sees(hashes, 3), 20, "the worker to see the engine's three blocks")
        assert f.reader.block_size(f.key) == BS and f.reader.endpoint_blocks(f.key) == 3

        f.view[0] = RoutingView(revision=2)  # the engine left the table

        def gone() -> bool:
            follow(f.reader)
            return f.reader.endpoints() == [] and sorted(os.listdir(f.writer.dir)) == ["endpoints"]

        await until(gone, 20, "the engine's table to go")
    assert not (tmp_path / "kv").exists()


async def test_an_engine_caching_more_gets_a_bigger_table_that_workers_follow(
    tmp_path: Path, engine: SimEngine
) -> None:
    async with following(tmp_path, engine) as f:
        first = f.writer.table(f.key)
        assert first is not None and first.capacity == MIN_CAPACITY
        # 600 blocks: more than half of a first table.
        hashes = await cache(engine, [f"x{i}" for i in range(600 * BS)])

        def sees_all_in_a_bigger_table() -> bool:
            table = f.writer.table(f.key)
            return (
                f.sees(hashes, 600)
                and table is not None
                and table.capacity > MIN_CAPACITY
                and sorted(os.listdir(f.writer.dir)) == ["endpoints", os.path.basename(table.path)]
            )

        await until(sees_all_in_a_bigger_table, 20, "a bigger table, the old one deleted")


async def test_without_room_for_a_bigger_table_the_first_one_serves_on(
    tmp_path: Path, engine: SimEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    create = SharedWriter.create
    refused = threading.Event()

    def no_room(self: SharedWriter, ep: object, capacity: int = MIN_CAPACITY) -> Table:
        if capacity > MIN_CAPACITY:
            refused.set()
            raise OSError(28, "No space left on device")
        return create(self, ep, capacity)

    monkeypatch.setattr(SharedWriter, "create", no_room)
    async with following(tmp_path, engine) as f:
        await cache(engine, [f"x{i}" for i in range(600 * BS)])
        await until(refused.is_set, 20, "a bigger table refused")
        # After the refusal, events still reach the first table.
        hashes = await cache(engine, [f"x{i}" for i in range(601 * BS)])
        await until(lambda: f.sees(hashes, 601), 20, "the worker to see every block in the first table")
        table = f.writer.table(f.key)
        assert table is not None and table.capacity == MIN_CAPACITY


async def test_a_table_still_being_made_when_its_engine_leaves_is_deleted(
    tmp_path: Path, engine: SimEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    view = [view_of(engine)]
    feed = feed_for(tmp_path, view)
    left, made = threading.Event(), threading.Event()
    create = SharedWriter.create

    def slow_create(self: SharedWriter, ep: object, capacity: int = MIN_CAPACITY) -> Table:
        left.wait(20)  # in the feed's thread, until the engine has left the table
        table = create(self, ep, capacity)
        made.set()
        return table

    monkeypatch.setattr(SharedWriter, "create", slow_create)
    await feed.start()
    try:
        await until(lambda: feed._subs, 20, "the subscription")
        view[0] = RoutingView(revision=2)
        await until(lambda: not feed._subs, 20, "the subscription to go")
        left.set()
        await until(made.is_set, 20, "the table file")
        writer = feed.writer
        assert writer is not None
        await until(lambda: sorted(os.listdir(writer.dir)) == ["endpoints"], 20, "the orphan file to go")
        assert writer._tables == {}
    finally:
        await feed.stop()
