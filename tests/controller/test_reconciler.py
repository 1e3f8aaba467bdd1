"""The work queue and the reconcile loop: de-duplication, one worker per key, requeue with
backoff, requeue_after (0 = no requeue) and requeue now, terminal errors, the periodic resync
and recovery from exceptions."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest

from motor_mesh.common.retry import Backoff
from motor_mesh.controller.reconcile.runner import REQUEUE_NOW, Reconciler, Result, Retry, Terminal
from motor_mesh.controller.reconcile.workqueue import WorkQueue
from tests.poll import until

FAST = Backoff(0.01, 0.04, jitter=0)


class Recorder:
    """A reconcile function that records calls and runs a per-call behaviour."""

    def __init__(self, behave: Callable[[str, int], Awaitable[Result | None]] | None = None) -> None:
        self.calls: list[str] = []
        self.running: dict[str, int] = {}
        self.max_parallel: dict[str, int] = {}
        self._behave = behave

    def count(self, key: str) -> int:
        return self.calls.count(key)

    async def __call__(self, key: str) -> Result | None:
        self.calls.append(key)
        self.running[key] = self.running.get(key, 0) + 1
        self.max_parallel[key] = max(self.max_parallel.get(key, 0), self.running[key])
        try:
            if self._behave is not None:
                return await self._behave(key, self.count(key))
            return None
        finally:
            self.running[key] -= 1


@pytest.fixture
async def loops() -> AsyncIterator[Callable[..., Reconciler[str]]]:
    made: list[Reconciler[str]] = []

    def make(reconcile: Recorder, **kw: object) -> Reconciler[str]:
        kw.setdefault("backoff", FAST)
        loop: Reconciler[str] = Reconciler("test", reconcile, **kw)  # type: ignore[arg-type]
        made.append(loop)
        return loop

    yield make
    for loop in made:
        await loop.stop()


# ---- the queue alone ----------------------------------------------------------------------------


async def test_a_key_waiting_is_queued_once() -> None:
    q: WorkQueue[str] = WorkQueue(FAST)
    for key in ("a", "b", "a", "a", "b"):
        q.add(key)
    assert len(q) == 2
    assert [await q.get(), await q.get()] == ["a", "b"]


async def test_a_key_added_while_processing_comes_back_once_after_done() -> None:
    q: WorkQueue[str] = WorkQueue(FAST)
    q.add("a")
    key = await q.get()
    q.add("a")
    q.add("a")
    assert len(q) == 0  # not handed out twice while a worker holds it
    q.done(key)
    assert len(q) == 1 and await q.get() == "a"


async def test_rate_limited_delays_grow_to_the_cap_and_forget_resets() -> None:
    q: WorkQueue[str] = WorkQueue(FAST)
    assert [q.add_rate_limited("a") for _ in range(5)] == [0.01, 0.02, 0.04, 0.04, 0.04]
    assert q.failures("a") == 5
    q.forget("a")
    assert q.failures("a") == 0 and q.add_rate_limited("a") == 0.01
    q.shut_down()


async def test_the_earliest_delayed_add_wins() -> None:
    q: WorkQueue[str] = WorkQueue(FAST)
    q.add_after("a", 30)
    q.add_after("a", 0.01)
    assert await asyncio.wait_for(q.get(), 5) == "a"
    q.shut_down()


# ---- the loop -----------------------------------------------------------------------------------


async def test_one_worker_per_key_and_the_last_change_is_seen(loops) -> None:
    gate = asyncio.Event()

    async def behave(key: str, n: int) -> None:
        if key == "a" and n == 1:
            await gate.wait()

    rec = Recorder(behave)
    loop = loops(rec, workers=4)
    loop.start()
    loop.enqueue("a")
    await until(lambda: rec.running.get("a") == 1)
    for _ in range(5):
        loop.enqueue("a")  # events while "a" is being reconciled
    loop.enqueue("b")
    await until(lambda: rec.count("b") == 1)  # other keys are not held up
    assert rec.count("a") == 1
    gate.set()
    await until(lambda: rec.count("a") == 2)  # once more, for everything that happened meanwhile
    loop.enqueue("c")
    await until(lambda: rec.count("c") == 1)
    assert rec.count("a") == 2 and rec.max_parallel["a"] == 1


async def test_failures_are_retried_with_backoff_until_they_succeed(loops, caplog) -> None:
    async def behave(key: str, n: int) -> None:
        if n <= 3:
            raise Retry(f"not yet ({n})")

    rec = Recorder(behave)
    loop = loops(rec)
    loop.start()
    caplog.set_level(logging.INFO)
    loop.enqueue("a")
    await until(lambda: rec.count("a") == 4)
    retries = [r for r in caplog.records if getattr(r, "event", "") == "reconcile_retry"]
    assert [r.fields["attempt"] for r in retries] == [1, 2, 3]  # type: ignore[attr-defined]
    assert [r.fields["in_s"] for r in retries] == [0.01, 0.02, 0.04]  # type: ignore[attr-defined]
    assert loop.stats.errors == 3


async def test_an_exception_is_logged_with_its_traceback_and_the_key_retried(loops, caplog) -> None:
    async def behave(key: str, n: int) -> None:
        if key == "a" and n == 1:
            raise ValueError("a bug in reconcile")

    rec = Recorder(behave)
    loop = loops(rec)
    loop.start()
    caplog.set_level(logging.INFO)
    loop.enqueue("a")
    await until(lambda: rec.count("a") == 2)
    [failed] = [r for r in caplog.records if getattr(r, "event", "") == "reconcile_failed"]
    assert failed.exc_info is not None and isinstance(failed.exc_info[1], ValueError)
    assert "ValueError: a bug in reconcile" in caplog.text  # the formatted traceback
    # The worker survived: it goes on serving keys.
    loop.enqueue("b")
    await until(lambda: rec.count("b") == 1)


async def test_a_stray_cancellation_inside_reconcile_does_not_kill_the_worker(loops) -> None:
    async def behave(key: str, n: int) -> None:
        if n == 1:
            raise asyncio.CancelledError  # what grpc.aio raises when a channel closes under a call

    rec = Recorder(behave)
    loop = loops(rec)
    loop.start()
    loop.enqueue("a")
    await until(lambda: rec.count("a") == 2)


async def test_terminal_errors_are_counted_and_not_retried(loops, caplog) -> None:
    async def behave(key: str, n: int) -> None:
        if key == "a":
            raise Terminal("cannot ever work")

    rec = Recorder(behave)
    loop = loops(rec)
    loop.start()
    caplog.set_level(logging.INFO)
    loop.enqueue("a")
    await until(lambda: loop.stats.terminal == 1)
    # A barrier well past every backoff delay (at most 0.04 s): a retry would have come first.
    loop.queue.add_after("barrier", 0.2)
    await until(lambda: rec.count("barrier") == 1)
    assert rec.count("a") == 1
    assert any(getattr(r, "event", "") == "reconcile_terminal" for r in caplog.records)


async def test_requeue_after_looks_again_later(loops) -> None:
    async def behave(key: str, n: int) -> Result | None:
        return Result(requeue_after=0.01) if n < 3 else None

    rec = Recorder(behave)
    loop = loops(rec)
    loop.start()
    loop.enqueue("a")
    await until(lambda: rec.count("a") == 3)


@pytest.mark.parametrize("after", [0, -1.0])
async def test_requeue_after_zero_or_less_does_not_requeue(loops, after: float) -> None:
    # controller-runtime's semantics: only a positive requeue_after asks for another look.
    async def behave(key: str, n: int) -> Result:
        return Result(requeue_after=after)

    rec = Recorder(behave)
    loop = loops(rec)  # one worker, first in first out
    loop.start()
    loop.enqueue("a")
    await until(lambda: loop.stats.reconciles == 1)
    loop.enqueue("barrier")  # queued behind "a" had "a" been requeued
    await until(lambda: rec.count("barrier") == 1)
    assert rec.calls == ["a", "barrier"]


async def test_requeue_now_looks_again_at_once_without_backoff(loops) -> None:
    async def behave(key: str, n: int) -> Result | None:
        return REQUEUE_NOW if n < 3 else None

    rec = Recorder(behave)
    loop = loops(rec, backoff=Backoff(3600, 3600, jitter=0))  # a backoff would not come back
    loop.start()
    loop.enqueue("a")
    await until(lambda: rec.count("a") == 3)
    assert loop.queue.retries == 0 and loop.queue.failures("a") == 0


async def test_resync_looks_at_every_key_without_events(loops) -> None:
    rec = Recorder()
    loop = loops(rec, resync_s=0.02, keys=lambda: ["a", "b"])
    loop.start()  # start() is a resync too
    await until(lambda: rec.count("a") >= 3 and rec.count("b") >= 3)


async def test_stop_ends_the_workers(loops) -> None:
    rec = Recorder()
    loop = loops(rec, workers=3)
    loop.start()
    await asyncio.wait_for(loop.stop(), 5)
    loop.enqueue("a")  # after shut-down: ignored
    assert rec.calls == []
