"""A motor.v1 request carrying a field number its schema does not know, at any depth, is refused
with INVALID_ARGUMENT and a BadRequest naming the message, where it sits and the number; the
same request without it is accepted. Real servers, raw bytes on the wire: unary, server
streaming and a bidi stream (which the refusal ends)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
from google.protobuf import struct_pb2
from google.protobuf.message import Message
from google.rpc import error_details_pb2

from motor_mesh.common import errors, rpc
from motor_mesh.common import server as common_server
from motor_mesh.common.config import load
from motor_mesh.common.server import MotorServer
from motor_mesh.coordinator.app import Coordinator
from motor_mesh.gen.motor.v1 import common_pb2 as c
from motor_mesh.gen.motor.v1 import controller_pb2, coordinator_pb2, nodemanager_pb2
from motor_mesh.nodemanager import validation as nodemanager_validation
from tests.controller.fakes import FakeNodeManager, running_controller
from tests.fuzz.protogen import tag, varint
from tests.stub_controller import StubController, section

NODEMANAGER = nodemanager_pb2.DESCRIPTOR.services_by_name["NodeManager"]


def unknown_varint(number: int, value: int = 1) -> bytes:
    """The bytes of field ``number`` (wire type varint) holding ``value``."""
    return tag(number, 0) + varint(value)


def append_unknown(message: Message, number: int) -> bytes:
    """Append field ``number`` to ``message``'s own encoding (as a client built from another
    schema would send it); returns the appended bytes."""
    extra = unknown_varint(number)
    message.MergeFromString(extra)
    return extra


def refusal(err: grpc.aio.AioRpcError) -> list[tuple[str, str]]:
    """(field, description) of the BadRequest of an INVALID_ARGUMENT."""
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err
    [bad] = [d for d in errors.details_of(err) if isinstance(d, error_details_pb2.BadRequest)]
    return [(v.field, v.description) for v in bad.field_violations]


# ---- where an unknown field sits --------------------------------------------------------------


def test_each_message_carrying_unknown_fields_is_named_with_its_path() -> None:
    req = coordinator_pb2.AddInstancesRequest(
        instances=[
            c.Instance(id=1, endpoints=[c.Endpoint(port=1), c.Endpoint(port=2)]),
            c.Instance(id=2, parallel=c.ParallelConfig(dp=1)),
        ]
    )
    append_unknown(req.instances[0].endpoints[1], 15)
    append_unknown(req.instances[0].endpoints[1], 13)
    append_unknown(req.instances[1].parallel, 9)
    append_unknown(req, 4)
    assert rpc.unknown_fields(req) == [
        ("", "motor.v1.AddInstancesRequest has unknown field 4"),
        (
            "instances[0].endpoints[1]",
            "motor.v1.Endpoint (instances[0].endpoints[1]) has unknown fields 13, 15",
        ),
        ("instances[1].parallel", "motor.v1.ParallelConfig (instances[1].parallel) has unknown field 9"),
    ]
    # A message inside a map value counts too (no motor.v1 map holds messages yet).
    value = struct_pb2.Struct()
    value.fields["a"].number_value = 1
    append_unknown(value.fields["a"], 7)
    assert rpc.unknown_fields(value) == [
        ('fields["a"]', 'google.protobuf.Value (fields["a"]) has unknown field 7')
    ]
    assert rpc.unknown_fields(coordinator_pb2.AddInstancesRequest(instances=[c.Instance(id=1)])) == []


# ---- the Coordinator: a unary write ------------------------------------------------------------


@pytest.fixture
async def coordinator(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Coordinator]:
    monkeypatch.setattr(common_server, "SHUTDOWN_DRAIN_S", 0.0)
    cfg = load(None, env={}, overrides={"coordinator": {"port": 0, "http_port": 0, "workers": 1}})
    co = Coordinator(cfg.coordinator)
    await co.start()
    try:
        yield co
    finally:
        await co.stop()


def add_request() -> coordinator_pb2.AddInstancesRequest:
    return coordinator_pb2.AddInstancesRequest(
        instances=[
            c.Instance(
                id=7,
                role=c.ROLE_UNION,
                job_name="job-7",
                model_name="m",
                engine_type=c.ENGINE_TYPE_SIM,
                endpoints=[
                    c.Endpoint(id=0, host="127.0.0.1", port=1),
                    c.Endpoint(id=1, host="127.0.0.1", port=2),
                ],
            )
        ]
    )


async def test_an_add_with_an_unknown_field_in_a_nested_endpoint_is_refused(coordinator: Coordinator) -> None:
    async with grpc.aio.insecure_channel(coordinator.grpc_address) as ch:
        add = ch.unary_unary(
            "/motor.v1.Coordinator/AddInstances",
            request_serializer=None,  # raw bytes, as built below
            response_deserializer=coordinator_pb2.AddInstancesResponse.FromString,
        )
        listed = ch.unary_unary(
            "/motor.v1.Coordinator/ListInstances",
            request_serializer=coordinator_pb2.CoordinatorListInstancesRequest.SerializeToString,
            response_deserializer=coordinator_pb2.CoordinatorListInstancesResponse.FromString,
        )
        clean = add_request().SerializeToString()
        stale = add_request()
        extra = append_unknown(stale.instances[0].endpoints[1], 15)  # say a removed mgmt_port
        raw = stale.SerializeToString()
        assert extra in raw and len(raw) == len(clean) + len(extra)

        with pytest.raises(grpc.aio.AioRpcError) as err:
            await add(raw, timeout=5)
        problem = "motor.v1.Endpoint (instances[0].endpoints[1]) has unknown field 15"
        assert refusal(err.value) == [("instances[0].endpoints[1]", problem)]
        assert problem in (err.value.details() or "")
        table = await listed(coordinator_pb2.CoordinatorListInstancesRequest(), timeout=5)
        assert (list(table.available), table.revision) == ([], 0)  # nothing changed

        done = await add(clean, timeout=5)
        assert done.instance_count == 1
        table = await listed(coordinator_pb2.CoordinatorListInstancesRequest(), timeout=5)
        assert [i.id for i in table.available] == [7]


# ---- the Controller: a server stream and the heartbeat stream ---------------------------------


async def test_a_heartbeat_stream_ends_at_the_first_message_with_an_unknown_field(tmp_path: Path) -> None:
    nm = await FakeNodeManager().start()
    try:
        async with running_controller(tmp_path) as h:
            agent = await h.start_node(nm, job="j")  # registered, its engine started, one beat acked
            [engine] = nm.starts[-1].endpoints

            def beat(seq: int) -> controller_pb2.HeartbeatRequest:
                ep = c.Endpoint(id=engine.id, port=engine.port, status=c.ENDPOINT_STATUS_NORMAL, pid=40000)
                return controller_pb2.HeartbeatRequest(
                    beat=controller_pb2.Beat(
                        node_id=agent.node_id, session_epoch=agent.epoch, seq=seq, endpoints=[ep]
                    )
                )

            stream = h.channel.stream_stream(
                "/motor.v1.Controller/Heartbeat",
                request_serializer=None,
                response_deserializer=controller_pb2.HeartbeatResponse.FromString,
            )()
            await stream.write(beat(100).SerializeToString())
            assert (await stream.read()).ack.seq == 100  # the same beat without it: accepted
            stale = beat(101)
            append_unknown(stale.beat.endpoints[0], 42)
            await stream.write(stale.SerializeToString())
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stream.read()
            assert refusal(err.value) == [
                ("beat.endpoints[0]", "motor.v1.Endpoint (beat.endpoints[0]) has unknown field 42")
            ]

            watch = h.channel.unary_stream(
                "/motor.v1.Controller/WatchAlarms",
                request_serializer=None,
                response_deserializer=controller_pb2.WatchAlarmsResponse.FromString,
            )
            raw = controller_pb2.WatchAlarmsRequest().SerializeToString() + unknown_varint(99)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await watch(raw, timeout=5).read()
            assert refusal(err.value) == [("", "motor.v1.WatchAlarmsRequest has unknown field 99")]
    finally:
        await nm.stop()


# ---- the NodeManager's service, top level -----------------------------------------------------


class StubNodeManager(StubController):
    VALIDATORS = nodemanager_validation.VALIDATORS


async def test_a_nodemanager_request_with_unknown_fields_at_the_top_is_refused() -> None:
    srv = MotorServer("nodemanager", section(), [(NODEMANAGER, StubNodeManager())], port=0)
    await srv.start()
    try:
        async with grpc.aio.insecure_channel(srv.address) as ch:
            status = ch.unary_unary(
                "/motor.v1.NodeManager/GetStatus",
                request_serializer=None,
                response_deserializer=nodemanager_pb2.GetStatusResponse.FromString,
            )
            plain = nodemanager_pb2.GetStatusRequest(relaxed=True).SerializeToString()
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await status(plain + unknown_varint(12) + unknown_varint(9), timeout=5)
            assert refusal(err.value) == [("", "motor.v1.GetStatusRequest has unknown fields 9, 12")]
            # Without them it reaches the servicer (the stub answers UNIMPLEMENTED).
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await status(plain, timeout=5)
            assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED
    finally:
        await srv.stop()
