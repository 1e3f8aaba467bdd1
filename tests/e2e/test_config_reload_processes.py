"""Settings that change without a restart, on separate ``motor controller`` and ``motor
coordinator`` processes: a Controller keeping two Coordinators tells each that 2 share the load,
a reload reaches both with the same revision, and once one stops the survivor is told 1; SIGHUP
makes a Coordinator re-read its own file (a reloadable change applies, a port change is refused
and nothing changes), makes the Controller re-read its own section, stored under a new
revision that reaches the Coordinators, and sets a NodeManager's log level."""

from __future__ import annotations

import json
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from tests.poll import wait_until
from tests.ports import reserved_port
from tests.procs import Proc, grpcurl, motor_argv

pytestmark = pytest.mark.timeout(120)

POLLED = "method=/motor.v1.Coordinator/GetEngineMetrics"  # logged at debug level only
LISTED = "method=/motor.v1.Coordinator/ListInstances"  # logged at info


def coordinator_settings(address: str) -> tuple[int, int] | None:
    """(settings revision, replicas) from the Coordinator's ListInstances; None if it did not answer."""
    out = grpcurl("-d", "{}", address, "motor.v1.Coordinator/ListInstances")
    if out.returncode != 0:
        return None
    doc = json.loads(out.stdout or "{}")
    return int(doc.get("settings_revision", 0)), int(doc.get("replicas", 0))


def write(path: Path, **sections: dict[str, Any]) -> Path:
    path.write_text(json.dumps(sections))
    return path


def reload(controller: str, path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        motor_argv("config", "reload", str(path), "--controller", controller, "-o", "json"),
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_replicas_follow_the_reachable_coordinators_and_a_reload_reaches_both(tmp_path: Path) -> None:
    a_port, b_port, ctl_port = reserved_port(), reserved_port(), reserved_port()
    a, b = f"127.0.0.1:{a_port}", f"127.0.0.1:{b_port}"
    sections = {
        "controller": {"port": ctl_port, "coordinators": [a, b], "state_dir": str(tmp_path / "ctl")},
        "coordinator": {
            "http_port": 0,
            "workers": 1,
            "queue_timeout_s": 30,
            "controller": f"127.0.0.1:{ctl_port}",
        },
    }
    cfg = write(tmp_path / "cfg.json", **sections)
    procs = [
        Proc(motor_argv("coordinator", "--config", str(cfg), "--port", str(port)), cwd=tmp_path)
        for port in (a_port, b_port)
    ]
    procs.append(Proc(motor_argv("controller", "--config", str(cfg)), cwd=tmp_path))
    try:
        for p in procs:
            p.listening()
        for address in (a, b):
            wait_until(lambda address=address: coordinator_settings(address) == (0, 2), timeout=30)

        sections["coordinator"]["queue_timeout_s"] = 5
        out = reload(f"127.0.0.1:{ctl_port}", write(tmp_path / "edited.json", **sections))
        assert out.returncode == 0, out.stderr
        assert json.loads(out.stdout) == {
            "settings_revision": 1,
            "changed_keys": ["coordinator.queue_timeout_s"],
        }
        for address in (a, b):  # the replicas agree
            wait_until(lambda address=address: coordinator_settings(address) == (1, 2), timeout=30)
        for p in procs[:2]:
            p.wait_line("event=settings_applied revision=1 replicas=2 changed=queue_timeout_s")

        assert procs[1].stop() == 0
        # The survivor now takes the whole of every rate limit.
        wait_until(lambda: coordinator_settings(a) == (1, 1), timeout=30, what="replicas 1 on the survivor")
    finally:
        for p in procs:
            p.kill()


def test_sighup_rereads_a_coordinators_own_file(tmp_path: Path) -> None:
    port = reserved_port()
    address = f"127.0.0.1:{port}"
    base = {"port": port, "http_port": 0, "workers": 1, "queue_timeout_s": 30}
    path = write(tmp_path / "coordinator.json", coordinator=base)
    proc = Proc(motor_argv("coordinator", "--config", str(path)), cwd=tmp_path)
    try:
        proc.listening()

        def polled_logged() -> bool:
            mark = time.monotonic()
            for method in ("GetEngineMetrics", "ListInstances"):  # the second, at info: a barrier
                out = grpcurl("-d", "{}", address, f"motor.v1.Coordinator/{method}")
                assert out.returncode == 0, out.stderr
            proc.wait_line(LISTED, start=proc.index_at(mark))
            return bool(proc.lines_since(mark, POLLED))

        assert not polled_logged()
        write(path, coordinator={**base, "log_level": "debug", "queue_timeout_s": 7})
        proc.signal(signal.SIGHUP)
        line = proc.wait_line("event=config_reloaded")
        assert "via=sighup" in line and "changed=coordinator.log_level,coordinator.queue_timeout_s" in line
        wait_until(polled_logged, timeout=10, what="debug lines after SIGHUP")
        assert coordinator_settings(address) == (0, 1)

        # A port change: refused in one line, nothing applied (the log level stays debug).
        write(path, coordinator={**base, "port": port + 1, "log_level": "error"})
        start = len(proc.lines)
        proc.signal(signal.SIGHUP)
        refused = proc.wait_line("event=config_reload_refused", start=start)
        assert "refused=coordinator.port" in refused
        assert polled_logged()  # still at debug level
        assert coordinator_settings(address) == (0, 1)  # still on its port

        # A file that does not load: one line, nothing applied.
        path.write_text("{not json")
        start = len(proc.lines)
        proc.signal(signal.SIGHUP)
        assert "invalid JSON" in proc.wait_line("event=config_reload_failed", start=start)
        assert proc.alive()
    finally:
        assert proc.stop() == 0


def test_sighup_makes_the_controller_store_its_own_section_and_push_the_revision(tmp_path: Path) -> None:
    coordinator_port, ctl_port = reserved_port(), reserved_port()
    coordinator = f"127.0.0.1:{coordinator_port}"
    ctl = {"port": ctl_port, "coordinators": [coordinator], "state_dir": str(tmp_path / "ctl")}
    path = write(
        tmp_path / "cfg.json",
        controller=ctl,
        coordinator={"port": coordinator_port, "http_port": 0, "workers": 1},
    )
    procs = [
        Proc(motor_argv("coordinator", "--config", str(path)), cwd=tmp_path),
        Proc(motor_argv("controller", "--config", str(path)), cwd=tmp_path),
    ]
    try:
        for p in procs:
            p.listening()
        wait_until(lambda: coordinator_settings(coordinator) == (0, 1), timeout=30)
        controller = procs[1]
        write(
            path,
            controller={**ctl, "start_command_retries": 7},
            coordinator={"port": coordinator_port, "http_port": 0, "workers": 1},
        )
        controller.signal(signal.SIGHUP)
        line = controller.wait_line("event=config_reloaded")
        assert "via=sighup" in line and "changed=controller.start_command_retries" in line
        wait_until(lambda: coordinator_settings(coordinator) == (1, 1), timeout=30, what="revision 1 pushed")

        write(
            path,
            controller={**ctl, "state_dir": str(tmp_path / "elsewhere")},
            coordinator={"port": coordinator_port},
        )
        start = len(controller.lines)
        controller.signal(signal.SIGHUP)
        assert "refused=controller.state_dir" in controller.wait_line(
            "event=config_reload_refused", start=start
        )
        assert controller.alive()
    finally:
        for p in procs:
            p.kill()


def test_sighup_sets_a_nodemanagers_log_level(tmp_path: Path) -> None:
    path = write(tmp_path / "nm.json", nodemanager={"state_dir": str(tmp_path / "nm")})
    proc = Proc(motor_argv("nodemanager", "--config", str(path), "--port", "0"), cwd=tmp_path)
    try:
        address, _ = proc.listening()

        def status_logged() -> bool:
            mark = time.monotonic()
            out = grpcurl("-d", "{}", address, "motor.v1.NodeManager/GetStatus")
            assert out.returncode == 0, out.stderr
            time.sleep(0.2)
            return bool(proc.lines_since(mark, "method=/motor.v1.NodeManager/GetStatus"))

        assert status_logged()  # an info line
        write(path, nodemanager={"state_dir": str(tmp_path / "nm"), "log_level": "warning"})
        proc.signal(signal.SIGHUP)
        wait_until(lambda: not status_logged(), timeout=10, what="the info lines to stop")
        # --port 0 on the command line is no change, whatever the file says.
        write(path, nodemanager={"state_dir": str(tmp_path / "nm"), "log_level": "info", "port": 7300})
        proc.signal(signal.SIGHUP)
        line = proc.wait_line("event=config_reloaded")
        assert "changed=nodemanager.log_level" in line
        assert status_logged()
    finally:
        assert proc.stop() == 0
