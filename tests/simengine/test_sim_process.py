"""Process tree, signals and argv of `motor engine-sim`."""

from __future__ import annotations

import json
import os
import signal
import socket
import urllib.request

import pytest

from motor_mesh.simengine.cli import parse
from tests.poll import wait_until
from tests.procs import SimEngine, exited

pytestmark = pytest.mark.timeout(60)


def get_json(url: str) -> object:
    with urllib.request.urlopen(url, timeout=5) as r:
        return json.load(r)


def test_workers_die_with_a_sigkilled_process_group(spawn_engine) -> None:
    eng = spawn_engine("--workers", "2")
    pids = eng.worker_pids()
    assert len(pids) == 2 and not any(map(exited, pids))
    assert os.getpgid(pids[0]) == os.getpgid(eng.pid) == eng.pid  # same group, no new session
    os.killpg(eng.pid, signal.SIGKILL)
    wait_until(lambda: all(map(exited, [eng.pid, *pids])), 10, "group to die")


def test_workers_die_with_a_sigkilled_leader(spawn_engine) -> None:
    eng = spawn_engine("--workers", "2")
    pids = eng.worker_pids()
    os.kill(eng.pid, signal.SIGKILL)
    wait_until(lambda: all(map(exited, pids)), 10, "orphaned workers to exit")


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_stops_cleanly(spawn_engine, sig: signal.Signals) -> None:
    eng = spawn_engine("--workers", "1")
    pids = eng.worker_pids()
    eng.signal(sig)
    assert eng.popen.wait(10) == 0
    wait_until(lambda: exited(pids[0]), 10, "worker to exit")
    assert "event=stopped" in eng.output()


def test_unknown_flags_are_logged_and_ignored(spawn_engine) -> None:
    eng = spawn_engine(
        "serve", "m", "--enforce-eager", "--gpu-memory-utilization", "0.9", "--trust-remote-code=1",
        "--swap-space", "-1", "--max-num-seqs", "4",
    )  # fmt: skip
    flags = [line.split("flag=")[1] for line in eng.lines if "event=unknown_flag" in line]
    assert flags == ["--enforce-eager", "--gpu-memory-utilization", "--trust-remote-code", "--swap-space"]
    assert [m["id"] for m in get_json(eng.v1 + "/models")["data"]] == ["m"]


def test_vllm_style_argv(spawn_engine) -> None:
    kv = json.dumps(
        {"kv_connector": "NixlConnector", "kv_role": "kv_consumer", "engine_id": "7"}, separators=(",", ":")
    )
    eng = spawn_engine(
        "serve", "/no/such/model", "--served-model-name", "svc", "--host", "127.0.0.1", "--port", "0",
        "--tensor-parallel-size", "2", "--data-parallel-size", "2", "--data-parallel-address", "127.0.0.1",
        "--data-parallel-rpc-port", "12345", "--data-parallel-rank", "0", "--kv-transfer-config", kv,
    )  # fmt: skip
    line = eng.wait_line("event=listening")
    assert "role=decode" in line and "protocol=vllm" in line and "engine_id=7" in line
    assert [m["id"] for m in get_json(eng.v1 + "/models")["data"]] == ["svc"]
    assert "unknown_flag" not in eng.output()


def test_sglang_style_argv(spawn_engine) -> None:
    eng = spawn_engine(
        "--model-path", "/no/such/model", "--served-model-name", "svc", "--host", "127.0.0.1", "--port", "0",
        "--tp-size", "1", "--dp-size", "1", "--disaggregation-mode", "prefill",
        "--disaggregation-bootstrap-port", "0",
    )  # fmt: skip
    line = eng.wait_line("event=listening")
    assert "role=prefill" in line and "protocol=sglang" in line and eng.bootstrap_port > 0
    info = get_json(eng.base + "/get_server_info")
    assert info["disaggregation_mode"] == "prefill" and info["disaggregation_bootstrap_port"] == 0
    assert "unknown_flag" not in eng.output()


def test_headless_lives_without_http(spawn_engine) -> None:
    eng = spawn_engine("--headless", "--workers", "1", wait=False)
    eng.wait_line("event=headless")
    assert eng.search("event=listening") is None and eng.alive()
    pids = eng.worker_pids()
    assert pids and not exited(pids[0])
    assert eng.stop() == 0


def test_port_in_use_fails_with_exit_1(spawn_engine) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        eng = spawn_engine("--port", str(s.getsockname()[1]), wait=False)
        assert eng.popen.wait(15) == 1
    assert "event=bind_failed" in eng.output()


def test_parse_defaults_and_roles() -> None:
    cfg, unknown = parse([])
    assert (cfg.host, cfg.port, cfg.model, cfg.role, cfg.protocol) == (
        "127.0.0.1",
        10000,
        "motor-sim",
        "union",
        "vllm",
    )
    assert cfg.bootstrap_port == 10001 and unknown == []
    cfg, _ = parse(["serve", "m", "--kv-transfer-config", '{"kv_role":"kv_producer"}'])
    assert (cfg.model, cfg.role, cfg.protocol) == ("m", "prefill", "vllm")
    cfg, _ = parse(["--model", "x", "--disaggregation-mode", "decode", "--port", "20000"])
    assert (cfg.model, cfg.role, cfg.protocol, cfg.bootstrap_port) == ("x", "decode", "sglang", 20001)
    cfg, _ = parse(["--protocol", "sglang", "--bootstrap-port", "9000", "-tp", "4", "-dp", "2"])
    assert (cfg.role, cfg.bootstrap_port, cfg.tp, cfg.dp) == ("union", 9000, 4, 2)
    cfg, unknown = parse(["m2", "--max-num", "3", "--max-num-seqs", "5"])
    assert cfg.max_num_seqs == 5 and unknown[0] == "--max-num"
    cfg, _ = parse(["--fault", "die_after_tokens", "--fault-after-tokens", "7"])
    assert (cfg.fault, cfg.fault_after_tokens) == ("die_after_tokens", 7)


@pytest.mark.parametrize(
    "argv",
    [
        ["--kv-transfer-config", "{bad"],
        ["--fault", "explode"],
        ["--port", "70000"],
        ["--tpot-ms", "-1"],
        ["--fault-after-tokens", "-1"],
    ],
)
def test_parse_rejects_bad_values(argv: list[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        parse(argv)
    assert exc.value.code == 2


def test_cli_help_and_usage_errors() -> None:
    from motor_mesh.simengine.cli import main

    assert main(["--help"]) == 0
    assert main(["--fault", "explode"]) == 2


def test_sim_engine_helper_reports_ports() -> None:
    eng = SimEngine("--port", "0", "--protocol", "sglang", "--disaggregation-mode", "prefill").start()
    try:
        assert eng.port > 0 and eng.bootstrap_port > 0 and eng.bootstrap_port != eng.port
    finally:
        eng.kill()
