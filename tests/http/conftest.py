"""The server under test, started fresh for each test on 127.0.0.1 port 0.

``served`` has the production limits and clocks; ``serve(**kw)`` starts one with other
:class:`HttpServer` arguments (the slowloris tests shorten its clocks). At teardown every
server must still answer a normal request on a fresh connection, and nothing of the test may
have logged an error (a traceback, asyncio's "exception was never retrieved").
"""

from __future__ import annotations

import gc
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest

from tests.http.wire import Served

Serve = Callable[..., Awaitable[Served]]


def errors_logged(caplog: pytest.LogCaptureFixture) -> list[str]:
    records = caplog.get_records("setup") + caplog.get_records("call") + caplog.get_records("teardown")
    return [f"{r.name}: {r.getMessage()}" for r in records if r.levelno >= logging.ERROR]


@pytest.fixture
async def serve(caplog: pytest.LogCaptureFixture) -> AsyncIterator[Serve]:
    started: list[Served] = []

    async def start(**kw: Any) -> Served:
        served = await Served().start(**kw)
        started.append(served)
        return served

    yield start
    try:
        for s in started:
            await s.still_serving()
    finally:
        for s in started:
            await s.server.close(1.0)
    gc.collect()  # asyncio reports a task's unretrieved exception when the task is collected
    assert not errors_logged(caplog), errors_logged(caplog)


@pytest.fixture
async def served(serve: Serve) -> Served:
    return await serve()
