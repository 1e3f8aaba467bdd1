"""EngineSupervisor in-process: RestartEngines serialization, failure and abort, with the process
work replaced by gates the test controls."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import pytest

from motor_mesh.common import errors
from motor_mesh.common.config import load
from motor_mesh.common.procgroup import Reaper
from motor_mesh.gen.motor.v1 import common_pb2
from motor_mesh.gen.motor.v1 import nodemanager_pb2 as pb
from motor_mesh.nodemanager.launch import LaunchError
from motor_mesh.nodemanager.statefile import StateFile
from motor_mesh.nodemanager.supervisor import EngineSupervisor
from tests.poll import until

RESTART = pb.RestartEnginesRequest(action=pb.RESTART_ACTION_RESTART)
ABORT = pb.RestartEnginesRequest(action=pb.RESTART_ACTION_ABORT)


def supervisor(tmp_path: Path) -> EngineSupervisor:
    cfg = load(None, env={}, overrides={"nodemanager": {"job_name": "job-a", "state_dir": str(tmp_path)}})
    sup = EngineSupervisor(cfg.nodemanager, cfg.engine, StateFile(tmp_path), Reaper())
    sup.command = pb.StartEnginesRequest(
        job_name="job-a",
        instance_id=3,
        role=common_pb2.ROLE_PREFILL,
        endpoints=[common_pb2.Endpoint(id=0, host="127.0.0.1", port=10000)],
    )
    sup.instance_id = 3
    return sup


async def test_second_restart_while_one_runs_is_aborted(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    sup = supervisor(tmp_path)
    gate = asyncio.Event()
    launched: list[int] = []

    async def slow_stop(grace_s: float) -> None:
        await gate.wait()

    async def launch(req: pb.StartEnginesRequest) -> None:
        launched.append(req.instance_id)

    sup._stop_engines = slow_stop  # type: ignore[method-assign]
    sup._launch = launch  # type: ignore[method-assign]
    first = asyncio.create_task(sup.restart(RESTART))
    await until(lambda: sup.relaunching, 5, "relaunch running")
    assert sup.freeze.frozen
    with pytest.raises(errors.MotorError) as exc:
        await sup.restart(RESTART)
    assert exc.value.code == grpc.StatusCode.ABORTED
    (info,) = exc.value.details
    assert (info.reason, info.domain) == ("RELAUNCH_IN_PROGRESS", "motor")
    gate.set()
    assert await first == 1
    assert launched == [3] and not sup.relaunching
    assert "[ENGINE RELAUNCH #1 " in capsys.readouterr().out
    assert sup.freeze.frozen  # stays frozen until it expires or an ABORT
    assert await sup.restart(ABORT) == 1
    assert not sup.freeze.frozen


async def test_failed_relaunch_is_internal_and_unfreezes(tmp_path: Path) -> None:
    sup = supervisor(tmp_path)

    async def no_stop(grace_s: float) -> None:
        pass

    async def broken(req: pb.StartEnginesRequest) -> None:
        raise LaunchError("'vllm' not found on PATH")

    sup._stop_engines = no_stop  # type: ignore[method-assign]
    sup._launch = broken  # type: ignore[method-assign]
    with pytest.raises(errors.MotorError) as exc:
        await sup.restart(RESTART)
    assert exc.value.code == grpc.StatusCode.INTERNAL
    (info,) = exc.value.details
    assert info.reason == "RELAUNCH_FAILED" and "not found on PATH" in exc.value.message
    assert not sup.freeze.frozen and not sup.relaunching


async def test_restart_without_start_or_for_another_instance_is_refused(tmp_path: Path) -> None:
    sup = supervisor(tmp_path)
    with pytest.raises(errors.MotorError) as exc:
        await sup.restart(pb.RestartEnginesRequest(action=pb.RESTART_ACTION_RESTART, instance_id=4))
    assert exc.value.code == grpc.StatusCode.FAILED_PRECONDITION
    sup.command = None
    with pytest.raises(errors.MotorError) as exc:
        await sup.restart(RESTART)
    assert exc.value.code == grpc.StatusCode.FAILED_PRECONDITION
    (failure,) = exc.value.details
    assert failure.violations[0].type == "NO_START_RECORDED"
