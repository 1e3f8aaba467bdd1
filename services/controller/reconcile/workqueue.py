"""A work queue of keys, after Kubernetes' client-go workqueue.

Events do not carry work; they only say *which* thing to look at again (an instance id, a
pending job, a Coordinator address). The queue guarantees:

- **de-duplication**: a key already waiting is not queued twice, however many events name it;
- **one worker per key**: a key being processed is not handed out again; if it is added
  meanwhile, it is queued once more when the worker calls :meth:`done`, so the newest state is
  always looked at after the last change;
- **delays**: :meth:`add_after` queues a key later (the earliest pending delay wins), and
  :meth:`add_rate_limited` does so with the key's own exponential backoff, which
  :meth:`forget` resets.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Hashable
from typing import Generic, TypeVar

from motor_mesh.common.retry import Backoff

K = TypeVar("K", bound=Hashable)


class ShutDown(Exception):
    """The queue was shut down: workers stop."""


class WorkQueue(Generic[K]):
    def __init__(self, backoff: Backoff) -> None:
        self._backoff = backoff
        self._queue: collections.deque[K] = collections.deque()
        self._dirty: set[K] = set()  # queued, or to be queued again when its worker is done
        self._processing: set[K] = set()
        self._failures: dict[K, int] = {}
        self._timers: dict[K, asyncio.TimerHandle] = {}
        self._waiters: collections.deque[asyncio.Future[None]] = collections.deque()
        self._shut = False
        self.adds = 0  # keys queued (not counting the ones de-duplicated)
        self.retries = 0  # rate-limited requeues

    def __len__(self) -> int:
        """Keys waiting to be handed to a worker (the queue's depth)."""
        return len(self._queue)

    @property
    def processing(self) -> int:
        return len(self._processing)

    def add(self, key: K) -> None:
        if self._shut or key in self._dirty:
            return
        self._dirty.add(key)
        if key in self._processing:
            return  # done() queues it again
        self._queue.append(key)
        self.adds += 1
        self._wake()

    def add_after(self, key: K, delay: float) -> None:
        if delay <= 0:
            self.add(key)
            return
        if self._shut:
            return
        loop = asyncio.get_running_loop()
        when = loop.time() + delay
        timer = self._timers.get(key)
        if timer is not None:
            if timer.when() <= when:
                return
            timer.cancel()
        self._timers[key] = loop.call_at(when, self._fire, key)

    def add_rate_limited(self, key: K) -> float:
        """Queue ``key`` after its backoff, which grows with each call until :meth:`forget`."""
        failures = self._failures.get(key, 0)
        self._failures[key] = failures + 1
        self.retries += 1
        delay = self._backoff.delay(failures)
        self.add_after(key, delay)
        return delay

    def forget(self, key: K) -> None:
        """The key succeeded: its next failure starts the backoff from the beginning."""
        self._failures.pop(key, None)

    def failures(self, key: K) -> int:
        """Rate-limited requeues of ``key`` since it was last forgotten."""
        return self._failures.get(key, 0)

    async def get(self) -> K:
        """The next key; the caller must call :meth:`done` with it."""
        while not self._queue:
            if self._shut:
                raise ShutDown
            waiter = asyncio.get_running_loop().create_future()
            self._waiters.append(waiter)
            try:
                await waiter
            except asyncio.CancelledError:
                if waiter.done() and not waiter.cancelled():
                    self._wake()  # woken, then cancelled: pass the wake-up on to another worker
                raise
        key = self._queue.popleft()
        self._processing.add(key)
        self._dirty.discard(key)
        return key

    def done(self, key: K) -> None:
        self._processing.discard(key)
        if key in self._dirty and not self._shut:
            self._queue.append(key)
            self.adds += 1
            self._wake()

    def shut_down(self) -> None:
        """Stop handing out keys; every waiting worker gets :class:`ShutDown`."""
        self._shut = True
        for timer in self._timers.values():
            timer.cancel()
        self._timers.clear()
        self._queue.clear()
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)

    def _fire(self, key: K) -> None:
        self._timers.pop(key, None)
        self.add(key)

    def _wake(self) -> None:
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return
