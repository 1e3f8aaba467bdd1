"""A bug in a handler (an exception that is not a MotorError) answers INTERNAL with an ErrorInfo
and never the exception's text; the server's log has the traceback. Every kind of RPC."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.rpc import error_details_pb2

from motor_mesh.common import errors, log
from motor_mesh.common.rpc import BidiStream
from motor_mesh.common.server import MotorServer
from motor_mesh.controller.nodes.registration import Registrar
from motor_mesh.gen.motor.v1 import (
    common_pb2,
    controller_pb2,
    controller_pb2_grpc,
    nodemanager_pb2,
    nodemanager_pb2_grpc,
)
from motor_mesh.nodemanager.service import NodeManagerService
from tests.controller.fakes import running_controller
from tests.stub_controller import CONTROLLER, StubController, section

SECRET = "token=hunter2 at /srv/private/path"
NODEMANAGER = nodemanager_pb2.DESCRIPTOR.services_by_name["NodeManager"]


class Buggy(StubController):
    async def ListInstances(self, request: Any, context: Any) -> Any:
        raise RuntimeError(SECRET)

    async def WatchAlarms(self, request: Any, context: Any) -> AsyncIterator[Any]:
        yield controller_pb2.WatchAlarmsResponse()
        raise KeyError(SECRET)

    async def Heartbeat(self, stream: BidiStream, context: Any) -> None:
        await stream.read()
        raise ZeroDivisionError(SECRET)


@pytest.fixture
async def buggy() -> AsyncIterator[MotorServer]:
    srv = MotorServer("controller", section(), [(CONTROLLER, Buggy())], port=0)
    await srv.start()
    yield srv
    await srv.stop()


def assert_internal(err: grpc.aio.AioRpcError, method: str) -> None:
    assert err.code() == grpc.StatusCode.INTERNAL
    assert SECRET not in (err.details() or "") and "Error" not in (err.details() or "")
    [info] = [d for d in errors.details_of(err) if isinstance(d, error_details_pb2.ErrorInfo)]
    assert (info.reason, info.domain, info.metadata["method"]) == ("INTERNAL", "motor", method)


def failures(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if getattr(r, "event", "") == "rpc_failed"]


async def test_unary_server_streaming_and_bidi_handlers(buggy: MotorServer, caplog) -> None:
    caplog.set_level(logging.INFO)
    async with grpc.aio.insecure_channel(buggy.address) as ch:
        stub = controller_pb2_grpc.ControllerStub(ch)
        with pytest.raises(grpc.aio.AioRpcError) as unary:
            await stub.ListInstances(controller_pb2.ListInstancesRequest(), timeout=5)
        assert_internal(unary.value, "/motor.v1.Controller/ListInstances")

        watch = stub.WatchAlarms(controller_pb2.WatchAlarmsRequest(), timeout=5)
        assert await watch.read() == controller_pb2.WatchAlarmsResponse()
        with pytest.raises(grpc.aio.AioRpcError) as streaming:
            await watch.read()
        assert_internal(streaming.value, "/motor.v1.Controller/WatchAlarms")

        beats = stub.Heartbeat(timeout=5)
        await beats.write(controller_pb2.HeartbeatRequest(beat=controller_pb2.Beat(node_id=1)))
        with pytest.raises(grpc.aio.AioRpcError) as bidi:
            await beats.read()
        assert_internal(bidi.value, "/motor.v1.Controller/Heartbeat")

    logged = failures(caplog)
    assert [type(r.exc_info[1]) for r in logged if r.exc_info] == [RuntimeError, KeyError, ZeroDivisionError]


async def test_the_log_line_carries_the_traceback_on_one_line(capsys) -> None:
    log.setup("test", "json")
    try:
        raise RuntimeError("boom")
    except RuntimeError:
        log.exception("rpc_failed", method="/m")
    [line] = capsys.readouterr().err.splitlines()
    fields = json.loads(line)
    assert fields["event"] == "rpc_failed" and fields["error"] == "RuntimeError: boom"
    assert "Traceback (most recent call last)" in fields["traceback"]
    assert "test_the_log_line_carries_the_traceback_on_one_line" in fields["traceback"]


async def test_a_real_controller_handler(tmp_path: Path, monkeypatch, caplog) -> None:
    def broken(self: Registrar, request: Any) -> Any:
        raise OSError(SECRET)

    monkeypatch.setattr(Registrar, "register", broken)
    caplog.set_level(logging.INFO)
    async with running_controller(tmp_path) as h:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await h.agent(job="j", nm_port=7399).register()
        assert_internal(err.value, "/motor.v1.Controller/Register")
        # The server goes on serving.
        assert await asyncio.wait_for(h.instances(), 5) == []
    [record] = failures(caplog)
    assert record.exc_info is not None and isinstance(record.exc_info[1], OSError)


class BuggySupervisor:
    """What NodeManagerService calls, with a bug in SwitchRole's part."""

    async def switch_role(self, request: Any) -> Any:
        raise RuntimeError(SECRET)


async def test_a_nodemanager_handler(caplog) -> None:
    caplog.set_level(logging.INFO)
    service = NodeManagerService(BuggySupervisor(), lambda code, reason, delay: None)  # type: ignore[arg-type]
    srv = MotorServer("nodemanager", section(), [(NODEMANAGER, service)], port=0)
    await srv.start()
    try:
        async with grpc.aio.insecure_channel(srv.address) as ch:
            stub = nodemanager_pb2_grpc.NodeManagerStub(ch)
            req = nodemanager_pb2.SwitchRoleRequest(instance_id=5, role=common_pb2.ROLE_DECODE)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.SwitchRole(req, timeout=5)
            assert_internal(err.value, "/motor.v1.NodeManager/SwitchRole")
    finally:
        await srv.stop()
    [record] = failures(caplog)
    assert record.exc_info is not None and isinstance(record.exc_info[1], RuntimeError)
