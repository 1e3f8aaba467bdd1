"""Fixtures for Coordinator tests: an in-process Coordinator (real gRPC + HTTP servers on port 0),
instance builders, and real simulated-engine processes."""

from __future__ import annotations

import re
import socket
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import Any

import grpc
import pytest
from motor.v1 import common_pb2 as c
from motor.v1 import coordinator_pb2_grpc

from services.common import server as common_server
from services.common.config import load
from services.coordinator.runtime import Coordinator
from tests.procs import Proc, motor_argv

MODEL = "motor-sim"


def endpoint(port: int, host: str = "127.0.0.1", **kw: Any) -> c.Endpoint:
    return c.Endpoint(host=host, port=port, **kw)


def instance(
    iid: int,
    role: int,
    *ports: int,
    job: str | None = None,
    model: str = MODEL,
    engine_type: int = c.ENGINE_TYPE_SIM,
    bootstrap: int = 0,
    **kw: Any,
) -> c.Instance:
    return c.Instance(
        id=iid,
        role=role,
        job_name=job if job is not None else f"job-{iid}",
        model_name=model,
        engine_type=engine_type,
        endpoints=[endpoint(p, id=j, bootstrap_port=bootstrap) for j, p in enumerate(ports)],
        **kw,
    )


def dead_port() -> int:
    """A loopback port with nothing listening on it."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Running:
    co: Coordinator
    channel: grpc.aio.Channel
    stub: coordinator_pb2_grpc.CoordinatorAsyncStub

    @property
    def http(self) -> str:
        return self.co.http_address

    @property
    def grpc(self) -> str:
        return self.co.grpc_address


StartCoordinator = Callable[..., Awaitable[Running]]


@pytest.fixture
async def start_coordinator(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[StartCoordinator]:
    """``await start_coordinator(**coordinator_config)``; everything is stopped at teardown."""
    monkeypatch.setattr(common_server, "SHUTDOWN_DRAIN_S", 0.0)  # nothing to drain in a test
    started: list[Running] = []

    async def start(**overrides: Any) -> Running:
        cfg = load(None, env={}, overrides={"coordinator": {"port": 0, "http_port": 0, **overrides}})
        co = Coordinator(cfg.coordinator)
        await co.start()
        channel = grpc.aio.insecure_channel(co.grpc_address)
        running = Running(co, channel, coordinator_pb2_grpc.CoordinatorStub(channel))
        started.append(running)
        return running

    yield start
    for r in started:
        await r.channel.close()
        await r.co.stop()


@pytest.fixture
async def coord(start_coordinator: StartCoordinator) -> Running:
    return await start_coordinator()


# -- simulated engines ------------------------------------------------------------------------

_HTTP = re.compile(r"\bhttp=(\S+)")
_BOOT = re.compile(r"\bbootstrap=(\S+)")


@dataclass
class Engine:
    proc: Proc
    port: int
    bootstrap_port: int = 0

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def _kv(role: str, engine_id: str) -> list[str]:
    return [
        "--kv-transfer-config",
        f'{{"kv_connector":"NixlConnector","kv_role":"{role}","engine_id":"{engine_id}"}}',
    ]


ENGINE_ARGS: dict[str, list[str]] = {
    "vllm_p": _kv("kv_producer", "p1"),
    "vllm_p2": _kv("kv_producer", "p2"),
    "vllm_d": _kv("kv_consumer", "d1"),
    "vllm_d2": _kv("kv_consumer", "d2"),
    # Slow tokens, so a stream is still running when its client goes away.
    "vllm_d_slow": [*_kv("kv_consumer", "d3"), "--tpot-ms", "50"],
    "sgl_p": ["--protocol", "sglang", "--disaggregation-mode", "prefill"],
    "sgl_d": ["--protocol", "sglang", "--disaggregation-mode", "decode"],
    "union": [],
}


@pytest.fixture(scope="module")
def engines() -> Iterator[dict[str, Engine]]:
    """One simulated engine per kind, shared by the module (tests compare counter deltas)."""
    procs = {
        name: Proc(motor_argv("engine-sim", "serve", MODEL, "--host", "127.0.0.1", "--port", "0", *args))
        for name, args in ENGINE_ARGS.items()
    }
    try:
        out: dict[str, Engine] = {}
        for name, proc in procs.items():
            line = proc.wait_line("event=listening", timeout=30)
            http = _HTTP.search(line)
            assert http is not None, line
            boot = _BOOT.search(line)
            out[name] = Engine(
                proc,
                int(http.group(1).rsplit(":", 1)[1]),
                int(boot.group(1).rsplit(":", 1)[1]) if boot else 0,
            )
        yield out
    finally:
        for proc in procs.values():
            proc.kill()
