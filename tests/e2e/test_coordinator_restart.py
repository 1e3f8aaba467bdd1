"""A Coordinator SIGKILLed under `motor up`, three times in a row: each time `motor up` starts it
again with an empty table, the Controller notices (its health Watch, or the new incarnation)
and sends the full set with no operator action, the Coordinator's table equals what the
Controller calls routable, and a chat completion through the Coordinator's HTTP port is served.

How long the Controller took from the restarted Coordinator's gRPC port answering to its table
being whole again is printed per round (``-s`` shows it); it is measured, not asserted."""

from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path

import grpc
import openai
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from motor_mesh.gen.motor.v1 import controller_pb2, controller_pb2_grpc, coordinator_pb2, coordinator_pb2_grpc
from tests.controller.fakes import FRESH, Identity, controller_side, identity
from tests.e2e.cluster import CONTROLLER, COORDINATOR, Cluster
from tests.poll import wait_until
from tests.procs import exited

pytestmark = pytest.mark.timeout(120)

ROUNDS = 3  # motor up's restart backoff doubles (1 s, 2 s, 4 s): more rounds only wait longer
MESSAGES = [{"role": "user", "content": "Still there after the restart?"}]
Table = tuple[set[Identity], set[int]]


def controller_table(addr: str) -> Table:
    with grpc.insecure_channel(addr, options=FRESH) as ch:
        resp = controller_pb2_grpc.ControllerStub(ch).ListInstances(
            controller_pb2.ListInstancesRequest(), timeout=5
        )
    return controller_side(resp.instances)


def coordinator_table(addr: str) -> tuple[Table, str]:
    """Every instance the Coordinator holds (available, unavailable, paused), the paused ids,
    and which process answered (its incarnation)."""
    with grpc.insecure_channel(addr, options=FRESH) as ch:
        r = coordinator_pb2_grpc.CoordinatorStub(ch).ListInstances(
            coordinator_pb2.CoordinatorListInstancesRequest(), timeout=5
        )
    held = {identity(i) for group in (r.available, r.unavailable, r.paused) for i in group}
    return (held, {i.id for i in r.paused}), r.incarnation


def answering(addr: str) -> bool:
    """The Coordinator's gRPC port answers (its management service SERVING), on a channel of
    its own so no reconnect backoff hides a port that just opened."""
    req = health_pb2.HealthCheckRequest(service="motor.v1.Coordinator")
    with grpc.insecure_channel(addr, options=FRESH) as ch:
        try:
            resp = health_pb2_grpc.HealthStub(ch).Check(req, timeout=0.5, wait_for_ready=False)
        except grpc.RpcError:
            return False
    return resp.status == health_pb2.HealthCheckResponse.SERVING


def test_a_killed_coordinator_gets_the_full_set_back_every_time(tmp_path: Path) -> None:
    c = Cluster(tmp_path, "--prefill", "1", "--decode", "1", nodes=2)
    try:
        c.wait_ready()
        ctl, coord = c.grpc(CONTROLLER), c.grpc(COORDINATOR)

        def both_routable() -> Table | None:
            table = controller_table(ctl)
            return table if len(table[0]) == 2 else None

        want = wait_until(both_routable)
        assert wait_until(lambda: coordinator_table(coord)[0] == want)
        client = openai.OpenAI(base_url=f"{c.base_url}/v1", api_key="none", max_retries=0, timeout=30)
        latencies = []
        for n in range(1, ROUNDS + 1):
            _, before = coordinator_table(coord)
            pid = wait_until(lambda: c.component_pid("coordinator"), timeout=15)
            os.kill(pid, signal.SIGKILL)  # its own pid only: it shares motor up's process group
            wait_until(lambda: exited(pid), timeout=5, every=0.01)  # noqa: B023
            up_at = wait_until(lambda: answering(coord) and time.monotonic(), timeout=15, every=0.01)

            def synced() -> float | None:
                table, incarnation = coordinator_table(coord)
                return time.monotonic() if table == want and incarnation != before else None  # noqa: B023

            synced_at = wait_until(synced, timeout=15, every=0.01)
            latencies.append(synced_at - up_at)
            delay = re.findall(r"event=restart component=coordinator .*?in_s=(\S+)", c.proc.output())[-1]
            print(
                f"round {n}: motor up restarted the Coordinator after {delay} s; "
                f"port answering -> table re-synced {latencies[-1] * 1000:.0f} ms"
            )
            assert controller_table(ctl) == want  # the Controller's view never changed
            resp = client.chat.completions.create(model="motor-sim", messages=MESSAGES, max_tokens=4)
            assert resp.choices[0].message.content
        print("port answering -> re-synced, ms:", " ".join(f"{x * 1000:.0f}" for x in latencies))
        assert len(re.findall(r"event=restart component=coordinator ", c.proc.output())) == ROUNDS
    finally:
        c.cleanup()
