"""Each service as an operator meets it: started bare, inspected with grpcurl, stopped with SIGTERM."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest

from tests.ports import port_free, reserved_port
from tests.procs import grpcurl

SERVICES = [
    ("controller", "motor.v1.Controller", "SERVING"),
    ("coordinator", "motor.v1.Coordinator", "NOT_SERVING"),
    ("nodemanager", "motor.v1.NodeManager", "SERVING"),
]


def check(addr: str, service: str) -> str:
    out = grpcurl("-d", json.dumps({"service": service}), addr, "grpc.health.v1.Health/Check")
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)["status"]


@pytest.mark.parametrize(("command", "service", "overall"), SERVICES)
def test_service_starts_bare_answers_grpcurl_and_stops_on_sigterm(
    motor_proc, command, service, overall
) -> None:
    extra = ["--http-port", "0"] if command == "coordinator" else []
    proc = motor_proc(command, "--port", "0", *extra)
    addr, http = proc.listening()
    assert (http is not None) == (command == "coordinator")

    listed = grpcurl(addr, "list")
    assert listed.returncode == 0, listed.stderr
    assert set(listed.stdout.split()) >= {
        service,
        "grpc.health.v1.Health",
        "grpc.reflection.v1alpha.ServerReflection",
    }
    described = grpcurl(addr, "describe", service)
    assert described.returncode == 0 and "rpc " in described.stdout

    assert check(addr, service) == "SERVING"
    assert check(addr, "") == overall

    proc.signal(signal.SIGTERM)
    assert proc.popen.wait(timeout=5) == 0
    assert "event=stopped" in proc.output()


def test_nodemanager_without_job_name_does_not_register(motor_proc) -> None:
    proc = motor_proc("nodemanager", "--port", "0")
    proc.listening()
    proc.wait_line("event=registration_disabled")


def test_config_errors_are_all_printed_and_nothing_binds(motor_proc, tmp_path: Path) -> None:
    port = reserved_port()
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"controller": {"prot": 1, "heartbeat_interval_s": "fast", "port": port}}))
    proc = motor_proc("controller", "--config", str(bad))
    assert proc.popen.wait(timeout=20) == 1
    out = proc.output()
    assert "controller.prot: unknown key; did you mean 'port'?" in out
    assert "controller.heartbeat_interval_s" in out
    assert "event=listening" not in out
    assert port_free(port)  # never taken


def test_grpc_port_in_use_fails_with_a_clear_message(motor_proc) -> None:
    first = motor_proc("controller", "--port", "0")
    addr, _ = first.listening()
    port = addr.rsplit(":", 1)[1]
    # Its own state directory, so the port is the only thing the two share.
    second = motor_proc("controller", "--port", port, env={"MOTOR_CONTROLLER_STATE_DIR": "second"})
    assert second.popen.wait(20) == 1
    assert "cannot bind" in second.output()
