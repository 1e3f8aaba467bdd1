"""A real ``motor up`` cluster on reserved ports, for end-to-end tests."""

from __future__ import annotations

import json
import os
import re
import signal
import urllib.request
from pathlib import Path
from typing import Any

from motor_mesh.nodemanager.statefile import StateFile
from tests.ports import reserve
from tests.procs import Proc, child_pids, grpcurl, motor_argv, pids_with

CONTROLLER, COORDINATOR, HTTP, NM, ENGINE = 7100, 7200, 8000, 7300, 10000
ENGINE_KV = 12000  # engine k publishes its KV cache events on ENGINE_KV + 2k (replay: + 1)
CONTROLLER_METRICS, NM_METRICS = 9100, 9300  # /metrics of the Controller, of NodeManager i (+ i)
# Under --ha: the second Controller (and its /metrics), and etcd's client and peer ports.
CONTROLLER_1, CONTROLLER_1_METRICS, ETCD_CLIENT, ETCD_PEER = 7101, 9101, 2379, 2380


def up_ports(nodes: int, dp: int = 1, ha: bool = False) -> list[int]:
    """Every default port ``motor up`` binds for ``nodes`` NodeManagers of ``dp`` engines each
    (the services, the NodeManagers, their metrics ports, each engine's port and port + 1 and its
    KV events ports; with ``ha``, the second Controller's and etcd's), before --port-offset."""
    ports = [CONTROLLER, COORDINATOR, HTTP, CONTROLLER_METRICS]
    if ha:
        ports += [CONTROLLER_1, CONTROLLER_1_METRICS, ETCD_CLIENT, ETCD_PEER]
    ports += [p + i for i in range(nodes) for p in (NM, NM_METRICS)]
    return ports + [
        base + 2 * k + j for base in (ENGINE, ENGINE_KV) for k in range(nodes * dp) for j in (0, 1)
    ]


class CallFailed(AssertionError):
    """A grpcurl call that failed (the component does not answer, or refused the call): a test
    that asserts on the answer fails on it; a poll of a component that is (re)starting names it
    as its "not yet"."""


def nodemanager_pid(port: int) -> int:
    """The pid of the NodeManager serving gRPC on ``port`` (found by its command line)."""
    found = pids_with("nodemanager", str(port))
    assert found, f"no NodeManager on port {port}"
    return found[0]


class Cluster:
    """``motor up *args`` on ports reserved for it (tests/ports.py: ``motor up`` binds fixed
    ports, moved by --port-offset, so it cannot take port 0). ``nodes`` (NodeManagers) and ``dp``
    (engines of each) must match what ``args`` ask for: they are not parsed here. ``env`` is added
    to the environment of ``motor up``, which every component and engine inherits (PATH,
    PYTHONPATH). ``ha``: ``motor up --ha`` (etcd and two Controllers). ``extra_ports``: more
    default ports to keep free at the same offset (a real engine's side channel, say)."""

    def __init__(
        self,
        tmp: Path,
        *args: str,
        nodes: int = 2,
        dp: int = 1,
        env: dict[str, str] | None = None,
        ha: bool = False,
        extra_ports: list[int] | None = None,
    ) -> None:
        self.nodes, self.dp = nodes, dp
        self.ports = reserve(up_ports(nodes, dp, ha) + (extra_ports or []))
        self.off = self.ports.shift
        self.state = tmp / "state"
        ha_args = ["--ha"] if ha else []
        self.proc = Proc(
            motor_argv("up", "--port-offset", str(self.off), "--state-dir", str(self.state), *ha_args, *args),
            cwd=tmp,
            env=env,
        )

    # addresses
    def grpc(self, base: int) -> str:
        return f"127.0.0.1:{base + self.off}"

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{HTTP + self.off}"

    def metrics_url(self, base: int) -> str:
        """``/metrics`` of the service whose default metrics port is ``base`` (CONTROLLER_METRICS,
        NM_METRICS + i)."""
        return f"http://127.0.0.1:{base + self.off}/metrics"

    def engine_port(self, k: int) -> int:
        """Engine ``k``'s business port (engines are numbered across NodeManagers)."""
        return ENGINE + 2 * k + self.off

    def engine_url(self, k: int) -> str:
        return f"http://127.0.0.1:{self.engine_port(k)}"

    def node_of_port(self, port: int) -> int:
        """Which NodeManager runs the engine serving on ``port``: engine k is on node k // dp."""
        return (port - ENGINE - self.off) // 2 // self.dp

    def wait_ready(self, timeout: float = 60.0) -> str:
        line = self.proc.wait_line(lambda s: s.startswith("READY "), timeout)
        assert line in self.proc.stdout_lines
        return line

    # observations
    def call(self, addr: str, method: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
        out = grpcurl("-d", json.dumps(body or {}), addr, method)
        if out.returncode != 0:
            raise CallFailed(out.stderr)
        return json.loads(out.stdout or "{}")

    def controller_instances(self) -> list[dict[str, Any]]:
        return self.call(self.grpc(CONTROLLER), "motor.v1.Controller/ListInstances").get("instances", [])

    def pd_legs(self, k: int) -> dict[tuple[str, str], float]:
        text = urllib.request.urlopen(f"{self.engine_url(k)}/metrics", timeout=5).read().decode()
        legs = {}
        for m in re.finditer(r"^motor_sim_pd_legs_total\{([^}]*)\} (\S+)$", text, re.M):
            labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1)))
            legs[(labels["side"], labels["protocol"])] = float(m.group(2))
        return legs

    def engine_pgids(self) -> list[int]:
        return [r.pgid for i in range(self.nodes) for r in StateFile(self.state / f"nm-{i}").read()]

    def component_pid(self, name: str) -> int:
        """The pid of a child of ``motor up`` by its command line (controller, coordinator,
        nodemanager); 0 unless exactly one matches."""
        found = child_pids(self.proc.popen.pid, name)
        return found[0] if len(found) == 1 else 0

    def controller_addrs(self) -> list[str]:
        """Both Controllers of an --ha cluster, controller-0 first."""
        return [self.grpc(CONTROLLER), self.grpc(CONTROLLER_1)]

    @property
    def etcd_endpoint(self) -> str:
        return self.grpc(ETCD_CLIENT)

    def nodemanager_pid(self, i: int) -> int:
        """The pid of NodeManager nm-<i>."""
        return nodemanager_pid(NM + i + self.off)

    def stop(self, timeout: float = 15.0) -> int:
        self.proc.signal(signal.SIGTERM)
        try:
            return self.proc.popen.wait(timeout)
        finally:
            self.cleanup()

    def cleanup(self) -> None:
        self.proc.kill()
        for g in self.engine_pgids():
            try:
                os.killpg(g, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        self.ports.close()
