"""Level-triggered reconcile loops, after Kubernetes' controller-runtime.

A :class:`Reconciler` owns a :class:`WorkQueue` and a few workers. Event handlers only
``enqueue(key)``; a worker takes the key and calls ``reconcile(key)``, which compares what
should be with what is observed now and acts on the difference. The result drives the queue
(controller-runtime's semantics):

- :data:`REQUEUE_NOW` (``Result(requeue_now=True)``): look again as soon as a worker is free
  (success: the key's backoff is forgotten);
- a :class:`Result` with ``requeue_after`` > 0: look again after that long (success: the key's
  backoff is forgotten). ``requeue_after`` 0, negative or None asks for no timed look: 0 is
  not "now", which must be said with ``requeue_now``;
- ``Result(requeue=True)``, a :class:`Retry`, or any other exception: look again after the
  key's backoff, which grows with each failure (an unexpected exception is logged with its
  traceback: it is a bug, but the loop survives it);
- a :class:`Terminal` error: logged and counted, never retried;
- anything else: done, until an event or the periodic resync names the key again.

The resync enqueues every key ``keys()`` lists, so a lost event is corrected within one period.
Each loop keeps plain counters and a duration histogram (:class:`Stats`) that the Controller's
``/metrics`` reads at scrape time (controller/metrics.py) and :meth:`Reconciler.report` logs.
"""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import Awaitable, Callable, Hashable, Iterable
from dataclasses import dataclass
from typing import Generic, TypeVar

from motor_mesh.common import log
from motor_mesh.common.latency import LatencyHistogram
from motor_mesh.common.retry import Backoff
from motor_mesh.common.tasks import cancelled_from_outside, spawn
from motor_mesh.controller.reconcile.workqueue import ShutDown, WorkQueue
from motor_mesh.controller.store.db import StateWriteError

K = TypeVar("K", bound=Hashable)

# Reconcile durations, from a decision on memory alone (well under 1 ms) to one waiting on
# NodeManager and Coordinator calls (seconds; a hung peer up to its deadlines).
DURATION_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
# Why a reconcile failed: Retry or StateWriteError (expected, retried), an unexpected exception
# (a bug, retried), Terminal (not retried).
FAILURE_KINDS = ("retry", "exception", "terminal")


@dataclass(frozen=True)
class Result:
    """What a successful reconcile asks of the queue (the module docstring says how each is
    taken): ``requeue_now`` wins over ``requeue_after``, which wins over ``requeue``."""

    requeue: bool = False
    requeue_after: float | None = None
    requeue_now: bool = False


DONE = Result()
REQUEUE_NOW = Result(requeue_now=True)


class Retry(Exception):
    """An expected, transient failure (a peer unreachable): one warning line, then the key is
    retried with its backoff."""


class Terminal(Exception):
    """A failure that retrying cannot fix: logged, counted, and the key is not retried."""


class Stats:
    """Counters for one reconciler since start, plus the durations of the current window."""

    def __init__(self) -> None:
        self.reconciles = 0
        self.failures: collections.Counter[str] = collections.Counter()  # by FAILURE_KINDS
        self.duration = LatencyHistogram(DURATION_BUCKETS)  # since start, for /metrics
        self.durations: list[float] = []

    @property
    def errors(self) -> int:
        """Failed reconciles that are retried."""
        return self.failures["retry"] + self.failures["exception"]

    @property
    def terminal(self) -> int:
        return self.failures["terminal"]

    def window(self) -> tuple[list[float], float]:
        """Sorted durations since the last call, and their sum; starts a new window."""
        durations = sorted(self.durations)
        self.durations = []
        return durations, sum(durations)


class Reconciler(Generic[K]):
    def __init__(
        self,
        name: str,
        reconcile: Callable[[K], Awaitable[Result | None]],
        *,
        workers: int = 1,
        backoff: Backoff,
        resync_s: float | None = None,
        keys: Callable[[], Iterable[K]] | None = None,
    ) -> None:
        self.name = name
        self.queue: WorkQueue[K] = WorkQueue(backoff)
        self.stats = Stats()
        self._reconcile = reconcile
        self._workers = workers
        self._resync_s = resync_s
        self._keys = keys
        self._tasks: list[asyncio.Task[None]] = []
        self._running: dict[K, float] = {}  # key -> monotonic start, for the oldest in flight

    def enqueue(self, key: K) -> None:
        self.queue.add(key)

    def start(self) -> None:
        self._tasks = [spawn(f"{self.name}-worker-{i}", self._work) for i in range(self._workers)]
        if self._resync_s and self._keys is not None:
            self._tasks.append(spawn(f"{self.name}-resync", self._resync))
        self.resync()

    async def stop(self) -> None:
        self.queue.shut_down()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []

    def resync(self) -> None:
        """Enqueue every key there is."""
        if self._keys is not None:
            for key in list(self._keys()):
                self.queue.add(key)

    async def _resync(self) -> None:
        assert self._resync_s
        while True:
            await asyncio.sleep(self._resync_s)
            self.resync()

    async def _work(self) -> None:
        while True:
            try:
                key = await self.queue.get()
            except ShutDown:
                return
            await self._process(key)
            # A reconcile that never waits on I/O would otherwise let one worker run a whole
            # resync's worth of keys in one go while heartbeats wait behind it.
            await asyncio.sleep(0)

    async def _process(self, key: K) -> None:
        queue, stats = self.queue, self.stats
        start = time.monotonic()
        self._running[key] = start
        try:
            result = await self._reconcile(key) or DONE
        except Terminal as exc:
            stats.failures["terminal"] += 1
            queue.forget(key)
            log.error("reconcile_terminal", reconciler=self.name, item=key, reason=str(exc))
        except (Retry, StateWriteError) as exc:  # expected: one line, not a traceback per attempt
            stats.failures["retry"] += 1
            delay = queue.add_rate_limited(key)
            log.warn(
                "reconcile_retry",
                reconciler=self.name,
                item=key,
                reason=str(exc),
                attempt=queue.failures(key),
                in_s=round(delay, 3),
            )
        except asyncio.CancelledError:
            if cancelled_from_outside():
                raise
            # Not our cancellation: grpc.aio raises it for a call whose channel was closed.
            self._failed(key, "cancelled")
        except Exception:
            self._failed(key, "exception")
        else:
            if result.requeue_now:
                queue.forget(key)
                queue.add(key)
            elif result.requeue_after is not None and result.requeue_after > 0:
                queue.forget(key)
                queue.add_after(key, result.requeue_after)
            elif result.requeue:
                queue.add_rate_limited(key)
            else:
                queue.forget(key)
        finally:
            del self._running[key]
            queue.done(key)
            took = time.monotonic() - start
            stats.reconciles += 1
            stats.durations.append(took)
            stats.duration.observe(took)

    def _failed(self, key: K, kind: str) -> None:
        self.stats.failures["exception"] += 1
        delay = self.queue.add_rate_limited(key)
        log.exception(
            "reconcile_failed",
            reconciler=self.name,
            item=key,
            kind=kind,
            attempt=self.queue.failures(key),
            in_s=round(delay, 3),
        )

    def longest_running_s(self) -> float:
        """How long the oldest reconcile in flight has been running; 0 when none is."""
        now = time.monotonic()
        return now - min(self._running.values(), default=now)

    def report(self) -> None:
        """One ``reconcile_stats`` line for the window since the last report, when it saw work."""
        durations, total = self.stats.window()
        if not durations and not len(self.queue):
            return
        q, s = self.queue, self.stats
        log.event(
            "reconcile_stats",
            reconciler=self.name,
            depth=len(q),
            processing=q.processing,
            adds=q.adds,
            retries=q.retries,
            reconciles=s.reconciles,
            errors=s.errors,
            terminal=s.terminal,
            window_reconciles=len(durations),
            p50_ms=round(durations[len(durations) // 2] * 1000, 3) if durations else 0,
            max_ms=round(durations[-1] * 1000, 3) if durations else 0,
            busy_ms=round(total * 1000, 3),
            oldest_running_s=round(self.longest_running_s(), 3),
        )
