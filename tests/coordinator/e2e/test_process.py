"""A real ``motor coordinator`` process, driven with grpcurl and plain HTTP."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

from tests.procs import Proc, grpcurl

PAIR = {
    "instances": [
        {
            "id": 11,
            "role": "ROLE_PREFILL",
            "job_name": "p",
            "model_name": "motor-sim",
            "engine_type": "ENGINE_TYPE_SIM",
            "endpoints": [{"host": "127.0.0.1", "port": 10000, "pid": 123}],
        },
        {
            "id": 12,
            "role": "ROLE_DECODE",
            "job_name": "d",
            "model_name": "motor-sim",
            "engine_type": "ENGINE_TYPE_SIM",
            "endpoints": [{"host": "127.0.0.1", "port": 10002}],
        },
    ]
}


def _get(url: str) -> tuple[int, dict[str, str], bytes]:
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            return resp.status, dict(resp.headers), resp.read()
    except urllib.error.HTTPError as err:
        return err.code, dict(err.headers), err.read()


def _health(addr: str) -> str:
    out = grpcurl("-d", '{"service": ""}', addr, "grpc.health.v1.Health/Check")
    assert out.returncode == 0, out.stderr
    return str(json.loads(out.stdout)["status"])


def test_grpcurl_list_instances_and_readiness(motor_proc: Callable[..., Proc]) -> None:
    proc = motor_proc("coordinator", "--port", "0", "--http-port", "0")
    addr, http = proc.listening()
    assert http is not None
    assert len([ln for ln in proc.lines if "event=listening" in ln]) == 1
    assert "service=coordinator" in proc.wait_line("event=listening")

    # Before anything is routable: health "" NOT_SERVING, the contract's 503 body.
    assert _health(addr) == "NOT_SERVING"
    status, headers, body = _get(f"http://{http}/v1/models")
    assert status == 503 and headers["Retry-After"] == "1"
    assert json.loads(body) == {
        "error": {
            "message": "no routable instance",
            "type": "service_unavailable",
            "param": None,
            "code": "no_routable_instance",
        }
    }
    assert _get(f"http://{http}/readiness")[0] == 503
    assert _get(f"http://{http}/health")[0] == 200

    added = grpcurl("-d", json.dumps(PAIR), addr, "motor.v1.Coordinator/AddInstances")
    assert added.returncode == 0, added.stderr
    assert json.loads(added.stdout)["instance_count"] == 2
    assert _health(addr) == "SERVING"
    assert _get(f"http://{http}/readiness")[0] == 200
    status, _, body = _get(f"http://{http}/v1/models")
    assert status == 200 and [m["id"] for m in json.loads(body)["data"]] == ["motor-sim"]

    listed = grpcurl("-d", "{}", addr, "motor.v1.Coordinator/ListInstances")
    assert listed.returncode == 0, listed.stderr
    out = json.loads(listed.stdout)
    assert [i["id"] for i in out["available"]] == ["11", "12"]
    assert out["available"][0]["endpoints"][0]["pid"] == "123"
    assert out["revision"] == "1" and out["incarnation"]

    described = grpcurl(addr, "describe", "motor.v1.Coordinator")
    assert described.returncode == 0 and "ListInstances" in described.stdout
    assert proc.stop() == 0


def test_bad_api_keys_file_exits_before_binding(motor_proc: Callable[..., Proc], tmp_path: Path) -> None:
    cfg = tmp_path / "c.json"
    cfg.write_text(json.dumps({"coordinator": {"api_keys_file": str(tmp_path / "missing")}}))
    proc = motor_proc("coordinator", "--config", str(cfg), "--port", "0", "--http-port", "0")
    assert proc.popen.wait(20) == 1
    assert "api_keys_file" in proc.output() and "event=listening" not in proc.output()


def test_an_inherited_multiprocess_metrics_dir_is_not_used(
    motor_proc: Callable[..., Proc], tmp_path: Path
) -> None:
    # What a parent (another Coordinator's workers, a container's defaults) may leave behind:
    # a directory this Coordinator does not own, here already removed.
    gone = tmp_path / "gone"
    proc = motor_proc(
        "coordinator",
        "--port",
        "0",
        "--http-port",
        "0",
        env={"PROMETHEUS_MULTIPROC_DIR": str(gone), "MOTOR_COORDINATOR_WORKERS": "1"},
    )
    _, http = proc.listening()
    status, _, body = _get(f"http://{http}/metrics")
    assert status == 200 and b"motor_coordinator_requests_in_flight" in body
    assert not gone.exists()
