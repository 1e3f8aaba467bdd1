"""Scrapes every engine endpoint of the routing table, every ``engine_metrics_interval_s``.

Off the request path: one supervised task in the management process; the scrapes run
concurrently (at most :data:`CONCURRENCY` at once), each with a deadline, their starts spread
over up to a second, and the parsing runs in one thread: about 1 ms of CPU for a vLLM engine's
60 KB exposition (parse.Parser reads each series once; prometheus_client's parser over the whole
text takes 11 ms, holding the interpreter lock against the loop serving requests; the costs are
in bench/results/engine_metrics.md). An exposition byte-for-byte
the same as the engine's last one (an idle engine) is not parsed again. An engine whose scrape
fails keeps its last values until they are ``engine_metrics_stale_s`` old; one that leaves the
table is forgotten in the same round (and left out of every answer at once, see :mod:`.source`).
Headless endpoints serve no HTTP and are not scraped.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import aiohttp

from motor_mesh.common import log, tasks
from motor_mesh.common.enums import ROLE_NAMES
from motor_mesh.coordinator.engine_metrics import parse
from motor_mesh.coordinator.engine_metrics.snapshot import Engine, Snapshot, SnapshotFile
from motor_mesh.coordinator.table import TableState

CONCURRENCY = 32
MAX_BODY_BYTES = 16 * 1024 * 1024  # a vLLM exposition with many LoRAs and models stays far below
TIMEOUT_CAP_S = 5.0
SPREAD_S = 1.0  # a round's scrapes start spread over this much (at most half the interval)

Key = tuple[int, str, int]


def endpoints(state: TableState) -> dict[Key, tuple[str, int]]:
    """(instance id, host, port) -> (role name, DP rank) of every serving endpoint."""
    out: dict[Key, tuple[str, int]] = {}
    for iid, inst in state.instances.items():
        role = ROLE_NAMES.get(inst.role, str(inst.role))
        dp = max(inst.parallel.dp, 1)
        for ep in inst.endpoints:
            if not ep.headless:
                out[(iid, ep.host, ep.port)] = (role, ep.id % dp)
    return out


class Collector:
    def __init__(
        self,
        table: Callable[[], TableState],
        interval_s: float,
        stale_s: float,
        shared: SnapshotFile | None = None,
        on_round: Callable[[Snapshot, int], None] | None = None,
    ) -> None:
        self._table = table
        self.interval_s = interval_s
        self.stale_s = stale_s
        self._shared = shared  # with inference workers: where they read each round
        self._on_round = on_round  # (snapshot, failed scrapes) for the Coordinator's own metrics
        self.snapshot = Snapshot(stale_s=stale_s)
        self._engines: dict[Key, Engine] = {}
        self._prev_at: dict[Key, float] = {}  # monotonic time of each engine's last good scrape
        self._bodies: dict[Key, bytes] = {}  # each engine's last exposition, parsed into .families
        # One parse at a time: never more than one thread taking the interpreter from the loop.
        self._parser = ThreadPoolExecutor(1, thread_name_prefix="engine-metrics-parse")
        self._limit = asyncio.Semaphore(CONCURRENCY)
        self._session: aiohttp.ClientSession | None = None
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=CONCURRENCY, limit_per_host=0),
            # The engines' metrics are plain text; compressed answers are not asked for.
            auto_decompress=False,
            headers={"Accept": "text/plain", "Accept-Encoding": "identity"},
        )
        self._task = tasks.spawn("engine_metrics", self._run)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        if self._session is not None:
            await self._session.close()
        self._parser.shutdown(wait=False, cancel_futures=True)

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            began = loop.time()
            await self.collect()
            await asyncio.sleep(max(0.0, self.interval_s - (loop.time() - began)))

    async def collect(self) -> Snapshot:
        """One round: scrape every endpoint of the table now, publish the snapshot."""
        wanted = endpoints(self._table())
        for key in list(self._engines):
            if key not in wanted:
                del self._engines[key]
                self._prev_at.pop(key, None)
                self._bodies.pop(key, None)
        for key, (role, rank) in wanted.items():
            e = self._engines.get(key)
            if e is None or e.role != role or e.dp_rank != rank:
                self._engines[key] = Engine(key[0], role, key[1], key[2], rank)
        keys = list(self._engines)
        # Spread over the round, not all at once: a burst of 64 answers (4 MB) and their parses
        # at one instant stalls the loop serving requests for as long as they take, which showed
        # up as p99 latency (bench/results/engine_metrics.md); one at a time it never waits long.
        spread = min(self.interval_s / 2, SPREAD_S)
        step = spread / len(keys) if keys else 0.0
        results = await asyncio.gather(
            *(self._scrape(self._engines[k], i * step) for i, k in enumerate(keys))
        )
        failed = 0
        for key, engine in zip(keys, results, strict=True):
            if key in self._engines:  # not forgotten meanwhile
                self._engines[key] = engine
                failed += 1 if engine.error else 0
        snap = Snapshot(self.snapshot.seq + 1, time.time(), self.stale_s, tuple(self._engines.values()))
        if self._shared is not None:
            await asyncio.to_thread(self._shared.write, snap)
        self.snapshot = snap
        if self._on_round is not None:
            self._on_round(snap, failed)
        return snap

    async def _scrape(self, e: Engine, after_s: float = 0.0) -> Engine:
        assert self._session is not None
        if after_s > 0:
            await asyncio.sleep(after_s)
        timeout = min(self.interval_s, TIMEOUT_CAP_S) or TIMEOUT_CAP_S
        url = f"http://{_host(e.host)}:{e.port}/metrics"
        try:
            async with self._limit:
                async with self._session.get(url, timeout=aiohttp.ClientTimeout(total=timeout)) as r:
                    if r.status != 200:
                        return _failed(e, f"HTTP {r.status}")
                    body = await _whole_body(r)
            if body is None:
                return _failed(e, f"answer larger than {MAX_BODY_BYTES} bytes")
            if body == self._bodies.get(e.key):
                families = e.families  # nothing changed since the last scrape
            else:
                text = body.decode("utf-8", "replace")
                families = await asyncio.get_running_loop().run_in_executor(self._parser, parse.parse, text)
                self._bodies[e.key] = body
        except TimeoutError:
            return _failed(e, f"no answer within {timeout:g} s")
        except aiohttp.ClientError as exc:
            return _failed(e, _why(exc))
        except ValueError as exc:
            return _failed(e, f"not a Prometheus exposition: {exc}"[:200])
        now_mono = time.monotonic()
        before = self._prev_at.get(e.key)
        self._prev_at[e.key] = now_mono
        elapsed = now_mono - before if before is not None else 0.0
        rates = parse.rates(families, e.families if before is not None else (), elapsed)
        if e.error or e.ok_at == 0:
            log.event("engine_metrics_scraped", instance_id=e.instance_id, endpoint=f"{e.host}:{e.port}")
        return Engine(e.instance_id, e.role, e.host, e.port, e.dp_rank, time.time(), "", families, rates)


async def _whole_body(r: aiohttp.ClientResponse) -> bytes | None:
    """The whole answer; None past MAX_BODY_BYTES. (``content.read(n)`` would return what has
    arrived so far, a part of the answer.)"""
    chunks, size = [], 0
    async for chunk in r.content.iter_chunked(1 << 16):
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            return None
        chunks.append(chunk)
    return b"".join(chunks)


def _failed(e: Engine, why: str) -> Engine:
    if not e.error:  # one line when an engine starts failing, not one per round
        log.warn("engine_metrics_failed", instance_id=e.instance_id, endpoint=f"{e.host}:{e.port}", error=why)
    return Engine(e.instance_id, e.role, e.host, e.port, e.dp_rank, e.ok_at, why, e.families, e.rates)


def _why(exc: BaseException) -> str:
    return (str(exc) or type(exc).__name__)[:200]


def _host(host: str) -> str:
    return f"[{host}]" if ":" in host else host
