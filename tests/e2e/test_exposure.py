"""Management plane safety at start: the one-line warnings for reachable ports that nothing
guards, and key files that others could read."""

from __future__ import annotations

import json
import logging
import shutil
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest

from motor_mesh.common import server as common_server
from motor_mesh.common.config import load
from motor_mesh.common.exposure import is_loopback
from motor_mesh.common.server import MotorServer
from motor_mesh.coordinator.app import Coordinator
from tests.e2e.test_tls import make_pki, tls_files
from tests.procs import Proc
from tests.stub_controller import CONTROLLER, StubController

EXPOSED = "event=management_plane_exposed"
needs_openssl = pytest.mark.skipif(shutil.which("openssl") is None, reason="openssl CLI needed")


@pytest.mark.parametrize(
    ("host", "loopback"),
    [
        ("127.0.0.1", True),
        ("127.8.9.10", True),
        ("::1", True),
        ("[::1]", True),
        ("::ffff:127.0.0.1", True),
        ("localhost", True),
        ("LOCALHOST", True),
        ("0.0.0.0", False),
        ("::", False),
        ("10.1.2.3", False),
        ("fe80::1", False),
        ("node-1.cluster.local", False),
        ("localhost.evil.example", False),
    ],
)
def test_loopback_is_127_8_and_ipv6_1_and_localhost(host: str, loopback: bool) -> None:
    assert is_loopback(host) is loopback


def _start(motor_proc: Callable[..., Proc], service: str, *args: str, cwd: Path | None = None) -> Proc:
    extra = ["--http-port", "0"] if service == "coordinator" else []
    proc = motor_proc(service, "--port", "0", *extra, *args, cwd=cwd)
    proc.listening()  # the warning comes before this line
    return proc


def _count(proc: Proc, marker: str) -> int:
    return sum(marker in line for line in proc.lines)


@pytest.mark.parametrize("service", ["controller", "coordinator", "nodemanager"])
def test_service_on_all_interfaces_without_key_or_mtls_warns_once(
    motor_proc: Callable[..., Proc], service: str
) -> None:
    proc = _start(motor_proc, service, "--host", "0.0.0.0")
    warnings = [line for line in proc.lines if EXPOSED in line]
    assert len(warnings) == 1, proc.output()
    assert "level=warning" in warnings[0] and f"service={service}" in warnings[0]
    assert "address=0.0.0.0:" in warnings[0]
    assert proc.stop() == 0


def test_management_key_or_loopback_means_no_warning(motor_proc: Callable[..., Proc], tmp_path: Path) -> None:
    key = tmp_path / "mgmt.key"
    key.write_text("s3cret\n")
    key.chmod(0o600)
    cfg = tmp_path / "motor.json"
    cfg.write_text(json.dumps({"controller": {"management_key_file": str(key)}}))
    guarded = _start(motor_proc, "controller", "--config", str(cfg), "--host", "0.0.0.0")
    (tmp_path / "local").mkdir()  # a state_dir of its own
    local = _start(motor_proc, "controller", cwd=tmp_path / "local")
    assert _count(guarded, EXPOSED) == 0 and _count(local, EXPOSED) == 0
    # The key guards the port, but plaintext gRPC shows it to anyone on the path.
    assert _count(guarded, "event=management_key_in_clear") == 1
    assert _count(local, "event=management_key_in_clear") == 0
    assert "s3cret" not in guarded.output()
    assert guarded.stop() == 0 and local.stop() == 0


# -- in process: which TLS setups count as a guard, and the inference port ----------------------


def _events(caplog: pytest.LogCaptureFixture, name: str) -> list[logging.LogRecord]:
    return [r for r in caplog.records if getattr(r, "event", None) == name]


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture
def no_drain(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(common_server, "SHUTDOWN_DRAIN_S", 0.0)


@needs_openssl
@pytest.mark.parametrize(("ca", "warned"), [(True, 0), (False, 1)])
async def test_only_mtls_guards_the_management_port(
    pki: Path, caplog: pytest.LogCaptureFixture, no_drain: None, ca: bool, warned: int
) -> None:
    """Server TLS alone encrypts but lets anyone call; client certificates authenticate."""
    caplog.set_level(logging.WARNING)
    tls = tls_files(pki, ca=ca)
    cfg = load(None, env={}, overrides={"controller": {"port": 0, "host": "0.0.0.0", **tls}}).controller
    srv = MotorServer("controller", cfg, [(CONTROLLER, StubController())], port=0)
    await srv.start()
    await srv.stop()
    assert len(_events(caplog, "management_plane_exposed")) == warned


@needs_openssl
async def test_a_management_key_over_tls_is_guarded(
    pki: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture, no_drain: None
) -> None:
    caplog.set_level(logging.WARNING)
    key = tmp_path / "mgmt.key"
    key.write_text("s3cret\n")
    key.chmod(0o600)
    values = {"port": 0, "host": "0.0.0.0", "management_key_file": str(key), **tls_files(pki, ca=False)}
    cfg = load(None, env={}, overrides={"controller": values}).controller
    srv = MotorServer("controller", cfg, [(CONTROLLER, StubController())], port=0)
    await srv.start()
    await srv.stop()
    assert not _events(caplog, "management_plane_exposed")
    assert not _events(caplog, "management_key_in_clear")


@pytest.fixture
async def start_coordinator(no_drain: None) -> AsyncIterator[Callable[..., Any]]:
    started: list[Coordinator] = []

    async def start(**overrides: Any) -> Coordinator:
        values = {"port": 0, "http_port": 0, **overrides}
        co = Coordinator(load(None, env={}, overrides={"coordinator": values}).coordinator)
        await co.start()
        started.append(co)
        return co

    yield start
    for co in started:
        await co.stop()


def _keys_file(tmp_path: Path, mode: int = 0o600) -> str:
    path = tmp_path / "api.keys"
    path.write_text("# clients\nsk-one\n")
    path.chmod(mode)
    return str(path)


@needs_openssl
@pytest.mark.parametrize(
    ("host", "keys", "tls", "expected"),
    [
        ("0.0.0.0", False, False, {"inference_api_open": 1, "api_keys_in_clear": 0}),
        ("0.0.0.0", True, False, {"inference_api_open": 0, "api_keys_in_clear": 1}),
        ("0.0.0.0", True, True, {"inference_api_open": 0, "api_keys_in_clear": 0}),
        ("127.0.0.1", False, False, {"inference_api_open": 0, "api_keys_in_clear": 0}),
    ],
)
async def test_inference_port_warnings(
    start_coordinator: Callable[..., Any],
    pki: Path,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    host: str,
    keys: bool,
    tls: bool,
    expected: dict[str, int],
) -> None:
    caplog.set_level(logging.WARNING)
    overrides: dict[str, Any] = {"host": host}
    if keys:
        overrides["api_keys_file"] = _keys_file(tmp_path)
    if tls:
        overrides.update(tls_files(pki))
    co = await start_coordinator(**overrides)
    assert {name: len(_events(caplog, name)) for name in expected} == expected
    if expected["inference_api_open"] or expected["api_keys_in_clear"]:
        (record,) = [r for name in expected for r in _events(caplog, name)]
        assert record.fields["address"] == co.http_address  # type: ignore[attr-defined]


def test_api_keys_file_readable_by_others_stops_the_coordinator(
    motor_proc: Callable[..., Proc], tmp_path: Path
) -> None:
    keys = _keys_file(tmp_path, 0o644)
    cfg = tmp_path / "motor.json"
    cfg.write_text(json.dumps({"coordinator": {"api_keys_file": keys}}))
    proc = motor_proc("coordinator", "--config", str(cfg), "--port", "0", "--http-port", "0")
    assert proc.popen.wait(20) == 1
    refused = (
        f"motor coordinator: coordinator.api_keys_file: {keys}: "
        "API keys file must not be readable by group or others (chmod 600)"
    )
    assert refused in proc.lines
    assert "event=listening" not in proc.output() and "sk-one" not in proc.output()

    Path(keys).chmod(0o600)
    proc = _start(motor_proc, "coordinator", "--config", str(cfg))
    assert proc.stop() == 0
