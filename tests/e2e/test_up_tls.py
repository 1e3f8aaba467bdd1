"""A whole cluster with mTLS on every gRPC port and HTTPS on the inference port: every internal
client follows its section (NodeManager → Controller, Controller → Coordinator and NodeManagers,
``motor up``'s own checks), and operators and applications get in with the CA."""

from __future__ import annotations

import json
import ssl
import subprocess
from pathlib import Path

import httpx2
import openai
import pytest

from tests.e2e.cluster import COORDINATOR, HTTP, Cluster
from tests.e2e.test_tls import make_pki, tls_files
from tests.poll import wait_until
from tests.procs import motor_argv


def test_cluster_on_mtls_serves_https_and_the_cli_gets_in_with_the_ca(tmp_path: Path) -> None:
    pki = make_pki(tmp_path)
    files = tls_files(pki, ca=True)
    cfg = tmp_path / "motor.json"
    cfg.write_text(json.dumps({section: files for section in ("controller", "coordinator", "nodemanager")}))
    cluster = Cluster(tmp_path, "--config", str(cfg))
    try:
        ready = cluster.wait_ready(90)
        assert ready == f"READY https://127.0.0.1:{HTTP + cluster.off}"

        ca = str(pki / "ca.pem")
        client = openai.OpenAI(
            base_url=f"{ready.split()[1]}/v1",
            api_key="unused",
            max_retries=0,
            http_client=httpx2.Client(verify=ssl.create_default_context(cafile=ca)),
        )
        reply = client.chat.completions.create(
            model="motor-sim", messages=[{"role": "user", "content": "hi"}], max_tokens=4
        )
        assert reply.choices[0].message.content

        def register_list(*tls: str) -> subprocess.CompletedProcess[str]:
            argv = motor_argv(
                "register", "list", "-o", "json", "--coordinator", cluster.grpc(COORDINATOR), *tls
            )
            return subprocess.run([*argv, "--timeout", "5"], capture_output=True, text=True, timeout=60)

        mtls = (
            "--tls-ca-file",
            ca,
            "--tls-cert-file",
            str(pki / "client.pem"),
            "--tls-key-file",
            str(pki / "client.key"),
        )
        listed = wait_until(lambda: register_list(*mtls).stdout, timeout=20)
        assert len(json.loads(listed)["available"]) == 2  # pushed by the Controller over mTLS

        refused = register_list("--tls-ca-file", ca)  # TLS, but no client certificate
        assert refused.returncode == 1 and "cannot reach the Coordinator" in refused.stderr
        assert len(refused.stderr.strip().splitlines()) == 1
    finally:
        assert cluster.proc.stop(20) == 0


@pytest.fixture(autouse=True)
def _no_proxy(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NO_PROXY", "127.0.0.1")
