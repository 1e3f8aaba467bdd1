"""TLS and mTLS on the shared server and channel (certificates made here with openssl)."""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common.channel import open_channel
from services.common.config import ServerConfig, load
from services.common.server import MotorServer
from tests.test_runtime import CONTROLLER, StubController

pytestmark = pytest.mark.skipif(
    shutil.which("openssl") is None, reason="openssl CLI needed to make certificates"
)


def openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("pki")
    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.pem",
            "-days", "1", "-subj", "/CN=motor-test-ca", cwd=d)  # fmt: skip
    (d / "san.ext").write_text("subjectAltName=IP:127.0.0.1\n")
    for name in ("server", "client"):
        openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key", "-out", f"{name}.csr",
                "-subj", f"/CN={name}", cwd=d)  # fmt: skip
        openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
                "-out", f"{name}.pem", "-days", "1", "-extfile", "san.ext", cwd=d)  # fmt: skip
    return d


@pytest.fixture
async def mtls_server(pki: Path) -> AsyncIterator[MotorServer]:
    tls: dict[str, Any] = {
        "tls_cert_file": str(pki / "server.pem"),
        "tls_key_file": str(pki / "server.key"),
        "tls_ca_file": str(pki / "ca.pem"),
    }
    cfg = load(None, env={}, overrides={"controller": {"port": 0, **tls}}).controller
    srv = MotorServer("controller", cfg, [(CONTROLLER, StubController())], port=0)
    await srv.start()
    yield srv
    await srv.stop()


async def check(channel: grpc.aio.Channel) -> int:
    req = health_pb2.HealthCheckRequest(service="motor.v1.Controller")
    resp = await health_pb2_grpc.HealthStub(channel).Check(req, timeout=5, wait_for_ready=False)
    return resp.status


async def test_mtls_client_with_certificate_is_served(mtls_server: MotorServer, pki: Path) -> None:
    tls = ServerConfig(
        tls_ca_file=str(pki / "ca.pem"),
        tls_cert_file=str(pki / "client.pem"),
        tls_key_file=str(pki / "client.key"),
    )
    async with open_channel(mtls_server.address, tls=tls) as ch:
        assert await check(ch) == health_pb2.HealthCheckResponse.SERVING


async def test_client_without_certificate_or_plaintext_is_refused(
    mtls_server: MotorServer, pki: Path
) -> None:
    async with open_channel(mtls_server.address, tls=ServerConfig(tls_ca_file=str(pki / "ca.pem"))) as ch:
        with pytest.raises(grpc.aio.AioRpcError) as no_cert:
            await check(ch)
        assert no_cert.value.code() == grpc.StatusCode.UNAVAILABLE
    async with grpc.aio.insecure_channel(mtls_server.address) as ch:
        with pytest.raises(grpc.aio.AioRpcError) as plain:
            await check(ch)
        assert plain.value.code() == grpc.StatusCode.UNAVAILABLE
