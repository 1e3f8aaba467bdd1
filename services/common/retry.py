"""Retrying: exponential backoff with jitter, and which gRPC outcomes are worth another try.

Every retry loop in Motor (registration, the heartbeat stream, the work queue's per-key
requeue, ``motor up`` restarting a child) takes its delays from a :class:`Backoff` and asks a
:class:`RetryPolicy` whether a failed call may be repeated, so the rules live in one place.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Iterable
from dataclasses import dataclass, field

import grpc

# Codes that say the request itself is wrong or not allowed: sending it again cannot help.
TERMINAL_CODES = frozenset(
    {
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.FAILED_PRECONDITION,
        grpc.StatusCode.OUT_OF_RANGE,
        grpc.StatusCode.NOT_FOUND,
        grpc.StatusCode.ALREADY_EXISTS,
        grpc.StatusCode.UNAUTHENTICATED,
        grpc.StatusCode.PERMISSION_DENIED,
        grpc.StatusCode.UNIMPLEMENTED,
    }
)


@dataclass(frozen=True)
class RetryPolicy:
    """Which failed calls may be repeated: every status code except the ``terminal`` ones.

    The default suits most calls. A caller whose protocol gives a code a transient meaning
    narrows the set: a NodeManager's registration keeps trying through ALREADY_EXISTS (its old
    session has not timed out yet) and gives up only on a request that can never be accepted.
    """

    terminal: frozenset[grpc.StatusCode] = TERMINAL_CODES

    def retryable(self, code: grpc.StatusCode | None) -> bool:
        return code is not None and code != grpc.StatusCode.OK and code not in self.terminal


def policy(terminal: Iterable[grpc.StatusCode]) -> RetryPolicy:
    return RetryPolicy(frozenset(terminal))


@dataclass
class Backoff:
    """Delays that start at ``initial`` and grow by ``multiplier`` up to ``maximum``.

    Each delay is spread by ``jitter`` (0.2 = anywhere from 20% below to 20% above), so many
    clients that failed together do not come back together. ``reset()`` after a success.
    """

    initial: float
    maximum: float
    multiplier: float = 2.0
    jitter: float = 0.2
    _attempt: int = field(default=0, init=False, repr=False)

    def __post_init__(self) -> None:
        if not 0 < self.initial <= self.maximum:
            raise ValueError(f"backoff needs 0 < initial <= maximum, got {self.initial}, {self.maximum}")

    def delay(self, attempt: int) -> float:
        """The jittered delay before retry number ``attempt`` (0 = the first retry)."""
        # Capping the exponent first keeps a long outage from overflowing the float.
        base = min(self.initial * self.multiplier ** min(attempt, 64), self.maximum)
        if self.jitter:
            base *= random.uniform(1 - self.jitter, 1 + self.jitter)
        return base

    def next(self, at_least: float | None = None) -> float:
        """The delay to wait now; the following one is longer (up to the cap).

        ``at_least`` is the server's own word on when to come back (HTTP ``Retry-After``, gRPC
        ``RetryInfo``): the delay is no shorter, but a server's wait is honoured only up to
        ``maximum``, so a wrong or hostile one cannot park the caller for hours."""
        delay = self.delay(self._attempt)
        self._attempt += 1
        if at_least is not None:
            delay = max(delay, min(at_least, self.maximum))
        return delay

    def reset(self) -> None:
        self._attempt = 0

    async def sleep(self) -> float:
        """Wait the next delay; returns how long it was."""
        delay = self.next()
        await asyncio.sleep(delay)
        return delay
