"""KV cache events on vLLM's wire, from vLLM's ZmqEventPublisher (`--kv-events-config`).

PUB socket (`endpoint`): multipart `(topic, seq, payload)`, seq an 8-byte big-endian count from
0 (one per batch), payload a msgpack `KVEventBatch` `[ts, events, data_parallel_rank]` whose
events are tagged arrays:
  ["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium, lora_name]
  ["BlockRemoved", block_hashes, medium]
  ["AllBlocksCleared"]
ROUTER socket (`replay_endpoint`): a DEALER sends `[b"", start_seq]` and gets `[b"", seq, payload]`
for every kept batch (the last `buffer_steps`) from `start_seq` on, then `[b"", -1, b""]`.

As in vLLM, an engine of data-parallel rank R uses both ports + R, and an endpoint with a
wildcard (or ipc/inproc) is bound while any other PUB endpoint is connected to. Unlike vLLM,
`tcp://*:N` binds the sim's `--host` (all interfaces only when that is 0.0.0.0 or ::): simulated
engines run many to a host, on loopback in tests, and must not open ports to the network for it.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections import deque
from typing import Any, cast

import msgspec
import zmq
import zmq.asyncio

from motor_mesh.common import log, tasks
from motor_mesh.simengine.config import KvEventsConfig

MEDIUM_GPU = "GPU"
END_SEQ = (-1).to_bytes(8, "big", signed=True)
REPLAY_YIELD_EVERY = 256  # replayed batches between yields to the engine's other work


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """Base of the events; the tag (first array item) is the class name."""


class BlockStored(KVCacheEvent):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


def stored(hashes: list[int], parent: int | None, token_ids: list[int], block_size: int) -> BlockStored:
    return BlockStored(hashes, parent, token_ids, block_size, None, MEDIUM_GPU, None)


def removed(hashes: list[int]) -> BlockRemoved:
    return BlockRemoved(hashes, MEDIUM_GPU)


def offset_endpoint_port(endpoint: str, rank: int) -> str:
    """vLLM's: a tcp endpoint's port + the data-parallel rank, an inproc name + `_dp<rank>`."""
    if not rank:
        return endpoint
    if "inproc" in endpoint:
        return f"{endpoint}_dp{rank}"
    if "tcp" in endpoint and ":" in endpoint:
        base, port = endpoint.rsplit(":", 1)
        return f"{base}:{int(port) + rank}"
    return endpoint


def local_endpoint(endpoint: str, host: str) -> tuple[str, bool]:
    """(address, IPv6) with a `*` host replaced by the engine's own host."""
    if not endpoint.startswith("tcp://*:") or host in ("", "0.0.0.0", "::"):
        return endpoint, host == "::" and endpoint.startswith("tcp://*:")
    port = endpoint.rsplit(":", 1)[1]
    if ":" in host:
        return f"tcp://[{host}]:{port}", True
    return f"tcp://{host}:{port}", False


def _binds(endpoint: str) -> bool:
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class Publisher:
    """The engine's event sockets on its event loop. `publish` never waits: a PUB socket drops
    what a slow subscriber's high-water mark refuses, and replay fills the gap."""

    def __init__(self, cfg: KvEventsConfig, host: str, rank: int) -> None:
        self.rank = rank
        self._topic = cfg.topic.encode()
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=cfg.buffer_steps)
        self._seq = itertools.count()
        self._pending: list[tuple[float, list[Any]]] = []  # (when, events) not numbered yet
        self._closed = False
        self._encode = msgspec.msgpack.Encoder().encode
        self._ctx = zmq.asyncio.Context()
        self._pub: zmq.asyncio.Socket | None = None
        self._replay: zmq.asyncio.Socket | None = None
        self._task: asyncio.Task[None] | None = None
        self.dropped = 0
        self.endpoints: dict[str, str] = {}  # log field -> where it is bound or connected
        try:
            if cfg.endpoint:
                self._pub = self._open(zmq.PUB, cfg.endpoint, host, "kv_events", cfg.hwm)
            if cfg.replay_endpoint:
                # No mark: a ROUTER silently drops what is over it, and zmq learns what a peer read
                # only every (mark + 1) / 2 messages, so a second long answer on one connection
                # would lose its end marker. Answers go only to a client that asked, each at
                # most buffer_steps + 1 messages.
                self._replay = self._open(zmq.ROUTER, cfg.replay_endpoint, host, "kv_replay", 0)
        except zmq.ZMQError as exc:
            self._ctx.destroy(linger=0)
            raise OSError(exc.errno, f"kv events: {exc}") from None
        if self._replay is not None:
            self._task = tasks.spawn("kv_events_replay", self._serve_replay)

    def _open(self, kind: int, endpoint: str, host: str, name: str, hwm: int) -> zmq.asyncio.Socket:
        endpoint = offset_endpoint_port(endpoint, self.rank)
        bind = kind == zmq.ROUTER or _binds(endpoint)
        address, ipv6 = local_endpoint(endpoint, host)
        sock = self._ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.IPV6, int(ipv6))
        sock.set_hwm(hwm)
        if bind:
            sock.bind(address)
            address = sock.getsockopt_string(zmq.LAST_ENDPOINT)  # the real port of a port 0
        else:
            sock.connect(address)
        self.endpoints[name] = address
        return sock

    def publish(self, events: list[Any]) -> None:
        """One batch, numbered and sent once the running callback is done: as with vLLM's
        publisher thread, the answer whose prefill caused the events does not wait for them.
        Nothing once closed (a request finishing while the engine stops)."""
        if self._closed:
            return
        self._pending.append((time.time(), events))
        if len(self._pending) == 1:
            try:
                asyncio.get_running_loop().call_soon(self._flush)
            except RuntimeError:  # no loop running: nothing to wait for
                self._flush()

    def _flush(self) -> None:
        pending, self._pending = self._pending, []
        for ts, events in pending:
            seq = next(self._seq)
            payload = self._encode(KVEventBatch(ts, events, self.rank))
            self._buffer.append((seq, payload))
            if self._pub is None:
                continue
            parts = (self._topic, seq.to_bytes(8, "big"), payload)
            sent = cast("asyncio.Future[Any]", self._pub.send_multipart(parts, flags=zmq.NOBLOCK))
            if sent.done():
                self._check_sent(sent)
            else:
                sent.add_done_callback(self._check_sent)

    def _check_sent(self, sent: asyncio.Future[Any]) -> None:
        exc = None if sent.cancelled() else sent.exception()
        if exc is not None:
            self.dropped += 1
            if self.dropped == 1 or self.dropped % 10_000 == 0:
                log.warn("kv_event_dropped", error=str(exc), dropped=self.dropped)

    async def _serve_replay(self) -> None:
        assert self._replay is not None
        router = self._replay
        while True:
            frames = await router.recv_multipart()
            if len(frames) != 3 or len(frames[2]) != 8:
                log.warn("kv_replay_bad_request", frames=len(frames))
                continue
            client, _, start = frames
            first = int.from_bytes(start, "big")
            # A copy: batches published while this one is sent must not disturb it.
            for i, (seq, payload) in enumerate([b for b in self._buffer if b[0] >= first]):
                await router.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
                if i % REPLAY_YIELD_EVERY == REPLAY_YIELD_EVERY - 1:
                    await asyncio.sleep(0)
            await router.send_multipart((client, b"", END_SEQ, b""))

    async def close(self) -> None:
        self._flush()
        self._closed = True
        await tasks.cancel_quietly(self._task)
        self._ctx.destroy(linger=0)
