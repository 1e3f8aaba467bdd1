"""The wait a SIGTERM makes for the Controller's Stop (services/nodemanager/app.py
``drain_first``): bounded, cut short by stdin closing, over once the Stop was carried out; and a
node with nothing to drain does not ask. In-process, with stand-ins for the link and the
supervisor."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import grpc
import pytest

from motor_mesh.common import errors
from motor_mesh.nodemanager import app
from tests.poll import until


class Link:
    def __init__(self, failure: errors.MotorError | None = None) -> None:
        self.registered = asyncio.Event()
        self.registered.set()
        self.leaving = False
        self.asked: list[str] = []
        self.failure = failure

    async def terminate_instance(self, reason: str, timeout_s: float) -> Any:
        self.asked.append(reason)
        if self.failure is not None:
            raise grpc.aio.AioRpcError(self.failure.code, grpc.aio.Metadata(), grpc.aio.Metadata(), "refused")
        return None


class Sup:
    def __init__(self, instance_id: int = 42) -> None:
        self.instance_id = instance_id
        self.engines = {0: object()} if instance_id else {}
        self.address = "127.0.0.1:7300"
        self.closed = False


@pytest.fixture(autouse=True)
def info_records(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="motor")


def outcome(caplog: pytest.LogCaptureFixture) -> str:
    (rec,) = [r for r in caplog.records if r.getMessage() == "drain_wait_over"]
    return str(rec.fields["outcome"])  # type: ignore[attr-defined]


def events() -> tuple[asyncio.Event, asyncio.Event, asyncio.Event]:
    return asyncio.Event(), asyncio.Event(), asyncio.Event()


async def test_the_wait_for_the_stop_is_bounded(caplog) -> None:
    link, sup = Link(), Sup()
    stop, done, received = events()
    await asyncio.wait_for(app.drain_first(link, sup, stop, done, received, 0.2), 10)  # type: ignore[arg-type]
    assert outcome(caplog) == "timeout"
    assert len(link.asked) == 1 and link.leaving and sup.closed


async def test_stdin_closing_ends_the_wait(caplog) -> None:
    link, sup = Link(), Sup()
    stop, done, received = events()
    waiting = asyncio.create_task(app.drain_first(link, sup, stop, done, received, 45))  # type: ignore[arg-type]
    await until(lambda: link.asked)  # the Controller was asked to terminate the instance
    assert not waiting.done()
    stop.set()
    await asyncio.wait_for(waiting, 10)
    assert outcome(caplog) == "stdin_closed"


async def test_a_stop_that_arrived_is_waited_for_past_the_bound(caplog) -> None:
    link, sup = Link(), Sup()
    stop, done, received = events()
    waiting = asyncio.create_task(app.drain_first(link, sup, stop, done, received, 0.1))  # type: ignore[arg-type]
    await until(lambda: link.asked)
    received.set()  # the Controller's Stop: it stops the engines, then asks for the exit
    # Well past the 0.1 s bound, the wait goes on until the Stop is carried out.
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(asyncio.shield(waiting), 0.3)
    assert not waiting.done()
    done.set()
    await asyncio.wait_for(waiting, 10)
    assert outcome(caplog) == "stopped_by_controller"


async def test_a_refused_request_or_nothing_to_drain_returns_at_once(caplog) -> None:
    stop, done, received = events()
    refused = Link(errors.MotorError(grpc.StatusCode.NOT_FOUND, "no live instance"))
    await asyncio.wait_for(app.drain_first(refused, Sup(), stop, done, received, 45), 10)  # type: ignore[arg-type]
    assert [r for r in caplog.records if r.getMessage() == "drain_request_failed"]
    idle = Link()
    await asyncio.wait_for(app.drain_first(idle, Sup(instance_id=0), stop, done, received, 45), 10)  # type: ignore[arg-type]
    await asyncio.wait_for(app.drain_first(None, Sup(), stop, done, received, 45), 10)
    assert idle.asked == [] and not idle.leaving
    assert len([r for r in caplog.records if r.getMessage() == "drain_skipped"]) == 2
