"""Waiting for something observable to hold: the one poll helper of the tests.

``await until(fn)`` in async code (``fn`` may be a plain function or return an awaitable: an RPC,
an HTTP probe) and ``wait_until(fn)`` in plain code (threads, sync tests) call ``fn`` every
``every`` seconds until it returns something truthy, and return that.

A falsy answer means "not yet". So does an exception, but only of a type the call names in
``retry`` (none by default): each poll says which errors, for what it polls, mean that the thing
is not there yet, e.g. ``retry=(grpc.RpcError,)`` while a server starts, ``(KeyError,)`` for a
key that appears later, ``(AssertionError,)`` for a condition written as asserts. Any
other exception is a bug in the test or in what it tests: it propagates at once, with its own
traceback, rather than after the whole timeout. When ``timeout`` runs out the failure says what
was waited for and the last answer or error (chained, traceback and all).
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

Retry = type[BaseException] | tuple[type[BaseException], ...]
"""The exception types that mean "not yet" to one poll."""

EVERY_S = 0.02


class _Poll:
    """One poll's deadline, its "not yet" errors and its last miss: until() and wait_until()
    differ only in how they call ``fn`` and how they sleep."""

    def __init__(self, timeout: float, what: str, retry: Retry) -> None:
        self.timeout, self.what = timeout, what
        self.retry = retry if isinstance(retry, tuple) else (retry,)
        if not all(isinstance(t, type) and issubclass(t, BaseException) for t in self.retry):
            raise TypeError(f"retry takes exception types, not {retry!r}")
        self.deadline = time.monotonic() + timeout
        self.last: Any = None

    @contextmanager
    def attempt(self) -> Iterator[None]:
        try:
            yield
        except self.retry as exc:
            self.last = exc

    def hit(self, value: Any) -> bool:
        if inspect.isawaitable(value):
            raise TypeError("wait_until() polls plain functions: await until() for a coroutine")
        self.last = value
        return bool(value)

    def pause(self, every: float) -> float:
        """How long to sleep before the next try; raises once the time is up."""
        if time.monotonic() > self.deadline:
            cause = self.last if isinstance(self.last, BaseException) else None
            raise AssertionError(
                f"timed out after {self.timeout} s waiting for {self.what} (last: {self.last!r})"
            ) from cause
        return every


async def until(
    fn: Callable[[], Any],
    timeout: float = 30.0,  # noqa: ASYNC109  (a poll's bound, not an operation's deadline)
    what: str = "condition",
    *,
    retry: Retry = (),
    every: float = EVERY_S,
) -> Any:
    """Call ``fn`` (and await what it returns, if awaitable) until the value is truthy; return it.
    An exception of a type in ``retry`` is a miss like a falsy value; any other propagates."""
    poll = _Poll(timeout, what, retry)
    while True:
        with poll.attempt():
            value = fn()
            if inspect.isawaitable(value):
                value = await value
            if poll.hit(value):
                return value
        await asyncio.sleep(poll.pause(every))


def wait_until(
    fn: Callable[[], Any],
    timeout: float = 30.0,
    what: str = "condition",
    *,
    retry: Retry = (),
    every: float = EVERY_S,
) -> Any:
    """``until`` for plain code (sync tests, threads, starting a process from a coroutine): it
    blocks the calling thread."""
    poll = _Poll(timeout, what, retry)
    while True:
        with poll.attempt():
            if poll.hit(value := fn()):
                return value
        time.sleep(poll.pause(every))
