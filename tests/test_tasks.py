"""Background tasks: an unexpected failure reaches the log with its traceback; a supervised loop
is started again after it fails; a cancellation is not a failure."""

from __future__ import annotations

import asyncio
import logging

import pytest

from motor_mesh.common import tasks
from motor_mesh.common.retry import Backoff
from tests.poll import until


def failed(caplog: pytest.LogCaptureFixture) -> list:
    return [r for r in caplog.records if r.getMessage() == "task_failed"]


async def test_a_failing_task_logs_its_traceback_and_ends(caplog: pytest.LogCaptureFixture) -> None:
    async def broken() -> None:
        raise RuntimeError("probe table corrupt")

    task = tasks.start("engine-0-exit", broken())
    assert await task is None
    (record,) = failed(caplog)
    assert record.levelname == "ERROR" and record.exc_info is not None
    assert isinstance(record.exc_info[1], RuntimeError)
    assert task.get_name() == "engine-0-exit"


async def test_a_cancelled_task_is_cancelled_not_failed(caplog: pytest.LogCaptureFixture) -> None:
    started = asyncio.Event()

    async def forever() -> None:
        started.set()
        await asyncio.Event().wait()

    task = tasks.start("reaper", forever())
    await started.wait()
    await tasks.cancel_quietly(task)
    assert task.cancelled()
    assert not failed(caplog)


async def test_a_supervised_loop_is_restarted_after_each_failure(caplog: pytest.LogCaptureFixture) -> None:
    runs: list[int] = []

    async def flaky() -> None:
        runs.append(len(runs))
        if len(runs) == 2:
            raise asyncio.CancelledError  # a stray one, as grpc.aio raises for a closed channel
        if len(runs) < 4:
            raise KeyError("lost")
        await asyncio.Event().wait()

    task = tasks.spawn("pusher", flaky, Backoff(0.01, 0.02))
    await until(lambda: len(runs) == 4)
    assert [type(r.exc_info[1]) for r in failed(caplog)] == [KeyError, asyncio.CancelledError, KeyError]
    await tasks.cancel_quietly(task)
    assert task.cancelled() and len(failed(caplog)) == 3


async def test_a_supervised_loop_that_returns_is_done(caplog: pytest.LogCaptureFixture) -> None:
    async def once() -> None:
        return None

    task = tasks.spawn("arbiter", once)
    assert await asyncio.wait_for(task, 5) is None
    assert not failed(caplog)


async def test_a_supervised_run_gives_up_after_its_restarts(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    runs = 0

    async def crashing() -> None:
        nonlocal runs
        runs += 1
        if runs == 1:
            raise asyncio.CancelledError  # a stray one counts like any other failure
        raise KeyError(f"lost {runs}")

    with pytest.raises(tasks.GaveUp) as info:
        await tasks.supervise("strategy", crashing, Backoff(0.01, 0.02), restarts=2)
    assert runs == 3 and isinstance(info.value.__cause__, KeyError)
    assert "failed 3 times" in str(info.value) and "lost 3" in str(info.value)
    assert len(failed(caplog)) == 3
    assert len([r for r in caplog.records if r.getMessage() == "task_restarting"]) == 2


async def test_an_expected_exception_is_the_answer_not_a_failure(caplog: pytest.LogCaptureFixture) -> None:
    async def refusing() -> None:
        raise ValueError("no")

    with pytest.raises(ValueError, match="no"):
        await tasks.supervise("strategy", refusing, Backoff(0.01, 0.02), restarts=3, expected=(ValueError,))
    assert not failed(caplog)
