from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable

import pytest

from motor_mesh.common import server
from tests.controller.fakes import FakeCoordinator, FakeNodeManager
from tests.etcd import etcd_server  # noqa: F401  (a fixture: found by the tests here)


@pytest.fixture(autouse=True)
def quick_stop(monkeypatch: pytest.MonkeyPatch) -> None:
    """In-process servers stop without the 1 s production drain."""
    monkeypatch.setattr(server, "SHUTDOWN_DRAIN_S", 0.0)
    monkeypatch.setattr(server, "STOP_GRACE_S", 0.2)


@pytest.fixture
async def node_managers() -> AsyncIterator[Callable[..., Awaitable[FakeNodeManager]]]:
    started: list[FakeNodeManager] = []

    async def start(host: str = "127.0.0.1") -> FakeNodeManager:
        nm = await FakeNodeManager().start(host)
        started.append(nm)
        return nm

    yield start
    for nm in started:
        await nm.stop()


@pytest.fixture
async def coordinator() -> AsyncIterator[FakeCoordinator]:
    c = await FakeCoordinator().start()
    yield c
    await c.stop()
