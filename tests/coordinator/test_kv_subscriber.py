"""A Subscription against a real publisher on loopback: the sockets and the protocol of vLLM's
ZmqEventPublisher (numbered batches on PUB, a replay buffer behind a ROUTER), the batches
encoded with vLLM's own msgspec structs."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import AsyncIterator

import msgspec
import pytest
import zmq
import zmq.asyncio

from motor_mesh.common import tasks
from motor_mesh.coordinator.kv.hashing import chain
from motor_mesh.coordinator.kv.index import KvIndex
from motor_mesh.coordinator.kv.subscriber import Subscription
from motor_mesh.coordinator.kv.wire import SEQ_END, Batch, Cleared, Stored
from tests.poll import until
from tests.vllm_kv_events import KVEventBatch, vllm_stored

BS = 4


class Publisher:
    """An engine's KV event publisher. XPUB rather than PUB (the same to a subscriber) so a test
    can wait for the subscription to arrive before it publishes."""

    def __init__(self, ctx: zmq.asyncio.Context, buffer_steps: int = 10_000) -> None:
        self.pub = ctx.socket(zmq.XPUB)
        self.router = ctx.socket(zmq.ROUTER)
        for sock in (self.pub, self.router):
            sock.setsockopt(zmq.LINGER, 0)
        self.port = self.replay_port = 0
        self.buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self.seq = 0
        self.subscriptions = 0
        self.answer = True  # False: replay requests wait in pending until release()
        # vLLM releases differ: some repeat the topic frame before the number in replay answers.
        self.topic_in_replay = False
        self.pending: list[tuple[bytes, int]] = []
        self._tasks: list[asyncio.Task[None]] = []

    async def start(self, port: int = 0, replay_port: int = 0) -> Publisher:
        if port:  # the same ports again (a restarted engine): the old ones are freed in the background
            await until(lambda: _bind(self.pub, port), 10, "the publish port free again")
            await until(lambda: _bind(self.router, replay_port), 10, "the replay port free again")
            self.port, self.replay_port = port, replay_port
        else:
            self.port = self.pub.bind_to_random_port("tcp://127.0.0.1")
            self.replay_port = self.router.bind_to_random_port("tcp://127.0.0.1")
        self._tasks = [
            tasks.start("subscriptions", self._subscriptions()),
            tasks.start("replay", self._replay()),
        ]
        return self

    async def _subscriptions(self) -> None:
        while True:
            if (await self.pub.recv()).startswith(b"\x01"):
                self.subscriptions += 1

    async def _replay(self) -> None:
        while True:
            client, _, start = await self.router.recv_multipart()
            self.pending.append((client, int.from_bytes(start, "big")))
            if self.answer:
                await self.release()

    async def release(self) -> None:
        """Answer the replay requests received so far, as vLLM does."""
        pending, self.pending = self.pending, []
        for client, start in pending:
            for seq, payload in list(self.buffer):
                if seq >= start:
                    await self.router.send_multipart(
                        [client, b"", *self._topic(), seq.to_bytes(8, "big"), payload]
                    )
            await self.router.send_multipart([client, b"", *self._topic(), SEQ_END, b""])

    def _topic(self) -> list[bytes]:
        return [b""] if self.topic_in_replay else []

    async def publish(self, payload: bytes | None = None, *, send: bool = True, keep: bool = True) -> int:
        """Publish batch number ``seq`` (``send=False``: lost on its way; ``keep=False``: not in
        the replay buffer). By default a batch storing one block of ``[seq] * BS``."""
        seq = self.seq
        self.seq += 1
        if payload is None:
            payload = msgspec.msgpack.encode(
                KVEventBatch(time.time(), [vllm_stored([1000 + seq], None, [seq] * BS, BS)], 0)
            )
        if send:
            await self.pub.send_multipart([b"", seq.to_bytes(8, "big"), payload])
        if keep:
            self.buffer.append((seq, payload))
        return seq

    async def close(self) -> None:
        for task in self._tasks:
            await tasks.cancel_quietly(task)
        self.pub.close(linger=0)
        self.router.close(linger=0)


def _bind(sock: zmq.asyncio.Socket, port: int) -> bool:
    try:
        sock.bind(f"tcp://127.0.0.1:{port}")
    except zmq.ZMQError:
        return False
    return True


class Engine:
    """What the subscriber is told: the batches applied (by their marker seq), the resets, the
    stats, and an index fed from them as the Coordinator feeds its own."""

    def __init__(self) -> None:
        self.applied: list[int] = []
        self.resets: list[str] = []
        self.outcomes: list[str] = []
        self.stat_resets: list[str] = []
        self.lags: list[float] = []
        self.index = KvIndex()

    def apply(self, key: str, batch: Batch) -> None:
        assert key == "e"
        event = batch.events[0]
        assert isinstance(event, Stored) and isinstance(event.block_hashes[0], int)
        self.applied.append(event.block_hashes[0] - 1000)
        self.index.apply_all(key, batch.events)

    def reset(self, key: str, reason: str) -> None:
        self.resets.append(reason)
        self.index.apply(key, Cleared())

    # Stats
    def batch(self, lag_s: float, events: int) -> None:
        assert events == 1
        self.lags.append(lag_s)

    def replay(self, outcome: str) -> None:
        self.outcomes.append(outcome)

    def reset_stat(self, reason: str) -> None:
        self.stat_resets.append(reason)


class Stats:
    def __init__(self, engine: Engine) -> None:
        self.batch, self.replay, self.reset = engine.batch, engine.replay, engine.reset_stat


def held(*seqs: int) -> frozenset[int]:
    return frozenset(chain([s] * BS, BS)[0] for s in seqs)


@pytest.fixture
async def started() -> AsyncIterator[list[asyncio.Task[None]]]:
    runs: list[asyncio.Task[None]] = []
    yield runs
    for run in runs:
        await tasks.cancel_quietly(run)


def follow(
    ctx: zmq.asyncio.Context,
    pub: Publisher,
    engine: Engine,
    runs: list[asyncio.Task[None]],
    *,
    replay_port: int | None = None,
    replay_timeout_s: float = 5.0,
) -> Subscription[str]:
    sub = Subscription(
        ctx,
        "e",
        "127.0.0.1",
        pub.port,
        pub.replay_port if replay_port is None else replay_port,
        engine.apply,
        engine.reset,
        Stats(engine),
        replay_timeout_s=replay_timeout_s,
    )
    runs.append(asyncio.create_task(sub.run()))
    return sub


async def subscribed(pub: Publisher, engine: Engine) -> None:
    """Wait until the catch-up is done and the subscription reached the publisher: from then on
    every batch sent reaches the subscriber."""
    await until(lambda: engine.outcomes and pub.subscriptions, 10, "the subscriber caught up and subscribed")


async def test_catches_up_from_the_engines_buffer_then_follows(ctx, started) -> None:
    pub = await Publisher(ctx).start()
    for _ in range(3):
        await pub.publish()  # before anyone subscribed: only the replay buffer has them
    engine = Engine()
    sub = follow(ctx, pub, engine, started)
    await until(lambda: engine.applied == [0, 1, 2], 10, "the catch-up")
    await subscribed(pub, engine)
    await pub.publish()
    await until(lambda: engine.applied == [0, 1, 2, 3], 10, "batch 3")
    assert engine.outcomes == ["ok"] and engine.resets == []
    assert (sub.last_seq, sub.gaps, sub.replays, sub.resets) == (3, 0, 1, 0)
    assert len(engine.lags) == 4 and all(lag > -60 for lag in engine.lags)
    assert engine.index.blocks("e") == held(0, 1, 2, 3)
    await pub.close()


@pytest.mark.parametrize("topic_in_replay", [False, True], ids=["seq-first", "topic-first"])
async def test_a_missed_batch_comes_from_the_replay(ctx, started, topic_in_replay) -> None:
    """Both replay answer shapes of vLLM's publisher are read (the CPU build 0.32 sends the
    topic frame before the number; others do not)."""
    pub = await Publisher(ctx).start()
    pub.topic_in_replay = topic_in_replay
    engine = Engine()
    sub = follow(ctx, pub, engine, started)
    await subscribed(pub, engine)
    await pub.publish()
    await pub.publish()
    await pub.publish(send=False)  # lost on the way, still in the engine's buffer
    await pub.publish()
    await until(lambda: engine.applied == [0, 1, 2, 3], 10, "batches 0-3")
    assert engine.outcomes == ["ok", "ok"] and engine.resets == []
    assert (sub.last_seq, sub.gaps, sub.replays, sub.resets) == (3, 1, 2, 0)
    assert engine.index.blocks("e") == held(0, 1, 2, 3)
    await pub.close()


async def test_a_batch_the_buffer_no_longer_holds_resets(ctx, started) -> None:
    pub = await Publisher(ctx).start()
    engine = Engine()
    sub = follow(ctx, pub, engine, started)
    await subscribed(pub, engine)
    await pub.publish()
    await pub.publish()
    await pub.publish(send=False, keep=False)
    await pub.publish()
    await pub.publish()
    await until(lambda: engine.applied == [0, 1, 3, 4], 10, "batches 0, 1, 3, 4")
    assert engine.outcomes == ["ok", "truncated"]
    assert engine.resets == engine.stat_resets == ["gap"] and sub.resets == 1
    # Rebuilt from what followed the gap: what came before is forgotten.
    assert engine.index.blocks("e") == held(3, 4)
    await pub.close()


async def test_a_restarted_engine_resets(ctx, started) -> None:
    pub = await Publisher(ctx).start()
    engine = Engine()
    sub = follow(ctx, pub, engine, started)
    await subscribed(pub, engine)
    for _ in range(3):
        await pub.publish()
    await until(lambda: engine.applied == [0, 1, 2], 10, "batches 0-2")
    await pub.close()
    # A new engine process on the same ports numbers its batches from 0 again.
    again = await Publisher(ctx).start(pub.port, pub.replay_port)
    await until(lambda: again.subscriptions, 10, "the subscriber reconnected")
    await again.publish(send=False)  # published before the subscriber was there
    await again.publish()
    await until(lambda: engine.applied == [0, 1, 2, 0, 1], 10, "the new engine's batches 0 and 1")
    assert engine.resets == ["restart"] and sub.last_seq == 1
    assert engine.index.blocks("e") == held(0, 1)
    await again.publish()
    await until(lambda: engine.applied[-1] == 2, 10, "batch 2")
    assert engine.resets == ["restart"] and engine.outcomes == ["ok", "ok"]
    await again.close()


async def test_without_a_replay_port_a_gap_resets(ctx, started) -> None:
    pub = await Publisher(ctx).start()
    engine = Engine()
    sub = follow(ctx, pub, engine, started, replay_port=0)
    await subscribed(pub, engine)
    await pub.publish()
    await pub.publish()
    await pub.publish(send=False)
    await pub.publish()
    await until(lambda: engine.applied == [0, 1, 3], 10, "batches 0, 1, 3")
    assert engine.outcomes == ["none", "none"] and engine.resets == ["gap"]
    assert sub.replays == 0 and sub.gaps == 1
    await pub.close()


async def test_an_unanswered_replay_times_out_and_resets(ctx, started) -> None:
    pub = await Publisher(ctx).start()
    pub.answer = False
    engine = Engine()
    sub = follow(ctx, pub, engine, started, replay_timeout_s=0.3)
    await subscribed(pub, engine)
    assert engine.outcomes == ["timeout"]
    await pub.publish()
    await pub.publish(send=False)
    await pub.publish()
    await until(lambda: engine.applied == [0, 2], 10, "batches 0 and 2")
    assert engine.outcomes == ["timeout", "timeout"] and engine.resets == ["gap"]
    # The late answers go to sockets the subscriber has closed: they cannot pass for the next.
    await pub.release()
    pub.answer = True
    await pub.publish(send=False)
    await pub.publish()
    await until(lambda: engine.applied == [0, 2, 3, 4], 10, "batches 3 and 4 from a replay")
    assert engine.outcomes[-1] == "ok" and engine.resets == ["gap"] and sub.replays == 3
    await pub.close()


async def test_an_undecodable_batch_is_a_gap_logged_once(ctx, started, caplog) -> None:
    caplog.set_level(logging.WARNING, logger="motor")
    pub = await Publisher(ctx).start()
    engine = Engine()
    sub = follow(ctx, pub, engine, started)
    await subscribed(pub, engine)
    await pub.publish()
    await pub.publish(b"\xc1 not msgpack")
    await pub.publish()
    await pub.publish(msgspec.msgpack.encode(["not", "a batch"]))
    await pub.pub.send_multipart([b"", b"short seq", b""])  # no usable number at all
    await pub.publish()
    await until(lambda: engine.applied == [0, 2, 4], 10, "the readable batches")
    assert engine.resets == ["gap", "gap"] and sub.undecodable == 3
    warned = [r for r in caplog.records if getattr(r, "event", None) == "kv_events_undecodable"]
    assert len(warned) == 1 and warned[0].fields["engine"] == f"127.0.0.1:{pub.port}"
    await pub.close()


async def test_cancelling_closes_the_sockets(started) -> None:
    pub_ctx, ctx = zmq.asyncio.Context(), zmq.asyncio.Context()
    pub = await Publisher(pub_ctx).start()
    engine = Engine()
    follow(ctx, pub, engine, started)
    await subscribed(pub, engine)
    await tasks.cancel_quietly(started.pop())
    # term() waits for every socket of the context to be closed.
    await asyncio.wait_for(asyncio.to_thread(ctx.term), 10)
    await pub.close()
    pub_ctx.destroy(linger=0)
