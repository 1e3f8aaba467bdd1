"""Chaos on the control stream: `motor up --prefill 1 --decode 2` plus a second prefill
NodeManager started here, which reaches the Controller only through a loopback TCP proxy. Its
stream is cut (every connection reset), then stalled (nothing moves, nothing is closed) for
twice the heartbeat timeout; last the Controller itself is stopped (SIGSTOP) for 12 s, past
the heartbeat timeout and past the NodeManagers' own 10 s watchdog on a silent stream.

A short heartbeat (1 s) and heartbeat timeout (4 s) keep the stalls short. The NodeManager's
own watchdog gives up on a silent stream only after 10 s, so neither stream stall reaches it;
the stopped Controller does, and its NodeManagers re-attach when it continues.

- A cut must cost nothing: the NodeManager opens a new stream before the timeout, its
  instance stays, with the same engine.
- A stall longer than the timeout is a silent NodeManager to the Controller: its instance is
  taken out of routing (DELETED), and when the path flows again the node registers again and
  its job serves again.
- A stopped Controller is not a silent NodeManager: when it continues, no instance is deleted
  and no engine restarted.

Non-streaming requests may not fail in any of them (another pair is healthy throughout)."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator

import pytest

from motor_mesh.gen.motor.v1 import common_pb2
from tests.chaos.harness import ACTIVE, CONTROLLER, DELETED, Cluster, Load, by_job, pid_of, scenario
from tests.chaos.proxy import TcpProxy
from tests.e2e.cluster import CONTROLLER_METRICS
from tests.metrics import scrape
from tests.poll import wait_until
from tests.procs import Proc, exited

pytestmark = pytest.mark.timeout(150)

HEARTBEAT_S, TIMEOUT_S = 1, 4
STOP_S = 12.0  # a VM pause or a long stall, past every timeout on both sides (NodeManager: 10 s)
CONFIG = {
    "controller": {
        "heartbeat_interval_s": HEARTBEAT_S,
        "instance_heartbeat_timeout_s": TIMEOUT_S,
        "engine_relaunch_poll_interval_s": 1,
    }
}
PROXIED = 3  # NodeManager index of the node behind the proxy (motor up runs 0, 1, 2)
JOB = "motor-sim-prefill-1"


class Rig:
    def __init__(self, cluster: Cluster, proxy: TcpProxy, nm: Proc) -> None:
        self.cluster, self.proxy, self.nm = cluster, proxy, nm


@pytest.fixture(scope="module")
def rig(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Rig]:
    c = Cluster(tmp_path_factory.mktemp("chaos-stream"), prefill=1, decode=2, config=CONFIG, extra_nodes=1)
    proxy = TcpProxy("127.0.0.1", CONTROLLER + c.off).start()
    try:
        c.wait_ready()
        nm = c.start_nodemanager(PROXIED, "prefill", JOB, proxy.address)
        c.steady(4)
        yield Rig(c, proxy, nm)
    finally:
        c.close()
        proxy.close()


@pytest.fixture(scope="module")
def load(rig: Rig) -> Iterator[Load]:
    lg = Load(rig.cluster.base_url).start()
    try:
        lg.wait_served(10, since=0.0)
        yield lg
    finally:
        lg.stop()


def engines(instances: list[common_pb2.Instance]) -> dict[str, tuple[int, int]]:
    """job -> (instance id, engine pid)"""
    return {i.job_name: (i.id, pid_of(i)) for i in instances}


def test_cut_stream_reconnects_and_keeps_the_instance(rig: Rig, load: Load) -> None:
    c = rig.cluster
    with scenario(
        "nm_stream_cut", load, "reset the NodeManager-Controller connection (proxy)", cluster=c
    ) as sc:
        before = engines(c.steady(4))
        sc.fault()
        t = sc.fault_at or 0.0
        assert rig.proxy.cut() >= 1, "no connection through the proxy to cut"
        rig.nm.wait_line("event=heartbeat_stream_open", 30, start=rig.nm.index_at(t))
        after = engines(c.steady(4))
        sc.recovered()
        load.wait_served(10, since=sc.recovered_at or 0)
        assert after == before, "an instance was replaced or an engine restarted"
        assert not {d.id for d in c.instances(DELETED)} & {i for i, _ in before.values()}
        failed, _, _, _ = sc.counts()
        assert failed == 0, sc.errors()


def test_stalled_stream_takes_the_node_out_then_it_serves_again(rig: Rig, load: Load) -> None:
    c = rig.cluster
    with scenario(
        "nm_stream_stall",
        load,
        f"stall the NodeManager-Controller path for {2 * TIMEOUT_S} s (proxy)",
        cluster=c,
    ) as sc:
        before = engines(c.steady(4))
        old_id = before[JOB][0]
        sc.fault()
        rig.proxy.stall()
        try:
            # Silent past the timeout: out of routing, in both tables.
            wait_until(
                lambda: all(i.id != old_id for i in c.instances()) and not c.disagreement(),
                TIMEOUT_S * 4,
                "the silent node's instance out of routing",
                every=0.1,
            )
            sc.notes["detected_s"] = round(time.monotonic() - (sc.fault_at or 0), 2)
            time.sleep(max(0.0, (sc.fault_at or 0) + 2 * TIMEOUT_S - time.monotonic()))
        finally:
            rig.proxy.resume()
        sc.clock("the path flowing again")

        def serving_again() -> bool:
            inst = by_job(c.instances()).get(JOB)
            return inst is not None and inst.status == ACTIVE and not c.disagreement()

        wait_until(serving_again, 60, "the job ACTIVE and routed again", every=0.1)
        sc.recovered()
        after = engines(c.steady(4))
        load.wait_served(10, since=sc.recovered_at or 0)
        sc.notes["new_instance_id"] = after[JOB][0] != old_id
        sc.notes["engine_restarted"] = after[JOB][1] != before[JOB][1]
        assert {j: v for j, v in after.items() if j != JOB} == {j: v for j, v in before.items() if j != JOB}
        failed, _, _, _ = sc.counts()
        assert failed == 0, sc.errors()


def test_stopped_controller_deletes_nothing_when_it_continues(rig: Rig, load: Load) -> None:
    c = rig.cluster
    with scenario(
        "controller_sigstop", load, f"SIGSTOP the Controller for {STOP_S:.0f} s, then SIGCONT", cluster=c
    ) as sc:
        before = engines(c.steady(4))
        pid = c.component_pid("controller")
        assert pid
        sc.fault()
        os.kill(pid, signal.SIGSTOP)
        try:
            time.sleep(STOP_S)
        finally:
            os.kill(pid, signal.SIGCONT)
        sc.clock("SIGCONT")
        after = engines(c.steady(4, timeout=30))
        sc.recovered()
        load.wait_served(10, since=sc.recovered_at or 0)
        # Watch a few heartbeat timeouts more: a late sweep would delete now.
        deadline = time.monotonic() + 2 * TIMEOUT_S
        while time.monotonic() < deadline:
            assert engines(c.instances()) == before, "an instance was replaced or an engine restarted"
            time.sleep(0.25)
        assert after == before
        assert not {d.id for d in c.instances(DELETED)} & {i for i, _ in before.values()}
        assert not exited(pid) and c.component_pid("controller") == pid
        # The pause is told apart from silent NodeManagers, and an operator can see it.
        stalls = scrape(f"http://{c.addr(CONTROLLER_METRICS)}/metrics")
        assert stalls.value("motor_controller_loop_stalls_total") >= 1
        failed, _, _, _ = sc.counts()
        assert failed == 0, sc.errors()
