"""Overload protection: at most ``max_concurrent_requests`` completions at once, a bounded FIFO
queue behind them, and a queue timeout (docs/operations.md, "Overload").

A full queue answers 429 at once and a wait past ``queue_timeout_s`` answers 503, both with
``Retry-After``: the client learns immediately, and the requests already admitted keep their
latency because the engines never see the excess. Admission itself is a counter in the
common case (no queue): no future, no lock.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import math

from motor_mesh.common.http_errors import OpenAIError


def too_many(limit: int) -> OpenAIError:
    return OpenAIError(
        429,
        f"too many requests: {limit} are being served and the queue is full; retry later",
        "rate_limit_error",
        "too_many_requests",
        headers={"Retry-After": "1"},
    )


def queue_timeout(seconds: float) -> OpenAIError:
    return OpenAIError(
        503,
        f"the request waited queue_timeout_s ({seconds:g} s) for a free slot; retry later",
        "service_unavailable",
        "queue_timeout",
        headers={"Retry-After": "1"},
    )


class Admission:
    def __init__(self, max_concurrent: int, max_queued: int, queue_timeout_s: float) -> None:
        self.max_concurrent = max_concurrent
        self.max_queued = max_queued
        self.queue_timeout_s = queue_timeout_s
        self.active = 0
        self._waiters: collections.deque[asyncio.Future[None]] = collections.deque()

    @classmethod
    def share(cls, max_concurrent: int, max_queued: int, queue_timeout_s: float, workers: int) -> Admission:
        """One worker's part of the Coordinator-wide limits (rounded up: never zero)."""
        return cls(math.ceil(max_concurrent / workers), math.ceil(max_queued / workers), queue_timeout_s)

    @property
    def queued(self) -> int:
        return len(self._waiters)

    async def acquire(self) -> None:
        """Take a slot, waiting in line if need be. Raises OpenAIError 429 / 503."""
        if self.active < self.max_concurrent and not self._waiters:
            self.active += 1
            return
        if len(self._waiters) >= self.max_queued:
            raise too_many(self.max_concurrent)
        fut = asyncio.get_running_loop().create_future()
        self._waiters.append(fut)
        try:
            async with asyncio.timeout(self.queue_timeout_s):
                await fut  # release() handed its slot over: active already counts us
        except (TimeoutError, asyncio.CancelledError) as exc:
            if fut.done() and not fut.cancelled():
                self.release()  # the slot arrived just as we gave up: pass it on
            if isinstance(exc, TimeoutError):
                raise queue_timeout(self.queue_timeout_s) from None
            raise
        finally:
            if not fut.done():
                fut.cancel()
            with contextlib.suppress(ValueError):  # release() already took it off the line
                self._waiters.remove(fut)

    def release(self) -> None:
        while self._waiters:
            fut = self._waiters.popleft()
            if not fut.done():
                fut.set_result(None)  # the slot moves to the first in line
                return
        self.active -= 1
