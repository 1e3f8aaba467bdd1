"""A real ``motor up`` cluster on free ports, for end-to-end tests."""

from __future__ import annotations

import json
import os
import random
import re
import signal
import socket
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

from services.nodemanager.statefile import StateFile
from tests.procs import Proc, child_pids, grpcurl, motor_argv

CONTROLLER, COORDINATOR, HTTP, NM, ENGINE = 7100, 7200, 8000, 7300, 10000


def port_free(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_offset(nodes: int, dp: int = 1) -> int:
    """A --port-offset whose every port (services, NodeManagers, their ``dp`` engines each) is
    free now."""
    for _ in range(200):
        off = random.randrange(20000, 50000, 10)
        ports = [CONTROLLER, COORDINATOR, HTTP, *(NM + i for i in range(nodes))]
        ports += [ENGINE + 2 * k + j for k in range(nodes * dp) for j in (0, 1)]
        if all(port_free(p + off) for p in ports):
            return off
    raise RuntimeError("no free port offset")


def nodemanager_pid(port: int) -> int:
    """The pid of the NodeManager serving gRPC on ``port`` (found by its command line)."""
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmd = (entry / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if b"nodemanager" in cmd and str(port).encode() in cmd:
                return int(entry.name)
    raise AssertionError(f"no NodeManager on port {port}")


def poll(fn: Callable[[], Any], timeout: float = 30.0, every: float = 0.1) -> Any:
    """Call ``fn`` until it returns something truthy (exceptions count as not yet)."""
    deadline, last = time.monotonic() + timeout, None
    while time.monotonic() < deadline:
        try:
            result = fn()
            if result:
                return result
        except Exception as exc:
            last = exc
        time.sleep(every)
    raise AssertionError(f"condition not met in {timeout}s (last error: {last!r})")


class Cluster:
    """``motor up *args`` on free ports. ``nodes`` (NodeManagers) and ``dp`` (engines of each)
    must match what ``args`` ask for: they are not parsed here. ``env`` is added to the
    environment of ``motor up``, which every component and engine inherits (PATH, PYTHONPATH)."""

    def __init__(
        self, tmp: Path, *args: str, nodes: int = 2, dp: int = 1, env: dict[str, str] | None = None
    ) -> None:
        self.nodes, self.dp = nodes, dp
        self.off = free_offset(nodes, dp)
        self.state = tmp / "state"
        self.proc = Proc(
            motor_argv("up", "--port-offset", str(self.off), "--state-dir", str(self.state), *args),
            cwd=tmp,
            env=env,
        )

    # addresses
    def grpc(self, base: int) -> str:
        return f"127.0.0.1:{base + self.off}"

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{HTTP + self.off}"

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
        assert out.returncode == 0, out.stderr
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
