"""The engines' KV cache events into an index: one subscription per endpoint.

Exactly one process of a Coordinator runs a feed: the one that serves inference with
``workers = 1``, else the management process, which mirrors the index into memory its inference
workers map (:mod:`.shared`). It follows only the engines of the roles a kv_aware policy
chooses among: the others' events would be work for nothing.

Level-triggered: every ``RECONCILE_S`` the routing view is compared with the subscriptions. An
endpoint that left the table, or whose engine process changed (a new pid after a relaunch), or
whose event ports changed, loses its index entries and its subscription; a new one gets a
subscription that first replays what the engine still buffers. With workers, an endpoint whose
shared table is more than half full gets a bigger one (:mod:`.shared`), made off the event loop
and filled from the index.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass

import zmq.asyncio

from motor_mesh.common import log, tasks
from motor_mesh.common.config import CoordinatorConfig
from motor_mesh.coordinator.kv.index import KvIndex
from motor_mesh.coordinator.kv.metrics import KvMetrics
from motor_mesh.coordinator.kv.shared import SharedWriter, Table
from motor_mesh.coordinator.kv.subscriber import Subscription
from motor_mesh.coordinator.kv.wire import Batch
from motor_mesh.coordinator.routes import RoutingView

RECONCILE_S = 0.25
GROW_RETRY_S = 10.0  # after a bigger table could not be made (no room on the file system)


@dataclass(frozen=True)
class _Spec:
    host: str
    port: int
    replay_port: int
    pid: int


@dataclass
class _Sub:
    spec: _Spec
    task: asyncio.Task[None]


class KvFeed:
    """Create inside the running loop; :meth:`start` once, :meth:`stop` at the end."""

    def __init__(
        self,
        cfg: CoordinatorConfig,
        view: Callable[[], RoutingView],
        metrics: KvMetrics,
        roles: set[int],
        writer: SharedWriter | None = None,
    ) -> None:
        self._view = view
        self.metrics = metrics
        self.roles = roles
        self.writer = writer
        self.index = KvIndex(cfg.kv_index_max_blocks, writer)
        self._subs: dict[str, _Sub] = {}  # by endpoint (its base URL: the index's key)
        self._grows: dict[str, asyncio.Task[None]] = {}  # shared tables being replaced by bigger ones
        self._ctx: zmq.asyncio.Context | None = None
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        if self.writer is not None:
            await asyncio.to_thread(self.writer.open)
        self._ctx = zmq.asyncio.Context()
        self._task = tasks.spawn("kv_reconcile", self._reconcile_loop)

    async def stop(self) -> None:
        await tasks.cancel_quietly(self._task)
        for sub in self._subs.values():
            await tasks.cancel_quietly(sub.task)
        self._subs.clear()
        for grow in list(self._grows.values()):
            await tasks.cancel_quietly(grow)
        if self._ctx is not None:
            self._ctx.destroy(linger=0)
            self._ctx = None
        if self.writer is not None:
            await asyncio.to_thread(self.writer.close)

    async def _reconcile_loop(self) -> None:
        last: RoutingView | None = None
        while True:
            view = self._view()
            if view is not last:
                self.reconcile(view)
                last = view
            self.metrics.index_blocks.set(self.index.size)
            self._grow_crowded()
            await asyncio.sleep(RECONCILE_S)

    def reconcile(self, view: RoutingView) -> None:
        want: dict[str, _Spec] = {}
        for t in view.targets:
            if t.role in self.roles:
                for ep in t.endpoints:
                    if ep.kv_port:
                        want[ep.base] = _Spec(ep.host, ep.kv_port, ep.kv_replay_port, ep.pid)
        for key, sub in list(self._subs.items()):
            spec = want.get(key)
            if spec != sub.spec:
                sub.task.cancel()
                del self._subs[key]
                self._forget(key)
                # A new pid (or new ports) is another engine process, its cache empty.
                reason = "left" if spec is None else "restart"
                self.metrics.reset(reason)
                log.event("kv_unsubscribed", endpoint=key, pid=sub.spec.pid, reason=reason)
        for key, spec in want.items():
            if key not in self._subs:
                self._subscribe(key, spec)
        self.metrics.subscriptions.set(len(self._subs))

    def _forget(self, key: str) -> None:
        self.index.drop(key)
        if self.writer is not None:
            table = self.writer.uninstall(key)
            if table is not None:
                tasks.start(f"kv_unlink {key}", asyncio.to_thread(SharedWriter.unlink, table))

    def _subscribe(self, key: str, spec: _Spec) -> None:
        assert self._ctx is not None
        sub: _Sub | None = None  # set below, before the task first runs

        def apply(k: object, batch: Batch) -> None:
            # A cancelled subscription's last batch must not touch its successor's entries.
            if self._subs.get(key) is sub:
                for event in batch.events:
                    self.index.apply(key, event)
                if self.writer is not None and self.writer.crowded:
                    self._grow_crowded()

        def reset(k: object, reason: str) -> None:
            if self._subs.get(key) is sub:
                self.index.drop(key)  # the subscription logged why (event=kv_events_reset)
                self.metrics.reset(reason)

        subscription = Subscription(
            self._ctx, key, spec.host, spec.port, spec.replay_port, apply, reset, self.metrics
        )

        async def run() -> None:
            if self.writer is not None and self._subs.get(key) is sub:
                await self._share(key, sub)
            await subscription.run()

        task = tasks.spawn(f"kv_events {key}", run)
        sub = _Sub(spec, task)
        self._subs[key] = sub
        log.event("kv_subscribed", endpoint=key, events=f"{spec.host}:{spec.port}", pid=spec.pid)

    async def _share(self, key: str, sub: _Sub | None) -> None:
        """A table the workers read for ``key``, before its first event (files: off the loop)."""
        assert self.writer is not None
        writer = self.writer
        creating = asyncio.ensure_future(asyncio.to_thread(writer.create, key))
        try:
            table = await asyncio.shield(creating)
        except OSError as exc:  # no room: the workers route this endpoint by load
            log.warn("kv_shared_table_failed", endpoint=key, error=str(exc))
            return
        except asyncio.CancelledError:
            creating.add_done_callback(_discard)  # the file being made is nobody's
            raise
        spare: Table | None = table
        if self._subs.get(key) is sub:  # still wanted
            # The index and the new, empty table start equal (after a failed subscription
            # restarts, the index may hold entries from before); the table this one replaces,
            # if any, goes instead.
            self.index.drop(key)
            spare = writer.install(key, table)
        if spare is not None:
            await asyncio.to_thread(SharedWriter.unlink, spare)

    def _grow_crowded(self) -> None:
        if self.writer is None:
            return
        for key in self.writer.crowded:
            if key not in self._grows and isinstance(key, str):
                self._grows[key] = tasks.start(f"kv_grow {key}", self._grow(key))

    async def _grow(self, key: str) -> None:
        """Replace ``key``'s crowded table by a bigger one holding what the index says."""
        assert self.writer is not None
        writer = self.writer
        try:
            old, sub = writer.table(key), self._subs.get(key)
            if old is None or sub is None:
                return
            capacity = writer.grown(self.index.endpoint_blocks(key))
            creating = asyncio.ensure_future(asyncio.to_thread(writer.create, key, capacity))
            try:
                table = await asyncio.shield(creating)
            except OSError as exc:  # no room: the old table skips adds past its room
                log.warn("kv_shared_table_failed", endpoint=key, capacity=capacity, error=str(exc))
                await asyncio.sleep(GROW_RETRY_S)
                return
            except asyncio.CancelledError:
                creating.add_done_callback(_discard)
                raise
            spare: Table | None = table
            if self._subs.get(key) is sub and writer.table(key) is old:  # nothing replaced it since
                spare = writer.replace(key, table, self.index.blocks(key))
                log.event("kv_shared_table_grown", endpoint=key, capacity=table.capacity)
            if spare is not None:
                await asyncio.to_thread(SharedWriter.unlink, spare)
        finally:
            self._grows.pop(key, None)


def _discard(created: asyncio.Future[Table]) -> None:
    if not created.cancelled() and created.exception() is None:
        tasks.start("kv_unlink", asyncio.to_thread(SharedWriter.unlink, created.result()))
