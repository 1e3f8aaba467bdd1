"""The fault manager and the relaunch strategy, against fake NodeManagers: what each NodeManager
is told (RestartEngines RESTART / ABORT, Stop), what GetFaultToleranceStatus shows, and what
becomes of the instance."""

from __future__ import annotations

import logging
from typing import Any

import grpc
import pytest
from google.rpc import error_details_pb2

from motor_mesh.common import errors
from motor_mesh.controller.faults import manager as faults
from motor_mesh.controller.faults.strategies import EngineRelaunch
from motor_mesh.gen.motor.v1 import controller_pb2, nodemanager_pb2
from tests.controller.fakes import ABNORMAL, ACTIVE, INACTIVE, NORMAL, running_controller
from tests.poll import until

RESTART, ABORT = nodemanager_pb2.RESTART_ACTION_RESTART, nodemanager_pb2.RESTART_ACTION_ABORT
UNAVAILABLE = errors.error_info(grpc.StatusCode.UNAVAILABLE, "TEST_DOWN", "test: down")
# The shortest waits the configuration allows: a failing wait ends on the unreachable threshold.
FAST = {"engine_relaunch_poll_interval_s": 1, "engine_relaunch_dispatch_retries": 0}


@pytest.fixture(autouse=True)
def info_records(caplog: pytest.LogCaptureFixture) -> None:
    """Events (info) are what some tests wait for: instance_torn_down."""
    caplog.set_level(logging.INFO, logger="motor")


async def active_pair(h, a, b, **agent):
    """One instance over NodeManagers ``a`` and ``b`` (dp 2), ACTIVE; their agents."""
    first = h.agent(job="j", nm=a, ports=(10000,), dp=2, **agent)
    second = h.agent(job="j", nm=b, ports=(10002,), dp=2, **agent)
    await first.register()
    await second.register()
    await until(lambda: a.starts and b.starts)
    await first.beat(NORMAL)
    await second.beat(NORMAL)
    await until(lambda: h.instances(status=ACTIVE))
    return first, second


async def engine_event(agent, kind: int = controller_pb2.ENGINE_EVENT_TYPE_DEAD) -> None:
    """``agent``'s engine reported dead (or unhealthy): its endpoint id is the one its StartEngines
    gave it, its pid the fake NodeManager's 40000 + id."""
    ep_id = agent.nm.starts[-1].endpoints[0].id
    await agent.event(ep_id, 40000 + ep_id, kind)


async def fault_status(h, instance_id: int = 0) -> list[controller_pb2.FaultToleranceEntry]:
    req = controller_pb2.GetFaultToleranceStatusRequest(instance_id=instance_id)
    return list((await h.stub.GetFaultToleranceStatus(req, timeout=5)).instances)


async def test_a_dead_engine_is_relaunched_on_every_node_together(tmp_path, node_managers) -> None:
    a, b = await node_managers(), await node_managers()
    async with running_controller(tmp_path, **FAST) as h:
        first, _ = await active_pair(h, a, b)
        (entry,) = await fault_status(h)
        assert (entry.fault_level, entry.strategy, list(entry.history)) == (0, "", [])
        await engine_event(first)
        await until(lambda: h.instances(status=INACTIVE))
        # Both ranks restart, not only the one whose engine died; nothing is aborted.
        await until(lambda: a.restarts and b.restarts)
        assert (a.restarts, b.restarts) == ([RESTART], [RESTART])

        async def phase() -> tuple[int, str, str] | None:
            # The phase is written once every RestartEngines has answered, a moment after the
            # fakes recorded them: "restart" is the only not-yet.
            (e,) = await fault_status(h)
            return None if e.phase == "restart" else (e.fault_level, e.strategy, e.phase)

        assert await until(phase) == (2, "EngineRelaunch", "wait_ready")
        a.ready = b.ready = True

        async def done() -> controller_pb2.FaultToleranceEntry | None:
            (e,) = await fault_status(h)
            return e if e.history else None

        entry = await until(done)
        assert entry.strategy == "" and "EngineRelaunch succeeded" in entry.history[0]
        assert (a.restarts, b.restarts, a.stops, b.stops) == ([RESTART], [RESTART], [], [])


async def test_an_unreachable_node_manager_aborts_the_relaunch_everywhere(tmp_path, node_managers) -> None:
    a, b = await node_managers(), await node_managers()
    async with running_controller(tmp_path, **FAST) as h:
        first, _ = await active_pair(h, a, b)
        b.status_error = UNAVAILABLE  # the probe before the relaunch fails
        await engine_event(first)
        # Phase 2 at once for all: no RESTART anywhere, an ABORT to each.
        await until(lambda: a.restarts and b.restarts)
        assert (a.restarts, b.restarts) == ([ABORT], [ABORT])


async def test_abort_goes_only_where_the_restart_was_refused(tmp_path, node_managers) -> None:
    a, b = await node_managers(), await node_managers()
    async with running_controller(tmp_path, **FAST) as h:
        first, _ = await active_pair(h, a, b)
        b.restart_error = errors.error_info(grpc.StatusCode.INTERNAL, "RELAUNCH_FAILED", "test: cannot start")
        await engine_event(first)
        await until(lambda: len(b.restarts) == 2)
        assert (a.restarts, b.restarts) == ([RESTART], [RESTART, ABORT])  # a's engines stay held


async def test_a_restart_already_running_counts_as_accepted(tmp_path, node_managers) -> None:
    a, b = await node_managers(), await node_managers()
    async with running_controller(tmp_path, **FAST) as h:
        first, _ = await active_pair(h, a, b)
        b.restart_error = errors.error_info(grpc.StatusCode.ABORTED, "RELAUNCH_IN_PROGRESS", "test: running")
        a.ready = b.ready = True
        await engine_event(first)

        async def history() -> list[str]:
            (e,) = await fault_status(h)
            return list(e.history)

        assert "EngineRelaunch succeeded" in (await until(history))[0]
        assert (a.restarts, b.restarts) == ([RESTART], [RESTART])


async def test_a_failed_relaunch_escalates_to_terminating_the_instance(
    tmp_path, node_managers, caplog: pytest.LogCaptureFixture
) -> None:
    a, b = await node_managers(), await node_managers()
    async with running_controller(tmp_path, **FAST, engine_relaunch_nm_unreachable_threshold=1) as h:
        first, _ = await active_pair(h, a, b)
        await engine_event(first)
        await until(lambda: a.restarts and b.restarts)
        a.status_error = UNAVAILABLE  # a goes away while the engines come up
        # The relaunch fails; both restarts were accepted, so nothing is aborted and nobody is
        # stopped: each is left to finish recovering or to let its freeze expire. The instance
        # is gone.
        await until(lambda: logged(caplog, "instance_torn_down"))
        assert await h.instances() == []
        assert (a.restarts, b.restarts, a.stops, b.stops) == ([RESTART], [RESTART], [], [])


def crash_in_wait_ready(monkeypatch: pytest.MonkeyPatch, times: int) -> None:
    """The relaunch hits a bug (RuntimeError) when it starts waiting, ``times`` times; then it
    runs as written. Retries come after 10 ms instead of seconds."""
    monkeypatch.setattr(faults, "RESTART_BACKOFF", (0.01, 0.02))
    real = EngineRelaunch._wait_ready
    crashes = 0

    async def wait_ready(self: EngineRelaunch, inst: Any, rec: Any) -> Any:
        nonlocal crashes
        if crashes < times:
            crashes += 1
            raise RuntimeError("test: a bug")
        return await real(self, inst, rec)

    monkeypatch.setattr(EngineRelaunch, "_wait_ready", wait_ready)


def logged(caplog: pytest.LogCaptureFixture, event: str) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.getMessage() == event]


async def test_a_crashing_relaunch_is_run_again_and_succeeds(
    tmp_path, node_managers, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    crash_in_wait_ready(monkeypatch, times=2)
    a, b = await node_managers(), await node_managers()
    async with running_controller(tmp_path, **FAST) as h:
        first, _ = await active_pair(h, a, b)
        a.ready = b.ready = True
        await engine_event(first)

        async def done() -> controller_pb2.FaultToleranceEntry | None:
            (e,) = await fault_status(h)
            return e if e.history and not e.strategy else None

        entry = await until(done)
        assert "EngineRelaunch succeeded" in entry.history[0] and len(entry.history) == 1
        # The crashed step is tried again where it was: the RESTART already sent is not repeated.
        assert (a.restarts, b.restarts) == ([RESTART], [RESTART])
        assert a.stops == b.stops == []
        await until(lambda: h.instances(status=ACTIVE))  # the next reconcile turns it ACTIVE
        crashes = logged(caplog, "strategy_crashed")
        assert len(crashes) == 2 and all(
            r.exc_info and isinstance(r.exc_info[1], RuntimeError) for r in crashes
        )
        assert logged(caplog, "strategy_failed") == []


async def test_a_relaunch_that_keeps_crashing_fails_and_escalates(
    tmp_path, node_managers, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    crash_in_wait_ready(monkeypatch, times=100)
    a, b = await node_managers(), await node_managers()
    async with running_controller(tmp_path, **FAST) as h:
        first, _ = await active_pair(h, a, b)
        await engine_event(first)
        await until(lambda: logged(caplog, "instance_torn_down"))  # escalated to Terminate
        runs = faults.STRATEGY_RESTARTS + 1
        assert (a.restarts, b.restarts) == ([RESTART], [RESTART])
        assert len(logged(caplog, "strategy_crashed")) == runs
        [failure] = logged(caplog, "strategy_failed")
        assert f"failed {runs} times, last: RuntimeError: test: a bug" in failure.fields["reason"]  # type: ignore[attr-defined]
        assert a.stops == b.stops == []  # both had accepted the restart


async def test_engines_that_die_again_fail_the_relaunch_at_once(
    tmp_path, node_managers, caplog: pytest.LogCaptureFixture
) -> None:
    a, b = await node_managers(), await node_managers()
    # Complete timeout 10 minutes: only the fast failure can end it within the test.
    async with running_controller(tmp_path, **FAST, engine_relaunch_complete_timeout_s=600) as h:
        first, _ = await active_pair(h, a, b)
        b.engines_dead = True  # its relaunched engine starts, then dies
        await engine_event(first)
        await until(lambda: logged(caplog, "instance_torn_down"))  # escalated to Terminate
        assert (a.restarts, b.restarts) == ([RESTART], [RESTART])
        assert a.stops == b.stops == []


async def test_relaunch_disabled_leaves_recovery_to_the_pods(tmp_path, node_managers) -> None:
    a, b = await node_managers(), await node_managers()
    async with running_controller(tmp_path, **FAST, enable_engine_relaunch=False) as h:
        first, _ = await active_pair(h, a, b)
        other = await node_managers()
        assert not (await h.agent(job="k", nm=other).register()).engine_relaunch_enabled
        await engine_event(first)
        await until(lambda: h.instances(status=INACTIVE))
        (entry,) = await fault_status(h, 1)
        assert (entry.fault_level, entry.strategy) == (2, "")
        assert a.restarts == b.restarts == []


async def test_a_lost_death_report_is_corrected_by_the_next_beat(tmp_path, node_managers) -> None:
    a, b = await node_managers(), await node_managers()
    async with running_controller(tmp_path, **FAST) as h:
        first, _ = await active_pair(h, a, b)
        # No engine event: only the beat saying the engine is ABNORMAL with no process.
        await first.beat(ABNORMAL, pids=(0,))
        await until(lambda: a.restarts and b.restarts)
        assert (a.restarts, b.restarts) == ([RESTART], [RESTART])


async def test_fault_status_of_an_unknown_instance_is_not_found(tmp_path) -> None:
    async with running_controller(tmp_path) as h:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await fault_status(h, 42)
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
        assert await fault_status(h) == []


async def test_an_unhealthy_but_running_engine_is_not_relaunched(tmp_path, node_managers) -> None:
    a, b = await node_managers(), await node_managers()
    async with running_controller(tmp_path, **FAST) as h:
        first, _ = await active_pair(h, a, b)
        await engine_event(first, controller_pb2.ENGINE_EVENT_TYPE_UNHEALTHY)
        await until(lambda: h.instances(status=INACTIVE))
        (entry,) = await fault_status(h)
        assert (entry.fault_level, entry.strategy) == (0, "")
        assert a.restarts == b.restarts == []
        await first.beat(NORMAL)
        await until(lambda: h.instances(status=ACTIVE))


# ---- reported faults (ReportFaults) ------------------------------------------------------------


def fault(nm, level: int = 0, code: str = "", cleared: bool = False) -> controller_pb2.NodeFault:
    return controller_pb2.NodeFault(
        host=nm.host,
        nm_port=nm.port,
        level=level,
        code=code,
        reason="test",
        cleared=cleared,  # type: ignore[arg-type]
    )


async def report(h, *faults: controller_pb2.NodeFault) -> list[int]:
    resp = await h.stub.ReportFaults(controller_pb2.ReportFaultsRequest(faults=faults), timeout=5)
    return list(resp.affected_instance_ids)


async def test_above_l2_the_instance_is_separated_until_cleared(tmp_path, node_managers) -> None:
    a, b = await node_managers(), await node_managers()
    async with running_controller(tmp_path, **FAST) as h:
        await active_pair(h, a, b)
        assert await report(h, fault(b, controller_pb2.FAULT_LEVEL_L1, "ecc")) == [1]
        (entry,) = await fault_status(h)
        assert entry.fault_level == 1 and await h.instances(status=ACTIVE)  # L1: shown, not handled
        await report(h, fault(b, controller_pb2.FAULT_LEVEL_L4, "link"))
        await until(lambda: h.instances(status=INACTIVE))
        (entry,) = await fault_status(h)
        assert entry.fault_level == 4
        await report(h, fault(b, code="link", cleared=True))
        await until(lambda: h.instances(status=ACTIVE))  # the engines were fine all along
        (entry,) = await fault_status(h)
        assert entry.fault_level == 1  # "ecc" is still there
        assert a.restarts == b.restarts == []


async def test_an_l2_restart_request_relaunches_and_is_then_consumed(tmp_path, node_managers) -> None:
    a, b = await node_managers(), await node_managers()
    async with running_controller(tmp_path, **FAST) as h:
        await active_pair(h, a, b)
        a.ready = b.ready = True
        await report(h, fault(a, controller_pb2.FAULT_LEVEL_L2, "restart"))

        async def relaunched() -> controller_pb2.FaultToleranceEntry | None:
            (e,) = await fault_status(h)
            return e if e.history and not e.strategy else None

        entry = await until(relaunched)
        assert "EngineRelaunch succeeded" in entry.history[0] and entry.fault_level == 0
        assert (a.restarts, b.restarts) == ([RESTART], [RESTART])


async def test_a_separating_fault_stops_a_running_relaunch(tmp_path, node_managers) -> None:
    a, b = await node_managers(), await node_managers()
    async with running_controller(tmp_path, **FAST) as h:
        first, _ = await active_pair(h, a, b)
        await engine_event(first)
        await until(lambda: a.restarts and b.restarts)  # relaunching; the engines do not come up
        await report(h, fault(b, controller_pb2.FAULT_LEVEL_L5, "device"))

        async def stopped() -> controller_pb2.FaultToleranceEntry | None:
            (e,) = await fault_status(h)
            return e if e.history else None

        entry = await until(stopped)
        assert (entry.strategy, entry.fault_level) == ("", 5)
        assert "EngineRelaunch stopped" in entry.history[0]
        assert (a.restarts, b.restarts) == ([RESTART], [RESTART])  # both accepted: nothing to abort


async def test_bad_fault_reports_change_nothing(tmp_path, node_managers) -> None:
    a, b = await node_managers(), await node_managers()
    async with running_controller(tmp_path, **FAST) as h:
        await active_pair(h, a, b)
        unknown = controller_pb2.NodeFault(
            host="127.0.0.9", nm_port=7300, level=controller_pb2.FAULT_LEVEL_L3
        )
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await report(h, fault(a, controller_pb2.FAULT_LEVEL_L6), unknown)
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
        [info] = [d for d in errors.details_of(err.value) if isinstance(d, error_details_pb2.ResourceInfo)]
        assert info.resource_name == "127.0.0.9:7300"
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await report(h, fault(a))  # no level, not a clear
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        (entry,) = await fault_status(h)
        assert entry.fault_level == 0 and await h.instances(status=ACTIVE)


async def test_reported_faults_and_history_survive_a_controller_restart(tmp_path, node_managers) -> None:
    a, b = await node_managers(), await node_managers()
    async with running_controller(tmp_path, **FAST) as h:
        await active_pair(h, a, b)
        a.ready = b.ready = True
        await report(h, fault(a, controller_pb2.FAULT_LEVEL_L2, "restart"))

        async def history() -> list[str]:
            (e,) = await fault_status(h)
            return list(e.history) if not e.strategy else []

        await until(history)
        await report(h, fault(b, controller_pb2.FAULT_LEVEL_L1, "ecc"))
    async with running_controller(tmp_path, **FAST) as h:  # the same state_dir

        async def restored() -> controller_pb2.FaultToleranceEntry | None:
            (e,) = await fault_status(h, 1)
            return e if e.fault_level == 1 else None

        entry = await until(restored)  # the L1 fault is back; the consumed L2 is not
        assert "EngineRelaunch succeeded" in entry.history[0]
