"""The Controller in-process with fake NodeManagers and a fake Coordinator: registration to
ACTIVE, engine death, heartbeat timeout, stale sessions and bad input."""

from __future__ import annotations

import gc

import grpc
import pytest
from google.rpc import error_details_pb2

from motor_mesh.common.errors import details_of
from motor_mesh.gen.motor.v1 import common_pb2, controller_pb2
from tests.controller.fakes import (
    ABNORMAL,
    ACTIVE,
    DELETED,
    EP_PAUSED,
    INACTIVE,
    NORMAL,
    PAUSED,
    WAIT,
    FakeCoordinator,
    running_controller,
)
from tests.poll import until
from tests.test_gcpolicy import SlowToFree


async def test_register_to_active_reaches_the_coordinator(tmp_path, node_managers, coordinator) -> None:
    nm = await node_managers()
    async with running_controller(tmp_path, coordinators=[coordinator.address]) as h:
        agent = h.agent(job="p", nm=nm)
        await agent.register()
        await until(lambda: nm.starts)
        assert (await agent.beat(WAIT)).ack.seq == 1
        assert (await h.instances())[0].status != ACTIVE
        await agent.beat(NORMAL, pids=(1234,))
        [inst] = await until(lambda: h.instances(status=ACTIVE))
        assert inst.endpoints[0].status == NORMAL and inst.endpoints[0].pid == 1234
        await until(lambda: 1 in coordinator.table)
        [add] = coordinator.ok_calls("Add")
        assert add.instances[0].status == ACTIVE and add.instances[0].job_name == "p"


async def test_engine_death_separates_and_recovery_readds(tmp_path, node_managers, coordinator) -> None:
    nm = await node_managers()
    async with running_controller(tmp_path, coordinators=[coordinator.address]) as h:
        agent = h.agent(job="p", nm=nm)
        await agent.register()
        await until(lambda: nm.starts)
        await agent.beat(NORMAL, pids=(1234,))
        await until(lambda: 1 in coordinator.table)
        ack = await agent.event(endpoint_id=0, pid=1234)
        assert ack.ack.seq == agent.seq
        await until(lambda: h.instances(status=INACTIVE))
        await until(lambda: 1 not in coordinator.table)
        # A stale beat still showing the dead pid healthy does not bring it back.
        await agent.beat(NORMAL, pids=(1234,))
        assert (await h.instances())[0].status == INACTIVE
        await agent.beat(NORMAL, pids=(5678,))  # relaunched engine
        await until(lambda: h.instances(status=ACTIVE))
        await until(lambda: 1 in coordinator.table)
        assert coordinator.count("Add", ok=True) == 2 and coordinator.count("Delete", ok=True) == 1


async def test_pause_and_resume(tmp_path, node_managers, coordinator) -> None:
    nm = await node_managers()
    async with running_controller(tmp_path, coordinators=[coordinator.address]) as h:
        agent = h.agent(job="p", nm=nm)
        await agent.register()
        await until(lambda: nm.starts)
        await agent.beat(NORMAL)
        await until(lambda: 1 in coordinator.table)
        await agent.beat(EP_PAUSED)
        await until(lambda: h.instances(status=PAUSED))
        await until(lambda: 1 in coordinator.paused)
        await agent.beat(NORMAL)
        await until(lambda: h.instances(status=ACTIVE))
        await until(lambda: 1 not in coordinator.paused)


async def test_broken_stream_deletes_after_timeout(tmp_path, node_managers, coordinator) -> None:
    nm = await node_managers()
    async with running_controller(
        tmp_path, coordinators=[coordinator.address], instance_heartbeat_timeout_s=0.5
    ) as h:
        agent = h.agent(job="p", nm=nm)
        await agent.register()
        await until(lambda: nm.starts)
        await agent.beat(NORMAL)
        await until(lambda: 1 in coordinator.table)
        agent.drop_stream()
        [gone] = await until(lambda: h.instances(status=DELETED), timeout=5)
        assert gone.id == 1
        assert await h.instances() == []  # DELETED only when asked for
        await until(lambda: 1 not in coordinator.table)
        assert coordinator.count("Delete", ok=True) == 1
        # Its NodeManager must register again; the DELETED id counts as a new registration.
        assert (await agent.beat(NORMAL)).directive == controller_pb2.DIRECTIVE_REREGISTER
        resp = await agent.register(instance_id=1)
        assert resp.instance_id == 0
        await until(lambda: len(nm.starts) == 2)
        assert nm.starts[1].instance_id == 2


async def test_stale_epoch_is_told_to_reregister(tmp_path, node_managers) -> None:
    nm = await node_managers()
    async with running_controller(tmp_path) as h:
        agent = h.agent(job="p", nm=nm)
        await agent.register()
        agent.epoch += 1
        agent.open()
        beat = controller_pb2.Beat(node_id=agent.node_id, session_epoch=agent.epoch, seq=1)
        await agent.call.write(controller_pb2.HeartbeatRequest(beat=beat))
        first = await agent.call.read()
        assert first.directive == controller_pb2.DIRECTIVE_REREGISTER
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await agent.call.read()
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        [pf] = [d for d in details_of(err.value) if isinstance(d, error_details_pb2.PreconditionFailure)]
        assert (pf.violations[0].type, pf.violations[0].subject) == ("STALE_SESSION", f"node/{agent.node_id}")


async def test_unknown_node_via_engine_event_is_stale(tmp_path) -> None:
    async with running_controller(tmp_path) as h:
        agent = h.agent(job="p", nm_port=7300)
        agent.node_id, agent.epoch = 99, 1
        assert (await agent.event(0, 1)).directive == controller_pb2.DIRECTIVE_REREGISTER
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await agent.call.read()
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION


async def test_register_without_job_name_changes_nothing(tmp_path, node_managers) -> None:
    nm = await node_managers()
    async with running_controller(tmp_path) as h:
        bad = h.agent(job="", nm=nm)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await bad.register()
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        [br] = [d for d in details_of(err.value) if isinstance(d, error_details_pb2.BadRequest)]
        assert [v.field for v in br.field_violations] == ["job_name"]
        assert await h.instances() == [] and not nm.starts
        await h.agent(job="p", nm=nm).register()
        await until(lambda: nm.starts)
        assert nm.starts[0].instance_id == 1  # the refused request took no id


async def test_list_instances_filters_and_orders(tmp_path, node_managers) -> None:
    p, d = await node_managers(), await node_managers()
    async with running_controller(tmp_path) as h:
        dec = h.agent(job="d", nm=d, role=common_pb2.ROLE_DECODE)
        pre = h.agent(job="p", nm=p)
        await dec.register()
        await until(lambda: d.starts)
        await pre.register()
        await until(lambda: p.starts)
        await dec.beat(NORMAL)
        await until(lambda: h.instances(status=ACTIVE))
        assert [i.id for i in await h.instances()] == [1, 2]
        assert [i.job_name for i in await h.instances(role=common_pb2.ROLE_PREFILL)] == ["p"]
        assert [i.job_name for i in await h.instances(status=ACTIVE)] == ["d"]
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await h.instances(status=42)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT


async def test_abnormal_beat_marks_instance_inactive(tmp_path, node_managers) -> None:
    nm = await node_managers()
    async with running_controller(tmp_path) as h:
        agent = h.agent(job="p", nm=nm)
        await agent.register()
        await until(lambda: nm.starts)
        await agent.beat(NORMAL)
        await until(lambda: h.instances(status=ACTIVE))
        await agent.beat(ABNORMAL)
        await until(lambda: h.instances(status=INACTIVE))


async def test_two_coordinators_each_get_the_change(tmp_path, node_managers, coordinator) -> None:
    other = await FakeCoordinator().start()
    nm = await node_managers()
    try:
        async with running_controller(tmp_path, coordinators=[coordinator.address, other.address]) as h:
            agent = h.agent(job="p", nm=nm)
            await agent.register()
            await until(lambda: nm.starts)
            await agent.beat(NORMAL)
            await until(lambda: 1 in coordinator.table and 1 in other.table)
    finally:
        await other.stop()


async def test_heartbeat_stats_are_logged(tmp_path, node_managers, monkeypatch, caplog) -> None:
    from motor_mesh.controller.nodes import heartbeats

    caplog.set_level("INFO")
    # No window closes until the test says so: the three beats are in one window however slow.
    monkeypatch.setattr(heartbeats, "STATS_WINDOW_S", 3600.0)
    nm = await node_managers()
    async with running_controller(tmp_path, instance_heartbeat_timeout_s=0.2) as h:
        agent = h.agent(job="p", nm=nm)
        await agent.register()
        for _ in range(3):
            await agent.beat()
        # The ack reaches the agent before the Controller records its latency: wait for the third.
        hub = h.controller.hub
        await until(lambda: len(hub._acks) == 3, what="three acks timed")
        SlowToFree(20)  # a collection in the window, with a pause of at least 20 ms
        gc.collect()
        monkeypatch.setattr(heartbeats, "STATS_WINDOW_S", 0.0)  # the next tick closes it

        def stats() -> dict:
            found = [
                getattr(r, "fields", {})
                for r in caplog.records
                if getattr(r, "event", "") == "heartbeat_stats"
            ]
            return found[-1] if found else {}

        line = await until(stats)
        assert line["messages"] == 3 and 0 < line["ack_p50_ms"] <= line["ack_p99_ms"]
        assert list(line)[:4] == ["messages", "ack_p50_ms", "ack_p99_ms", "window_s"]
        assert line["gc_collections"] >= 1 and line["gc_max_ms"] >= 20


async def test_a_lost_observation_is_corrected_by_the_resync(tmp_path, node_managers, monkeypatch) -> None:
    from motor_mesh.controller import app

    monkeypatch.setattr(app, "RESYNC_S", 0.2)
    nm = await node_managers()
    async with running_controller(tmp_path) as h:
        agent = h.agent(job="p", nm=nm)
        await agent.register()
        # The start answered (its pid is recorded): nothing left in flight to look at the beat.
        await until(lambda: _first_pid(h))
        monkeypatch.setattr(h.controller.hub, "enqueue", lambda instance_id: None)  # events get lost
        await agent.beat(NORMAL)
        await until(lambda: h.instances(status=ACTIVE), timeout=5)


async def _first_pid(h) -> int:
    found = await h.instances()
    return found[0].endpoints[0].pid if found else 0
