"""The settings of a reload on the etcd store, against a real etcd: what one leader stores (under
the key the layout names) a new leader applies over its file's values and pushes to the
Coordinators; a write etcd cannot take is UNAVAILABLE and changes nothing."""

from __future__ import annotations

import json
from pathlib import Path

import grpc
import pytest

from motor_mesh.common.errors import RpcFailure
from motor_mesh.controller.store.interface import StoredSettings
from motor_mesh.gen.motor.v1 import controller_pb2
from tests.controller.e2e.test_desired_etcd import PREFIX, Leader, leading
from tests.controller.fakes import FakeCoordinator
from tests.controller.test_settings import config_text
from tests.etcd import EtcdServer, etcdctl
from tests.poll import until

pytestmark = pytest.mark.timeout(60)


async def reload(leader: Leader, **changes: dict[str, object]) -> controller_pb2.ReloadConfigResponse:
    text = config_text(leader.controller.settings.running, **changes)
    resp: controller_pb2.ReloadConfigResponse = await leader.stub.ReloadConfig(
        controller_pb2.ReloadConfigRequest(config_text=text), timeout=10
    )
    return resp


async def test_a_new_leader_goes_on_with_the_stored_settings(tmp_path: Path, etcd_server: EtcdServer) -> None:
    async with leading(tmp_path, etcd_server, "a") as a:
        assert a.controller.settings.revision == 0
        resp = await reload(a, coordinator={"queue_timeout_s": 4}, controller={"start_command_retries": 6})
        assert resp.settings_revision == 1
    out = etcdctl(etcd_server.endpoint, "get", f"{PREFIX}/meta/settings", "--print-value-only")
    doc = json.loads(out)
    assert doc["revision"] == 1 and doc["coordinator"]["queue_timeout_s"] == 4
    assert doc["controller"]["start_command_retries"] == 6

    coordinator = await FakeCoordinator().start()
    try:
        # The standby's file knew neither change; as leader it applies the stored settings.
        async with leading(tmp_path, etcd_server, "b") as b:
            c = b.controller
            assert c.settings.revision == 1 and c.cfg.start_command_retries == 6
            assert c.store.load_settings() == StoredSettings(1, {**doc["coordinator"]}, {**doc["controller"]})
            c.coordinators.set_addresses([coordinator.address])
            await until(lambda: coordinator.settings and coordinator.settings[-1].settings_revision == 1)
            assert json.loads(coordinator.settings[-1].settings_json)["queue_timeout_s"] == 4
            assert (await reload(b, coordinator={"queue_timeout_s": 5})).settings_revision == 2
        async with leading(tmp_path, etcd_server, "c") as leader_c:
            assert leader_c.controller.settings.revision == 2
            assert leader_c.controller.settings.running.coordinator.queue_timeout_s == 5
    finally:
        await coordinator.stop()


async def test_a_write_etcd_cannot_take_is_unavailable_and_changes_nothing(
    tmp_path: Path, etcd_server: EtcdServer
) -> None:
    async with leading(tmp_path, etcd_server, "a") as a:
        await reload(a, coordinator={"queue_timeout_s": 4})
        etcd_server.stop()
        try:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await reload(a, coordinator={"queue_timeout_s": 8})
            failure = RpcFailure.of(err.value)
            assert (failure.code, failure.reason) == (grpc.StatusCode.UNAVAILABLE, "STATE_WRITE_FAILED")
            assert a.controller.settings.revision == 1
            assert a.controller.settings.running.coordinator.queue_timeout_s == 4
        finally:
            etcd_server.start()
