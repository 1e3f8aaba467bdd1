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

Never stale (``coordinator.kv_events_stale_s``, S; 0 turns it off). An engine whose events stop
while it still serves (its publisher wedged, its ports cut off) would otherwise be credited
forever with the blocks it held then. Checked on the same beat, from per-endpoint times:

- once an endpoint has been silent (no message published or replayed) for S - P, where P =
  min(PROBE_S, S / 2), its subscription asks the replay socket for what followed the last batch
  (:meth:`.Subscription.probe`). An idle engine answers with nothing, one whose publish port
  alone is cut with the batches missed (applied: the endpoint is heard from again); a wedged or
  unreachable one does not answer within P. Asked again every S - P while it stays silent;
- it is **stale** once silent for S, its last probe unanswered (or it has no replay port), and it
  served in that silence. "Served" is known from the legs in flight on its instance, seen at
  each beat (this process's own, or every process's when the feed is given ``legs``), and from
  :meth:`KvFeed.prefill_sent` when the router calls it. Seeing a leg proves it served; not seeing
  one proves nothing (a short leg falls between two looks), so without the router's calls an
  endpoint whose replay does not answer is taken to have served: a replay socket that does not
  answer is itself a sign the events are not getting through. Once the router has called
  :meth:`KvFeed.prefill_sent` it is taken to tell of every prefill, and an endpoint it told of
  none since the engine was last heard from is idle: its cache has not changed, the index holds.
  Without a replay port an endpoint is stale only when it was seen serving: with neither a
  replay port nor a sign of serving it is never marked stale;
- a stale endpoint's blocks are dropped from the index (and so from the workers' shared tables):
  kv_aware weighs it by load alone. Logged once (``kv_events_stale``, a warning), counted in
  ``motor_coordinator_kv_events_stale_endpoints`` and as a reset of reason "stale";
- it rejoins with the first batch or answer that arrives (``kv_events_resumed``). Its subscription
  then catches up from the start of the engine's buffer, as a new one does, so its blocks are
  credited again as far as the buffer reaches back; a stored chain whose parent was cached before
  that is not credited (the index counts it an orphan): the index claims less than the engine
  holds, never more.

A stale verdict needs no timer of its own: the probes are one-shot tasks, their outcome a time
the next beat compares. (An engine serving only whole-prompt cache hits publishes nothing: with
no replay port to ask, it can be found stale while healthy, which costs cache hits until its
next batch, not a wrong answer.)
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable, Mapping
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
PROBE_S = 2.0  # the longest a silent engine's replay socket is given to answer a probe


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
    events: Subscription[str]
    # Monotonic times, for the staleness check (see the module's doc).
    served_at: float = -math.inf  # its engine last seen serving
    probed_at: float = -math.inf  # the last probe sent
    unanswered_at: float = -math.inf  # the last probe that got no answer was sent
    stale_at: float | None = None  # found stale; None: it is not
    probe: asyncio.Task[None] | None = None


class KvFeed:
    """Create inside the running loop; :meth:`start` once, :meth:`stop` at the end."""

    def __init__(
        self,
        cfg: CoordinatorConfig,
        view: Callable[[], RoutingView],
        metrics: KvMetrics,
        roles: set[int],
        writer: SharedWriter | None = None,
        legs: Callable[[], Mapping[int, int]] | None = None,
    ) -> None:
        """``legs``: legs in flight per instance id, every process's (the management process
        knows its workers'); without it the view's own targets are looked at, this process's
        legs (the router's, when the feed runs in the inference process)."""
        self._view = view
        self.metrics = metrics
        self.roles = roles
        self.writer = writer
        self.index = KvIndex(cfg.kv_index_max_blocks, writer)
        self._subs: dict[str, _Sub] = {}  # by endpoint (its base URL: the index's key)
        self._grows: dict[str, asyncio.Task[None]] = {}  # shared tables being replaced by bigger ones
        self._ctx: zmq.asyncio.Context | None = None
        self._task: asyncio.Task[None] | None = None
        self.stale_s = cfg.kv_events_stale_s
        self.probe_s = min(PROBE_S, self.stale_s / 2)
        self._legs = legs
        self._told = False  # prefill_sent() was called: the router tells of every prefill

    def prefill_sent(self, key: str) -> None:
        """The router sent a prefill (or a whole request) to endpoint ``key`` (its base URL).
        From the first call on, the feed counts on being told of every one (see the module's
        doc)."""
        self._told = True
        sub = self._subs.get(key)
        if sub is not None:
            sub.served_at = time.monotonic()

    async def start(self) -> None:
        if self.writer is not None:
            await asyncio.to_thread(self.writer.open)
        self._ctx = zmq.asyncio.Context()
        self._task = tasks.spawn("kv_reconcile", self._reconcile_loop)

    async def stop(self) -> None:
        await tasks.cancel_quietly(self._task)
        for sub in self._subs.values():
            await tasks.cancel_quietly(sub.task)
            await tasks.cancel_quietly(sub.probe)
        self._subs.clear()
        self.metrics.stale_endpoints.set(0)
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
            if self.stale_s > 0:
                self._check_stale(view, time.monotonic())
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
                if sub.probe is not None:
                    sub.probe.cancel()
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
        self._count_stale()

    # ---- never stale (see the module's doc) -------------------------------------------------------

    def _check_stale(self, view: RoutingView, now: float) -> None:
        """One beat of the staleness check: what the engines are seen serving, the probes to
        send, the verdicts."""
        self._look_for_legs(view, now)
        again = self.stale_s - self.probe_s  # silence before a probe, and between two
        for key, sub in self._subs.items():
            heard = sub.events.heard_at
            if sub.stale_at is not None:
                if heard > sub.stale_at:  # a probe's empty answer (a batch resumed it already)
                    self._resume(key, sub, now)
                    continue
            elif self._stale(sub, now):
                self._mark_stale(key, sub, now)
            if (
                sub.probe is None
                and sub.spec.replay_port
                and now - heard >= again
                and now - sub.probed_at >= again
            ):
                sub.probed_at = now
                sub.probe = tasks.start(f"kv_probe {key}", self._probe(sub, now))

    def _stale(self, sub: _Sub, now: float) -> bool:
        heard = sub.events.heard_at
        if now - heard < self.stale_s:
            return False
        served = sub.served_at > heard
        if not sub.spec.replay_port:
            return served
        if sub.unanswered_at <= heard:  # no probe since it was last heard from went unanswered
            return False
        return served or not self._told

    def _look_for_legs(self, view: RoutingView, now: float) -> None:
        legs = self._legs() if self._legs is not None else None
        for t in view.targets:
            if t.role in self.roles and (t.legs if legs is None else legs.get(t.id)):
                # Per instance: with several endpoints, each counts as serving.
                for ep in t.endpoints:
                    sub = self._subs.get(ep.base)
                    if sub is not None:
                        sub.served_at = now

    async def _probe(self, sub: _Sub, sent: float) -> None:
        try:
            if await sub.events.probe(self.probe_s) is False:
                sub.unanswered_at = sent
        finally:
            sub.probe = None

    def _mark_stale(self, key: str, sub: _Sub, now: float) -> None:
        sub.stale_at = now
        self.index.drop(key)  # the mirror clears the workers' table too
        # When it answers again, its catch-up starts from the engine's buffer's first batch.
        sub.events.forget()
        self.metrics.reset("stale")
        self._count_stale()
        log.warn(
            "kv_events_stale",
            endpoint=key,
            silent_s=round(now - sub.events.heard_at, 3),
            replay="unanswered" if sub.spec.replay_port else "none",
            served=sub.served_at > sub.events.heard_at,
        )

    def _resume(self, key: str, sub: _Sub, now: float) -> None:
        if sub.stale_at is None:
            return
        stale_s = now - sub.stale_at
        sub.stale_at = None
        self._count_stale()
        log.event("kv_events_resumed", endpoint=key, stale_s=round(stale_s, 3))

    def _count_stale(self) -> None:
        self.metrics.stale_endpoints.set(sum(sub.stale_at is not None for sub in self._subs.values()))

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
            current = self._subs.get(key)
            if current is not None and current is sub:
                if current.stale_at is not None:  # its events flow again: what they store counts
                    self._resume(key, current, time.monotonic())
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
        sub = _Sub(spec, task, subscription)
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
