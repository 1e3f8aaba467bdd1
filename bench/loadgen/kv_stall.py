"""How long kv_aware's request path holds the event loop, with a real tokenizer: in process.

An inference worker serves every request on one asyncio loop; whatever kv_aware does without
awaiting (render the chat template, encode what the memo does not hold, hash the blocks, look
them up) delays every other request that worker is serving. The path here is the one
``KvRouting.prompt`` and ``KvAware`` take: ``await Tokens.prompt(body, chat, held)`` (a long
text encoded in a thread, a chunk at a time while some endpoint holds all of it so far),
``prompt.hashes(16)``, then the lookup, ``KvIndex.holder`` over two endpoints. A ticker task
on the same loop wakes on every iteration (``await asyncio.sleep(0)``) and keeps the longest
time between two of its wake-ups: the longest the loop was held.

A gap is also split by what the loop's thread did meanwhile (:class:`Gap`): ran (the path's
code on the loop), waited for a CPU (the kernel's count: on a busy machine, other processes'
turns; the ticker, never sleeping, is always in the queue), or was blocked (waiting for the GIL
while the encoding thread runs Python). The stall kv_aware itself causes is the gap less the
wait for a CPU.

After each request the endpoint it went to stores the blocks of the whole prompt
(``BlockStored`` into the index, as the management process applies the engines' events), so
later turns find their history cached. That work is the engine's and the management
process's, not the worker's: the ticker does not count it.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.loadgen import kv_workload
from bench.loadgen.harness import percentile, wait_quiet
from motor_mesh.common.tokenizer import HfTokenizer
from motor_mesh.coordinator.kv import wire
from motor_mesh.coordinator.kv.hashing import chain
from motor_mesh.coordinator.kv.index import KvIndex
from motor_mesh.coordinator.kv.prompt import Prompt, Tokens

BLOCK = 16
# What the engine "answered" each turn: a fixed text (the in-process path has no engine).
ANSWER = "Here is what you asked for, in short: it depends on the load, the cache and the model."


@dataclass(frozen=True)
class Gap:
    """One gap between two wake-ups of the ticker (seconds): its wall time, and of it the time
    the loop's thread waited for a CPU (runnable, not running: the kernel's ``run_delay``), and
    the time it ran (its CPU time). The rest it was blocked: on this loop, waiting for the GIL
    (the encoding thread's Python part), as ``sleep(0)`` never waits for I/O."""

    wall: float = 0.0
    waiting_for_cpu: float = 0.0
    running: float = 0.0

    @property
    def held(self) -> float:
        """What the loop would have been held with a CPU free: the wall time less the wait for one."""
        return self.wall - self.waiting_for_cpu

    @property
    def blocked(self) -> float:
        return max(0.0, self.wall - self.waiting_for_cpu - self.running)


@dataclass
class Stall:
    """One workload: each request's path time, and the ticker's longest gaps (seconds)."""

    paths: list[float] = field(default_factory=list)
    longest: Gap = field(default_factory=Gap)  # the longest wall time
    longest_held: Gap = field(default_factory=Gap)  # the longest with the wait for a CPU taken out
    ticks: int = 0
    tokens: list[int] = field(default_factory=list)  # each request's prompt tokens
    background_pct: float = 0.0  # other processes' CPU (% of a core) the second before it started

    @property
    def p99(self) -> float:
        return percentile(sorted(self.paths), 99)


@dataclass
class _Endpoint:
    """What the index reads of an endpoint (routes.Upstream's ``base`` and ``down``)."""

    base: str
    down: bool = False


class _Ticker:
    """The longest gaps between two wake-ups of a task that yields on every loop iteration;
    gaps that span :meth:`pause` (the bench's own bookkeeping) are not counted.

    On a busy machine the ticker's thread (always runnable: it never sleeps) is taken off the
    CPU for other processes' turns; the kernel counts that wait (``/proc/<tid>/schedstat``, its
    second field), so a gap can be split into the wait for a CPU and the rest."""

    def __init__(self) -> None:
        self.longest = Gap()
        self.longest_held = Gap()
        self.ticks = 0
        self._epoch = 0
        self._stop = False

    def pause(self) -> None:
        self._epoch += 1

    async def run(self) -> None:
        fd = os.open(f"/proc/self/task/{threading.get_native_id()}/schedstat", os.O_RDONLY)
        try:
            await self._run(lambda: int(os.pread(fd, 64, 0).split()[1]) / 1e9)
        finally:
            os.close(fd)

    async def _run(self, run_delay: Callable[[], float]) -> None:
        clock, cpu = time.perf_counter, time.thread_time
        last, last_wait, last_cpu, epoch = clock(), run_delay(), cpu(), self._epoch
        while not self._stop:
            await asyncio.sleep(0)
            now, wait, ran = clock(), run_delay(), cpu()
            if epoch == self._epoch:
                gap = Gap(now - last, wait - last_wait, ran - last_cpu)
                if gap.wall > self.longest.wall:
                    self.longest = gap
                if gap.held > self.longest_held.held:
                    self.longest_held = gap
                self.ticks += 1
            last, last_wait, last_cpu, epoch = now, wait, ran, self._epoch

    def stop(self) -> None:
        self._stop = True


def chat_bodies(convs: list[kv_workload.Conversation], order: list[int]) -> list[dict[str, Any]]:
    """The chat workload's request bodies, each turn's history with :data:`ANSWER` answers."""
    turns = dict.fromkeys(range(len(convs)), 0)
    bodies = []
    for c in order:
        conv = convs[c]
        conv.answers = [ANSWER] * turns[c]
        bodies.append({"messages": conv.messages(turns[c]), "max_tokens": 16})
        turns[c] += 1
    return bodies


def _held(index: KvIndex) -> Callable[[Prompt], bool]:
    """What the request path asks after each chunk of a long prompt (KvRouting._held): whether
    some endpoint holds every full block so far."""

    def held(prompt: Prompt) -> bool:
        hashes = prompt.hashes(BLOCK)
        return bool(hashes) and any(run == len(hashes) for run in index.match(hashes).values())

    return held


async def _measure(tokens: Tokens, bodies: list[dict[str, Any]]) -> Stall:
    index = KvIndex()
    held = _held(index)
    eps = [_Endpoint("http://127.0.0.1:10000"), _Endpoint("http://127.0.0.1:10002")]
    out = Stall()
    # Other users' jobs take CPUs from the ticker: start in a quiet second if one comes.
    out.background_pct = await wait_quiet([], max_wait_s=60.0)
    # The loop's thread pool started, as a serving worker's is (it loaded its tokenizer there):
    # starting a thread waits for it on the loop, once per process, not per request.
    await asyncio.to_thread(int)
    ticker = _Ticker()
    task = asyncio.create_task(ticker.run())
    await asyncio.sleep(0)
    for i, body in enumerate(bodies):
        t = time.perf_counter()
        prompt = await tokens.prompt(body, True, held)
        assert prompt is not None
        prompt.hashes(BLOCK)
        _cached, where = index.holder(prompt, eps)  # type: ignore[arg-type]
        out.paths.append(time.perf_counter() - t)
        # Let the ticker see the path's last synchronous stretch, then, out of its sight, the
        # engine's part: the whole prompt encoded (the path may have stopped early, estimating
        # the rest) and its blocks stored.
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        ticker.pause()
        ids = tokens.tokenizer.encode(tokens.chat_text(body, body["messages"]) or "", special=False)
        out.tokens.append(len(ids))
        hashes: list[wire.BlockHash] = list(chain(ids, BLOCK))
        ep = where if where is not None else eps[i % len(eps)]
        index.apply(ep.base, wire.Stored(hashes, None, ids[: len(hashes) * BLOCK], BLOCK))
        await asyncio.sleep(0)
    ticker.stop()
    await task
    out.longest, out.longest_held, out.ticks = ticker.longest, ticker.longest_held, ticker.ticks
    return out


def measure(directory: str, workloads: dict[str, list[dict[str, Any]]]) -> dict[str, Stall]:
    """Each workload's bodies through a fresh ``Tokens`` (an empty memo, as a worker starts)."""
    hf = HfTokenizer(str(Path(directory) / "tokenizer.json"))
    out = {}
    for name, bodies in workloads.items():
        tokens = Tokens(hf, sim=False)
        out[name] = asyncio.run(_measure(tokens, bodies))
    return out
