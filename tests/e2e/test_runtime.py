"""The shared gRPC runtime as a client sees it: bad input, keys, health, stop, channels."""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.rpc import error_details_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc

from motor_mesh.common import errors
from motor_mesh.common.channel import open_channel
from motor_mesh.common.config import ConfigError, load
from motor_mesh.common.server import MotorServer
from motor_mesh.gen.motor.v1 import common_pb2, controller_pb2, controller_pb2_grpc, coordinator_pb2
from tests.ports import reserved_port
from tests.stub_controller import CONTROLLER, COORDINATOR, StubController, StubCoordinator, section


@pytest.fixture
async def server() -> AsyncIterator[MotorServer]:
    srv = MotorServer("controller", section(), [(CONTROLLER, StubController())], port=0)
    await srv.start()
    yield srv
    await srv.stop()


def raw_call(channel: grpc.aio.Channel, method: str) -> Any:
    # A generic call with no serializer sends the bytes as they are: what a broken client does.
    return channel.unary_unary(method, request_serializer=None, response_deserializer=None)


async def health(channel: grpc.aio.Channel, service: str = "") -> int:
    stub = health_pb2_grpc.HealthStub(channel)
    resp = await stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
    return resp.status


async def test_malformed_protobuf_is_invalid_argument_and_server_keeps_serving(server: MotorServer) -> None:
    async with grpc.aio.insecure_channel(server.address) as ch:
        with pytest.raises(grpc.aio.AioRpcError) as exc:
            await raw_call(ch, "/motor.v1.Controller/Register")(b"\xff\xff\xff\xff\x0f", timeout=5)
        assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "malformed protobuf" in exc.value.details()
        assert "DecodeError" not in exc.value.details()
        (bad,) = errors.details_of(exc.value)
        assert isinstance(bad, error_details_pb2.BadRequest)
        assert bad.field_violations[0].description == "malformed protobuf"
        assert await health(ch, "motor.v1.Controller") == health_pb2.HealthCheckResponse.SERVING


class AckingController(StubController):
    """Heartbeat served with the runtime's read/write stream: one ack per message."""

    async def Heartbeat(self, stream: Any, context: Any) -> None:
        while (req := await stream.read()) is not None:
            await stream.write(controller_pb2.HeartbeatResponse(ack=controller_pb2.Ack(seq=req.beat.seq)))


async def test_malformed_message_on_a_bidi_stream_ends_it_with_invalid_argument() -> None:
    srv = MotorServer("controller", section(), [(CONTROLLER, AckingController())], port=0)
    await srv.start()
    try:
        async with grpc.aio.insecure_channel(srv.address) as ch:
            call = ch.stream_stream(
                "/motor.v1.Controller/Heartbeat", request_serializer=None, response_deserializer=None
            )()
            good = controller_pb2.HeartbeatRequest(beat=controller_pb2.Beat(seq=41))
            await call.write(good.SerializeToString())
            ack = controller_pb2.HeartbeatResponse.FromString(await call.read())
            assert ack.ack.seq == 41
            await call.write(b"\xff\xff\xff\xff\x0f")
            with pytest.raises(grpc.aio.AioRpcError) as exc:
                await call.read()
            assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "malformed protobuf" in exc.value.details()
            assert await health(ch, "motor.v1.Controller") == health_pb2.HealthCheckResponse.SERVING
    finally:
        await srv.stop()


async def test_oversized_message_is_resource_exhausted(server: MotorServer) -> None:
    big = controller_pb2.RegisterRequest(job_name="x" * (5 * 1024 * 1024))
    async with grpc.aio.insecure_channel(server.address) as ch:
        with pytest.raises(grpc.aio.AioRpcError) as exc:
            await controller_pb2_grpc.ControllerStub(ch).Register(big, timeout=10)
        assert exc.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert await health(ch) == health_pb2.HealthCheckResponse.SERVING


async def test_missing_required_fields_name_each_field_path(server: MotorServer) -> None:
    req = controller_pb2.RegisterRequest(
        role=common_pb2.ROLE_PREFILL, model_name="m", host="127.0.0.1", nm_port=7300, ports=[0]
    )
    async with grpc.aio.insecure_channel(server.address) as ch:
        with pytest.raises(grpc.aio.AioRpcError) as exc:
            await controller_pb2_grpc.ControllerStub(ch).Register(req, timeout=5)
        assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        (bad,) = errors.details_of(exc.value)
        fields = [v.field for v in bad.field_violations]
        assert fields == ["job_name", "ports[0]"]
        assert await health(ch) == health_pb2.HealthCheckResponse.SERVING


async def test_instance_set_field_paths_on_coordinator() -> None:
    cfg = load(None, env={}, overrides={"coordinator": {"port": 0}}).coordinator
    srv = MotorServer("coordinator", cfg, [(COORDINATOR, StubCoordinator())], port=0, readiness_gated=True)
    await srv.start()
    try:
        inst = common_pb2.Instance(id=1, role=common_pb2.ROLE_DECODE, model_name="m", job_name="j")
        inst.endpoints.add(host="127.0.0.1", port=10000)
        inst.endpoints.add(host="127.0.0.1", port=0)
        empty = common_pb2.Instance(id=2, role=common_pb2.ROLE_PREFILL, model_name="m", job_name="k")
        async with grpc.aio.insecure_channel(srv.address) as ch:
            call = raw_call(ch, "/motor.v1.Coordinator/SetInstances")
            body = coordinator_pb2.SetInstancesRequest(instances=[inst, empty]).SerializeToString()
            with pytest.raises(grpc.aio.AioRpcError) as exc:
                await call(body, timeout=5)
            assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            (bad,) = errors.details_of(exc.value)
            assert [v.field for v in bad.field_violations] == [
                "instances[0].endpoints[1].port",
                "instances[1].endpoints",
            ]
            # Nothing routable yet: the Coordinator's "" is readiness, not liveness.
            assert await health(ch) == health_pb2.HealthCheckResponse.NOT_SERVING
            assert await health(ch, "motor.v1.Coordinator") == health_pb2.HealthCheckResponse.SERVING
    finally:
        await srv.stop()


def key_file(tmp_path: Path, content: str, mode: int = 0o600) -> str:
    path = tmp_path / "key"
    path.write_text(content + "\n")
    os.chmod(path, mode)
    return str(path)


async def test_management_key_required_on_motor_rpcs_only(tmp_path: Path) -> None:
    cfg = section(management_key_file=key_file(tmp_path, "s3cret"))
    srv = MotorServer("controller", cfg, [(CONTROLLER, StubController())], port=0)
    await srv.start()
    req = controller_pb2.ListAlarmsRequest()
    try:
        async with grpc.aio.insecure_channel(srv.address) as ch:
            stub = controller_pb2_grpc.ControllerStub(ch)
            with pytest.raises(grpc.aio.AioRpcError) as missing:
                await stub.ListAlarms(req, timeout=5)
            assert missing.value.code() == grpc.StatusCode.UNAUTHENTICATED
            with pytest.raises(grpc.aio.AioRpcError) as wrong:
                await stub.ListAlarms(req, timeout=5, metadata=(("x-motor-management-key", "nope"),))
            assert wrong.value.code() == grpc.StatusCode.PERMISSION_DENIED
            assert "s3cret" not in wrong.value.details()
            # Health never needs the key.
            assert await health(ch) == health_pb2.HealthCheckResponse.SERVING
        # The right key (trailing newline stripped) reaches the handler, through our channel.
        async with open_channel(srv.address, key="s3cret") as ch:
            with pytest.raises(grpc.aio.AioRpcError) as ok:
                await controller_pb2_grpc.ControllerStub(ch).ListAlarms(req)
            assert ok.value.code() == grpc.StatusCode.UNIMPLEMENTED
    finally:
        await srv.stop()


def test_key_file_readable_by_others_refuses_to_start(tmp_path: Path) -> None:
    cfg = section(management_key_file=key_file(tmp_path, "s3cret", 0o644))
    with pytest.raises(ConfigError) as exc:
        MotorServer("controller", cfg, [(CONTROLLER, StubController())], port=0)
    assert "s3cret" not in str(exc.value.errors)


async def test_graceful_stop_flips_health_before_closing(server: MotorServer) -> None:
    async with grpc.aio.insecure_channel(server.address) as ch:
        watch = health_pb2_grpc.HealthStub(ch).Watch(
            health_pb2.HealthCheckRequest(service="motor.v1.Controller")
        )
        first = await watch.read()
        assert first.status == health_pb2.HealthCheckResponse.SERVING
        stopping = asyncio.create_task(server.stop())
        second = await asyncio.wait_for(watch.read(), 5)
        assert second.status == health_pb2.HealthCheckResponse.NOT_SERVING
        await asyncio.wait_for(stopping, 10)


async def test_second_server_on_same_port_fails_loudly(server: MotorServer) -> None:
    twin = MotorServer("controller", section(), [(CONTROLLER, StubController())], port=server.port)
    with pytest.raises(OSError, match="cannot bind"):
        await twin.start()


async def test_channel_waits_for_a_peer_that_starts_late() -> None:
    port = reserved_port()
    srv = MotorServer("controller", section(), [(CONTROLLER, StubController())], port=port)

    async def start_later() -> None:
        await asyncio.sleep(0.5)
        await srv.start()

    starter = asyncio.create_task(start_later())
    try:
        async with open_channel(f"127.0.0.1:{port}") as ch:
            # wait_for_ready: the call rides out the peer's start instead of failing UNAVAILABLE.
            stub = health_pb2_grpc.HealthStub(ch)
            resp = await stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=10)
            assert resp.status == health_pb2.HealthCheckResponse.SERVING
    finally:
        await starter
        await srv.stop()


async def test_channel_gives_unary_calls_a_deadline() -> None:
    # A server that never answers: the default deadline ends the call instead of hanging.
    class Service(StubController):
        async def ListAlarms(self, request: Any, context: Any) -> Any:
            await asyncio.sleep(3600)

    srv = MotorServer("controller", section(), [(CONTROLLER, Service())], port=0)
    await srv.start()
    try:
        async with open_channel(srv.address) as ch:
            with pytest.raises(grpc.aio.AioRpcError) as exc:
                await controller_pb2_grpc.ControllerStub(ch).ListAlarms(controller_pb2.ListAlarmsRequest())
            assert exc.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    finally:
        await srv.stop()


async def test_idle_stream_with_frequent_client_pings_is_never_cut_off(server: MotorServer) -> None:
    # Pinging every second is far more often than our clients' 20 s; a server on grpc defaults
    # answers the third such ping with GOAWAY too_many_pings and the stream dies UNAVAILABLE.
    options = [
        ("grpc.keepalive_time_ms", 1000),
        ("grpc.keepalive_timeout_ms", 5000),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
    ]
    async with grpc.aio.insecure_channel(server.address, options=options) as ch:
        watch = health_pb2_grpc.HealthStub(ch).Watch(health_pb2.HealthCheckRequest(service="probe"))
        first = await watch.read()
        assert first.status == health_pb2.HealthCheckResponse.SERVICE_UNKNOWN
        nxt = asyncio.ensure_future(watch.read())
        await asyncio.sleep(6)  # the stream sits idle while pings flow
        assert not nxt.done(), f"stream ended: {nxt.result() if not nxt.exception() else nxt.exception()}"
        await server.health.set("probe", health_pb2.HealthCheckResponse.SERVING)
        assert (await asyncio.wait_for(nxt, 5)).status == health_pb2.HealthCheckResponse.SERVING
