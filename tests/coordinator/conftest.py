"""Fixtures for Coordinator tests: an in-process Coordinator (real gRPC + HTTP servers on port 0),
instance builders, real simulated-engine processes, and a fake Controller that records alarms."""

from __future__ import annotations

import re
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import aiohttp
import grpc
import pytest

from motor_mesh.common import server as common_server
from motor_mesh.common.config import load
from motor_mesh.coordinator.app import Coordinator
from motor_mesh.gen.motor.v1 import (
    alarm_pb2,
    controller_pb2,
    controller_pb2_grpc,
    coordinator_pb2,
    coordinator_pb2_grpc,
)
from motor_mesh.gen.motor.v1 import common_pb2 as c
from tests.procs import SimEngine

if TYPE_CHECKING:
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

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
        cfg = load(
            None, env={}, overrides={"coordinator": {"port": 0, "http_port": 0, "workers": 1, **overrides}}
        )
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

Engine = SimEngine  # what these tests call a simulated engine


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


def _start_engines(args_by_name: dict[str, list[str]], procs: list[SimEngine]) -> dict[str, SimEngine]:
    """Start one engine per entry (all at once), then wait until each listens. Every process
    started is appended to ``procs``, for the caller to kill."""
    started = {}
    for name, args in args_by_name.items():
        started[name] = SimEngine("serve", MODEL, "--host", "127.0.0.1", "--port", "0", *args)
        procs.append(started[name])
    return {name: eng.start() for name, eng in started.items()}


@pytest.fixture(scope="module")
def engines() -> Iterator[dict[str, Engine]]:
    """One simulated engine per kind, shared by the module (tests compare counter deltas)."""
    procs: list[SimEngine] = []
    try:
        yield _start_engines(ENGINE_ARGS, procs)
    finally:
        for proc in procs:
            proc.kill()


SpawnEngines = Callable[..., dict[str, Engine]]


@pytest.fixture
def spawn_engines() -> Iterator[SpawnEngines]:
    """``spawn_engines(name=[flags...], ...)``: engines of the test's own (to arm faults on, or
    slow down), killed at teardown."""
    procs: list[SimEngine] = []

    def spawn(**args_by_name: list[str]) -> dict[str, Engine]:
        return _start_engines(args_by_name, procs)

    try:
        yield spawn
    finally:
        for proc in procs:
            proc.kill()


# -- reading what engines and the Coordinator did -----------------------------------------------

LEGS = re.compile(r'^motor_sim_pd_legs_total\{protocol="(\w+)",side="(\w+)"\} ([0-9.]+)$', re.M)
RUNNING = re.compile(r"^vllm:num_requests_running\{[^}]*\} ([0-9.]+)$", re.M)


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


async def set_table(coord: Running, *insts: c.Instance) -> None:
    """The Coordinator's whole table, through its management RPC."""
    await coord.stub.SetInstances(coordinator_pb2.SetInstancesRequest(instances=insts), timeout=5)


async def get_text(http: aiohttp.ClientSession, url: str) -> str:
    async with http.get(url, timeout=aiohttp.ClientTimeout(total=5)) as resp:
        return await resp.text()


async def legs(http: aiohttp.ClientSession, engine: Engine) -> dict[str, float]:
    """The engine's PD legs so far, as {"prefill/vllm": n, ...}."""
    text = await get_text(http, f"{engine.base}/metrics")
    return {f"{side}/{proto}": float(n) for proto, side, n in LEGS.findall(text)}


async def running(http: aiohttp.ClientSession, engine: Engine) -> float:
    """Requests the engine is serving right now."""
    m = RUNNING.search(await get_text(http, f"{engine.base}/metrics"))
    assert m is not None
    return float(m.group(1))


# -- a fake Controller (precision alarms) -------------------------------------------------------


class FakeController(controller_pb2_grpc.ControllerServicer):
    """Records every ReportAlarms; refuses with UNAVAILABLE while ``refuse`` is set."""

    def __init__(self) -> None:
        self.alarms: list[alarm_pb2.Alarm] = []
        self.calls = 0
        self.refused = 0
        self.refuse = False
        self.metadata: list[dict[str, str]] = []
        self.address = ""

    async def ReportAlarms(
        self, request: controller_pb2.ReportAlarmsRequest, context: grpc.aio.ServicerContext
    ) -> controller_pb2.ReportAlarmsResponse:
        self.calls += 1
        self.metadata.append({k: str(v) for k, v in context.invocation_metadata() or ()})
        if self.refuse:
            self.refused += 1
            await context.abort(grpc.StatusCode.UNAVAILABLE, "controller restarting")
        self.alarms.extend(request.alarms)
        return controller_pb2.ReportAlarmsResponse()

    def of(self, category: int) -> list[alarm_pb2.Alarm]:
        return [a for a in self.alarms if a.category == category]


async def serve_controller(fake: FakeController, port: int = 0) -> grpc.aio.Server:
    """Serve ``fake`` on 127.0.0.1:``port`` (0: any free port); sets ``fake.address``."""
    server = grpc.aio.server()
    controller_pb2_grpc.add_ControllerServicer_to_server(fake, server)
    bound = server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    fake.address = f"127.0.0.1:{bound}"
    return server


@pytest.fixture
async def fake_controller() -> AsyncIterator[FakeController]:
    fake = FakeController()
    server = await serve_controller(fake)
    try:
        yield fake
    finally:
        await server.stop(None)


# -- traces -----------------------------------------------------------------------------------


@pytest.fixture
def spans(monkeypatch: pytest.MonkeyPatch) -> Iterator[InMemorySpanExporter]:
    """Tracing on for the Coordinators a test starts, their spans kept in memory."""
    # Imported here: a Coordinator test that does not trace loads no OpenTelemetry.
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from motor_mesh.coordinator import inference
    from motor_mesh.coordinator.tracing import RequestTracer

    exporter = InMemorySpanExporter()
    provider = TracerProvider()  # the default sampler: parent-based, always on
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    # What OTEL_EXPORTER_OTLP_ENDPOINT would switch on, without an OTLP exporter behind it.
    monkeypatch.setattr(inference, "request_tracer", lambda: RequestTracer(provider))
    yield exporter
    provider.shutdown()
