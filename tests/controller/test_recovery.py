"""The recovery service (services/controller/faults/recovery.py): TerminateInstance, the precision alarm
clear paths, and automatic precision recovery, through the Controller's gRPC API with fake
NodeManagers and a fake Coordinator."""

from __future__ import annotations

import grpc
import pytest

from motor_mesh.controller.alarms.store import INSTANCE_FAULT, PRECISION, precision_moi
from motor_mesh.controller.faults import recovery
from motor_mesh.gen.motor.v1 import alarm_pb2, common_pb2, controller_pb2
from tests.controller.fakes import ACTIVE, running_controller
from tests.poll import until

MOI = precision_moi("127.0.0.1", 1, 2)


async def pd_group(h, p_nm, d_nm):
    """A prefill instance (id 1) and a decode instance (id 2), both ACTIVE."""
    p = await h.start_node(p_nm, job="p", role=common_pb2.ROLE_PREFILL)
    d = await h.start_node(d_nm, job="d", role=common_pb2.ROLE_DECODE, ports=(10002,))
    await until(lambda: len(h.controller.table.find(status=ACTIVE)) == 2)
    return p, d


def precision_alarm(category=alarm_pb2.ALARM_CATEGORY_ALARM, p: int = 1, d: int = 2) -> alarm_pb2.Alarm:
    return alarm_pb2.Alarm(
        alarm_id=PRECISION,
        category=category,
        severity=alarm_pb2.SEVERITY_MAJOR,
        moi=precision_moi("127.0.0.1", p, d),
        alarm_name="Precision issue",
        instance_id=d,
        p_instance_id=p,
    )


async def report(h, *alarms) -> controller_pb2.ReportAlarmsResponse:
    return await h.stub.ReportAlarms(controller_pb2.ReportAlarmsRequest(alarms=alarms), timeout=10)


async def alarms(h, active_only: bool) -> list[alarm_pb2.Alarm]:
    """Oldest first (ListAlarms pages newest first)."""
    req = controller_pb2.ListAlarmsRequest(active_only=active_only, page_size=1000)
    return sorted((await h.stub.ListAlarms(req, timeout=5)).alarms, key=lambda a: a.sequence)


async def test_terminate_stops_decode_then_prefill_and_clears_the_precision_alarm(
    tmp_path, node_managers, coordinator
) -> None:
    p_nm, d_nm = await node_managers(), await node_managers()
    async with running_controller(tmp_path, coordinators=[coordinator.address]) as h:
        await pd_group(h, p_nm, d_nm)
        await report(h, precision_alarm())
        req = controller_pb2.TerminateInstanceRequest(
            instance_id=2, p_instance_id=1, precision_alarm_clear=True, reason="operator"
        )
        resp = await h.stub.TerminateInstance(req, timeout=10)
        assert (resp.terminated, resp.precision_alarm_cleared, resp.scheduler_state_cleared) == (
            True,
            True,
            True,
        )
        assert resp.moi == MOI
        assert d_nm.stopped_at[0] < p_nm.stopped_at[0]  # decode first
        assert coordinator.clears == [(1, 2)]
        assert not [a for a in await alarms(h, True) if a.alarm_id == PRECISION]
        cleared = [a for a in await alarms(h, False) if a.category == alarm_pb2.ALARM_CATEGORY_CLEAR]
        assert [a.moi for a in cleared] == [MOI]
        # Removed on purpose: no instance fault alarm for either.
        assert not [a for a in await alarms(h, True) if a.alarm_id == INSTANCE_FAULT]
        assert not await h.instances()


async def test_without_an_active_precision_alarm_nothing_is_cleared(
    tmp_path, node_managers, coordinator
) -> None:
    p_nm, d_nm = await node_managers(), await node_managers()
    async with running_controller(tmp_path, coordinators=[coordinator.address]) as h:
        await pd_group(h, p_nm, d_nm)
        # A plain record of the group that is not a precision alarm clears nothing.
        other = precision_alarm()
        other.alarm_id = INSTANCE_FAULT
        other.category = alarm_pb2.ALARM_CATEGORY_EVENT
        await report(h, other)
        req = controller_pb2.TerminateInstanceRequest(
            instance_id=2, p_instance_id=1, precision_alarm_clear=True
        )
        resp = await h.stub.TerminateInstance(req, timeout=10)
        assert resp.terminated and not resp.precision_alarm_cleared and resp.moi == ""
        assert coordinator.clears == []


async def test_a_terminate_that_misses_a_node_manager_still_deletes_and_clears(
    tmp_path, node_managers, coordinator
) -> None:
    p_nm, d_nm = await node_managers(), await node_managers()
    async with running_controller(tmp_path, coordinators=[coordinator.address]) as h:
        await pd_group(h, p_nm, d_nm)
        await report(h, precision_alarm())
        await p_nm.stop()  # the prefill's NodeManager cannot be reached
        req = controller_pb2.TerminateInstanceRequest(
            instance_id=2, p_instance_id=1, precision_alarm_clear=True
        )
        resp = await h.stub.TerminateInstance(req, timeout=30)
        # Out of routing all the same (its NodeManager registers again when it is back), so the
        # group's alarm is cleared and the Coordinator told.
        assert not resp.terminated and resp.precision_alarm_cleared and resp.scheduler_state_cleared
        assert not await h.instances() and d_nm.stops
        assert not [a for a in await alarms(h, True) if a.alarm_id == PRECISION]
        assert coordinator.clears == [(1, 2)]


async def test_a_coordinator_that_fails_the_clear_is_called_again(
    tmp_path, node_managers, coordinator
) -> None:
    coordinator.refuse_clears = 1_000_000
    p_nm, d_nm = await node_managers(), await node_managers()
    async with running_controller(tmp_path, coordinators=[coordinator.address]) as h:
        await pd_group(h, p_nm, d_nm)
        await report(h, precision_alarm())
        req = controller_pb2.TerminateInstanceRequest(
            instance_id=2, p_instance_id=1, precision_alarm_clear=True
        )
        # The answer comes by the deadline with what is done; the reconcile keeps calling.
        resp = await h.stub.TerminateInstance(req, timeout=3)
        assert resp.terminated and resp.precision_alarm_cleared and not resp.scheduler_state_cleared
        coordinator.refuse_clears = 0
        await until(lambda: coordinator.clears == [(1, 2)], timeout=15)


async def test_terminate_errors(tmp_path) -> None:
    async with running_controller(tmp_path) as h:
        for req, code in [
            (controller_pb2.TerminateInstanceRequest(), grpc.StatusCode.INVALID_ARGUMENT),
            (controller_pb2.TerminateInstanceRequest(instance_id=99), grpc.StatusCode.NOT_FOUND),
        ]:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await h.stub.TerminateInstance(req, timeout=5)
            assert err.value.code() == code


async def test_a_reported_clear_of_an_active_alarm_says_so(tmp_path, coordinator) -> None:
    async with running_controller(tmp_path, coordinators=[coordinator.address]) as h:
        assert not (await report(h, precision_alarm(alarm_pb2.ALARM_CATEGORY_CLEAR))).precision_alarm_cleared
        await report(h, precision_alarm())
        resp = await report(h, precision_alarm(alarm_pb2.ALARM_CATEGORY_CLEAR))
        assert resp.precision_alarm_cleared and not resp.precision_recovery_pending
        await until(lambda: coordinator.clears == [(1, 2)])  # told after the answer


async def auto_recovered(h, coordinator, p_nm, d_nm) -> None:
    """The pair is gone (decode stopped first), the alarm cleared with its moi, the Coordinator
    told."""
    await until(lambda: coordinator.clears == [(1, 2)], timeout=30)
    await until(lambda: p_nm.stops)  # the prefill goes once the decode is gone

    async def none_left() -> bool:
        return not await h.instances()

    await until(none_left)
    assert d_nm.stops and d_nm.stopped_at[0] < p_nm.stopped_at[0]
    precision = [a for a in await alarms(h, False) if a.alarm_id == PRECISION]
    assert [(a.category, a.moi) for a in precision] == [
        (alarm_pb2.ALARM_CATEGORY_ALARM, MOI),
        (alarm_pb2.ALARM_CATEGORY_CLEAR, MOI),
    ]
    assert precision[1].reason == "cleared by recovery: precision_recovery"
    assert not await alarms(h, True)


async def test_auto_recovery_answers_at_once_then_terminates_the_group_and_clears_the_alarm(
    tmp_path, node_managers, coordinator
) -> None:
    p_nm, d_nm = await node_managers(), await node_managers()
    # Engines that take longer to stop than the Coordinator waits for its report's answer.
    p_nm.stop_delay = d_nm.stop_delay = 3.0
    async with running_controller(
        tmp_path, coordinators=[coordinator.address], precision_auto_recovery_enabled=True
    ) as h:
        await pd_group(h, p_nm, d_nm)
        resp = await h.stub.ReportAlarms(
            controller_pb2.ReportAlarmsRequest(alarms=[precision_alarm()]), timeout=2
        )
        assert resp.precision_recovery_pending and not resp.precision_alarm_cleared
        await auto_recovered(h, coordinator, p_nm, d_nm)


async def test_auto_recovery_interrupted_by_a_controller_restart_finishes_after_it(
    tmp_path, node_managers, coordinator
) -> None:
    p_nm, d_nm = await node_managers(), await node_managers()
    d_nm.stop_delay = 60.0  # the first Controller never sees the decode's Stop answered
    settings = {"coordinators": [coordinator.address], "precision_auto_recovery_enabled": True}
    async with running_controller(tmp_path, **settings) as h:
        await pd_group(h, p_nm, d_nm)
        await report(h, precision_alarm())
        await until(lambda: d_nm.stops)
    assert coordinator.clears == [] and not p_nm.stops
    d_nm.stop_delay = 0.0
    async with running_controller(tmp_path, **settings) as h:
        await auto_recovered(h, coordinator, p_nm, d_nm)
        assert len(d_nm.stops) == 2  # the unfinished round is sent again


async def test_a_precision_alarm_of_instances_that_are_gone_is_cleared(
    tmp_path, node_managers, coordinator
) -> None:
    p_nm, d_nm = await node_managers(), await node_managers()
    async with running_controller(tmp_path, coordinators=[coordinator.address]) as h:
        await pd_group(h, p_nm, d_nm)
        await report(h, precision_alarm())
        await h.stub.TerminateInstance(controller_pb2.TerminateInstanceRequest(instance_id=2), timeout=10)

        async def cleared() -> list[alarm_pb2.Alarm]:
            return [a for a in await alarms(h, False) if a.category == alarm_pb2.ALARM_CATEGORY_CLEAR]

        [clear] = await until(cleared)
        assert (clear.moi, clear.reason) == (MOI, recovery.INSTANCE_GONE)
        assert coordinator.clears == []  # nothing of the group to reset: it is not recovered


async def test_an_alarm_reported_after_the_group_was_recovered_is_cleared_as_gone(
    tmp_path, node_managers, coordinator
) -> None:
    p_nm, d_nm = await node_managers(), await node_managers()
    settings = {"coordinators": [coordinator.address], "precision_auto_recovery_enabled": True}
    async with running_controller(tmp_path, **settings) as h:
        await pd_group(h, p_nm, d_nm)
        await report(h, precision_alarm())
        await auto_recovered(h, coordinator, p_nm, d_nm)
        # A late report about the group (another Coordinator's samples, say): nothing left to
        # recover, so it is cleared as gone.
        await report(h, precision_alarm())

        async def gone() -> alarm_pb2.Alarm | None:
            cleared = [a for a in await alarms(h, False) if a.category == alarm_pb2.ALARM_CATEGORY_CLEAR]
            return cleared[-1] if cleared and cleared[-1].reason == recovery.INSTANCE_GONE else None

        await until(gone)
        assert not await alarms(h, True)
