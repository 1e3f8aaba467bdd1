"""``--controller`` with several Controllers: every command is answered by the leader, whichever
address it is at; a set with no leader is one line on stderr and exit 1."""

from __future__ import annotations

import asyncio
import json
import subprocess
from pathlib import Path

from motor_mesh.gen.motor.v1 import alarm_pb2, common_pb2
from tests.fake_controller import FakeController, controllers
from tests.ports import reserved_port
from tests.procs import Proc, motor_argv


async def motor(*args: str) -> subprocess.CompletedProcess[str]:
    """``motor ARGS``, run while this loop keeps serving the fake Controllers."""
    proc = await asyncio.create_subprocess_exec(
        *motor_argv(*args), stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode is not None
    return subprocess.CompletedProcess(args, proc.returncode, out.decode(), err.decode())


def leading(*ids: int) -> FakeController:
    fake = FakeController()
    fake.instances = [
        common_pb2.Instance(id=i, role=common_pb2.ROLE_PREFILL, status=common_pb2.INSTANCE_STATUS_ACTIVE)
        for i in ids
    ]
    fake.alarms = [
        alarm_pb2.Alarm(sequence=s, alarm_id="0xFC001009", reason=f"alarm {s}", instance_id=s)
        for s in (1, 2, 3)
    ]
    return fake


async def test_instances_are_answered_by_the_leader_behind_a_standby() -> None:
    standby, leader = FakeController(leading=False), leading(4, 5)
    async with controllers(standby, leader) as (stand, lead):
        got = await motor("instances", "-o", "json", "--controller", f"{stand.address},{lead.address}")
    assert got.returncode == 0, got.stderr
    assert [i["id"] for i in json.loads(got.stdout)] == ["4", "5"]  # uint64: a JSON string
    assert standby.refused >= 1 and got.stderr == ""


async def test_standbys_only_is_one_line_and_exit_1() -> None:
    a, b = FakeController(leading=False), FakeController(leading=False)
    async with controllers(a, b) as (sa, sb):
        listed = f"{sa.address},{sb.address}"
        got = await motor("instances", "--controller", listed, "--timeout", "5")
    assert got.returncode == 1 and got.stdout == ""
    assert got.stderr.splitlines() == [
        f"motor instances: no Controller leader among {listed} "
        "(this Controller is a standby; no leader is elected yet)"
    ]


async def test_faults_status_and_alarms_reach_the_leader_past_a_dead_address() -> None:
    dead = f"127.0.0.1:{reserved_port()}"
    standby, leader = FakeController(leading=False), leading(4)
    async with controllers(standby, leader) as (stand, lead):
        standby.leader_hint = lead.address
        controllers_flag = ["--controller", f"{dead},{stand.address}"]  # the leader only by the hint
        report = await motor(
            "faults", *controllers_flag, "report", "--node", "127.0.0.1:7300", "--level", "L3"
        )
        assert report.returncode == 0, report.stderr
        assert [f.level for r in leader.faults for f in r.faults] == [3]

        alarms = await motor("alarms", "--all", "-o", "json", *controllers_flag)
        assert alarms.returncode == 0, alarms.stderr
        assert [a["reason"] for a in json.loads(alarms.stdout)] == ["alarm 1", "alarm 2", "alarm 3"]

        status = await motor(
            "status", "-o", "json", *controllers_flag, "--coordinator", f"127.0.0.1:{reserved_port()}"
        )
        doc = json.loads(status.stdout)
        assert doc["controller"]["address"] == lead.address and doc["controller"]["error"] is None
        assert doc["controller"]["instances"]["prefill"]["ACTIVE"] == 1


async def test_alarms_watch_streams_from_the_leader(tmp_path: Path) -> None:
    standby, leader = FakeController(leading=False), leading()
    async with controllers(standby, leader) as (stand, lead):
        standby.leader_hint = lead.address
        flag = f"{stand.address},{lead.address}"
        watch = Proc(motor_argv("alarms", "--watch", "--after", "1", "--controller", flag), cwd=tmp_path)
        try:
            await watch.await_line("alarm 3", 30)
            assert [line.split()[0] for line in watch.stdout_lines] == ["2", "3"]
            assert watch.lines == watch.stdout_lines  # no "watch broken" on the way to the leader
        finally:
            watch.kill()


async def test_help_names_the_forms_of_controller() -> None:
    got = await motor("instances", "--help")
    assert "H:P[,H:P...]" in got.stdout and "dns:///NAME:PORT" in got.stdout
