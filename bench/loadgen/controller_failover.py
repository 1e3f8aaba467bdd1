"""Controller failover under load, for bench/bench_failover.py: ``motor up --ha --prefill 1
--decode 2`` (etcd, controller-0 and controller-1, simulated engines) with one client sending
non-streaming completions back to back. Each round SIGKILLs the leading Controller (the one whose
health for ``motor.v1.Controller`` is SERVING) and measures

- new leader: the kill → a Controller's health SERVING again (polled every 10 ms): the other
  one, or the killed one once ``motor up`` has restarted it (it campaigns too; the dead process
  itself never counts);
- re-attached: the kill → the new leader's ``motor_controller_nodemanagers_connected`` equals the
  number of NodeManagers (polled every 20 ms);
- failed requests from the kill until the killed Controller is back standing by;
- engine restarts and instance id changes: ListInstances on the new leader, once settled, against
  the old leader's just before the kill (same id per job, same engine pids).

Before each kill the leader must have run motor up's healthy-run time, so its restart is not
slowed by crash-loop backoff. The lease and heartbeat interval are the defaults, as an operator
gets them.
"""

from __future__ import annotations

import os
import re
import signal
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from bench.loadgen.etcd_proc import NOT_INSTALLED, etcd_binary
from bench.loadgen.failover_load import Load, process_age_s
from bench.loadgen.up import CONTROLLER, CONTROLLER_1, CONTROLLER_1_METRICS, CONTROLLER_METRICS, Up, gone
from motor_mesh.cli.up import HEALTHY_RUN_S
from motor_mesh.common.config import ControllerConfig
from motor_mesh.gen.motor.v1 import common_pb2, controller_pb2, controller_pb2_grpc

TITLE = "Controller failover (motor up --ha, simulated engines)"
NODEMANAGERS = 3
SERVICE = "motor.v1.Controller"
LEASE_S = ControllerConfig().leader_lease_s
HEARTBEAT_S = ControllerConfig().heartbeat_interval_s
LEADER_TARGET_S, REATTACH_TARGET_S = LEASE_S + 1, HEARTBEAT_S
LEADER_POLL_S, ATTACH_POLL_S = 0.01, 0.02
WAIT_S = 120.0  # for anything that should take seconds: past it the round is broken, not slow
# gRPC waits a second and more before reconnecting to a server that refused it; the killed
# Controller's address is polled every 10 ms and must be seen as soon as it serves again.
FAST_RECONNECT = [
    ("grpc.initial_reconnect_backoff_ms", 10),
    ("grpc.min_reconnect_backoff_ms", 10),
    ("grpc.max_reconnect_backoff_ms", 100),
]
CONNECTED = re.compile(r"(?m)^motor_controller_nodemanagers_connected (\S+)$")
ACTIVE = common_pb2.INSTANCE_STATUS_ACTIVE

Snapshot = dict[str, tuple[int, tuple[int, ...]]]  # job → (instance id, engine pids)


@dataclass
class Round:
    leader_s: float
    attached_s: float
    failed: int
    restarts: list[str]  # one line per engine whose pid changed
    id_changes: list[str]  # one line per job whose instance id changed
    restarted_won: bool  # the killed Controller, back as a standby, won the election


@dataclass
class Result:
    rounds: list[Round]
    served: int  # requests served over the whole run
    failed_between: int  # requests failed outside the rounds (the waits before each kill)


class HaCluster:
    def __init__(self, workdir: Path) -> None:
        self.up = Up(["--ha", "--prefill", "1", "--decode", "2"], workdir)
        ports = ((CONTROLLER, CONTROLLER_METRICS), (CONTROLLER_1, CONTROLLER_1_METRICS))
        self.addrs = [self.up.addr(grpc_port) for grpc_port, _ in ports]
        self.metrics = [f"http://{self.up.addr(metrics_port)}/metrics" for _, metrics_port in ports]
        self.channels = [grpc.insecure_channel(a, options=FAST_RECONNECT) for a in self.addrs]
        self.url = self.up.url

    def health(self, i: int, service: str = SERVICE) -> str:
        """SERVING, NOT_SERVING, or the error code of Controller ``i`` not answering."""
        stub = health_pb2_grpc.HealthStub(self.channels[i])
        try:
            r = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=1)
        except grpc.RpcError as err:
            return err.code().name if isinstance(err, grpc.Call) else "ERROR"
        return health_pb2.HealthCheckResponse.ServingStatus.Name(r.status)

    def pids(self, i: int) -> list[int]:
        return self.up.children("controller", self.addrs[i].rsplit(":", 1)[1])

    def snapshot(self, i: int) -> Snapshot | None:
        """Every instance Controller ``i`` lists, once all of them are ACTIVE with engines."""
        stub = controller_pb2_grpc.ControllerStub(self.channels[i])
        try:
            live = stub.ListInstances(controller_pb2.ListInstancesRequest(), timeout=5).instances
        except grpc.RpcError:
            return None
        if len(live) != NODEMANAGERS or any(
            inst.status != ACTIVE or not all(e.pid for e in inst.endpoints) for inst in live
        ):
            return None
        return {inst.job_name: (inst.id, tuple(e.pid for e in inst.endpoints)) for inst in live}

    def connected(self, i: int) -> int | None:
        """NodeManagers streaming to Controller ``i`` (None: no answer, or not leading)."""
        try:
            with urllib.request.urlopen(self.metrics[i], timeout=1) as resp:
                m = CONNECTED.search(resp.read().decode())
        except OSError:
            return None
        return int(float(m.group(1))) if m else None

    def settled(self) -> tuple[int, Snapshot]:
        """Until one Controller leads with every instance ACTIVE and the other stands by (alive,
        not leading), one process each: the leader's index and its instances."""
        deadline = time.monotonic() + WAIT_S
        while time.monotonic() < deadline:
            states = [self.health(i) for i in (0, 1)]
            if sorted(states) == ["NOT_SERVING", "SERVING"] and all(len(self.pids(i)) == 1 for i in (0, 1)):
                leader = states.index("SERVING")
                snap = self.snapshot(leader)
                if snap is not None and self.health(1 - leader, "") == "SERVING":
                    return leader, snap
            time.sleep(0.1)
        raise RuntimeError(f"no leader and standby with {NODEMANAGERS} ACTIVE instances in {WAIT_S:g} s")

    def close(self) -> None:
        for ch in self.channels:
            ch.close()
        self.up.stop()


def wait_leader(c: HaCluster, old: int, victim: int, start: float) -> tuple[int, float]:
    """Which Controller leads after ``old`` (process ``victim``) was killed at ``start``, and when."""
    while True:
        if c.health(1 - old) == "SERVING":
            return 1 - old, time.perf_counter() - start
        # Only a process that is not the killed one can answer on its address.
        if gone(victim) and c.health(old) == "SERVING":
            return old, time.perf_counter() - start
        if time.perf_counter() - start > WAIT_S:
            raise RuntimeError(f"no new leader {WAIT_S:g} s after killing the leader")
        time.sleep(LEADER_POLL_S)


def wait_attached(c: HaCluster, leader: int, start: float) -> float:
    while c.connected(leader) != NODEMANAGERS:
        if time.perf_counter() - start > WAIT_S:
            raise RuntimeError(f"not every NodeManager streams to the new leader {WAIT_S:g} s after the kill")
        time.sleep(ATTACH_POLL_S)
    return time.perf_counter() - start


def changes(before: Snapshot, after: Snapshot) -> tuple[list[str], list[str]]:
    """(engine restarts, id changes) from ``before`` to ``after``, one line each."""
    restarts, ids = [], []
    for job, (old_id, old_pids) in sorted(before.items()):
        new_id, new_pids = after.get(job, (0, ()))
        if new_id != old_id:
            ids.append(f"{job}: instance id {old_id} → {new_id or 'none'}")
        pairs = zip(old_pids, new_pids, strict=False)
        restarts += [f"{job}: engine pid {p} → {q}" for p, q in pairs if p != q]
    return restarts, ids


def one_round(c: HaCluster, load: Load) -> Round:
    leader, _ = c.settled()
    [victim] = c.pids(leader)
    # motor up restarts a child that crashed within HEALTHY_RUN_S of its last start with a
    # growing delay: the leader must have run that long, so the round measures the failover.
    time.sleep(max(0.0, HEALTHY_RUN_S + 1 - process_age_s(victim)))
    still, before = c.settled()
    if still != leader or c.pids(leader) != [victim]:
        raise RuntimeError("the leadership moved without a kill")
    failed_before = load.failed
    start = time.perf_counter()
    os.kill(victim, signal.SIGKILL)
    new, leader_s = wait_leader(c, leader, victim, start)
    attached_s = wait_attached(c, new, start)
    now_leading, after = c.settled()  # the killed Controller is back, standing by
    if now_leading != new:
        raise RuntimeError("the leadership moved again after the failover")
    restarts, ids = changes(before, after)
    r = Round(leader_s, attached_s, load.failed - failed_before, restarts, ids, new == leader)
    print(
        f"controller round: leader {leader_s:.2f}s (controller-{new}) attached {attached_s:.2f}s "
        f"failed {r.failed} engine restarts {len(restarts)} id changes {len(ids)}",
        file=sys.stderr,
    )
    return r


def run(rounds: int) -> Result:
    with tempfile.TemporaryDirectory() as tmp:
        c = HaCluster(Path(tmp))
        load = Load(c.url)
        thread = threading.Thread(target=load.run, daemon=True)
        try:
            c.settled()
            thread.start()
            out = [one_round(c, load) for _ in range(rounds)]
            return Result(out, load.ok, load.failed - sum(r.failed for r in out))
        finally:
            load.stop.set()
            thread.join(40)
            c.close()


def p50_max(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} / {max(values):.2f}"


def section(result: Result | None) -> list[str]:
    """The report's Controller section; None: etcd is not installed."""
    if result is None:
        return [f"## {TITLE}", "", f"Not run: {NOT_INSTALLED}.", ""]
    rs = result.rounds
    leader = [r.leader_s for r in rs]
    after_leader = [r.attached_s - r.leader_s for r in rs]
    failed = sum(r.failed for r in rs)
    restarts = [line for r in rs for line in r.restarts]
    ids = [line for r in rs for line in r.id_changes]
    row = [str(len(rs)), p50_max(leader), p50_max([r.attached_s for r in rs]), p50_max(after_leader)]
    row += [str(failed), str(len(restarts)), str(len(ids))]

    def judged(name: str, ok: bool, measured: str) -> str:
        return f"- {name}: {'met' if ok else '**missed**'} ({measured})"

    won = sum(r.restarted_won for r in rs)
    notes = []
    if won:
        notes += [f"In {won} of {len(rs)} rounds the killed Controller, back as a standby, won.", ""]
    if result.failed_between:
        notes += [f"Requests failed in the waits before the kills: {result.failed_between}.", ""]
    if restarts or ids:
        notes += [*(f"- {line}" for line in [*restarts, *ids]), ""]
    sent = result.served + failed + result.failed_between
    return [
        f"## {TITLE}",
        "",
        f"{len(rs)} SIGKILLs of the leading Controller (controller-0 on 7100, controller-1 on 7101), "
        f"leader_lease_s {LEASE_S:g} and heartbeat_interval_s {HEARTBEAT_S:g} (the defaults), the "
        "same client load. New leader: kill → a Controller's health motor.v1.Controller SERVING "
        "again, the standby's or the killed one's once motor up has restarted it (polled every "
        f"10 ms); re-attached: kill → the new leader's "
        f"motor_controller_nodemanagers_connected = {NODEMANAGERS} (polled every 20 ms). Failed "
        "requests: from the kill until the killed Controller is back standing by.",
        "",
        "| rounds | new leader p50 / max s | re-attached p50 / max s (from kill) "
        "| re-attach after leader p50 / max s | failed requests | engine restarts | id changes |",
        "|---|---|---|---|---|---|---|",
        "| " + " | ".join(row) + " |",
        "",
        f"Targets: new leader ≤ {LEADER_TARGET_S:g} s after the kill (leader_lease_s + 1 s); every "
        f"NodeManager streaming to it ≤ {REATTACH_TARGET_S:g} s after that (one heartbeat interval); "
        "0 failed non-streaming requests; 0 engine restarts; 0 instance id changes.",
        "",
        judged(
            f"new leader ≤ {LEADER_TARGET_S:g} s",
            max(leader) <= LEADER_TARGET_S,
            f"p50 {statistics.median(leader):.2f} s, max {max(leader):.2f} s",
        ),
        judged(
            f"re-attach ≤ {REATTACH_TARGET_S:g} s after the new leader",
            max(after_leader) <= REATTACH_TARGET_S,
            f"p50 {statistics.median(after_leader):.2f} s, max {max(after_leader):.2f} s",
        ),
        judged("0 failed requests", failed == 0, f"{failed} of {sent} sent"),
        judged("0 engine restarts", not restarts, str(len(restarts))),
        judged("0 id changes", not ids, str(len(ids))),
        "",
        *notes,
    ]


def available() -> bool:
    return etcd_binary() is not None
