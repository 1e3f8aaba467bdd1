"""Where the KV index lives: measured, for bench/bench_kv_routing.py.

Motor keeps one index per inference process, each fed by its own subscription to every engine
(services/coordinator/kv/routing.py). The alternative is one index in the management process
that the workers ask over ZeroMQ on every request. This measures what decides between them:

- the request path in process: tokenize a chat request (its long system prompt cached by line),
  hash its blocks, match them against an index of several endpoints;
- the same lookup as a round trip to another process holding the index (a DEALER → ROUTER over
  ipc, the hashes sent as msgpack, the answer back): what each request would pay instead;
- what a per-process index costs: decoding and applying one event batch (a request's
  ``BlockStored`` of a long prompt), and memory per indexed block.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import statistics
import tempfile
import time
import tracemalloc
from dataclasses import dataclass

import msgspec
import zmq
import zmq.asyncio

from services.common.tokenizer import Builtin
from services.coordinator.kv import wire
from services.coordinator.kv.index import KvIndex
from services.coordinator.kv.prompt import Prompt, Tokens

BLOCK = 16
ENDPOINTS = 4
SAMPLES = 2000


@dataclass
class Costs:
    path_us: list[float]  # tokenize + hash + match, per request
    round_trip_us: list[float]  # the same match asked of another process
    ingest_us: float  # decode + apply one BlockStored batch of a prompt
    bytes_per_block: float
    prompt_tokens: int


def _request(system_words: int, question: int) -> dict[str, object]:
    system = " ".join(f"policy0clause{j}" for j in range(system_words))
    return {
        "messages": [
            {"role": "system", "content": system},
            {"role": "user", "content": f"q{question} about it"},
        ]
    }


def _stored_batch(tokens: list[int], salt: int) -> bytes:
    n = len(tokens) // BLOCK
    hashes: list[wire.BlockHash] = [salt * 1_000_003 + i for i in range(n)]
    event = wire.Stored(hashes, None, tokens[: n * BLOCK], BLOCK)
    return wire.encode(wire.Batch(time.time(), [event], 0))


def _filled_index(tokens: list[int], blocks_per_endpoint: int) -> KvIndex:
    """An index of ENDPOINTS endpoints, each holding the prompt's blocks and filler chains."""
    index = KvIndex(blocks_per_endpoint * 2)
    for e in range(ENDPOINTS):
        ep = f"http://127.0.0.1:{10000 + 2 * e}"
        index.apply_all(ep, wire.decode(_stored_batch(tokens, e)).events)
        filler = 0
        while index.endpoint_blocks(ep) < blocks_per_endpoint:
            chunk = [e * 10_000_000 + filler * 4096 + i for i in range(BLOCK * 64)]
            index.apply_all(ep, wire.decode(_stored_batch(chunk, 1000 + e * 100_000 + filler)).events)
            filler += 1
    return index


def _path_costs(tokens: Tokens, index: KvIndex, eps: list[str]) -> list[float]:
    out = []
    for i in range(SAMPLES):
        req = _request(1000, i)
        t = time.perf_counter()
        ids = tokens.of(req, True)
        assert ids
        index.match(Prompt(ids).hashes(BLOCK), eps)
        out.append((time.perf_counter() - t) * 1e6)
    return out


def _serve_index(address: str, tokens_list: list[int], blocks: int, ready: object) -> None:
    index = _filled_index(tokens_list, blocks)
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


def _bytes_per_block(tokens: list[int]) -> float:
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    index = _filled_index(tokens, 50_000)
    used = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    return used / index.size


def measure(blocks_per_endpoint: int = 100_000) -> Costs:
    tok = Tokens(Builtin(), sim=True)
    ids = tok.of(_request(1000, 0), True)
    assert ids
    index = _filled_index(ids, blocks_per_endpoint)
    eps = [f"http://127.0.0.1:{10000 + 2 * e}" for e in range(ENDPOINTS)]
    path = _path_costs(tok, index, eps)

    batch = _stored_batch(ids, 99)
    t = time.perf_counter()
    rounds = 500
    scratch = KvIndex()
    for r in range(rounds):
        scratch.apply_all(f"ep{r}", wire.decode(batch).events)
    ingest = (time.perf_counter() - t) / rounds * 1e6

    with tempfile.TemporaryDirectory() as d:
        address = f"ipc://{os.path.join(d, 'index')}"
        mp = multiprocessing.get_context("spawn")
        ready = mp.Event()
        server = mp.Process(target=_serve_index, args=(address, ids, blocks_per_endpoint, ready), daemon=True)
        server.start()
        if not ready.wait(300):
            server.kill()
            raise RuntimeError("the index process did not start")
        trips = asyncio.run(_round_trips(address, Prompt(ids).hashes(BLOCK)))
        server.join(10)
    return Costs(path, trips, ingest, _bytes_per_block(ids), len(ids))


def p(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q / 100 * len(ordered)))]


def summary(c: Costs) -> list[str]:
    rt = statistics.median(c.round_trip_us)
    path = statistics.median(c.path_us)
    return [
        "| what | p50 | p99 | max |",
        "|---|---|---|---|",
        f"| in process: tokenize + hash + match ({c.prompt_tokens}-token chat, {ENDPOINTS} endpoints) "
        f"| {path:.1f} µs | {p(c.path_us, 99):.1f} µs | {max(c.path_us):.1f} µs |",
        f"| round trip to an index in another process (ipc, msgpack) | {rt:.1f} µs "
        f"| {p(c.round_trip_us, 99):.1f} µs | {max(c.round_trip_us):.1f} µs |",
        "",
        f"- Applying one event batch (a {c.prompt_tokens // BLOCK}-block `BlockStored`) to an index: "
        f"{c.ingest_us:.0f} µs, decode included.",
        f"- Memory: {c.bytes_per_block:.0f} bytes per indexed block "
        "(engine hash, our hash, reference count).",
    ]
