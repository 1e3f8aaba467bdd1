"""SwitchRole: a ``motor nodemanager`` process with simulated engines turned from prefill to
decode in place (the new engine's launch line, the old process group gone, GetStatus, a repeated
call, StartEngines and registration afterwards) and every refusal over gRPC; the supervisor in
process, with the process work replaced by gates, for the refusal while a relaunch runs and a
failed launch."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.protobuf.message import Message
from google.rpc import error_details_pb2

from motor_mesh.common import errors
from motor_mesh.gen.motor.v1 import common_pb2
from motor_mesh.gen.motor.v1 import nodemanager_pb2 as pb
from motor_mesh.nodemanager.launch import LaunchError
from tests.nodemanager.conftest import ControllerServer, NodeManagerProc, nm_config
from tests.nodemanager.test_supervisor import supervisor
from tests.poll import until
from tests.ports import reserved_pair
from tests.procs import group_gone

PREFILL = common_pb2.ROLE_PREFILL
DECODE = common_pb2.ROLE_DECODE
UNION = common_pb2.ROLE_UNION
RESTART = pb.RestartEnginesRequest(action=pb.RESTART_ACTION_RESTART)


def kv_role(pid: int) -> str:
    """The kv_role in the --kv-transfer-config of the running process ``pid``."""
    argv = [a.decode() for a in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")]
    value = argv[argv.index("--kv-transfer-config") + 1]
    return str(json.loads(value)["kv_role"])


async def switch(nm: NodeManagerProc, role: int, instance_id: int = 5) -> pb.SwitchRoleResponse:
    resp: pb.SwitchRoleResponse = await nm.stub.SwitchRole(
        pb.SwitchRoleRequest(instance_id=instance_id, role=role),  # type: ignore[arg-type]
        timeout=30,
    )
    return resp


async def refused(call: Any) -> tuple[grpc.StatusCode, list[Message]]:
    with pytest.raises(grpc.aio.AioRpcError) as exc:
        await call
    return exc.value.code(), errors.details_of(exc.value)


def violation_type(details: list[Message]) -> str:
    (failure,) = details
    assert isinstance(failure, error_details_pb2.PreconditionFailure)
    (violation,) = failure.violations
    return violation.type


def bad_fields(details: list[Message]) -> list[str]:
    (bad,) = details
    assert isinstance(bad, error_details_pb2.BadRequest)
    return [v.field for v in bad.field_violations]


# --- a NodeManager process ----------------------------------------------------------------------


async def test_a_prefill_node_switches_to_decode(
    tmp_path: Path, controller: ControllerServer, start_nm: Callable[..., Any]
) -> None:
    # (controller first: its server stops after the NodeManager is gone, not waiting on its stream)
    fake = controller.fake
    nm = await start_nm(
        nm_config(tmp_path, [reserved_pair()], job_name="job-a", controller=controller.address)
    )
    await until(lambda: fake.registers, 15, "registration")
    assert fake.registers[-1].role == PREFILL

    old = (await nm.start_engines()).endpoints[0].pid
    status = await nm.wait_ready()
    assert status.role == PREFILL and kv_role(old) == "kv_producer"

    start = len(nm.proc.lines)
    resp = await switch(nm, DECODE)
    assert (resp.role, resp.switched, resp.relaunch_count) == (DECODE, True, 1)
    # The old engine's process group was stopped before the answer; a new process serves decode.
    assert group_gone(old)
    status = await nm.status()
    assert status.role == DECODE and status.relaunch_count == 1
    (ep,) = status.endpoints
    assert ep.pid not in (0, old)
    assert kv_role(ep.pid) == "kv_consumer"
    assert nm.recorded_pgids() == [ep.pid]
    line = await nm.wait_line("event=role_switched", start=start)
    assert "from_role=prefill" in line and "to_role=decode" in line and "relaunch_count=1" in line
    status = await nm.wait_ready()
    assert [e.pid for e in status.endpoints] == [ep.pid] and status.role == DECODE

    # Asked again (a lost answer): nothing happens.
    again = await switch(nm, DECODE)
    assert (again.role, again.switched, again.relaunch_count) == (DECODE, False, 1)
    status = await nm.status()
    assert [e.pid for e in status.endpoints] == [ep.pid] and status.ready

    # The Controller's StartEngines now carries DECODE: the same command, repeated; PREFILL is
    # not this node any more.
    repeated = await nm.start_engines(role=DECODE)
    assert [e.pid for e in repeated.endpoints] == [ep.pid]
    code, details = await refused(nm.start_engines(role=PREFILL))
    assert code == grpc.StatusCode.FAILED_PRECONDITION and violation_type(details) == "NODE_MISMATCH"

    # Registering again (the stream told to), the node registers as what it serves.
    registered = len(fake.registers)
    fake.reregister()
    await until(lambda: len(fake.registers) > registered, 15, "registering again")
    assert fake.registers[-1].role == DECODE
    assert [e.pid for e in (await nm.status()).endpoints] == [ep.pid]


async def test_refusals(tmp_path: Path, start_nm: Callable[..., Any]) -> None:
    nm = await start_nm(nm_config(tmp_path, [reserved_pair()]))

    code, details = await refused(switch(nm, DECODE))
    assert code == grpc.StatusCode.FAILED_PRECONDITION and violation_type(details) == "NO_START_RECORDED"

    for role, instance_id, fields in [
        (common_pb2.ROLE_UNSPECIFIED, 5, ["role"]),
        (UNION, 5, ["role"]),
        (DECODE, 0, ["instance_id"]),
        (UNION, 0, ["instance_id", "role"]),
    ]:
        code, details = await refused(switch(nm, role, instance_id))
        assert code == grpc.StatusCode.INVALID_ARGUMENT, (role, instance_id)
        assert bad_fields(details) == fields

    pid = (await nm.start_engines()).endpoints[0].pid
    code, details = await refused(switch(nm, DECODE, instance_id=6))
    assert code == grpc.StatusCode.FAILED_PRECONDITION and violation_type(details) == "INSTANCE_MISMATCH"
    # Refused: the engine and the role are as they were.
    status = await nm.status()
    assert [e.pid for e in status.endpoints] == [pid] and status.role == PREFILL
    assert status.relaunch_count == 0 and kv_role(pid) == "kv_producer"


async def test_a_union_node_cannot_switch(tmp_path: Path, start_nm: Callable[..., Any]) -> None:
    nm = await start_nm(nm_config(tmp_path, [reserved_pair()], role="union"))
    pid = (await nm.start_engines()).endpoints[0].pid
    for role in (PREFILL, DECODE):
        code, details = await refused(switch(nm, role))
        assert code == grpc.StatusCode.FAILED_PRECONDITION
        assert violation_type(details) == "ROLE_NOT_SWITCHABLE"
    status = await nm.status()
    assert status.role == UNION and [e.pid for e in status.endpoints] == [pid]
    assert status.relaunch_count == 0


# --- the supervisor in process ------------------------------------------------------------------


async def test_a_switch_while_a_relaunch_runs_is_aborted(tmp_path: Path) -> None:
    sup = supervisor(tmp_path)
    gate = asyncio.Event()
    launched: list[int] = []

    async def slow_stop(grace_s: float) -> None:
        await gate.wait()

    async def launch(req: pb.StartEnginesRequest) -> None:
        launched.append(req.role)

    sup._stop_engines = slow_stop  # type: ignore[method-assign]
    sup._launch = launch  # type: ignore[method-assign]

    def assert_aborted(exc: pytest.ExceptionInfo[errors.MotorError]) -> None:
        assert exc.value.code == grpc.StatusCode.ABORTED
        (info,) = exc.value.details
        assert isinstance(info, error_details_pb2.ErrorInfo) and info.reason == "RELAUNCH_IN_PROGRESS"

    # A switch while RestartEngines runs, and RestartEngines while a switch runs.
    restart = asyncio.create_task(sup.restart(RESTART))
    await until(lambda: sup.relaunching, 5, "relaunch running")
    with pytest.raises(errors.MotorError) as exc:
        await sup.switch_role(pb.SwitchRoleRequest(instance_id=3, role=DECODE))
    assert_aborted(exc)
    gate.set()
    assert await restart == 1 and launched == [PREFILL]

    gate.clear()
    switching = asyncio.create_task(sup.switch_role(pb.SwitchRoleRequest(instance_id=3, role=DECODE)))
    await until(lambda: sup.relaunching, 5, "switch running")
    assert sup.freeze.frozen
    with pytest.raises(errors.MotorError) as exc:
        await sup.restart(RESTART)
    assert_aborted(exc)
    gate.set()
    assert await switching == (DECODE, True, 2)
    assert launched == [PREFILL, DECODE] and not sup.relaunching
    assert sup.role == DECODE and sup.command is not None and sup.command.role == DECODE


async def test_a_failed_launch_is_internal_and_unfreezes(tmp_path: Path) -> None:
    sup = supervisor(tmp_path)

    async def no_stop(grace_s: float) -> None:
        pass

    async def broken(req: pb.StartEnginesRequest) -> None:
        raise LaunchError("'vllm' not found on PATH")

    sup._stop_engines = no_stop  # type: ignore[method-assign]
    sup._launch = broken  # type: ignore[method-assign]
    with pytest.raises(errors.MotorError) as exc:
        await sup.switch_role(pb.SwitchRoleRequest(instance_id=3, role=DECODE))
    assert exc.value.code == grpc.StatusCode.INTERNAL
    (info,) = exc.value.details
    assert isinstance(info, error_details_pb2.ErrorInfo)
    assert info.reason == "RELAUNCH_FAILED" and "not found on PATH" in exc.value.message
    assert not sup.freeze.frozen and not sup.relaunching
