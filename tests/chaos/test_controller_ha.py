"""Chaos on the Controllers of `motor up --ha --prefill 1 --decode 1` (etcd, two Controllers,
one client sending completions throughout):

- the leader is SIGKILLed: a new leader (the standby, or the killed one restarted by motor up,
  whichever wins the election once the lease is gone), every NodeManager streams to it, no engine
  restarts, no instance id changes and no non-streaming request fails;
- the leader is SIGSTOPped past its lease: the standby leads and changes the instance set (a
  NodeManager started here adds a decode instance); then the old leader is let go (SIGCONT)
  and steps down (exit 3, restarted as a standby) without one write landing in etcd or one
  push landing in the Coordinator;
- the leader is SIGKILLed in the middle of an engine relaunch (waiting for the relaunched
  engine): the new leader continues it from the record stored in etcd, and the NodeManager
  relaunches exactly once.

The engines take 2 s to load, so a relaunch has a waiting phase to be caught in.

A short lease and heartbeat keep the failovers short. Times (to a new leader, to every
NodeManager re-attached) are measured and printed, not asserted: bench/bench_failover.py
reports them against their targets."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Iterator

import grpc
import pytest

from motor_mesh.controller.store.etcd_client import EtcdClient
from motor_mesh.gen.motor.v1 import (
    controller_pb2,
    controller_pb2_grpc,
    nodemanager_pb2,
    nodemanager_pb2_grpc,
)
from tests.chaos.harness import ACTIVE, DELETED, Cluster, Load, pid_of, scenario
from tests.e2e.cluster import CONTROLLER, CONTROLLER_METRICS, ETCD_CLIENT, NM
from tests.etcd import NOT_INSTALLED
from tests.metrics import scrape
from tests.poll import wait_until
from tests.procs import exited, system_binary

pytestmark = [
    pytest.mark.timeout(180),
    pytest.mark.skipif(system_binary("etcd") is None, reason=NOT_INSTALLED),
]

LEASE_S, HEARTBEAT_S = 2, 1
CONFIG = {
    "controller": {"leader_lease_s": LEASE_S, "heartbeat_interval_s": HEARTBEAT_S},
    "engine": {"args": {"startup_s": 2}},
}
PREFIX = b"/motor/"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    c = Cluster(
        tmp_path_factory.mktemp("chaos-ha"), prefill=1, decode=1, config=CONFIG, extra_nodes=1, ha=True
    )
    try:
        c.wait_ready(90)
        c.steady(2)
        yield c
    finally:
        c.close()


@pytest.fixture(scope="module")
def load(cluster: Cluster) -> Iterator[Load]:
    lg = Load(cluster.base_url).start()
    try:
        lg.wait_served(10, since=0.0)
        yield lg
    finally:
        lg.stop()


def _index(c: Cluster, addr: str) -> int:
    """0 for controller-0, 1 for controller-1."""
    return c.controllers.index(addr)


def _pid(c: Cluster, addr: str) -> int:
    return c._child_pid("controller", str(CONTROLLER + _index(c, addr) + c.off))


def _attached(c: Cluster, addr: str) -> bool:
    """Every NodeManager's heartbeat stream is open on the Controller at ``addr``."""
    metrics = scrape(f"http://{c.addr(CONTROLLER_METRICS + _index(c, addr))}/metrics")
    return metrics.value("motor_controller_nodemanagers_connected") == c.nodes


def _roles(c: Cluster) -> tuple[str, str]:
    leader = wait_until(c.leader, 30, "a leading Controller", every=0.05)
    return leader, next(a for a in c.controllers if a != leader)


def _standing_by(c: Cluster, addr: str) -> bool:
    """The Controller at ``addr`` runs (again) and answers as a standby."""
    return bool(_pid(c, addr)) and not c.serving(addr, "motor.v1.Controller") and c.serving(addr, "")


def _etcd_revision(c: Cluster) -> int:
    async def read() -> int:
        client = EtcdClient([c.addr(ETCD_CLIENT)], timeout_s=3)
        try:
            return (await client.get_prefix(PREFIX))[1]
        finally:
            await client.close()

    return asyncio.run(read())


def test_a_killed_leader_is_replaced_and_nothing_restarts(cluster: Cluster, load: Load) -> None:
    c = cluster
    with scenario(
        "controller_leader_sigkill", load, "SIGKILL the leading Controller (--ha)", cluster=c
    ) as sc:
        before = c.steady(2)
        engines = {i.id: pid_of(i) for i in before}
        old, _ = _roles(c)
        pid = _pid(c, old)
        assert pid and _attached(c, old)
        sc.fault()
        os.kill(pid, signal.SIGKILL)

        def successor() -> tuple[str, float] | None:
            # The standby, or the killed one already restarted by motor up: both stand for
            # election once the dead leader's lease is gone (never the dead process itself).
            leader = c.leader()
            if not leader or (leader == old and _pid(c, old) in (0, pid)):
                return None
            return leader, time.monotonic()

        new, leads = wait_until(successor, 30, "a new leader", every=0.01)
        attached = wait_until(lambda: _attached(c, new) and time.monotonic(), 30, every=0.02)
        sc.recovered()
        assert sc.fault_at is not None
        sc.notes.update(new_leader_s=round(leads - sc.fault_at, 3), reattached_s=round(attached - leads, 3))
        print(
            f"leader killed -> {new} leads {leads - sc.fault_at:.2f} s -> all attached +{attached - leads:.2f} s"
        )
        after = c.steady(2)
        assert c.leader() == new
        assert {i.id: pid_of(i) for i in after} == engines, "an instance id changed or an engine restarted"
        assert not c.instances(DELETED)
        load.wait_served(10, since=attached)
        failed, _, _, _ = sc.counts()
        assert failed == 0, sc.errors()
        # The other one stands by (the killed one restarted by motor up, if it did not win).
        other = next(a for a in c.controllers if a != new)
        wait_until(lambda: _standing_by(c, other), 30, "the other Controller standing by")


def test_a_paused_leader_wakes_up_and_steps_down_without_a_write_or_a_push(
    cluster: Cluster, load: Load
) -> None:
    c = cluster
    with scenario(
        "controller_leader_sigstop",
        load,
        f"SIGSTOP the leading Controller past its {LEASE_S} s lease",
        cluster=c,
    ) as sc:
        before = c.steady(2)
        old, standby = _roles(c)
        pid = _pid(c, old)
        sc.fault()
        os.kill(pid, signal.SIGSTOP)
        try:
            wait_until(
                lambda: c.serving(standby, "motor.v1.Controller"), 30, "the standby leading", every=0.02
            )
            sc.recovered()
            # The new leader changes the instance set: a NodeManager started here registers one
            # more decode instance (it is given both Controllers, and finds the leader).
            c.start_nodemanager(c.nodes, "decode", "chaos-decode-extra", ",".join(c.controllers))
            changed = [i.id for i in c.steady(3)]
            assert set(changed) > {i.id for i in before}
            # Quiet: nothing more for the new leader to write.
            etcd_rev = _quiet_revision(c)
            table = c.coordinator_table()
        finally:
            os.kill(pid, signal.SIGCONT)
        wait_until(lambda: exited(pid), 30, "the old leader stepping down")
        index = _index(c, old)
        c.up.wait_line(f"event=restart component=controller-{index} rc=3", 30)
        wait_until(lambda: _standing_by(c, old), 30, "the old leader back as a standby")
        assert c.leader() == standby
        assert _etcd_revision(c) == etcd_rev, "a write landed in etcd after the old leader woke"
        now = c.coordinator_table()
        assert (now.revision, now.incarnation) == (table.revision, table.incarnation), "a push landed"
        assert [i.id for i in c.steady(3)] == changed
        failed, _, _, _ = sc.counts()
        assert failed == 0, sc.errors()


def _quiet_revision(c: Cluster) -> int:
    """etcd's revision once it has not moved for a second."""
    seen: list[int] = []

    def settled() -> int | None:
        seen.append(_etcd_revision(c))
        return seen[-1] if len(seen) >= 5 and len(set(seen[-5:])) == 1 else None

    return wait_until(settled, 30, "etcd's revision settled", every=0.25)


def _phase(addr: str, instance_id: int) -> tuple[str, str]:
    """(strategy, phase) of the instance, as the Controller at ``addr`` says; ("", "") when it
    does not answer as the leader."""
    with grpc.insecure_channel(addr) as ch:
        try:
            resp = controller_pb2_grpc.ControllerStub(ch).GetFaultToleranceStatus(
                controller_pb2.GetFaultToleranceStatusRequest(instance_id=instance_id), timeout=2
            )
        except grpc.RpcError:
            return "", ""
    return resp.instances[0].strategy, resp.instances[0].phase


def _relaunches(c: Cluster, i: int) -> int:
    with grpc.insecure_channel(c.addr(NM + i)) as ch:
        status = nodemanager_pb2_grpc.NodeManagerStub(ch).GetStatus(
            nodemanager_pb2.GetStatusRequest(), timeout=5
        )
    return status.relaunch_count


def test_a_relaunch_interrupted_by_killing_the_leader_finishes_once(cluster: Cluster, load: Load) -> None:
    c = cluster
    # Two instances of motor up, and the one the SIGSTOP test added, if it ran.
    before = c.steady(len(c.instances(ACTIVE)))
    victim = next(i for i in before if i.job_name == "motor-sim-decode-0")
    nm = 1  # motor up starts the prefill NodeManager first
    old_pid, nm_pid, relaunches = pid_of(victim), c.nodemanager_pid(nm), _relaunches(c, nm)
    leader, _ = _roles(c)
    with scenario(
        "controller_leader_sigkill_mid_relaunch", load, "SIGKILL the leader mid-relaunch", cluster=c
    ) as sc:
        sc.fault()
        os.killpg(old_pid, signal.SIGKILL)
        wait_until(
            lambda: _phase(leader, victim.id) == ("EngineRelaunch", "wait_ready"),
            30,
            "the relaunch waiting for its engine",
            every=0.02,
        )
        os.kill(_pid(c, leader), signal.SIGKILL)

        def relaunched() -> bool:
            inst = next((i for i in c.instances() if i.id == victim.id), None)
            return inst is not None and inst.status == ACTIVE and pid_of(inst) not in (0, old_pid)

        wait_until(relaunched, 60, "the instance ACTIVE again with a new engine", every=0.05)
        sc.recovered()
        assert c.leader()  # a new leader (the standby, or the killed one restarted) finished it
        # Continued, not started over nor escalated: one relaunch, the same NodeManager.
        assert _relaunches(c, nm) == relaunches + 1
        assert c.nodemanager_pid(nm) == nm_pid
        assert [i.id for i in c.steady(len(before))] == [i.id for i in before] and not c.instances(DELETED)
        wait_until(lambda: _phase(c.leader(), victim.id) == ("", ""), 30, "the relaunch finished")
