"""`motor up` end to end: real processes, grpcurl, and the openai SDK through the Coordinator."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from tests.e2e.cluster import CONTROLLER, COORDINATOR, NM, CallFailed, Cluster
from tests.poll import wait_until
from tests.ports import port_free
from tests.procs import motor_argv

pytestmark = pytest.mark.timeout(240)

MESSAGES = [{"role": "user", "content": "Say something about disaggregated serving."}]


def chat_both_ways(c: Cluster) -> None:
    client = openai.OpenAI(base_url=f"{c.base_url}/v1", api_key="none", max_retries=0, timeout=30)
    resp = client.chat.completions.create(model="motor-sim", messages=MESSAGES, max_tokens=8)
    assert resp.choices[0].message.content
    assert resp.usage is not None and resp.usage.completion_tokens > 0
    assert "kv_transfer_params" not in resp.model_dump_json()
    chunks = list(
        client.chat.completions.create(model="motor-sim", messages=MESSAGES, max_tokens=8, stream=True)
    )
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text


def assert_pd_legs(c: Cluster, protocol: str) -> None:
    """Both requests ran their prefill leg on engine 0 (prefill) and decode leg on engine 1."""
    before_p, before_d = c.pd_legs(0), c.pd_legs(1)
    chat_both_ways(c)
    after_p, after_d = c.pd_legs(0), c.pd_legs(1)
    assert after_p.get(("prefill", protocol), 0) - before_p.get(("prefill", protocol), 0) == 2
    assert after_d.get(("decode", protocol), 0) - before_d.get(("decode", protocol), 0) == 2
    assert after_p.get(("decode", protocol), 0) == before_p.get(("decode", protocol), 0)
    assert after_d.get(("prefill", protocol), 0) == before_d.get(("prefill", protocol), 0)


@pytest.fixture(scope="module")
def vllm_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    tmp = tmp_path_factory.mktemp("up-vllm")
    # A heartbeat timeout far beyond every wait below: a NodeManager killed and restarted must
    # be recognised by its new incarnation, not by its silence.
    cfg = tmp / "cfg.json"
    cfg.write_text(json.dumps({"controller": {"instance_heartbeat_timeout_s": 300}}))
    c = Cluster(tmp, "--config", str(cfg))
    try:
        c.wait_ready()
        yield c
    finally:
        c.cleanup()


def test_ready_line_and_pd_routing_vllm(vllm_cluster: Cluster) -> None:
    c = vllm_cluster
    assert c.proc.stdout_lines == [f"READY {c.base_url}"]
    assert_pd_legs(c, "vllm")


def test_operators_see_the_cluster_with_grpcurl(vllm_cluster: Cluster) -> None:
    c = vllm_cluster
    instances = wait_until(
        lambda: [i for i in c.controller_instances() if i.get("status") == "INSTANCE_STATUS_ACTIVE"]
    )
    assert sorted(i["role"] for i in instances) == ["ROLE_DECODE", "ROLE_PREFILL"]
    for inst in instances:
        (ep,) = inst["endpoints"]
        assert int(ep["pid"]) > 0 and ep["status"] == "ENDPOINT_STATUS_NORMAL"
    table = c.call(c.grpc(COORDINATOR), "motor.v1.Coordinator/ListInstances")
    assert sorted(i["id"] for i in table["available"]) == sorted(i["id"] for i in instances)
    for i in range(2):
        status = c.call(c.grpc(NM + i), "motor.v1.NodeManager/GetStatus")
        assert status["ready"] is True
        assert int(status["endpoints"][0]["pid"]) > 0
    for base in (CONTROLLER, COORDINATOR, NM, NM + 1):
        health = c.call(c.grpc(base), "grpc.health.v1.Health/Check", {"service": ""})
        assert health["status"] == "SERVING"


def test_controller_killed_is_restarted_and_nothing_is_relaunched(vllm_cluster: Cluster) -> None:
    c = vllm_cluster
    before = {i["id"]: [e["pid"] for e in i["endpoints"]] for i in c.controller_instances()}
    pid = c.component_pid("controller")
    assert pid
    os.kill(pid, signal.SIGKILL)
    c.proc.wait_line("event=restart component=controller", 20)

    def same_instances_active() -> bool:
        now = c.controller_instances()
        return {i["id"]: [e["pid"] for e in i["endpoints"]] for i in now} == before and all(
            i["status"] == "INSTANCE_STATUS_ACTIVE" for i in now
        )

    wait_until(same_instances_active, timeout=40, retry=(CallFailed,))  # refused until it listens
    assert_pd_legs(c, "vllm")


def test_nodemanager_killed_is_restarted_and_its_instance_rebuilt(vllm_cluster: Cluster) -> None:
    c = vllm_cluster
    decode_before = next(i for i in c.controller_instances() if i["role"] == "ROLE_DECODE")
    old_pgid = int(decode_before["endpoints"][0]["pid"])
    nm_pid = c.nodemanager_pid(1)
    os.kill(nm_pid, signal.SIGKILL)
    c.proc.wait_line("event=restart component=nm-1", 20)

    def rebuilt() -> bool:
        decode = [
            i
            for i in c.controller_instances()
            if i["role"] == "ROLE_DECODE" and i["status"] == "INSTANCE_STATUS_ACTIVE"
        ]
        return bool(decode) and int(decode[0]["endpoints"][0]["pid"]) != old_pgid

    wait_until(rebuilt, timeout=30, every=0.2)

    def old_group_gone() -> bool:  # its leader re-parented to motor up, which reaps it
        try:
            os.killpg(old_pgid, 0)
        except ProcessLookupError:
            return True
        return False

    wait_until(old_group_gone, timeout=10)
    wait_until(
        lambda: (
            c.call(c.grpc(COORDINATOR), "grpc.health.v1.Health/Check", {"service": ""})["status"] == "SERVING"
        )
    )
    assert_pd_legs(c, "vllm")


def test_sglang_protocol_and_clean_shutdown(tmp_path: Path) -> None:
    c = Cluster(tmp_path, "--sim-protocol", "sglang")
    try:
        c.wait_ready()
        assert_pd_legs(c, "sglang")
        pgids = c.engine_pgids()
        assert len(pgids) == 2
        assert c.stop(timeout=15) == 0
        for g in pgids:
            with pytest.raises(ProcessLookupError):
                os.killpg(g, 0)
        assert all(port_free(p + c.off) for p in (CONTROLLER, COORDINATOR, 8000, NM, NM + 1, 10000, 10002))
    finally:
        c.cleanup()


def test_operator_cli_views(vllm_cluster: Cluster) -> None:
    c = vllm_cluster
    flags = ["--controller", c.grpc(CONTROLLER), "--coordinator", c.grpc(COORDINATOR)]
    out = subprocess.run(
        motor_argv("instances", "-o", "json", *flags), capture_output=True, text=True, timeout=30
    )
    assert out.returncode == 0, out.stderr
    assert sorted(i["role"] for i in json.loads(out.stdout)) == ["ROLE_DECODE", "ROLE_PREFILL"]
    table = subprocess.run(motor_argv("instances", *flags), capture_output=True, text=True, timeout=30)
    assert table.stdout.splitlines()[0].split() == ["ID", "ROLE", "STATUS", "MODEL", "JOB", "ENDPOINTS"]
    status = subprocess.run(
        motor_argv("status", "-o", "json", *flags), capture_output=True, text=True, timeout=30
    )
    assert status.returncode == 0, status.stderr
    assert json.loads(status.stdout)["coordinators"][0]["routable"] is True
    down = subprocess.run(
        motor_argv("instances", "--controller", "127.0.0.1:9", "--timeout", "1"),
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert down.returncode == 1
    assert (
        down.stderr.strip()
        == "motor instances: cannot reach the Controller at 127.0.0.1:9 (DEADLINE_EXCEEDED)"
    )
