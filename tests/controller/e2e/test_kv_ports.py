"""Where each engine publishes its KV cache events, as its NodeManager reports it, reaches the
Controller's instances, the Coordinators they are pushed to and the database: from the
StartEngines answer, from beats (a new engine process), from a relaunch's GetStatus polls, and
across a Controller restart (SQLite and etcd alike)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from motor_mesh.controller.model import Instance, JobSpec, Member
from motor_mesh.controller.store.etcd_client import EtcdClient
from motor_mesh.controller.store.interface import StateStore
from motor_mesh.controller.store.sqlite import Store
from motor_mesh.gen.motor.v1 import common_pb2, controller_pb2, nodemanager_pb2
from tests.controller.e2e.test_etcd_store import open_etcd
from tests.controller.fakes import (
    ACTIVE,
    INACTIVE,
    NORMAL,
    FakeCoordinator,
    FakeNodeManager,
    kv_ports,
    running_controller,
)
from tests.etcd import EtcdServer
from tests.poll import until

Ports = list[tuple[int, int, int]]


def kv(endpoints: Any) -> Ports:
    """(business port, KV events port, replay port) of each endpoint, by port."""
    return sorted((e.port, e.kv_events_port, e.kv_events_replay_port) for e in endpoints)


def default(*ports: int) -> Ports:
    return [(p, kv_ports(p)["kv_events_port"], kv_ports(p)["kv_events_replay_port"]) for p in ports]


async def test_start_answers_reach_the_coordinator_and_survive_a_restart(
    tmp_path: Path, node_managers, coordinator: FakeCoordinator
) -> None:
    a, b = await node_managers(), await node_managers()
    async with running_controller(tmp_path, coordinators=[coordinator.address]) as h:
        first = h.agent(job="j", nm=a, ports=(10000,), dp=2)
        second = h.agent(job="j", nm=b, ports=(10002,), dp=2)
        await first.register()
        await second.register()

        async def started() -> list[common_pb2.Instance]:
            return [i for i in await h.instances() if all(e.kv_events_port for e in i.endpoints)]

        # Known from the StartEngines answers, before any beat.
        [inst] = await until(started, what="the StartEngines answers' ports")
        assert inst.status != ACTIVE
        assert kv(inst.endpoints) == default(10000, 10002)

        await first.beat(NORMAL)
        await second.beat(NORMAL)
        await until(lambda: inst.id in coordinator.table, what="the instance pushed")
        [add] = coordinator.ok_calls("Add")
        assert kv(add.instances[0].endpoints) == default(10000, 10002)
    sets = len(coordinator.ok_calls("Set"))
    # Written with the instance: a restarted Controller pushes them again.
    async with running_controller(tmp_path, coordinators=[coordinator.address]) as h:
        [inst] = await h.instances()
        assert kv(inst.endpoints) == default(10000, 10002)
        await until(lambda: len(coordinator.ok_calls("Set")) > sets, what="a full Set after the restart")
        [held] = coordinator.ok_calls("Set")[-1].instances
        assert kv(held.endpoints) == default(10000, 10002)


async def test_a_new_engine_process_reports_its_ports_in_its_beats(tmp_path: Path, node_managers) -> None:
    nm = await node_managers()
    async with running_controller(tmp_path) as h:
        agent = await h.start_node(nm, job="j")
        await until(lambda: h.instances(status=ACTIVE))
        # Another process (new pid) publishing elsewhere: what the beat says is what is kept.
        agent.seq += 1
        ep = common_pb2.Endpoint(
            id=0, port=10000, status=NORMAL, pid=777, kv_events_port=15000, kv_events_replay_port=15001
        )
        beat = controller_pb2.Beat(
            node_id=agent.node_id, session_epoch=agent.epoch, seq=agent.seq, endpoints=[ep]
        )
        await agent.send(controller_pb2.HeartbeatRequest(beat=beat))
        [inst] = await h.instances()
        assert (inst.endpoints[0].pid, kv(inst.endpoints)) == (777, [(10000, 15000, 15001)])


class MovedNodeManager(FakeNodeManager):
    """Reports its relaunched engine's events 1000 ports above the usual ones."""

    async def GetStatus(
        self, req: nodemanager_pb2.GetStatusRequest, ctx: grpc.aio.ServicerContext
    ) -> nodemanager_pb2.GetStatusResponse:
        resp = await super().GetStatus(req, ctx)
        for e in resp.endpoints:
            e.kv_events_port += 1000
            e.kv_events_replay_port += 1000
        return resp


async def test_a_relaunch_keeps_them_as_the_node_managers_report_them(
    tmp_path: Path, node_managers, coordinator: FakeCoordinator
) -> None:
    a = await node_managers()
    b = await MovedNodeManager().start()
    try:
        fast = {"engine_relaunch_poll_interval_s": 1, "engine_relaunch_dispatch_retries": 0}
        async with running_controller(tmp_path, coordinators=[coordinator.address], **fast) as h:
            first = h.agent(job="j", nm=a, ports=(10000,), dp=2)
            second = h.agent(job="j", nm=b, ports=(10002,), dp=2)
            await first.register()
            await second.register()
            await until(lambda: a.starts and b.starts)
            await first.beat(NORMAL)
            await second.beat(NORMAL)
            [inst] = await until(lambda: h.instances(status=ACTIVE))
            await until(lambda: inst.id in coordinator.table, what="the instance pushed")
            ep_id = a.starts[-1].endpoints[0].id
            await first.event(ep_id, 40000 + ep_id)  # its engine died
            await until(lambda: h.instances(status=INACTIVE))
            await until(lambda: a.restarts and b.restarts, what="the relaunch")
            a.ready = b.ready = True  # relaunched: GetStatus reports them NORMAL
            await until(lambda: h.instances(status=ACTIVE), what="ACTIVE after the relaunch")
            await until(lambda: len(coordinator.ok_calls("Add")) == 2, what="the instance pushed again")
            want = [(10000, 12000, 12001), (10002, 13002, 13003)]
            assert kv(coordinator.ok_calls("Add")[-1].instances[0].endpoints) == want
            assert kv((await h.instances())[0].endpoints) == want
    finally:
        await b.stop()


# ---- both stores keep the whole Endpoint -------------------------------------------------------


def instance_with_ports() -> Instance:
    ep = common_pb2.Endpoint(
        id=0, host="h", port=10000, status=NORMAL, pid=7, kv_events_port=12000, kv_events_replay_port=12001
    )
    member = Member(0, "h", 7300, [10000])
    member.attach([ep])
    spec = JobSpec(role=1, model_name="m", engine_type=3, pd_protocol=1)
    return Instance(id=1, job_name="j", spec=spec, status=ACTIVE, endpoints=[ep], members=[member])


async def round_trip(store: StateStore, reopen: Any) -> None:
    await store.assemble(instance_with_ports())
    again = await reopen()
    [loaded] = again.load_instances()
    assert kv(loaded.endpoints) == [(10000, 12000, 12001)]
    assert loaded.members[0].by_id[0] is loaded.endpoints[0]


async def test_sqlite_keeps_the_ports(tmp_path: Path) -> None:
    store = Store(tmp_path / "s")

    async def reopen() -> Store:
        await store.close()
        return Store(tmp_path / "s")

    await round_trip(store, reopen)


@pytest.fixture
async def etcd(etcd_server: EtcdServer) -> AsyncIterator[EtcdClient]:
    client = EtcdClient([etcd_server.endpoint], timeout_s=2.0)
    yield client
    await client.close()


async def test_etcd_keeps_the_ports(etcd: EtcdClient) -> None:
    store, _ = await open_etcd(etcd)

    async def reopen() -> StateStore:
        return (await open_etcd(etcd))[0]  # the next leader reading the state

    await round_trip(store, reopen)
