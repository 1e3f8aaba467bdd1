"""Background tasks that never fail quietly.

Nobody awaits a background task for its result, so an exception escaping one would otherwise
vanish with it, and whatever the task kept doing (a Coordinator's table in step, a work queue,
an engine's health probe) would stop without a word. Two kinds:

- :func:`spawn`: a loop meant to run for the life of its owner. A failure is logged with its
  traceback and the loop is started again after a backoff; returning normally ends it.
  :func:`supervise` is the same in the caller's own task, and can give up after a number of
  restarts (a recovery strategy that keeps crashing counts as failed rather than looping).
- :func:`start`: a one-shot task (wait for a process to exit, forward its output). A failure is
  logged with its traceback and ends the task.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

from motor_mesh.common import log
from motor_mesh.common.retry import Backoff

# A run that lasted this long was healthy: the next failure starts the backoff from scratch.
HEALTHY_RUN_S = 30.0


def cancelled_from_outside() -> bool:
    """Whether the current task is being cancelled (as opposed to a CancelledError that some
    library raised inside it, as grpc.aio does for a call whose channel was closed)."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


class GaveUp(Exception):
    """A supervised run failed again after its last allowed restart; ``__cause__`` is that
    failure."""


async def supervise(
    name: str,
    run: Callable[[], Awaitable[None]],
    backoff: Backoff | None = None,
    *,
    restarts: int | None = None,
    expected: tuple[type[Exception], ...] = (),
) -> None:
    """Run ``run()`` until it returns or this task is cancelled; start it again after each
    failure. ``expected`` exceptions are ``run``'s answer, not a failure: they reach the caller
    at once. After ``restarts`` restarts in all (None: no limit) the next failure raises
    :class:`GaveUp`."""
    backoff = backoff or Backoff(0.1, 5.0)
    failures = 0
    while True:
        started = time.monotonic()
        try:
            await run()
            return
        except expected:
            raise
        except asyncio.CancelledError as exc:
            if cancelled_from_outside():
                raise
            log.exception("task_failed", task=name)
            failure: BaseException = exc
        except Exception as exc:
            log.exception("task_failed", task=name)
            failure = exc
        if time.monotonic() - started > HEALTHY_RUN_S:
            backoff.reset()
        failures += 1
        if restarts is not None and failures > restarts:
            why = f"{type(failure).__name__}: {failure}"
            raise GaveUp(f"{name} failed {failures} times, last: {why}") from failure
        delay = backoff.next()
        log.event("task_restarting", task=name, in_s=round(delay, 3))
        await asyncio.sleep(delay)


def spawn(
    name: str, run: Callable[[], Awaitable[None]], backoff: Backoff | None = None
) -> asyncio.Task[None]:
    """``run()`` as a supervised task named ``name``."""
    return asyncio.get_running_loop().create_task(supervise(name, run, backoff), name=name)


async def _logging_failure(name: str, coro: Coroutine[Any, Any, None]) -> None:
    try:
        await coro
    except Exception:
        log.exception("task_failed", task=name)


def start(name: str, coro: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
    """``coro`` as a one-shot task named ``name``; an exception it raises is logged
    (``event=task_failed``) and ends the task."""
    return asyncio.get_running_loop().create_task(_logging_failure(name, coro), name=name)


async def cancel_quietly(task: asyncio.Task[Any] | None) -> None:
    """Cancel ``task`` and wait for it to end, however it ends."""
    if task is None:
        return
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError, Exception):
        await task


async def first_of(*events: asyncio.Event, within: float | None = None) -> None:
    """Until one of ``events`` is set, or ``within`` seconds pass."""
    waits = [asyncio.ensure_future(e.wait()) for e in events]
    try:
        await asyncio.wait(waits, timeout=within, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for w in waits:
            w.cancel()
