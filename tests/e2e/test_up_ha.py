"""``motor up --ha`` end to end: a real etcd, two Controllers of which one leads and the other
stands by (and tells clients where the leader is), requests served, the state in etcd, the
leader's death survived, and everything, etcd included, stopped by one SIGTERM."""

from __future__ import annotations

import json
import os
import re
import signal
import time
from collections.abc import Iterator

import grpc
import openai
import pytest
from google.rpc import error_details_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc

from motor_mesh.common.errors import details_of
from motor_mesh.gen.motor.v1 import common_pb2, controller_pb2, controller_pb2_grpc
from tests.e2e.cluster import Cluster
from tests.etcd import NOT_INSTALLED, etcdctl
from tests.poll import wait_until
from tests.procs import child_pids, exited, system_binary

pytestmark = [
    pytest.mark.timeout(240),
    pytest.mark.skipif(system_binary("etcd") is None, reason=NOT_INSTALLED),
]

LEASE_S = 2  # a short lease: the killed leader's successor is not long in coming


@pytest.fixture(scope="module")
def ha(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    tmp = tmp_path_factory.mktemp("up-ha")
    cfg = tmp / "cfg.json"
    cfg.write_text(json.dumps({"controller": {"leader_lease_s": LEASE_S}}))
    c = Cluster(tmp, "--config", str(cfg), ha=True)
    try:
        c.wait_ready(90)
        yield c
    finally:
        c.cleanup()


def health(addr: str) -> str:
    """Health of motor.v1.Controller at ``addr``: SERVING (leader), NOT_SERVING (standby), or
    the error code of a Controller that does not answer."""
    with grpc.insecure_channel(addr) as ch:
        try:
            r = health_pb2_grpc.HealthStub(ch).Check(
                health_pb2.HealthCheckRequest(service="motor.v1.Controller"), timeout=5
            )
        except grpc.RpcError as err:
            return err.code().name
    return health_pb2.HealthCheckResponse.ServingStatus.Name(r.status)


def roles(c: Cluster) -> tuple[str, str] | None:
    """(leader, standby) addresses once exactly one Controller serves and the other stands by."""
    a, b = c.controller_addrs()
    states = {addr: health(addr) for addr in (a, b)}
    if sorted(states.values()) != ["NOT_SERVING", "SERVING"]:
        return None
    return (a, b) if states[a] == "SERVING" else (b, a)


def list_instances(addr: str) -> controller_pb2.ListInstancesResponse:
    with grpc.insecure_channel(addr) as ch:
        return controller_pb2_grpc.ControllerStub(ch).ListInstances(
            controller_pb2.ListInstancesRequest(), timeout=5
        )


def named_leader(addr: str) -> str:
    """The leader a standby names in its refusal of a motor.v1.Controller call."""
    with pytest.raises(grpc.RpcError) as caught:
        list_instances(addr)
    assert caught.value.code() == grpc.StatusCode.UNAVAILABLE, caught.value
    (info,) = [d for d in details_of(caught.value) if isinstance(d, error_details_pb2.ErrorInfo)]
    assert info.reason == "NOT_LEADER"
    return info.metadata["leader"]


def active(addr: str) -> int:
    """How many instances the Controller at ``addr`` has ACTIVE."""
    return sum(i.status == common_pb2.INSTANCE_STATUS_ACTIVE for i in list_instances(addr).instances)


def chat(c: Cluster) -> None:
    client = openai.OpenAI(base_url=f"{c.base_url}/v1", api_key="none", max_retries=0, timeout=30)
    resp = client.chat.completions.create(
        model="motor-sim", messages=[{"role": "user", "content": "Hello from HA"}], max_tokens=8
    )
    assert resp.choices[0].message.content


def controller_pid(c: Cluster, addr: str) -> int:
    found = child_pids(c.proc.pid, "controller", addr.rsplit(":", 1)[1])
    assert len(found) == 1, found
    return found[0]


def test_one_controller_leads_and_the_other_redirects_to_it(ha: Cluster) -> None:
    assert ha.proc.stdout_lines == [f"READY {ha.base_url}"]
    leader, standby = wait_until(lambda: roles(ha), timeout=20)
    # A standby learns the leader by a watch: soon, not necessarily at once.
    wait_until(lambda: named_leader(standby) == leader, timeout=20)
    for name in ("controller-0", "controller-1", "etcd"):
        assert f"[{name}] " in ha.proc.output()


def test_requests_are_served_and_the_state_is_in_etcd(ha: Cluster) -> None:
    chat(ha)

    def instance_keys() -> list[str]:
        out = etcdctl(ha.etcd_endpoint, "get", "--prefix", "/motor", "--keys-only")
        return [k for k in out.split() if k.startswith("/motor/instances/")]

    wait_until(lambda: len(instance_keys()) == 2, timeout=20)


def test_a_new_leader_is_elected_when_the_leader_is_killed(ha: Cluster) -> None:
    leader, _ = wait_until(lambda: roles(ha), timeout=20)
    killed_at = time.monotonic()
    os.kill(controller_pid(ha, leader), signal.SIGKILL)
    name = f"controller-{ha.controller_addrs().index(leader)}"
    ha.proc.wait_line(f"event=restart component={name} rc=-9", 20)
    # Once the dead leader's lease has run out, one of the two (the standby, or the dead one
    # back as a standby) is elected; the other stands by.
    new_leader, _ = wait_until(lambda: roles(ha), timeout=LEASE_S + 30)
    leading = re.compile(rf"\[controller-[01]\] .*event=leading address={re.escape(new_leader)} ")
    wait_until(lambda: ha.proc.lines_since(killed_at, leading), timeout=10)
    # The NodeManagers found the new leader and registered their instances with it again.
    wait_until(lambda: active(new_leader) == 2, timeout=30)
    chat(ha)


def test_sigterm_stops_everything_etcd_included(ha: Cluster) -> None:
    (etcd,) = child_pids(ha.proc.pid, "--name=motor-up")
    children = child_pids(ha.proc.pid, "motor_mesh.cli")
    assert len(children) == 5  # two Controllers, the Coordinator, two NodeManagers
    assert ha.stop(15) == 0
    assert exited(etcd)
    assert all(exited(pid) for pid in children)
