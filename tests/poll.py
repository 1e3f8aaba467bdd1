"""Waiting for something observable to hold: the one poll helper of the tests.

``await until(fn)`` in async code (``fn`` may be a plain function or return an awaitable: an RPC,
an HTTP probe) and ``wait_until(fn)`` in plain code (threads, sync tests) call ``fn`` every
``every`` seconds until it returns something truthy, and return that. An error of the kinds in
``NOT_YET`` (a failed assert, a refused connection, an RPC error, a missing key) counts as "not
yet"; any other error is a bug and propagates at once. When ``timeout`` runs out the failure says
what was waited for and the last answer or error (chained, traceback and all).
"""

from __future__ import annotations

import asyncio
import inspect
import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import aiohttp
import grpc

NOT_YET: tuple[type[BaseException], ...] = (
    AssertionError,
    LookupError,  # the key or item being waited for is not there yet
    ValueError,  # half-written JSON
    OSError,  # refused / reset connections, timeouts, a file not written yet
    grpc.RpcError,
    aiohttp.ClientError,
    subprocess.SubprocessError,  # a CLI call that timed out
)
EVERY_S = 0.02


class _Poll:
    """One poll's deadline and last miss: until() and wait_until() differ only in how they call
    ``fn`` and how they sleep."""

    def __init__(self, timeout: float, what: str) -> None:
        self.timeout, self.what = timeout, what
        self.deadline = time.monotonic() + timeout
        self.last: Any = None

    @contextmanager
    def attempt(self) -> Iterator[None]:
        try:
            yield
        except NOT_YET as exc:
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
    every: float = EVERY_S,
) -> Any:
    """Call ``fn`` (and await what it returns, if awaitable) until the value is truthy; return it."""
    poll = _Poll(timeout, what)
    while True:
        with poll.attempt():
            value = fn()
            if inspect.isawaitable(value):
                value = await value
            if poll.hit(value):
                return value
        await asyncio.sleep(poll.pause(every))


def wait_until(
    fn: Callable[[], Any], timeout: float = 30.0, what: str = "condition", *, every: float = EVERY_S
) -> Any:
    """``until`` for plain code (sync tests, threads, starting a process from a coroutine): it
    blocks the calling thread."""
    poll = _Poll(timeout, what)
    while True:
        with poll.attempt():
            if poll.hit(value := fn()):
                return value
        time.sleep(poll.pause(every))
