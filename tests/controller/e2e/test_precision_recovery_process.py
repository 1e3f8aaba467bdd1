"""Automatic precision recovery by a real ``motor controller`` process, posting to a real
Alertmanager: ReportAlarms answers at once however slowly the engines stop, and a Controller
SIGKILLed halfway finishes the recovery after its restart (the teardown is stored state)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import grpc

from motor_mesh.controller.alarms.store import PRECISION, precision_moi
from motor_mesh.gen.motor.v1 import alarm_pb2, common_pb2, controller_pb2, controller_pb2_grpc
from tests.controller.e2e.test_alertmanager import (  # noqa: F401 (a fixture)
    Alertmanagers,
    alertmanagers,
    require_alertmanager,
)
from tests.controller.fakes import ACTIVE, NORMAL, NodeAgent
from tests.poll import until
from tests.procs import Proc, motor_argv


async def start_controller(tmp_path: Path, coordinator: str, webhook: str) -> tuple[Proc, str]:
    cfg = tmp_path / "controller.json"
    cfg.write_text(
        json.dumps(
            {
                "controller": {
                    "state_dir": str(tmp_path / "state"),
                    "coordinators": [coordinator],
                    "precision_auto_recovery_enabled": True,
                    "alarm_webhook_url": webhook,
                }
            }
        )
    )
    proc = Proc(motor_argv("controller", "--config", str(cfg), "--port", "0"), cwd=tmp_path)
    target, _ = await proc.await_listening()
    return proc, target


async def precision_alerts(am, http) -> list[dict]:
    return [a for a in await am.active_alerts(http) if a["labels"].get("alarm_id") == PRECISION]


async def test_precision_recovery_survives_slow_engines_and_a_controller_kill(
    tmp_path,
    node_managers,
    coordinator,
    alertmanagers: Alertmanagers,  # noqa: F811 (the fixture imported above)
) -> None:
    require_alertmanager()
    am, http = await alertmanagers.start(), alertmanagers.http
    p_nm, d_nm = await node_managers(), await node_managers()
    # The decode's engines take far longer to stop than the Coordinator waits for an answer.
    d_nm.stop_delay = 60.0
    webhook = f"{am.base}/api/v2/alerts"
    proc, target = await start_controller(tmp_path, coordinator.address, webhook)
    agents: list[NodeAgent] = []
    try:
        for nm, job, role, port in (
            (p_nm, "p", common_pb2.ROLE_PREFILL, 10000),
            (d_nm, "d", common_pb2.ROLE_DECODE, 10002),
        ):
            agent = NodeAgent(target, job=job, nm=nm, role=role, ports=(port,))
            agents.append(agent)
            await agent.register()
            await until(lambda nm=nm: nm.starts)
            await agent.beat(NORMAL)
        await until(lambda: {1, 2} <= set(coordinator.table))
        alarm = alarm_pb2.Alarm(
            alarm_id=PRECISION,
            category=alarm_pb2.ALARM_CATEGORY_ALARM,
            severity=alarm_pb2.SEVERITY_MAJOR,
            moi=precision_moi("127.0.0.1", 1, 2),
            alarm_name="Precision issue",
            instance_id=2,
            p_instance_id=1,
        )
        async with grpc.aio.insecure_channel(target) as ch:
            stub = controller_pb2_grpc.ControllerStub(ch)
            # The Coordinator's own deadline is 5 s; the answer must not wait for the engines.
            resp = await stub.ReportAlarms(controller_pb2.ReportAlarmsRequest(alarms=[alarm]), timeout=2)
        assert resp.precision_recovery_pending
        await until(lambda: precision_alerts(am, http), timeout=20)  # fired in Alertmanager
        await until(lambda: d_nm.stops)  # the decode is being stopped...

        await asyncio.to_thread(proc.kill)  # ...when the Controller dies: SIGKILL
        assert coordinator.clears == [] and p_nm.stops == []
        d_nm.stop_delay = 0.0
        proc, target = await start_controller(tmp_path, coordinator.address, webhook)

        # The new process goes on from the stored teardown: decode, then prefill, the alarm
        # cleared (resolved in Alertmanager), the Coordinator told.
        await until(lambda: coordinator.clears == [(1, 2)], timeout=30)
        await until(lambda: p_nm.stops, timeout=10)
        assert len(d_nm.stops) == 2 and d_nm.stopped_at[-1] < p_nm.stopped_at[0]

        async def resolved() -> bool:
            return not await precision_alerts(am, http)

        await until(resolved, timeout=30)
        async with grpc.aio.insecure_channel(target) as ch:
            stub = controller_pb2_grpc.ControllerStub(ch)
            listed = await stub.ListInstances(controller_pb2.ListInstancesRequest(), timeout=5)
            assert not [i for i in listed.instances if i.status == ACTIVE]
            active = await stub.ListAlarms(
                controller_pb2.ListAlarmsRequest(active_only=True, alarm_id=PRECISION), timeout=5
            )
            assert list(active.alarms) == []
    finally:
        for a in agents:
            await a.close()
        await asyncio.to_thread(proc.kill)
