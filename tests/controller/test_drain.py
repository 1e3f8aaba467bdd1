"""Planned drains (reconcile/teardown.py): a TerminateInstance first drains the instance on every
Coordinator (DrainInstances) until each reports nothing in flight or the deadline passes, and
only then deletes it and stops its NodeManagers; the drain is stored state a restarted
Controller goes on with; fault-driven removals and precision recoveries do not drain. Against
fake NodeManagers and fake Coordinators, through the Controller's gRPC API."""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import grpc
import pytest

from motor_mesh.common.enums import ACTIVE as ENUM_ACTIVE
from motor_mesh.controller.convert import instance_from_row, instance_row
from motor_mesh.controller.model import Instance, JobSpec, Member, Removal, Teardown
from motor_mesh.controller.reconcile import teardown
from motor_mesh.gen.motor.v1 import common_pb2, controller_pb2
from tests.controller.fakes import ACTIVE, FakeCoordinator, running_controller
from tests.controller.test_recovery import pd_group
from tests.poll import until


@pytest.fixture(autouse=True)
def info_records(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="motor")


def logged(caplog: pytest.LogCaptureFixture, event: str) -> list[Any]:
    """The ``fields`` of every ``event`` line so far."""
    return [r.fields for r in caplog.records if r.getMessage() == event]  # type: ignore[attr-defined]


async def terminate(
    h, instance_id: int, deadline: float = 1.0, **kw: Any
) -> controller_pb2.TerminateInstanceResponse:
    req = controller_pb2.TerminateInstanceRequest(instance_id=instance_id, reason="maintenance", **kw)
    return await h.stub.TerminateInstance(req, timeout=deadline)


def calls(coordinator: FakeCoordinator) -> list[str]:
    """The Coordinator's successful calls in order, by method."""
    return [m for m, _, ok in coordinator.calls if ok]


async def test_terminate_drains_first_then_deletes_and_stops(
    tmp_path, node_managers, coordinator, caplog
) -> None:
    nm = await node_managers()
    async with running_controller(tmp_path, coordinators=[coordinator.address]) as h:
        await h.start_node(nm, job="p")
        await until(lambda: 1 in coordinator.table)
        coordinator.in_flight[1] = 2  # two requests still on it
        # The answer comes by the deadline: the drain is recorded, not over.
        resp = await terminate(h, 1)
        assert not resp.terminated
        await until(lambda: coordinator.ok_calls("Drain"))
        assert coordinator.ok_calls("Drain")[0].ids == [1]
        assert not coordinator.ok_calls("Drain")[0].HasField("grace")  # the Coordinator's own grace
        # Asked again and again (it keeps its first deadline), but still live, routed-to by
        # nobody new, its engines running.
        await until(lambda: len(coordinator.ok_calls("Drain")) >= 3)
        assert [i.id for i in await h.instances()] == [1] and 1 in coordinator.table and not nm.stops
        assert len(coordinator.draining) == 1

        coordinator.in_flight[1] = 0  # the requests finished
        await until(lambda: nm.stops)
        assert await h.instances() == []
        order = calls(coordinator)
        assert order.index("Delete") > max(i for i, m in enumerate(order) if m == "Drain")
        assert nm.stops == ["terminated: maintenance"]
        (drained,) = logged(caplog, "instance_drained")
        assert drained["instance_id"] == 1 and drained["drained"] == coordinator.address
        assert drained["timed_out"] is False and drained["seconds"] >= 0
        assert [f["instance_id"] for f in logged(caplog, "instance_drain_started")] == [1]
        # A second terminate of a gone instance: NOT_FOUND, as before.
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await terminate(h, 1)
        assert err.value.code() == grpc.StatusCode.NOT_FOUND


async def test_a_drain_with_nothing_in_flight_answers_terminated(
    tmp_path, node_managers, coordinator
) -> None:
    nm = await node_managers()
    async with running_controller(tmp_path, coordinators=[coordinator.address]) as h:
        await h.start_node(nm, job="p")
        await until(lambda: 1 in coordinator.table)
        resp = await terminate(h, 1, deadline=10)
        assert resp.terminated and nm.stops
        assert calls(coordinator).count("Drain") >= 1


async def test_requests_that_never_finish_are_left_after_the_move_time_and_margin(
    tmp_path, node_managers, coordinator, caplog, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(teardown, "DRAIN_MARGIN_S", 0.3)
    coordinator.drain_grace_s = 0.2  # the Coordinator moves them almost at once
    nm = await node_managers()
    async with running_controller(tmp_path, coordinators=[coordinator.address]) as h:
        await h.start_node(nm, job="p")
        await until(lambda: 1 in coordinator.table)
        coordinator.in_flight[1] = 1  # and one never leaves
        await terminate(h, 1)
        await until(lambda: nm.stops, timeout=10)
        (drained,) = logged(caplog, "instance_drained")
        assert drained["timed_out"] is True and drained["undrained"] == coordinator.address
        assert drained["in_flight"] == 1
        assert await h.instances() == []


async def test_an_older_coordinator_counts_as_drained(tmp_path, node_managers, coordinator, caplog) -> None:
    coordinator.drain_unimplemented = True
    coordinator.in_flight[1] = 5  # it would not say
    nm = await node_managers()
    async with running_controller(tmp_path, coordinators=[coordinator.address]) as h:
        await h.start_node(nm, job="p")
        await until(lambda: 1 in coordinator.table)
        resp = await terminate(h, 1, deadline=10)
        assert resp.terminated and nm.stops
        (drained,) = logged(caplog, "instance_drained")
        assert drained["timed_out"] is False and drained["drained"] == coordinator.address
        assert not logged(caplog, "instance_drain_call_failed")


async def test_an_unreachable_coordinator_holds_the_drain_only_until_its_bound(
    tmp_path, node_managers, coordinator, caplog, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(teardown, "DRAIN_MARGIN_S", 0.3)
    monkeypatch.setattr(teardown, "DRAIN_UNANSWERED_S", 1.0)
    gone = await FakeCoordinator().start()
    address = gone.address
    await gone.stop()  # configured, never answers
    nm = await node_managers()
    async with running_controller(tmp_path, coordinators=[address]) as h:
        await h.start_node(nm, job="p")
        await until(lambda: h.instances(status=ACTIVE))
        await terminate(h, 1)
        await until(lambda: nm.stops, timeout=15)
        (drained,) = logged(caplog, "instance_drained")
        assert drained["timed_out"] is True and drained["undrained"] == address and drained["drained"] == ""
        # One warning for the whole drain, not one per call.
        assert [f["coordinator"] for f in logged(caplog, "instance_drain_call_failed")] == [address]


async def test_every_coordinator_must_report_drained(tmp_path, node_managers, coordinator, caplog) -> None:
    other = await FakeCoordinator().start()
    try:
        nm = await node_managers()
        async with running_controller(tmp_path, coordinators=[coordinator.address, other.address]) as h:
            await h.start_node(nm, job="p")
            await until(lambda: 1 in coordinator.table and 1 in other.table)
            other.in_flight[1] = 1
            await terminate(h, 1)
            await until(lambda: other.ok_calls("Drain") and coordinator.ok_calls("Drain"))
            await until(lambda: len(other.ok_calls("Drain")) >= 3)
            assert not nm.stops and [i.id for i in await h.instances()] == [1]
            other.in_flight[1] = 0
            await until(lambda: nm.stops)
            (drained,) = logged(caplog, "instance_drained")
            assert drained["drained"] == ",".join(sorted([coordinator.address, other.address]))
    finally:
        await other.stop()


async def test_a_drain_goes_on_after_a_controller_restart_with_its_deadline(
    tmp_path, node_managers, coordinator, caplog
) -> None:
    nm = await node_managers()
    async with running_controller(tmp_path, coordinators=[coordinator.address]) as h:
        await h.start_node(nm, job="p")
        await until(lambda: 1 in coordinator.table)
        coordinator.in_flight[1] = 1
        await terminate(h, 1)
        await until(lambda: coordinator.ok_calls("Drain"))
        stored = await until(lambda: (td := h.controller.table.live[1].teardown) and td.drain_until and td)
    first_move = coordinator.draining[1]
    async with running_controller(tmp_path, coordinators=[coordinator.address]) as h:
        # Still draining, with the same record: not started anew, not given up.
        inst = h.controller.table.live[1]
        assert inst.teardown is not None
        assert (inst.teardown.drain_started, inst.teardown.drain_until) == (
            stored.drain_started,
            stored.drain_until,
        )
        seen = len(coordinator.ok_calls("Drain"))
        await until(lambda: len(coordinator.ok_calls("Drain")) > seen)
        assert [i.id for i in await h.instances()] == [1] and not nm.stops
        coordinator.in_flight[1] = 0
        await until(lambda: nm.stops)
        assert coordinator.draining.get(1, first_move) == first_move
        assert len(logged(caplog, "instance_drain_started")) == 1
        assert len(logged(caplog, "instance_drained")) == 1


async def test_a_pd_group_drains_both_and_stops_decode_first(tmp_path, node_managers, coordinator) -> None:
    p_nm, d_nm = await node_managers(), await node_managers()
    async with running_controller(tmp_path, coordinators=[coordinator.address]) as h:
        await pd_group(h, p_nm, d_nm)
        await until(lambda: {1, 2} <= coordinator.table.keys())
        coordinator.in_flight.update({1: 1, 2: 1})
        await terminate(h, 2, p_instance_id=1)
        # Both are drained at once: neither waits for the other's drain to start.
        await until(lambda: {tuple(r.ids) for r in coordinator.ok_calls("Drain")} == {(1,), (2,)})
        assert not (p_nm.stops or d_nm.stops)
        coordinator.in_flight.update({1: 0, 2: 0})
        await until(lambda: p_nm.stops and d_nm.stops)
        assert d_nm.stopped_at[0] < p_nm.stopped_at[0]  # decode first


async def test_a_precision_recovery_terminate_does_not_drain(tmp_path, node_managers, coordinator) -> None:
    p_nm, d_nm = await node_managers(), await node_managers()
    async with running_controller(tmp_path, coordinators=[coordinator.address]) as h:
        await pd_group(h, p_nm, d_nm)
        await until(lambda: {1, 2} <= coordinator.table.keys())
        coordinator.in_flight.update({1: 3, 2: 3})
        # The operator's side of a precision recovery: the engines answer garbage, nothing is
        # kept on them.
        req = controller_pb2.TerminateInstanceRequest(
            instance_id=2, p_instance_id=1, precision_alarm_clear=True
        )
        resp = await h.stub.TerminateInstance(req, timeout=10)
        assert resp.terminated and d_nm.stops and p_nm.stops
        assert coordinator.count("Drain") == 0


async def test_a_fault_driven_removal_does_not_drain(tmp_path, node_managers, coordinator) -> None:
    nm = await node_managers()
    async with running_controller(
        tmp_path, coordinators=[coordinator.address], instance_heartbeat_timeout_s=1.5
    ) as h:
        agent = await h.start_node(nm, job="p")
        await until(lambda: 1 in coordinator.table)
        coordinator.in_flight[1] = 3
        agent.drop_stream()  # and silent from now on: the heartbeat timeout deletes it
        await until(lambda: h.instances(status=common_pb2.INSTANCE_STATUS_DELETED), timeout=10)
        await until(lambda: 1 not in coordinator.table)
        assert coordinator.count("Drain") == 0


def test_the_drain_is_stored_with_the_instance() -> None:
    ep = common_pb2.Endpoint(id=0, host="h", port=10000)
    member = Member(0, "h", 7300, [10000])
    member.attach([ep])
    td = Teardown(
        Removal.TERMINATED,
        "maintenance",
        stop=("h:7300",),
        drain=True,
        drain_started=1700000000.5,
        drain_until=1700000035.5,
        drained=("c:7200",),
    )
    inst = Instance(
        id=3,
        job_name="j",
        spec=JobSpec(role=1, model_name="m", engine_type=3, pd_protocol=1),
        status=ENUM_ACTIVE,
        endpoints=[ep],
        members=[member],
        teardown=td,
    )
    loaded = instance_from_row(3, *instance_row(inst))
    assert loaded.teardown == td and loaded.teardown.draining
    done = dataclasses.replace(td, drain_done=True)
    assert not done.draining
    # A record written before drains existed loads as one that does not drain.
    old = Teardown(Removal.TERMINATED, "x")
    assert not instance_from_row(3, *instance_row(dataclasses.replace(inst, teardown=old))).teardown.draining
