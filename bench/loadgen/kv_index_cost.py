"""Where the KV index lives: measured, for bench/bench_kv_routing.py.

With inference workers, Motor keeps one index in the management process, fed by one
subscription per engine, and mirrors which blocks each endpoint holds into mapped files the
workers read (services/coordinator/kv/shared.py). This measures what decides between that and
the alternatives (an index per worker, each fed by its own subscriptions; one index asked over
ZeroMQ on every request):

- the request path: read a chat request (its question new each time), hash its blocks, find
  the endpoint holding the longest prefix, against an index in the process and against the
  shared one; in a tight loop and with the CPU caches evicted before each request, as they are
  on a busy machine between two requests; and among several instances, each prompt weighed
  against each one's load;
- the same lookup as a round trip to another process holding the index (a DEALER -> ROUTER
  over ipc, the hashes as msgpack, the answer back);
- what following the events costs: decoding and applying one batch (a request's
  ``BlockStored`` of a long prompt and the ``BlockRemoved`` of as many blocks), with and without
  the mirror the workers read: once per Coordinator with the shared index, once per worker
  without; and memory per block.
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import os
import statistics
import tempfile
import time
import tracemalloc
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec
import zmq
import zmq.asyncio
from prometheus_client import CollectorRegistry

from bench.loadgen.harness import percentile
from motor_mesh.common.enums import ENGINE_SIM, PREFILL
from motor_mesh.common.tokenizer import Builtin, HfTokenizer
from motor_mesh.coordinator.bodies import loads
from motor_mesh.coordinator.kv import wire
from motor_mesh.coordinator.kv.index import DEFAULT_MAX_BLOCKS, KvIndex
from motor_mesh.coordinator.kv.metrics import KvMetrics
from motor_mesh.coordinator.kv.policy import IndexView, KvAware
from motor_mesh.coordinator.kv.prompt import Tokens
from motor_mesh.coordinator.kv.shared import MIN_CAPACITY, SharedReader, SharedWriter, capacity_for
from motor_mesh.coordinator.tally import Tallies
from tests.tokenizers import llama3_path

BLOCK = 16
ENDPOINTS = 4
MODEL = "motor-sim"
SAMPLES = 2000
COLD_SAMPLES = 300
EVICT_BYTES = 32 << 20  # more than this machine's caches


@dataclass
class Costs:
    in_process_us: list[float]  # tokenize + hash + match against a KvIndex, per request
    shared_us: list[float]  # the same against the shared index
    shared_cold_us: list[float]  # the same, CPU caches evicted before each request
    several_us: list[float]  # against the shared index, the endpoints as as many instances
    round_trip_us: list[float]  # the match asked of another process
    ingest_us: float  # decode + apply one batch to an index
    ingest_mirrored_us: float  # the same, mirrored for the workers
    bytes_per_block: float  # the index's own memory
    shared_bytes_per_block: float  # the mapped tables', at their fullest
    prompt_tokens: int
    tokenizer: str


def _request(system_words: int, question: int) -> dict[str, object]:
    system = " ".join(f"policy0clause{j}" for j in range(system_words))
    return {
        "messages": [
            {"role": "system", "content": system},
            {
                "role": "user",
                "content": f"question {question}: " + " ".join(f"w{question}x{i}" for i in range(40)),
            },
        ]
    }


def _stored(tokens: list[int], salt: int) -> wire.Stored:
    n = len(tokens) // BLOCK
    return wire.Stored([salt * 1_000_003 + i for i in range(n)], None, tokens[: n * BLOCK], BLOCK)


def _fill(index: KvIndex, tokens: list[int], blocks_per_endpoint: int) -> list[str]:
    """ENDPOINTS endpoints, each holding the prompt's blocks and filler chains."""
    eps = [f"http://127.0.0.1:{10000 + 2 * e}" for e in range(ENDPOINTS)]
    for e, ep in enumerate(eps):
        filler = 0
        while index.endpoint_blocks(ep) < blocks_per_endpoint - len(tokens) // BLOCK:
            chunk = [e * 10_000_000 + filler * 4096 + i for i in range(BLOCK * 64)]
            index.apply(ep, _stored(chunk, 1000 + e * 100_000 + filler))
            filler += 1
        index.apply(ep, _stored(tokens, e))  # last: at the bound, the oldest blocks go first
    return eps


@dataclass
class _Endpoint:
    """What the index reads of an endpoint."""

    base: str
    down: bool = False


class _Downs:
    n = 0  # no endpoint of the table out of rotation


class _Target:
    """What the request path reads of an instance."""

    def __init__(self, eps: list[str]) -> None:
        self.model, self.engine_type, self.role = MODEL, ENGINE_SIM, PREFILL
        self.endpoints = [_Endpoint(ep) for ep in eps]
        self.load = 0
        self.legs = 0  # requests in flight (kv_aware's load gate)
        self.downs = _Downs()


Read = Callable[[dict[str, Any], bool, Any], Any]  # (req, chat, target) -> prompt
Decide = Callable[..., Any]  # the policy, (targets, exclude, prompt) -> target


def _worker_path(tokens: Tokens, index: IndexView) -> tuple[Read, Decide]:
    """A request's two steps as an inference process takes them: its prompt read (what
    KvRouting.prompt awaits: a text this short is encoded inline) and the policy's choice among
    the candidates (a KvAware instance is the policy)."""
    return _read(tokens), KvAware(index, KvMetrics(CollectorRegistry(), Tallies()), 1.0, 1.0)


def _read(tokens: Tokens) -> Read:
    return lambda req, chat, target: tokens.read(req, chat)


def _path(
    read: Read,
    decide: Decide,
    eps: list[str],
    questions: range,
    evict: bytearray | None,
    several: bool = False,
) -> list[float]:
    """Per request (each with a question not seen before), microseconds to its choice: among
    one instance with every endpoint, or (``several``) as many instances of one endpoint each.
    The body is parsed after the eviction, as a worker parses it just before routing it."""
    out = []
    zeros = bytes(len(evict) // 64) if evict is not None else b""
    targets = [_Target([ep]) for ep in eps] if several else [_Target(eps)]
    for i in questions:
        raw = json.dumps(_request(1000, i)).encode()
        if evict is not None:
            evict[::64] = zeros
        req = loads(raw)
        t = time.perf_counter()
        prompt = read(req, True, targets[0])
        decide(targets, (), prompt)
        out.append((time.perf_counter() - t) * 1e6)
        assert prompt is not None and prompt.cached > 0
    return out


def _reader(directory: str) -> SharedReader:
    reader = SharedReader(directory)
    changed = reader.read_directory()
    assert changed is not None
    reader.install(*changed, reader.attach(changed[1]))
    return reader


def _serve_index(address: str, tokens: list[int], blocks: int, ready: object) -> None:
    index = KvIndex()
    _fill(index, tokens, blocks)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.bind(address)
    ready.set()  # type: ignore[attr-defined]
    enc, dec = msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder()
    while True:
        ident, payload = sock.recv_multipart()
        if payload == b"stop":
            break
        found = index.match(dec.decode(payload))
        sock.send_multipart([ident, enc.encode(found)])
    sock.close(0)
    ctx.term()


async def _round_trips(address: str, hashes: list[int]) -> list[float]:
    ctx = zmq.asyncio.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.connect(address)
    enc, dec = msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder()
    out = []
    for _ in range(SAMPLES):
        t = time.perf_counter()
        await sock.send(enc.encode(hashes))
        dec.decode(await sock.recv())
        out.append((time.perf_counter() - t) * 1e6)
    await sock.send(b"stop")
    sock.close(0)
    ctx.term()
    return out


def _ingest(tokens: list[int], writer: SharedWriter | None) -> float:
    """Per batch: a prompt's BlockStored (its tokens new each time, as when a cache churns) and
    the BlockRemoved of the batch before's blocks."""
    rounds = 500
    stored = [_stored([t + r * 100_000 for t in tokens], 5000 + r) for r in range(rounds)]
    payloads = [
        wire.encode(
            wire.Batch(time.time(), [s, *([wire.Removed(stored[r - 1].block_hashes)] if r else [])], 0)
        )
        for r, s in enumerate(stored)
    ]
    index = KvIndex(mirror=writer)
    if writer is not None:
        writer.install("e", writer.create("e"))
    t = time.perf_counter()
    for payload in payloads:
        index.apply_all("e", wire.decode(payload).events)
    return (time.perf_counter() - t) / rounds * 1e6


def _bytes_per_block(tokens: list[int]) -> float:
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    index = KvIndex()
    _fill(index, tokens, 50_000)
    used = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    return used / index.size


def tokens() -> Tokens:
    """Llama 3's tokenizer and chat template, as a real engine's model has them (``make
    tokenizers``); the simulated engine's built-in tokenizer without them."""
    path = llama3_path()
    if path is None:
        return Tokens(Builtin(), sim=True)
    return Tokens(HfTokenizer(os.path.join(path, "tokenizer.json")), sim=False)


def measure(blocks_per_endpoint: int = 100_000) -> Costs:
    tok = tokens()
    # The system prompt's ids remembered, as after any earlier conversation under it: each
    # request then encodes its own question (and the template's headers).
    first = tok.read(_request(1000, 0), True)
    assert first is not None
    ids = first.tokens
    with tempfile.TemporaryDirectory() as d:
        writer = SharedWriter(d, blocks_per_endpoint)
        writer.open()
        index = KvIndex(blocks_per_endpoint, writer)
        for e in range(ENDPOINTS):
            ep = f"http://127.0.0.1:{10000 + 2 * e}"
            # Made as big as the fill needs: here no feed replaces a crowded table.
            writer.install(ep, writer.create(ep, writer.max_capacity))
        eps = _fill(index, ids, blocks_per_endpoint)
        reader = _reader(d)
        in_process = _path(*_worker_path(tok, index), eps, range(1, SAMPLES + 1), None)
        worker = _worker_path(tok, reader)
        shared = _path(*worker, eps, range(SAMPLES + 1, 2 * SAMPLES + 1), None)
        cold = _path(
            *worker, eps, range(2 * SAMPLES + 1, 2 * SAMPLES + 1 + COLD_SAMPLES), bytearray(EVICT_BYTES)
        )
        several = _path(*worker, eps, range(3 * SAMPLES, 4 * SAMPLES), None, several=True)
        reader.close()
        writer.close()

    ingest = _ingest(ids, None)
    with tempfile.TemporaryDirectory() as d:
        writer = SharedWriter(d, blocks_per_endpoint)
        writer.open()
        ingest_mirrored = _ingest(ids, writer)
        writer.close()

    with tempfile.TemporaryDirectory() as d:
        address = f"ipc://{os.path.join(d, 'index')}"
        mp = multiprocessing.get_context("spawn")
        ready = mp.Event()
        server = mp.Process(target=_serve_index, args=(address, ids, blocks_per_endpoint, ready), daemon=True)
        server.start()
        if not ready.wait(300):
            server.kill()
            raise RuntimeError("the index process did not start")
        trips = asyncio.run(_round_trips(address, list(first.hashes(BLOCK))))
        server.join(10)
    # A table is replaced once more than half full by one at least four times what it holds: 16
    # to 32 bytes per block held; the largest, at the default bound, per block of the bound.
    shared_bytes = capacity_for(DEFAULT_MAX_BLOCKS) * 8 / DEFAULT_MAX_BLOCKS
    return Costs(
        in_process,
        shared,
        cold,
        several,
        trips,
        ingest,
        ingest_mirrored,
        _bytes_per_block(ids),
        shared_bytes,
        len(ids),
        tok.tokenizer.name if tok.memo is None else "Llama 3 (a conversation's system prompt remembered)",
    )


def _row(what: str, values: list[float]) -> str:
    p99 = percentile(sorted(values), 99)
    return f"| {what} | {statistics.median(values):.1f} µs | {p99:.1f} µs | {max(values):.1f} µs |"


def summary(c: Costs) -> list[str]:
    blocks = c.prompt_tokens // BLOCK
    return [
        "| what | p50 | p99 | max |",
        "|---|---|---|---|",
        _row(
            f"in process: read + hash + match ({c.prompt_tokens}-token chat, {ENDPOINTS} endpoints; "
            f"tokenizer: {c.tokenizer})",
            c.in_process_us,
        ),
        _row("the same against the shared index (what a worker does)", c.shared_us),
        _row("the same, CPU caches evicted before each request (then its body parsed)", c.shared_cold_us),
        _row(f"against the shared index, {ENDPOINTS} instances of one endpoint each", c.several_us),
        _row("round trip to an index in another process (ipc, msgpack)", c.round_trip_us),
        "",
        f"- Following the events, per batch (a {blocks}-block `BlockStored` and a {blocks}-block "
        f"`BlockRemoved`, decode included): {c.ingest_us:.0f} µs into an index, "
        f"{c.ingest_mirrored_us:.0f} µs mirrored for the workers. With the shared index the "
        "management process pays it once; with an index per worker every worker would.",
        f"- Memory: {c.bytes_per_block:.0f} bytes per indexed block in the management process "
        f"(engine hash, our hash, reference count), plus {c.shared_bytes_per_block:.0f} to "
        f"{2 * c.shared_bytes_per_block:.0f} bytes of mapped table per block held (a table "
        f"starts at {MIN_CAPACITY} slots and is replaced by a bigger one once more than half full).",
    ]
