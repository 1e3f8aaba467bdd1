"""What the fuzzers found, each as one small deterministic test.

Each guards a fix: the status and its details are bounded so they reach the caller; HEAD is
answered with a head alone; a pipelined request before garbage is answered before the 400; a
Delete naming an unknown role is INVALID_ARGUMENT; config strings never hold a NUL; Register
bounds parallel sizes, device counts and the ports an SGLang hand-off needs; a nested page token,
an unknown engine event type or endpoint status, an unknown role or restart action are refused or
handled, never INTERNAL.
"""

from __future__ import annotations

import asyncio
import base64
import json
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.rpc import error_details_pb2 as ed

from motor_mesh.common import errors
from motor_mesh.common.config import ConfigError, load_config
from motor_mesh.common.enums import DECODE, PREFILL
from motor_mesh.gen.motor.v1 import common_pb2 as c
from motor_mesh.gen.motor.v1 import controller_pb2 as pb
from motor_mesh.gen.motor.v1 import coordinator_pb2, nodemanager_pb2
from tests.controller.fakes import FakeNodeManager, Harness, NodeAgent, running_controller
from tests.coordinator.conftest import StartCoordinator, instance, set_table
from tests.fuzz.conftest import start_nodemanager
from tests.fuzz.harness import ALLOWED
from tests.poll import until
from tests.ports import reserved_port

# -- fixed ----------------------------------------------------------------------------------------


async def test_a_refusal_quoting_huge_input_still_reaches_the_caller(
    start_coordinator: StartCoordinator,
) -> None:
    """3000 bad instances, each naming a 60 kB host: the caller gets INVALID_ARGUMENT with a
    bounded BadRequest, not RESOURCE_EXHAUSTED "received metadata size exceeds hard limit"."""
    coord = await start_coordinator()
    bad = [c.Instance(id=i + 1, endpoints=[c.Endpoint(host="h" * 60_000, port=0)]) for i in range(60)]
    bad += [c.Instance(id=1000 + i) for i in range(3000)]
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await coord.stub.AddInstances(coordinator_pb2.AddInstancesRequest(instances=bad), timeout=10)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
    assert len((err.value.details() or "").encode()) <= errors.MAX_MESSAGE_BYTES
    [detail] = [d for d in errors.details_of(err.value) if isinstance(d, ed.BadRequest)]
    assert len(detail.field_violations) == errors.MAX_DETAIL_ENTRIES + 1
    assert detail.field_violations[-1].description.startswith("and ")
    assert detail.field_violations[0].field.startswith("instances[0]")


def test_errors_clip_whole_characters() -> None:
    clipped = errors.clip("é" * 1000, 100)
    assert len(clipped.encode()) <= 100 and clipped.endswith("(2000 bytes)")
    assert errors.clip("short", 100) == "short"


async def test_delete_naming_an_unknown_role_is_invalid_argument(start_coordinator: StartCoordinator) -> None:
    coord = await start_coordinator()
    await set_table(coord, instance(1, PREFILL, reserved_port()), instance(2, DECODE, reserved_port()))
    req = coordinator_pb2.DeleteInstancesRequest(instances=[c.Instance(id=1, role=77)])  # type: ignore[arg-type]
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await coord.stub.DeleteInstances(req, timeout=5)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "instances[0].role" in (err.value.details() or "")


async def _exchange(address: str, data: bytes) -> bytes:
    host, port = address.rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(data)
    got = await asyncio.wait_for(reader.read(1 << 20), 5)
    while chunk := await asyncio.wait_for(reader.read(1 << 20), 5):  # until the server closes
        got += chunk
    writer.close()
    return got


async def test_head_is_answered_with_a_head_alone(start_coordinator: StartCoordinator) -> None:
    coord = await start_coordinator()
    got = await _exchange(
        coord.http,
        b"HEAD /health HTTP/1.1\r\nHost: x\r\n\r\n"
        b"HEAD /v1/completions HTTP/1.1\r\nHost: x\r\n\r\n"
        b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
    )
    heads = got.split(b"\r\n\r\n")
    assert heads[0].startswith(b"HTTP/1.1 200 ")
    assert heads[1].startswith(b"HTTP/1.1 405 ") and b"Allow: POST" in heads[1]
    assert heads[2].startswith(b"HTTP/1.1 200 ") and heads[3].startswith(b'{"status":"ok"')


async def test_a_request_before_garbage_is_answered_before_the_400(
    start_coordinator: StartCoordinator,
) -> None:
    coord = await start_coordinator()
    got = await _exchange(coord.http, b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n{garbage")
    assert got.startswith(b"HTTP/1.1 200 "), got
    assert got.count(b"HTTP/1.1 400 Bad Request") == 1 and b"malformed HTTP request" in got


@pytest.mark.parametrize(
    "doc",
    [
        {"nodemanager": {"model": "a\x00b"}},
        {"controller": {"host": "\x00"}},
        {"controller": {"coordinators": ["a\x00b:1"]}},
        {"engine": {"args": {"x": ["ok", "a\x00b"]}}},
        {"engine": {"args": {"": True}}},
    ],
)
def test_config_strings_never_hold_a_nul(tmp_path: Path, doc: dict[str, object]) -> None:
    path = tmp_path / "cfg.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(ConfigError) as err:
        load_config(str(path), env={})
    assert len(err.value.errors) == 1


# -- the Controller: waiting for fixes ------------------------------------------------------------

_NODE: dict[str, Any] = {
    "job_name": "j",
    "role": c.ROLE_PREFILL,
    "model_name": "m",
    "engine_type": c.ENGINE_TYPE_SIM,
    "host": "127.0.0.1",
    "nm_port": 1,  # nothing listens: the registration is never assembled
    "ports": [10000],
}


async def _register(tmp_path: Path, req: pb.RegisterRequest) -> grpc.aio.AioRpcError | None:
    async with running_controller(tmp_path) as h:
        try:
            await h.stub.Register(req, timeout=10)
        except grpc.aio.AioRpcError as err:
            return err
    return None


def _bad_field(err: grpc.aio.AioRpcError | None, field: str) -> None:
    assert err is not None and err.code() == grpc.StatusCode.INVALID_ARGUMENT, err and err.code()
    fields = [
        v.field for d in errors.details_of(err) if isinstance(d, ed.BadRequest) for v in d.field_violations
    ]
    assert any(f.startswith(field) for f in fields), fields


async def test_register_with_a_huge_nnodes_is_refused(tmp_path: Path) -> None:
    req = pb.RegisterRequest(**_NODE, parallel=c.ParallelConfig(nnodes=2**31, tp=2**31))
    _bad_field(await _register(tmp_path, req), "parallel")


async def test_register_with_a_huge_device_count_is_refused(tmp_path: Path) -> None:
    req = pb.RegisterRequest(**_NODE, device_count=2**32 - 1)
    _bad_field(await _register(tmp_path, req), "device_count")


async def test_register_with_an_engine_port_that_leaves_no_room_for_port_plus_one(tmp_path: Path) -> None:
    req = pb.RegisterRequest(**{**_NODE, "ports": [65535], "engine_type": c.ENGINE_TYPE_SGLANG})
    _bad_field(await _register(tmp_path, req), "ports[0]")


async def test_list_alarms_with_a_deeply_nested_page_token(tmp_path: Path) -> None:
    token = base64.urlsafe_b64encode(b"[" * 100_000).decode()
    async with running_controller(tmp_path) as h:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await h.stub.ListAlarms(pb.ListAlarmsRequest(page_token=token), timeout=5)
    _bad_field(err.value, "page_token")


async def _base_node(h: Harness, nm: FakeNodeManager) -> NodeAgent:
    agent = await h.start_node(nm, job="base")

    async def active() -> bool:
        return [i.status for i in await h.instances()] == [c.INSTANCE_STATUS_ACTIVE]

    await until(active, 10, "the base instance ACTIVE")
    return agent


async def test_an_engine_event_of_an_unknown_type(tmp_path: Path) -> None:
    async with running_controller(tmp_path, instance_heartbeat_timeout_s=3600) as h:
        nm = await FakeNodeManager().start()
        try:
            agent = await _base_node(h, nm)
            await agent.event(0, 40000, kind=667)
        finally:
            await nm.stop()


async def test_a_beat_with_an_unknown_endpoint_status(tmp_path: Path) -> None:
    known = set(c.EndpointStatus.values())
    async with running_controller(tmp_path, instance_heartbeat_timeout_s=3600) as h:
        nm = await FakeNodeManager().start()
        try:
            agent = await _base_node(h, nm)
            try:
                await agent.beat(99)
            except grpc.aio.AioRpcError as err:  # refusing it is fine too
                assert err.code() in ALLOWED - {grpc.StatusCode.OK}
            for inst in await h.instances():
                assert {e.status for e in inst.endpoints} <= known, inst
        finally:
            await nm.stop()


# -- the NodeManager -----------------------------------------------------------


async def _nm_call(tmp_path: Path, method: str, req: object) -> grpc.StatusCode:
    nm = await start_nodemanager(tmp_path)
    try:
        await getattr(nm.stub, method)(req, timeout=10)
        return grpc.StatusCode.OK
    except grpc.aio.AioRpcError as err:
        return err.code()
    finally:
        nm.proc.kill()
        await nm.channel.close()


async def test_start_engines_with_an_unknown_role(tmp_path: Path) -> None:
    req = nodemanager_pb2.StartEnginesRequest(
        job_name="j",
        instance_id=1,
        role=99,  # type: ignore[arg-type]
        endpoints=[c.Endpoint(id=0, host="127.0.0.1", port=1)],
    )
    assert await _nm_call(tmp_path, "StartEngines", req) == grpc.StatusCode.INVALID_ARGUMENT


async def test_restart_engines_with_an_unknown_action(tmp_path: Path) -> None:
    req = nodemanager_pb2.RestartEnginesRequest(action=7)  # type: ignore[arg-type]
    assert await _nm_call(tmp_path, "RestartEngines", req) == grpc.StatusCode.INVALID_ARGUMENT


async def test_switch_role_with_an_unknown_role(tmp_path: Path) -> None:
    req = nodemanager_pb2.SwitchRoleRequest(instance_id=5, role=99)  # type: ignore[arg-type]
    assert await _nm_call(tmp_path, "SwitchRole", req) == grpc.StatusCode.INVALID_ARGUMENT
