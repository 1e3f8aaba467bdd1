"""A two-node instance (dp 2, each rank spanning both nodes) relaunched in place: one headless
engine on the second node is SIGKILLed, and both NodeManagers relaunch their engines together
(real `motor controller` and `motor nodemanager` processes, simulated engines)."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path
from typing import Any

import pytest

from motor_mesh.nodemanager.statefile import StateFile
from tests.poll import wait_until
from tests.ports import reserved_pair
from tests.procs import Proc, grpcurl, motor_argv

pytestmark = pytest.mark.timeout(120)


def instances(target: str) -> list[dict[str, Any]]:
    out = grpcurl("-d", "{}", target, "motor.v1.Controller/ListInstances")
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout or "{}").get("instances", [])


def test_both_nodes_of_an_instance_relaunch_together(tmp_path: Path) -> None:
    cfg = tmp_path / "controller.json"
    cfg.write_text(json.dumps({"controller": {"state_dir": str(tmp_path / "ctl"), "coordinators": []}}))
    procs: list[Proc] = []
    state_dirs = [tmp_path / f"nm-{k}" for k in range(2)]
    try:
        controller = Proc(motor_argv("controller", "--config", str(cfg), "--port", "0"), cwd=tmp_path)
        procs.append(controller)
        target, _ = controller.listening()
        nodes = []
        for k in range(2):
            nm_cfg = tmp_path / f"nm-{k}.json"
            first = reserved_pair()
            ports = [first, reserved_pair()]
            section = {
                "controller": target,
                "job_name": "two-node",
                "role": "union",
                "ports": ports,
                "node_rank": k,
                "parallel": {"dp": 2, "tp": 2, "nnodes": 2},
                "state_dir": str(state_dirs[k]),
                "status_poll_interval_s": 0.2,
            }
            nm_cfg.write_text(json.dumps({"nodemanager": section}))
            nodes.append(
                Proc(motor_argv("nodemanager", "--config", str(nm_cfg), "--port", "0"), cwd=tmp_path)
            )
        procs += nodes

        def active() -> dict[str, Any] | None:
            found = [i for i in instances(target) if i.get("status") == "INSTANCE_STATUS_ACTIVE"]
            return found[0] if found else None

        inst = wait_until(active, timeout=40)
        endpoints = inst["endpoints"]
        assert [bool(e.get("headless")) for e in endpoints] == [False, False, True, True]
        old_pids = {int(e["pid"]) for e in endpoints}
        os.killpg(int(endpoints[3]["pid"]), signal.SIGKILL)  # rank 1's part on the second node

        for node in nodes:  # the NodeManager process goes on; its engines are relaunched
            node.wait_line(lambda s: s.startswith("[ENGINE RELAUNCH #1 "), 30)

        def relaunched() -> dict[str, Any] | None:
            now = active()
            pids = {int(e.get("pid", 0)) for e in now["endpoints"]} if now else set()
            return now if now and now["id"] == inst["id"] and not pids & old_pids and 0 not in pids else None

        wait_until(relaunched, timeout=40)
        assert all(n.popen.poll() is None for n in nodes)
    finally:
        for p in reversed(procs):
            p.kill()
        for d in state_dirs:  # whatever the killed NodeManagers left running
            for record in StateFile(d).read():
                try:
                    os.killpg(record.pgid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
