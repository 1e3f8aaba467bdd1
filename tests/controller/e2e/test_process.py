"""The real ``motor controller`` process: kill -9 and restart on the same state_dir keeps the
instances and their ids, re-registered NodeManagers get no second StartEngines."""

from __future__ import annotations

import asyncio
import json
import signal
from pathlib import Path

import grpc
import pytest

from motor_mesh.gen.motor.v1 import controller_pb2, controller_pb2_grpc
from tests.controller.fakes import ACTIVE, NORMAL, NodeAgent
from tests.poll import until
from tests.procs import Proc, motor_argv


async def start_controller(tmp_path: Path, coordinator_address: str) -> tuple[Proc, str]:
    cfg = tmp_path / "controller.json"
    cfg.write_text(
        json.dumps(
            {
                "controller": {
                    "state_dir": str(tmp_path / "state"),
                    "coordinators": [coordinator_address],
                    "instance_heartbeat_timeout_s": 10,
                }
            }
        )
    )
    proc = Proc(motor_argv("controller", "--config", str(cfg), "--port", "0"), cwd=tmp_path)
    target, _ = await proc.await_listening()
    return proc, target


async def list_instances(target: str) -> list:
    async with grpc.aio.insecure_channel(target) as ch:
        stub = controller_pb2_grpc.ControllerStub(ch)
        return list((await stub.ListInstances(controller_pb2.ListInstancesRequest(), timeout=5)).instances)


async def test_restart_keeps_instances_without_restarting_engines(
    tmp_path, node_managers, coordinator
) -> None:
    nm = await node_managers()
    proc, target = await start_controller(tmp_path, coordinator.address)
    agents: list[NodeAgent] = []
    try:
        agent = NodeAgent(target, job="p", nm=nm)
        agents.append(agent)
        await agent.register()
        await until(lambda: nm.starts)
        await agent.beat(NORMAL)
        await until(lambda: 1 in coordinator.table)

        await asyncio.to_thread(proc.kill)  # SIGKILL: no chance to tidy up
        proc, target = await start_controller(tmp_path, coordinator.address)
        [restored] = await list_instances(target)
        assert (restored.id, restored.status) == (1, ACTIVE)

        # The NodeManager's stream reconnects with its old session: told to register again.
        back = NodeAgent(target, job="p", nm=nm)
        agents.append(back)
        back.node_id, back.epoch, back.seq = agent.node_id, agent.epoch, agent.seq
        assert (await back.beat(NORMAL)).directive == controller_pb2.DIRECTIVE_REREGISTER
        back.drop_stream()
        resp = await back.register(instance_id=1)
        assert resp.instance_id == 1
        assert (await back.beat(NORMAL)).ack.seq == back.seq
        [inst] = await list_instances(target)
        assert (inst.id, inst.status) == (1, ACTIVE)
        assert len(nm.starts) == 1  # engines kept running
        await until(lambda: coordinator.count("Set", ok=True) >= 2)  # the new Controller's sync
        assert 1 in coordinator.table and coordinator.count("Delete") == 0

        # Ids are never reused: the next job gets 2.
        other = await node_managers()
        fresh = NodeAgent(target, job="q", nm=other, ports=(10002,))
        agents.append(fresh)
        await fresh.register()
        await until(lambda: other.starts)
        assert other.starts[0].instance_id == 2

        # Graceful stop: exits 0, open heartbeat streams end.
        proc.signal(signal.SIGTERM)
        with pytest.raises(grpc.aio.AioRpcError):
            await asyncio.wait_for(back.call.read(), 10)
        assert await proc.await_exit(10) == 0
    finally:
        for a in agents:
            await a.close()
        await asyncio.to_thread(proc.kill)


async def test_second_controller_on_the_same_state_dir_refuses_to_start(tmp_path, coordinator) -> None:
    proc, _ = await start_controller(tmp_path, coordinator.address)
    try:
        second = Proc(
            motor_argv("controller", "--config", str(tmp_path / "controller.json"), "--port", "0"),
            cwd=tmp_path,
        )
        await second.await_line("in use by another Controller")
        assert await second.await_exit(20) == 1
    finally:
        await asyncio.to_thread(proc.kill)
