"""etcd partitioned from the leading Controller: a loopback TCP proxy sits between the leader
and etcd (the standby reaches etcd directly) and is stalled, so the leader's lease renewals
black-hole. The leader stops acting on its own deadline, before its lease can expire in etcd
(its ``leadership_lost`` comes before the standby's ``leader_elected``), exits with status 3,
and the standby takes over; the Coordinator they both push to moves to the new term."""

from __future__ import annotations

import re
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path

import pytest

from tests.chaos.proxy import TcpProxy
from tests.etcd import NOT_INSTALLED, EtcdServer
from tests.poll import wait_until
from tests.ports import reserved_port
from tests.procs import Proc, motor_argv, system_binary

pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.skipif(system_binary("etcd") is None, reason=NOT_INSTALLED),
]

LEASE_S = 2


@pytest.fixture
def procs() -> Iterator[list[Proc]]:
    started: list[Proc] = []
    yield started
    for p in reversed(started):
        p.stop()


def _controller(procs: list[Proc], tmp: Path, etcd: str, coordinator: str) -> tuple[Proc, str]:
    port = reserved_port()
    env = {
        "MOTOR_CONTROLLER_STORE": "etcd",
        "MOTOR_CONTROLLER_ETCD_ENDPOINTS": f'["{etcd}"]',
        "MOTOR_CONTROLLER_LEADER_LEASE_S": str(LEASE_S),
        "MOTOR_CONTROLLER_COORDINATORS": f'["{coordinator}"]',
        "MOTOR_CONTROLLER_STATE_DIR": str(tmp / f"controller-{port}"),
    }
    proc = Proc(motor_argv("controller", "--port", str(port)), cwd=tmp, env=env)
    procs.append(proc)
    return proc, f"127.0.0.1:{port}"


def _ts(line: str) -> datetime:
    stamp = re.search(r"\bts=(\S+)", line)
    assert stamp, line
    return datetime.fromisoformat(stamp.group(1).replace("Z", "+00:00"))


def _term(line: str) -> int:
    found = re.search(r"\bterm=(\d+)", line)
    assert found, line
    return int(found.group(1))


def test_a_leader_cut_off_from_etcd_stops_before_its_lease_can_pass_on(
    tmp_path: Path, procs: list[Proc]
) -> None:
    etcd = EtcdServer(tmp_path / "etcd").start()
    proxy = TcpProxy("127.0.0.1", etcd.client_port).start()
    try:
        coordinator_port = reserved_port()
        coordinator = Proc(
            motor_argv("coordinator", "--port", str(coordinator_port)),
            cwd=tmp_path,
            env={"MOTOR_COORDINATOR_HTTP_PORT": "0", "MOTOR_COORDINATOR_WORKERS": "1"},
        )
        procs.append(coordinator)
        coordinator.wait_line("event=listening", 30)
        address = f"127.0.0.1:{coordinator_port}"

        leader, leader_addr = _controller(procs, tmp_path, proxy.address, address)
        elected = leader.wait_line("event=leading", 30)
        standby, _ = _controller(procs, tmp_path, etcd.endpoint, address)
        standby.wait_line(f"event=leader_seen leader={leader_addr}", 30)
        coordinator.wait_line(f"event=leader_term term={_term(elected)} ", 30)

        proxy.stall()
        lost = leader.wait_line("event=leadership_lost", 30)
        assert wait_until(lambda: leader.popen.poll() is not None, 30, "the cut-off leader exiting")
        assert leader.popen.returncode == 3
        taken = standby.wait_line("event=leader_elected", 30)
        assert _term(taken) > _term(elected)
        assert _ts(lost) < _ts(taken), "the old leader was still acting when the new one was elected"
        coordinator.wait_line(f"event=leader_term term={_term(taken)} ", 30)
    finally:
        proxy.close()
        etcd.stop()
