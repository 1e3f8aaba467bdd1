"""TLS and mTLS on the shared server and channel, HTTPS on the Coordinator's inference port, and
clients that use TLS whenever their side of the deployment does (certificates made here with
openssl)."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import ssl
import subprocess
import sys
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import httpx2
import openai
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from motor_mesh.common import channel as channel_module
from motor_mesh.common import server as common_server
from motor_mesh.common.channel import ClientTLS, open_channel
from motor_mesh.common.config import ServerConfig, load
from motor_mesh.common.server import MotorServer
from motor_mesh.coordinator.app import Coordinator
from tests.ports import reserved_pair
from tests.procs import ROOT, Proc
from tests.stub_controller import CONTROLLER, StubController

pytestmark = pytest.mark.skipif(
    shutil.which("openssl") is None, reason="openssl CLI needed to make certificates"
)


def openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def make_pki(d: Path) -> Path:
    """A test CA and two certificates it signed (``server``, ``client``) for 127.0.0.1."""
    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.pem",
            "-days", "1", "-subj", "/CN=motor-test-ca", cwd=d)  # fmt: skip
    (d / "san.ext").write_text("subjectAltName=IP:127.0.0.1\n")
    for name in ("server", "client"):
        openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key", "-out", f"{name}.csr",
                "-subj", f"/CN={name}", cwd=d)  # fmt: skip
        openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
                "-out", f"{name}.pem", "-days", "1", "-extfile", "san.ext", cwd=d)  # fmt: skip
        (d / f"{name}.key").chmod(0o600)
    return d


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_pki(tmp_path_factory.mktemp("pki"))


def tls_files(pki: Path, name: str = "server", ca: bool = False) -> dict[str, str]:
    files = {"tls_cert_file": str(pki / f"{name}.pem"), "tls_key_file": str(pki / f"{name}.key")}
    return {**files, "tls_ca_file": str(pki / "ca.pem")} if ca else files


async def _server(tls: dict[str, Any]) -> MotorServer:
    cfg = load(None, env={}, overrides={"controller": {"port": 0, **tls}}).controller
    srv = MotorServer("controller", cfg, [(CONTROLLER, StubController())], port=0)
    await srv.start()
    return srv


@pytest.fixture
async def mtls_server(pki: Path, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[MotorServer]:
    monkeypatch.setattr(common_server, "SHUTDOWN_DRAIN_S", 0.0)
    srv = await _server(tls_files(pki, ca=True))
    yield srv
    await srv.stop()


@pytest.fixture
async def tls_server(pki: Path, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[MotorServer]:
    """TLS without client certificates."""
    monkeypatch.setattr(common_server, "SHUTDOWN_DRAIN_S", 0.0)
    srv = await _server(tls_files(pki))
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


# -- clients: ClientTLS, and TLS whenever the section has a certificate ---------------------------


async def test_client_tls_with_a_ca_file_is_served_by_a_tls_server(
    tls_server: MotorServer, pki: Path
) -> None:
    async with open_channel(tls_server.address, tls=ClientTLS(ca_file=str(pki / "ca.pem"))) as ch:
        assert await check(ch) == health_pb2.HealthCheckResponse.SERVING
    async with open_channel(tls_server.address) as ch:
        with pytest.raises(grpc.aio.AioRpcError) as plain:
            await check(ch)
        assert plain.value.code() == grpc.StatusCode.UNAVAILABLE


async def test_client_tls_presents_its_certificate_to_an_mtls_server(
    mtls_server: MotorServer, pki: Path
) -> None:
    mine = ClientTLS(str(pki / "ca.pem"), str(pki / "client.pem"), str(pki / "client.key"))
    async with open_channel(mtls_server.address, tls=mine) as ch:
        assert await check(ch) == health_pb2.HealthCheckResponse.SERVING
    async with open_channel(mtls_server.address, tls=ClientTLS(ca_file=str(pki / "ca.pem"))) as ch:
        with pytest.raises(grpc.aio.AioRpcError) as no_cert:
            await check(ch)
        assert no_cert.value.code() == grpc.StatusCode.UNAVAILABLE


# Run in a fresh interpreter: gRPC reads GRPC_DEFAULT_SSL_ROOTS_FILE_PATH (its "system roots")
# once per process.
_HEALTH_CHECK = """
import asyncio, sys
import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from motor_mesh.common.channel import open_channel
from motor_mesh.common.config import ServerConfig

async def main() -> None:
    tls = ServerConfig(tls_cert_file=sys.argv[2], tls_key_file=sys.argv[3])
    async with open_channel(sys.argv[1], tls=tls) as ch:
        req = health_pb2.HealthCheckRequest(service="motor.v1.Controller")
        try:
            resp = await health_pb2_grpc.HealthStub(ch).Check(req, timeout=5, wait_for_ready=False)
            print(health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status))
        except grpc.aio.AioRpcError as err:
            print(err.code().name)

asyncio.run(main())
"""


async def _check_in_subprocess(address: str, pki: Path, roots: Path | None) -> str:
    env = {k: v for k, v in os.environ.items() if k != "GRPC_DEFAULT_SSL_ROOTS_FILE_PATH"}
    if roots is not None:
        env["GRPC_DEFAULT_SSL_ROOTS_FILE_PATH"] = str(roots)
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", _HEALTH_CHECK, address, str(pki / "client.pem"), str(pki / "client.key"),
        cwd=ROOT, env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 0, err.decode()
    return out.decode().strip()


async def test_section_with_a_certificate_and_no_ca_uses_tls_verified_by_system_roots(
    mtls_server: MotorServer, pki: Path
) -> None:
    # The test CA as the system roots: served, and the client presented its certificate (the
    # server requires one).
    assert await _check_in_subprocess(mtls_server.address, pki, roots=pki / "ca.pem") == "SERVING"
    # gRPC's own roots do not know the test CA: the peer really is verified.
    assert await _check_in_subprocess(mtls_server.address, pki, roots=None) == "UNAVAILABLE"


async def test_tls_files_are_read_once_until_they_change(
    mtls_server: MotorServer, pki: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    reads: list[str] = []
    real = channel_module._read_file

    def counting(path: str) -> bytes:
        reads.append(Path(path).name)
        return real(path)

    monkeypatch.setattr(channel_module, "_read_file", counting)
    monkeypatch.setattr(channel_module, "_CREDENTIALS", OrderedDict())
    own = tmp_path / "client-pki"  # a copy this test may rotate and remove
    own.mkdir()
    for name in ("ca.pem", "client.pem", "client.key"):
        shutil.copy2(pki / name, own / name)
    tls = ServerConfig(**tls_files(own, "client", ca=True))
    for _ in range(3):
        async with open_channel(mtls_server.address, tls=tls) as ch:
            assert await check(ch) == health_pb2.HealthCheckResponse.SERVING
    assert sorted(reads) == ["ca.pem", "client.key", "client.pem"]

    cert = own / "client.pem"
    info = cert.stat()
    os.utime(cert, ns=(info.st_atime_ns, info.st_mtime_ns + 1_000_000_000))  # a rotated certificate
    async with open_channel(mtls_server.address, tls=tls) as ch:
        assert await check(ch) == health_pb2.HealthCheckResponse.SERVING
    assert sorted(reads) == sorted(["ca.pem", "client.key", "client.pem"] * 2)

    # Removed (or caught mid-rotation): the material read before still serves new channels.
    shutil.rmtree(own)
    async with open_channel(mtls_server.address, tls=tls) as ch:
        assert await check(ch) == health_pb2.HealthCheckResponse.SERVING
    assert len(reads) == 6


def test_controller_and_nodemanager_with_certificates_only_talk_tls(
    motor_proc: Callable[..., Proc], pki: Path, tmp_path: Path
) -> None:
    """Neither side has a CA file: both serve TLS, and both call the other over TLS, verified by
    the system roots (the test CA, through GRPC_DEFAULT_SSL_ROOTS_FILE_PATH)."""
    cfg = tmp_path / "motor.json"
    cfg.write_text(json.dumps({
        "controller": {**tls_files(pki, "server"), "coordinators": []},
        "nodemanager": {**tls_files(pki, "client"), "job_name": "tls", "role": "union", "ports": [reserved_pair()]},
    }))  # fmt: skip
    env = {"GRPC_DEFAULT_SSL_ROOTS_FILE_PATH": str(pki / "ca.pem")}
    controller = motor_proc("controller", "--config", str(cfg), "--port", "0", env=env)
    address, _ = controller.listening()
    nm = motor_proc("nodemanager", "--config", str(cfg), "--port", "0",
                    env={**env, "MOTOR_NODEMANAGER_CONTROLLER": address})  # fmt: skip
    try:
        nm.wait_line("event=registered", timeout=30)  # NodeManager -> Controller
        controller.wait_line("event=engines_started", timeout=30)  # Controller -> NodeManager
    finally:
        rc = nm.stop(timeout=20)  # SIGTERM: its engines are stopped with it
        controller.stop()
    assert rc == 0


# -- HTTPS on the Coordinator's inference port ----------------------------------------------------


def _https_client_context(pki: Path) -> ssl.SSLContext:
    return ssl.create_default_context(cafile=str(pki / "ca.pem"))


def test_coordinator_process_serves_https_on_its_http_port(
    motor_proc: Callable[..., Proc], pki: Path, tmp_path: Path
) -> None:
    cfg = tmp_path / "motor.json"
    cfg.write_text(json.dumps({"coordinator": tls_files(pki)}))
    proc = motor_proc("coordinator", "--config", str(cfg), "--port", "0", "--http-port", "0")
    _, http = proc.listening()
    assert http is not None and "https=true" in proc.wait_line("event=listening")

    async def get(url: str, **kw: Any) -> tuple[int, str]:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:
            async with session.get(url, **kw) as resp:
                return resp.status, await resp.text()

    ok = asyncio.run(get(f"https://{http}/health", ssl=_https_client_context(pki)))
    assert ok[0] == 200 and json.loads(ok[1])["status"] == "ok"  # plus which worker answered
    with pytest.raises(aiohttp.ClientError):
        asyncio.run(get(f"http://{http}/health"))
    assert proc.stop() == 0


@pytest.fixture
async def https_coordinator(pki: Path, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Coordinator]:
    """TLS with a CA file: mTLS on gRPC, while HTTPS asks no client certificate."""
    monkeypatch.setattr(common_server, "SHUTDOWN_DRAIN_S", 0.0)
    overrides = {"port": 0, "http_port": 0, **tls_files(pki, ca=True)}
    co = Coordinator(load(None, env={}, overrides={"coordinator": overrides}).coordinator)
    await co.start()
    yield co
    await co.stop()


async def test_openai_sdk_reaches_the_https_port_with_the_ca(
    https_coordinator: Coordinator, pki: Path
) -> None:
    base = f"https://{https_coordinator.http_address}/v1"
    async with httpx2.AsyncClient(verify=_https_client_context(pki)) as http:
        client = openai.AsyncOpenAI(base_url=base, api_key="unused", http_client=http, max_retries=0)
        with pytest.raises(openai.APIStatusError) as info:
            await client.models.list()
    # Nothing is routable yet: the answer itself proves the TLS path.
    assert info.value.status_code == 503
    assert info.value.body["code"] == "no_routable_instance"  # type: ignore[index]

    async with httpx2.AsyncClient() as http:  # the system roots do not know the test CA
        client = openai.AsyncOpenAI(base_url=base, api_key="unused", http_client=http, max_retries=0)
        with pytest.raises(openai.APIConnectionError):
            await client.models.list()


# -- the TLS private key must be private --------------------------------------------------------


@pytest.mark.parametrize("service", ["controller", "coordinator", "nodemanager"])
def test_tls_key_readable_by_others_stops_the_service(
    motor_proc: Callable[..., Proc], pki: Path, tmp_path: Path, service: str
) -> None:
    key = tmp_path / "server.key"
    key.write_bytes((pki / "server.key").read_bytes())
    key.chmod(0o644)
    cfg = tmp_path / "motor.json"
    cfg.write_text(json.dumps({service: {**tls_files(pki), "tls_key_file": str(key)}}))
    extra = ["--http-port", "0"] if service == "coordinator" else []
    proc = motor_proc(service, "--config", str(cfg), "--port", "0", *extra)
    assert proc.popen.wait(20) == 1
    refused = f"motor {service}: {key}: TLS key file must not be readable by group or others (chmod 600)"
    assert refused in proc.lines
    assert "event=listening" not in proc.output()
    assert "PRIVATE KEY" not in proc.output()

    key.chmod(0o600)
    proc = motor_proc(service, "--config", str(cfg), "--port", "0", *extra)
    proc.listening()
    assert proc.stop() == 0
