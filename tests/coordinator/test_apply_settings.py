"""ApplySettings on an in-process Coordinator (coordinator/settings.py, app.py ``apply_settings``):
the Controller's values replace the file's, ListInstances shows the revision and replicas, ""
puts the file's values back; anything its checks refuse, a key that needs a restart, replicas 0
or a tenants file that cannot be used changes nothing; an older leader's push is refused."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.rpc import error_details_pb2

from motor_mesh.common.config import load, reloadable
from motor_mesh.common.errors import RpcFailure, details_of
from motor_mesh.common.interceptors import LEADER_TERM_METADATA
from motor_mesh.gen.motor.v1 import coordinator_pb2
from tests.coordinator.conftest import Running, StartCoordinator


def settings(**changes: Any) -> str:
    """Every reloadable coordinator key, as the Controller pushes them, with ``changes``."""
    values = reloadable.values_of(load(None, env={}).coordinator, "coordinator")
    return json.dumps({**values, **changes})


async def apply(
    coord: Running, revision: int, text: str, replicas: int = 1, **kw: Any
) -> coordinator_pb2.ApplySettingsResponse:
    req = coordinator_pb2.ApplySettingsRequest(
        settings_revision=revision, settings_json=text, replicas=replicas
    )
    resp: coordinator_pb2.ApplySettingsResponse = await coord.stub.ApplySettings(req, timeout=5, **kw)
    return resp


async def listed(coord: Running) -> tuple[int, int]:
    resp = await coord.stub.ListInstances(coordinator_pb2.CoordinatorListInstancesRequest(), timeout=5)
    return resp.settings_revision, resp.replicas


async def test_the_controllers_values_apply_and_show(coord: Running) -> None:
    assert await listed(coord) == (0, 1)
    resp = await apply(
        coord,
        3,
        settings(queue_timeout_s=4, drain_grace_s=2, log_level="debug", rate_limit={"max_requests": 9}),
        2,
    )
    assert (resp.settings_revision, resp.replicas, resp.incarnation) == (3, 2, coord.co.table.incarnation)
    assert await listed(coord) == (3, 2)
    cfg = coord.co.cfg
    assert (cfg.queue_timeout_s, cfg.drain_grace_s, cfg.rate_limit.max_requests) == (4, 2, 9)
    assert coord.co.service.drain_grace_s == 2
    assert logging.getLogger().level == logging.DEBUG
    assert cfg.http_port == coord.co.own_cfg.http_port  # the rest is the file's
    # "": the Controller has no reload to give (its store was reset): the file's values again.
    await apply(coord, 0, "", 1)
    assert await listed(coord) == (0, 1)
    assert coord.co.cfg == coord.co.own_cfg


@pytest.mark.parametrize(
    ("text", "replicas", "fields"),
    [
        ("{", 1, ["settings_json"]),
        ("[1]", 1, ["settings_json"]),
        (json.dumps({"http_port": 9000}), 1, ["settings_json.http_port"]),
        (json.dumps({"queue_timeout_s": 0}), 1, ["settings_json.queue_timeout_s"]),
        (json.dumps({"rate_limit": {"window_s": "x"}}), 1, ["settings_json.rate_limit.window_s"]),
        (json.dumps({"queue_timeout_s": 2}), 0, ["replicas"]),
    ],
)
async def test_what_its_checks_refuse_changes_nothing(
    coord: Running, text: str, replicas: int, fields: list[str]
) -> None:
    await apply(coord, 1, settings(queue_timeout_s=7), 2)
    before = coord.co.cfg
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await apply(coord, 2, text, replicas)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    bad = [
        v.field
        for d in details_of(err.value)
        if isinstance(d, error_details_pb2.BadRequest)
        for v in d.field_violations
    ]
    assert bad == fields
    assert coord.co.cfg is before and await listed(coord) == (1, 2)


async def test_a_tenants_file_that_cannot_be_used_refuses_the_whole_apply(
    coord: Running, tmp_path: Path
) -> None:
    await apply(coord, 1, settings(queue_timeout_s=7), 1)
    before = coord.co.cfg
    missing = str(tmp_path / "missing.json")
    readable = tmp_path / "readable.json"
    readable.write_text(json.dumps([{"name": "a", "keys": ["k-a"]}]))
    readable.chmod(0o644)  # others may read it: refused like at start
    garbled = tmp_path / "garbled.json"
    garbled.write_text("{not json")
    garbled.chmod(0o600)
    for path in (missing, str(readable), str(garbled)):
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await apply(coord, 2, settings(queue_timeout_s=1, tenants_file=path), 3)
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert RpcFailure.of(err.value).reason == "TENANTS_FILE_UNUSABLE"
        assert "k-a" not in (err.value.details() or "")  # never a key
        assert coord.co.cfg is before and await listed(coord) == (1, 1)
    readable.chmod(0o600)
    await apply(coord, 2, settings(queue_timeout_s=1, tenants_file=str(readable)), 3)
    assert await listed(coord) == (2, 3) and coord.co.cfg.tenants_file == str(readable)


async def test_an_older_leaders_push_is_refused(coord: Running) -> None:
    await apply(coord, 2, settings(queue_timeout_s=3), 1, metadata=((LEADER_TERM_METADATA, "7"),))
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await apply(coord, 1, settings(queue_timeout_s=99), 1, metadata=((LEADER_TERM_METADATA, "6"),))
    assert RpcFailure.of(err.value).reason == "STALE_LEADER"
    assert coord.co.cfg.queue_timeout_s == 3 and await listed(coord) == (2, 1)


async def test_workers_take_the_settings_too(start_coordinator: StartCoordinator) -> None:
    coord = await start_coordinator(workers=2)
    await apply(coord, 5, settings(max_concurrent_requests=3), 2)
    assert await listed(coord) == (5, 2)
    assert coord.co.pool is not None and coord.co.pool.cfg.max_concurrent_requests == 3
