"""The desired instance counts on the etcd store, against a real etcd: what one leader records a
new leader loads (and exports as ``motor_desired_instances``), under the key the layout names;
a write etcd cannot take is UNAVAILABLE (STATE_WRITE_FAILED) and changes nothing."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import grpc
import pytest
from prometheus_client import generate_latest

from motor_mesh.common.errors import RpcFailure
from motor_mesh.common.server import MotorServer
from motor_mesh.controller import metrics
from motor_mesh.controller.app import Controller
from motor_mesh.controller.leader.election import Leadership
from motor_mesh.controller.store.etcd import EtcdStore
from motor_mesh.controller.store.etcd_client import EtcdClient
from motor_mesh.gen.motor.v1 import common_pb2, controller_pb2, controller_pb2_grpc
from tests.controller.fakes import controller_cfg
from tests.etcd import EtcdServer, etcdctl
from tests.metrics import Scrape

PREFIX = "/motor-desired-test"
PREFILL, DECODE = common_pb2.ROLE_PREFILL, common_pb2.ROLE_DECODE
pytestmark = pytest.mark.timeout(60)


class Leader:
    """A Controller that won the election and serves on its etcd store, as leader/ha.py runs one."""

    def __init__(self, controller: Controller, server: MotorServer, leadership: Leadership) -> None:
        self.controller = controller
        self.server = server
        self.leadership = leadership
        self.channel = grpc.aio.insecure_channel(f"127.0.0.1:{server.port}")
        self.stub = controller_pb2_grpc.ControllerStub(self.channel)

    async def set(self, role: int, replicas: int) -> controller_pb2.DesiredInstances:
        req = controller_pb2.SetDesiredInstancesRequest(role=role, replicas=replicas)
        return (await self.stub.SetDesiredInstances(req, timeout=10)).desired

    async def listed(self) -> list[tuple[int, int]]:
        resp = await self.stub.ListDesiredInstances(controller_pb2.ListDesiredInstancesRequest(), timeout=5)
        return [(d.role, d.replicas) for d in resp.desired]

    def scrape(self) -> Scrape:
        return Scrape(generate_latest(metrics.registry(self.controller)).decode())


@asynccontextmanager
async def leading(tmp_path: Path, etcd: EtcdServer, name: str) -> AsyncIterator[Leader]:
    client = EtcdClient([etcd.endpoint], timeout_s=2.0)
    leadership = Leadership(client, PREFIX, f"127.0.0.1:{name}", 10)
    cfg = controller_cfg(tmp_path / name, store="etcd", etcd_endpoints=[etcd.endpoint], etcd_prefix=PREFIX)
    try:
        await asyncio.wait_for(leadership.campaign(), 20)
        keeper = asyncio.create_task(leadership.keep())
        store = await EtcdStore.open(client, PREFIX, leadership)
        controller = Controller(cfg, store=store, leadership=leadership)
        server = MotorServer(
            "controller",
            cfg,
            [(controller_pb2.DESCRIPTOR.services_by_name["Controller"], controller.servicer)],
            port=0,
        )
        await server.start()
        await controller.start()
        leader = Leader(controller, server, leadership)
        try:
            yield leader
        finally:
            await leader.channel.close()
            await server.stop()
            await controller.stop()
            keeper.cancel()
            await asyncio.gather(keeper, return_exceptions=True)
            await leadership.resign()
    finally:
        await client.close()


async def test_a_new_leader_loads_and_exports_what_the_last_one_recorded(
    tmp_path: Path, etcd_server: EtcdServer
) -> None:
    async with leading(tmp_path, etcd_server, "a") as a:
        assert await a.listed() == []
        await a.set(DECODE, 3)
        stored = await a.set(PREFILL, 1)
        assert a.scrape().value("motor_desired_instances", role="decode") == 3
    # etcdctl, independent of Motor's client, sees the layout's key and value.
    out = etcdctl(etcd_server.endpoint, "get", f"{PREFIX}/desired_instances/decode", "--print-value-only")
    assert json.loads(out)["replicas"] == 3

    async with leading(tmp_path, etcd_server, "b") as b:
        resp = await b.stub.ListDesiredInstances(controller_pb2.ListDesiredInstancesRequest(), timeout=5)
        assert [(d.role, d.replicas) for d in resp.desired] == [(PREFILL, 1), (DECODE, 3)]
        assert resp.desired[0].update_time == stored.update_time
        m = b.scrape()
        assert (
            m.value("motor_desired_instances", role="prefill"),
            m.value("motor_desired_instances", role="decode"),
        ) == (1, 3)
        await b.set(DECODE, 0)
    async with leading(tmp_path, etcd_server, "c") as c:
        assert await c.listed() == [(PREFILL, 1), (DECODE, 0)]


async def test_a_write_etcd_cannot_take_is_unavailable_and_changes_nothing(
    tmp_path: Path, etcd_server: EtcdServer
) -> None:
    async with leading(tmp_path, etcd_server, "a") as a:
        await a.set(DECODE, 2)
        etcd_server.stop()
        try:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await a.set(DECODE, 5)
            failure = RpcFailure.of(err.value)
            assert (failure.code, failure.reason) == (grpc.StatusCode.UNAVAILABLE, "STATE_WRITE_FAILED")
            assert await a.listed() == [(DECODE, 2)]
            assert a.scrape().value("motor_desired_instances", role="decode") == 2
        finally:
            etcd_server.start()
