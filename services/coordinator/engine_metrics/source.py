"""Answers ``/metrics/engines`` and ``GetEngineMetrics`` from the newest snapshot.

Only engines still in the routing table count (one that left it is out of the next answer,
not the next round), and only fresh ones (a failing engine's last values are kept for
``engine_metrics_stale_s``). An answer is computed once per (round, table revision, view, role,
format), in a thread, and served from a cache until either changes.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from motor_mesh.coordinator.engine_metrics import exposition
from motor_mesh.coordinator.engine_metrics.aggregate import VIEWS, OutFamily, aggregate
from motor_mesh.coordinator.engine_metrics.collector import endpoints
from motor_mesh.coordinator.engine_metrics.snapshot import Engine, Snapshot
from motor_mesh.coordinator.table import TableState
from motor_mesh.gen.motor.v1 import coordinator_pb2 as pb

FORMATS = ("prometheus", "opentelemetry")
ROLES = ("prefill", "decode", "union")


class EngineMetrics:
    def __init__(
        self, read: Callable[[], Snapshot], table: Callable[[], TableState], *, blocking_read: bool
    ) -> None:
        self._read = read  # the newest snapshot; blocking_read: it reads a file
        self._blocking = blocking_read
        self._table = table
        # Per (round, table revision): the aggregates asked for, and their renderings.
        self._families: dict[tuple[str, str], list[OutFamily]] = {}
        self._bodies: dict[tuple[str, str, str], bytes] = {}
        self._protos: dict[tuple[str, str], list[pb.MetricFamily]] = {}
        self._cache_of: tuple[int, int] = (-1, -1)
        self._lock = asyncio.Lock()

    async def snapshot(self) -> Snapshot:
        return await asyncio.to_thread(self._read) if self._blocking else self._read()

    def engines(self, snap: Snapshot) -> list[Engine]:
        """Every engine of the snapshot that is still in the table."""
        present = endpoints(self._table())
        return [e for e in snap.engines if e.key in present]

    def endpoints(self, snap: Snapshot) -> list[Engine]:
        """Every serving endpoint of the table, with what the snapshot knows of it (an endpoint
        added since the last round: not scraped yet)."""
        known = {e.key: e for e in snap.engines}
        out = []
        for key, (role, rank) in endpoints(self._table()).items():
            e = known.get(key)
            out.append(
                e if e is not None else Engine(key[0], role, key[1], key[2], rank, error="not scraped yet")
            )
        return out

    def families(self, snap: Snapshot, view: str, role: str) -> list[OutFamily]:
        """Blocking (the aggregation is CPU work): call through a thread on a serving loop."""
        now = time.time()
        chosen = [
            e for e in self.engines(snap) if e.fresh(now, snap.stale_s) and (not role or e.role == role)
        ]
        return aggregate(chosen, view if view in VIEWS else "full")

    async def aggregated(self, view: str, role: str) -> tuple[Snapshot, list[OutFamily]]:
        """The newest snapshot and its aggregate for ``view`` (unknown = full) and ``role`` ("" =
        every role), computed once per round and table revision."""
        view = view if view in VIEWS else "full"
        snap = await self.snapshot()
        at = (snap.seq, self._table().revision)
        async with self._lock:  # one computation per key and round, however many ask at once
            self._expire(at)
            families = self._families.get((view, role))
            if families is None:
                families = await asyncio.to_thread(self.families, snap, view, role)
                self._families[(view, role)] = families
        return snap, families

    async def body(self, view: str, role: str, fmt: str) -> tuple[bytes, bytes]:
        """(content type, body). ``view`` unknown = full; ``fmt`` and ``role`` must be known."""
        view = view if view in VIEWS else "full"
        snap, families = await self.aggregated(view, role)
        at = (snap.seq, self._table().revision)
        async with self._lock:
            self._expire(at)
            body = self._bodies.get((view, role, fmt))
            if body is None:
                body = await asyncio.to_thread(self._render, families, snap.at, fmt)
                self._bodies[(view, role, fmt)] = body
        return (exposition.OTLP_CT if fmt == "opentelemetry" else exposition.PROMETHEUS_CT), body

    async def protos(self, view: str, role: str) -> tuple[Snapshot, list[pb.MetricFamily]]:
        """The aggregate as GetEngineMetrics answers it, converted once per round."""
        view = view if view in VIEWS else "full"
        snap, families = await self.aggregated(view, role)
        at = (snap.seq, self._table().revision)
        async with self._lock:
            self._expire(at)
            messages = self._protos.get((view, role))
            if messages is None:
                messages = await asyncio.to_thread(exposition.protos, families)
                self._protos[(view, role)] = messages
        return snap, messages

    def _expire(self, at: tuple[int, int]) -> None:
        if at != self._cache_of:
            self._families, self._bodies, self._protos, self._cache_of = {}, {}, {}, at

    @staticmethod
    def _render(families: list[OutFamily], at: float, fmt: str) -> bytes:
        if fmt == "opentelemetry":
            return exposition.otlp_json(families, at or time.time())
        return exposition.prometheus(families)
