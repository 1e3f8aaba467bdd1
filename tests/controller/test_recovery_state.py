"""Recovery progress is stored state: a relaunch interrupted by a Controller restart in any phase
continues (or escalates) exactly once; dispatch retries; an escalation never stops a NodeManager
that accepted the restart; a multi-node instance that loses a node stops its survivors. Against
fake NodeManagers, through the Controller's gRPC API."""

from __future__ import annotations

import asyncio
import contextlib
import logging

import grpc
import pytest

from motor_mesh.common import errors
from motor_mesh.controller.faults import strategies
from motor_mesh.controller.faults.strategies import Terminate
from motor_mesh.gen.motor.v1 import controller_pb2
from tests.controller.fakes import NORMAL, running_controller
from tests.controller.test_faults import ABORT, RESTART, active_pair, engine_event, fault_status
from tests.poll import until

FAST = {"engine_relaunch_poll_interval_s": 1, "engine_relaunch_dispatch_retries": 2}
ONCE = errors.error_info(grpc.StatusCode.INTERNAL, "TEST_TRANSIENT", "test: a transient failure")
REFUSED = errors.error_info(grpc.StatusCode.FAILED_PRECONDITION, "TEST_REFUSED", "test: cannot restart")


async def succeeded(h) -> controller_pb2.FaultToleranceEntry:
    async def done() -> controller_pb2.FaultToleranceEntry | None:
        entries = await fault_status(h)
        return entries[0] if entries and entries[0].history and not entries[0].strategy else None

    entry = await until(done, timeout=30)
    assert "EngineRelaunch succeeded" in entry.history[-1]
    return entry


@pytest.fixture(autouse=True)
def info_records(caplog: pytest.LogCaptureFixture) -> None:
    """Events (info) are what some tests wait for: instance_torn_down."""
    caplog.set_level(logging.INFO, logger="motor")


def torn_down(caplog: pytest.LogCaptureFixture) -> bool:
    """The instance's teardown is done: deleted, and every Stop it sends sent."""
    return any(r.getMessage() == "instance_torn_down" for r in caplog.records)


async def in_phase(h, strategy: str, phase: str) -> None:
    async def there() -> bool:
        entries = await fault_status(h)
        return bool(entries) and (entries[0].strategy, entries[0].phase) == (strategy, phase)

    await until(there, what=f"{strategy} in phase {phase}")


async def test_a_transient_restart_failure_is_retried_and_the_relaunch_succeeds(
    tmp_path, node_managers
) -> None:
    a, b = await node_managers(), await node_managers()
    async with running_controller(tmp_path, **FAST) as h:
        first, _ = await active_pair(h, a, b)
        b.restart_errors = [ONCE]
        a.ready = b.ready = True
        await engine_event(first)
        await succeeded(h)
        assert (a.restarts, b.restarts) == ([RESTART], [RESTART, RESTART])
        assert a.stops == b.stops == []


async def test_a_failed_relaunch_never_stops_a_node_manager_that_accepted_it(
    tmp_path, node_managers, caplog: pytest.LogCaptureFixture
) -> None:
    a, b = await node_managers(), await node_managers()
    async with running_controller(tmp_path, **FAST) as h:
        first, _ = await active_pair(h, a, b)
        b.restart_error = REFUSED
        await engine_event(first)
        await until(lambda: torn_down(caplog))  # escalated: Terminate
        # a accepted: it keeps its freeze and recovers (or its own arbiter decides); b did not:
        # ABORT, then Stop so its pod restarts.
        assert (a.restarts, b.restarts) == ([RESTART], [RESTART, ABORT])
        assert a.stops == [] and b.stops == ["relaunch_failed: engine relaunch failed"]


async def test_a_relaunch_probing_when_the_controller_restarts_continues(tmp_path, node_managers) -> None:
    a, b = await node_managers(), await node_managers()
    settings = {**FAST, "engine_relaunch_dispatch_retries": 10}
    async with running_controller(tmp_path, **settings) as h:
        first, _ = await active_pair(h, a, b)
        b.status_error = ONCE  # the probe before the restart keeps failing
        await engine_event(first)
        await in_phase(h, "EngineRelaunch", "probe")
    b.status_error = None
    a.ready = b.ready = True
    async with running_controller(tmp_path, **settings) as h:
        await succeeded(h)
        assert (a.restarts, b.restarts) == ([RESTART], [RESTART])


async def test_a_relaunch_waiting_when_the_controller_restarts_is_not_sent_again(
    tmp_path, node_managers
) -> None:
    a, b = await node_managers(), await node_managers()
    async with running_controller(tmp_path, **FAST) as h:
        first, _ = await active_pair(h, a, b)
        await engine_event(first)
        await in_phase(h, "EngineRelaunch", "wait_ready")
    a.ready = b.ready = True
    async with running_controller(tmp_path, **FAST) as h:
        await succeeded(h)
        assert (a.restarts, b.restarts) == ([RESTART], [RESTART])


async def test_a_restart_whose_answer_died_with_the_controller_is_not_sent_twice(
    tmp_path, node_managers
) -> None:
    a, b = await node_managers(), await node_managers()
    async with running_controller(tmp_path, **FAST) as h:
        first, _ = await active_pair(h, a, b)
        a.restart_delay = b.restart_delay = 60.0  # relaunched, but the answers never come
        await engine_event(first)
        await until(lambda: a.relaunches and b.relaunches)
    a.ready = b.ready = True
    async with running_controller(tmp_path, **FAST) as h:
        await succeeded(h)
        # The relaunch counts say both took the first RESTART: nothing is sent again.
        assert (a.restarts, b.restarts) == ([RESTART], [RESTART])


async def test_an_escalation_interrupted_by_a_controller_restart_runs_once(
    tmp_path, node_managers, monkeypatch, caplog: pytest.LogCaptureFixture
) -> None:
    real = Terminate.advance

    async def stuck(self: Terminate, inst: object, rec: object) -> strategies.Step:
        await asyncio.Event().wait()  # the Controller dies here
        raise AssertionError("unreachable")

    monkeypatch.setattr(Terminate, "advance", stuck)
    a, b = await node_managers(), await node_managers()
    async with running_controller(tmp_path, **FAST) as h:
        first, _ = await active_pair(h, a, b)
        b.restart_error = REFUSED
        await engine_event(first)
        await in_phase(h, "Terminate", "stop")
    monkeypatch.setattr(Terminate, "advance", real)
    async with running_controller(tmp_path, **FAST) as h:
        await until(lambda: torn_down(caplog))
        # The failed relaunch is not retried as a new one; the escalation ran once.
        assert (a.restarts, b.restarts) == ([RESTART], [RESTART, ABORT])
        assert a.stops == [] and len(b.stops) == 1


@contextlib.asynccontextmanager
async def beating(agent, every: float = 0.1):
    async def beat() -> None:
        while True:
            await agent.beat(NORMAL)
            await asyncio.sleep(every)

    task = asyncio.create_task(beat())
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await task


async def test_a_multi_node_instance_losing_a_node_stops_the_survivors(
    tmp_path, node_managers, caplog: pytest.LogCaptureFixture
) -> None:
    a, b = await node_managers(), await node_managers()
    async with running_controller(tmp_path, instance_heartbeat_timeout_s=1, heartbeat_interval_s=0.2) as h:
        first, second = await active_pair(h, a, b)
        async with beating(second):  # a's NodeManager goes silent; b's goes on
            first.drop_stream()
            await until(lambda: torn_down(caplog))
        # b's engines were ranks of a collective group that lost a member: its pod restarts, so
        # all ranks come back together when a's node returns. a is gone: nothing to tell it.
        assert b.stops == [f"heartbeat_timeout: {a.host}:{a.port} silent"] and a.stops == []


async def test_a_restarted_node_manager_of_a_multi_node_instance_stops_the_others(
    tmp_path, node_managers, caplog: pytest.LogCaptureFixture
) -> None:
    a, b = await node_managers(), await node_managers()
    async with running_controller(tmp_path) as h:
        first, _ = await active_pair(h, a, b)
        # a's NodeManager restarted in place: a new process (incarnation) at the same address.
        a.incarnation = first.request.incarnation = 7
        await first.register()
        await until(lambda: torn_down(caplog))
        assert b.stops == [f"node_manager_restarted: {a.host}:{a.port} restarted"] and a.stops == []
