"""Partial node loss of a two-node instance (dp 1, nnodes 2): real ``motor controller`` and
``motor nodemanager`` processes with simulated engines. The NodeManager of node_rank 1 is
SIGKILLed and comes back (its pod restarts); the Controller retires the instance and stops the
surviving node too, whose ranks could not go on in a collective group that lost a member, so
both nodes' engines start again together and the instance serves again."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import aiohttp
import grpc

from motor_mesh.gen.motor.v1 import common_pb2, controller_pb2, controller_pb2_grpc
from tests.nodemanager.conftest import nm_config
from tests.poll import until
from tests.ports import reserved_pair, reserved_port
from tests.procs import Proc, motor_argv

ACTIVE = common_pb2.INSTANCE_STATUS_ACTIVE


async def active_instance(target: str) -> common_pb2.Instance | None:
    async with grpc.aio.insecure_channel(target) as ch:
        resp = await controller_pb2_grpc.ControllerStub(ch).ListInstances(
            controller_pb2.ListInstancesRequest(status=ACTIVE), timeout=5
        )
    return resp.instances[0] if resp.instances else None


async def completes(port: int) -> bool:
    body = {"model": "served-1", "prompt": "hello", "max_tokens": 2}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as http:
        async with http.post(f"http://127.0.0.1:{port}/v1/completions", json=body) as resp:
            return resp.status == 200


async def test_a_lost_node_restarts_the_surviving_node_with_it(tmp_path: Path, start_nm) -> None:
    cfg = tmp_path / "controller.json"
    cfg.write_text(json.dumps({"controller": {"state_dir": str(tmp_path / "ctl"), "coordinators": []}}))
    controller = Proc(motor_argv("controller", "--config", str(cfg), "--port", "0"), cwd=tmp_path)
    try:
        target, _ = await controller.await_listening()
        engine_ports = [reserved_pair(), reserved_pair()]
        configs = [
            nm_config(
                tmp_path,
                [engine_ports[rank]],
                port=reserved_port(),  # a restarted pod comes back at the same address
                controller=target,
                job_name="two-nodes",
                node_rank=rank,
                parallel={"dp": 1, "tp": 2, "nnodes": 2},
                state_dir=str(tmp_path / f"nm-{rank}"),
            )
            for rank in (0, 1)
        ]
        head, tail = await start_nm(configs[0]), await start_nm(configs[1])
        first = await until(lambda: active_instance(target), timeout=30, what="the instance ACTIVE")
        head_pid = (await head.status()).endpoints[0].pid
        assert await completes(engine_ports[0])

        tail.proc.kill()  # node_rank 1's NodeManager dies (SIGKILL) ...
        await start_nm(configs[1])  # ... and its pod restarts it
        # The survivor is told to Stop: it stops its engine and exits non-zero, so its pod
        # restarts too and both ranks start together.
        assert await head.wait_exit(30) != 0
        head = await start_nm(configs[0])

        async def rebuilt() -> common_pb2.Instance | None:
            inst = await active_instance(target)
            return inst if inst is not None and inst.id != first.id else None

        again = await until(rebuilt, timeout=60, what="a new instance of the job ACTIVE")
        assert again.job_name == first.job_name
        assert (await head.status()).endpoints[0].pid not in (0, head_pid)
        assert await until(lambda: completes(engine_ports[0]), timeout=20, retry=(aiohttp.ClientError,))
    finally:
        await asyncio.to_thread(controller.kill)
