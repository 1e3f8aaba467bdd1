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


async def test_a_failed_terminate_skips_the_clear(tmp_path, node_managers, coordinator) -> None:
    p_nm, d_nm = await node_managers(), await node_managers()
    async with running_controller(tmp_path, coordinators=[coordinator.address]) as h:
        await pd_group(h, p_nm, d_nm)
        await report(h, precision_alarm())
        await p_nm.stop()  # the prefill's NodeManager cannot be reached
        req = controller_pb2.TerminateInstanceRequest(
            instance_id=2, p_instance_id=1, precision_alarm_clear=True
        )
        resp = await h.stub.TerminateInstance(req, timeout=30)
        assert not resp.terminated and not resp.precision_alarm_cleared
        assert [a.moi for a in await alarms(h, True) if a.alarm_id == PRECISION] == [MOI]
        assert coordinator.clears == []


async def test_a_coordinator_that_fails_the_clear_is_called_again(
    tmp_path, node_managers, coordinator, monkeypatch
) -> None:
    monkeypatch.setattr(recovery, "CLEAR_RETRY", (0.05, 0.1))
    coordinator.refuse_clears = 6  # more than the channel's own retries of one call
    p_nm, d_nm = await node_managers(), await node_managers()
    async with running_controller(tmp_path, coordinators=[coordinator.address]) as h:
        await pd_group(h, p_nm, d_nm)
        await report(h, precision_alarm())
        req = controller_pb2.TerminateInstanceRequest(
            instance_id=2, p_instance_id=1, precision_alarm_clear=True
        )
        resp = await h.stub.TerminateInstance(req, timeout=30)
        assert resp.terminated and resp.precision_alarm_cleared and not resp.scheduler_state_cleared
        await until(lambda: coordinator.clears == [(1, 2)], timeout=10)


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
        assert resp.precision_alarm_cleared and resp.scheduler_state_cleared
        assert not resp.precision_alarm_cleared_by_auto_recovery
        assert coordinator.clears == [(1, 2)]


async def test_auto_recovery_terminates_the_group_and_clears_the_alarm(
    tmp_path, node_managers, coordinator
) -> None:
    p_nm, d_nm = await node_managers(), await node_managers()
    async with running_controller(
        tmp_path, coordinators=[coordinator.address], precision_auto_recovery_enabled=True
    ) as h:
        await pd_group(h, p_nm, d_nm)
        resp = await report(h, precision_alarm())
        assert resp.precision_alarm_cleared_by_auto_recovery and resp.precision_alarm_cleared
        assert resp.scheduler_state_cleared
        assert d_nm.stops and p_nm.stops and d_nm.stopped_at[0] < p_nm.stopped_at[0]
        history = await alarms(h, False)
        assert [(a.alarm_id, a.category) for a in history if a.alarm_id == PRECISION] == [
            (PRECISION, alarm_pb2.ALARM_CATEGORY_ALARM),
            (PRECISION, alarm_pb2.ALARM_CATEGORY_CLEAR),
        ]
        assert not await alarms(h, True)
