"""Background tasks that never fail quietly.

Nobody awaits a background task for its result, so an exception escaping one would otherwise
vanish with it, and whatever the task kept doing (a Coordinator's table in step, a work queue,
an engine's health probe) would stop without a word. Two kinds:

- :func:`spawn`: a loop meant to run for the life of its owner. A failure is logged with its
  traceback and the loop is started again after a backoff; returning normally ends it.
- :func:`start`: a one-shot task (wait for a process to exit, forward its output). A failure is
  logged with its traceback and ends the task.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

from services.common import log
from services.common.retry import Backoff

# A run that lasted this long was healthy: the next failure starts the backoff from scratch.
HEALTHY_RUN_S = 30.0


def cancelled_from_outside() -> bool:
    """Whether the current task is being cancelled (as opposed to a CancelledError that some
    library raised inside it, as grpc.aio does for a call whose channel was closed)."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


async def supervise(name: str, run: Callable[[], Awaitable[None]], backoff: Backoff | None = None) -> None:
    """Run ``run()`` until it returns or this task is cancelled; start it again after each
    failure."""
    backoff = backoff or Backoff(0.1, 5.0)
    while True:
        started = time.monotonic()
        try:
            await run()
            return
        except asyncio.CancelledError:
            if cancelled_from_outside():
                raise
            log.exception("task_failed", task=name)
        except Exception:
            log.exception("task_failed", task=name)
        if time.monotonic() - started > HEALTHY_RUN_S:
            backoff.reset()
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
