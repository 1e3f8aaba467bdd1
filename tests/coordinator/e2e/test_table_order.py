"""A management write reaches every inference worker before ListInstances shows it: a real
``motor coordinator`` with two workers, one of them stopped (SIGSTOP) so it cannot take a write.
While the write waits for it, and after it failed, ListInstances does not list the instance;
the worker that took it is put back; once both take it, a request on each finds it."""

from __future__ import annotations

import os
import signal
from collections.abc import AsyncIterator, Callable
from contextlib import AsyncExitStack
from pathlib import Path

import aiohttp
import grpc
import pytest

from motor_mesh.common.enums import UNION
from motor_mesh.gen.motor.v1 import coordinator_pb2 as cpb
from motor_mesh.gen.motor.v1 import coordinator_pb2_grpc
from tests.coordinator.conftest import MODEL, Engine, instance
from tests.coordinator.e2e.test_workers import BODY, _start, _worker_pids
from tests.poll import until
from tests.procs import Proc

# A probe on a pinned connection answers at once; this only bounds a connection that landed on
# the stopped worker by mistake (the kernel would have handed it over before the stop).
PROBE = aiohttp.ClientTimeout(total=5)


async def _pinned(http: str, worker: int, stack: AsyncExitStack) -> aiohttp.ClientSession:
    """A session whose one keep-alive connection is served by inference worker ``worker``."""
    for _ in range(400):
        session = await stack.enter_async_context(
            aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1), timeout=PROBE)
        )
        async with session.get(f"http://{http}/health") as r:
            if int((await r.json())["worker"]) == worker:
                return session
    raise AssertionError(f"no connection reached worker {worker} in 400 tries")


async def _models(session: aiohttp.ClientSession, http: str) -> list[str]:
    async with session.get(f"http://{http}/v1/models") as r:
        return [m["id"] for m in (await r.json()).get("data", [])] if r.status == 200 else []


async def _is_empty(session: aiohttp.ClientSession, http: str) -> bool:
    return await _models(session, http) == []


async def _listed(stub: coordinator_pb2_grpc.CoordinatorStub) -> list[int]:
    table = await stub.ListInstances(cpb.CoordinatorListInstancesRequest(), timeout=10)
    return [i.id for i in table.available]


@pytest.fixture
async def sessions() -> AsyncIterator[AsyncExitStack]:
    async with AsyncExitStack() as stack:
        yield stack


async def test_list_instances_never_shows_an_instance_before_every_worker_routes_to_it(
    motor_proc: Callable[..., Proc], tmp_path: Path, engines: dict[str, Engine], sessions: AsyncExitStack
) -> None:
    proc, grpc_addr, http = _start(motor_proc, tmp_path)
    w0, w1 = await _pinned(http, 0, sessions), await _pinned(http, 1, sessions)
    add = cpb.AddInstancesRequest(instances=[instance(7, UNION, engines["union"].port)])
    async with grpc.aio.insecure_channel(grpc_addr) as ch:
        stub = coordinator_pb2_grpc.CoordinatorStub(ch)
        stopped = _worker_pids(proc)[1]
        os.kill(stopped, signal.SIGSTOP)
        try:
            call = stub.AddInstances(add, timeout=30)
            # Worker 0 routes the instance: the write is at the workers, waiting for worker 1
            # (or, on a machine stalled past the ack timeout, it has failed already).
            await until(lambda: call.done() or _models(w0, http), what="worker 0 taking the write")
            assert await _listed(stub) == []
            with pytest.raises(grpc.aio.AioRpcError) as failed:
                await call
            assert failed.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "not changed" in (failed.value.details() or "")
            assert await _listed(stub) == []
            # The worker that took the failed write routes by the table again.
            await until(lambda: _is_empty(w0, http), what="worker 0 put back")

            # A caller that gives up first (its deadline) does not stop the write halfway: it
            # still fails whole, and worker 0, which took it, is put back all the same.
            with pytest.raises(grpc.aio.AioRpcError) as gave_up:
                await stub.AddInstances(add, timeout=1)
            # (UNAVAILABLE only on a machine stalled past the ack timeout.)
            assert gave_up.value.code() in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNAVAILABLE)
            assert await _listed(stub) == []
            await until(lambda: _is_empty(w0, http), what="worker 0 put back after the caller left")
            await until(
                lambda: proc.output().count("event=workers_behind") == 2, what="the second write's end"
            )
            assert await _listed(stub) == []
        finally:
            os.kill(stopped, signal.SIGCONT)

        # Retried with both workers up: the moment it answers, ListInstances lists it and a
        # request on either worker is served by it.
        await stub.AddInstances(add, timeout=30)
        assert await _listed(stub) == [7]
        for session in (w0, w1):
            async with session.post(f"http://{http}/v1/chat/completions", json=BODY) as r:
                assert r.status == 200, await r.text()
            assert await _models(session, http) == [MODEL]
    assert "Traceback" not in proc.output() and "never retrieved" not in proc.output()
