"""With OTEL_EXPORTER_OTLP_ENDPOINT set, spans reach an OTLP collector: a span per RPC from every
service, and one trace per inference request from the client's ``traceparent`` through the
Coordinator's prefill and decode legs into both engines."""

from __future__ import annotations

import json
import secrets
import threading
import urllib.request
from collections.abc import Iterator
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import openai
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from tests.e2e.cluster import Cluster
from tests.poll import wait_until
from tests.procs import SimEngine, grpcurl

pytestmark = pytest.mark.timeout(120)

# Export within 0.1 s of a span's end instead of the SDK's 5 s.
FAST_EXPORT = {"OTEL_BSP_SCHEDULE_DELAY": "100"}


@dataclass(frozen=True)
class Span:
    service: str  # its resource's service.name
    name: str
    trace_id: str
    span_id: str
    parent_id: str
    kind: int
    attributes: dict[str, Any]


def _value(v: Any) -> Any:
    kind = v.WhichOneof("value")
    return getattr(v, kind) if kind else None


class Collector(trace_service_pb2_grpc.TraceServiceServicer):
    """An OTLP/gRPC trace receiver on a loopback port of its own (a thread pool serves it, so
    sync and async tests alike can use it). Keeps every span it is sent."""

    def __init__(self) -> None:
        self.spans: list[Span] = []
        self._lock = threading.Lock()
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(self, self._server)
        self.port = self._server.add_insecure_port("127.0.0.1:0")
        self._server.start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        self._server.stop(None)

    def Export(self, request, context):
        got = []
        for rs in request.resource_spans:
            resource = {a.key: _value(a.value) for a in rs.resource.attributes}
            service = str(resource.get("service.name", ""))
            for ss in rs.scope_spans:
                for s in ss.spans:
                    attrs = {a.key: _value(a.value) for a in s.attributes}
                    got.append(
                        Span(
                            service,
                            s.name,
                            s.trace_id.hex(),
                            s.span_id.hex(),
                            s.parent_span_id.hex(),
                            s.kind,
                            attrs,
                        )
                    )
        with self._lock:
            self.spans += got
        return trace_service_pb2.ExportTraceServiceResponse()

    def names(self) -> list[str]:
        with self._lock:
            return [s.name for s in self.spans]

    def named(self, name: str) -> list[Span]:
        with self._lock:
            return [s for s in self.spans if s.name == name]

    def trace(self, trace_id: str) -> list[Span]:
        with self._lock:
            return [s for s in self.spans if s.trace_id == trace_id]


SERVER, CLIENT = 2, 3  # OTLP Span.SpanKind


def traceparent(trace_id: str, span_id: str, sampled: bool = True) -> str:
    return f"00-{trace_id}-{span_id}-{'01' if sampled else '00'}"


@pytest.fixture
def collector() -> Iterator[Collector]:
    c = Collector()
    yield c
    c.stop()


def test_rpc_spans_reach_the_otlp_collector(motor_proc, collector: Collector) -> None:
    proc = motor_proc(
        "controller", "--port", "0", env={"OTEL_EXPORTER_OTLP_ENDPOINT": collector.endpoint, **FAST_EXPORT}
    )
    addr, _ = proc.listening()
    grpcurl("-d", json.dumps({}), addr, "motor.v1.Controller/ListInstances")
    wait_until(lambda: "/motor.v1.Controller/ListInstances" in collector.names(), 10, "the RPC's span")


def test_inference_workers_flush_their_spans_when_the_coordinator_stops(
    motor_proc, collector: Collector, tmp_path: Path
) -> None:
    engine = SimEngine("--port", "0").start()
    try:
        cfg = tmp_path / "coordinator.json"
        cfg.write_text(json.dumps({"coordinator": {"workers": 2}}))
        # Batches leave only when full or at shutdown: whatever arrives was flushed by the stop.
        env = {"OTEL_EXPORTER_OTLP_ENDPOINT": collector.endpoint, "OTEL_BSP_SCHEDULE_DELAY": "600000"}
        proc = motor_proc("coordinator", "--config", str(cfg), "--port", "0", "--http-port", "0", env=env)
        addr, http = proc.listening(30)
        union = {
            "id": 5,
            "role": "ROLE_UNION",
            "job_name": "u",
            "model_name": "motor-sim",
            "engine_type": "ENGINE_TYPE_SIM",
            "endpoints": [{"host": "127.0.0.1", "port": engine.port}],
        }
        added = grpcurl("-d", json.dumps({"instances": [union]}), addr, "motor.v1.Coordinator/AddInstances")
        assert added.returncode == 0, added.stderr
        trace_id = secrets.token_hex(16)
        body = {"model": "motor-sim", "prompt": "flush", "max_tokens": 2}
        req = urllib.request.Request(
            f"http://{http}/v1/completions",
            json.dumps(body).encode(),
            {"Content-Type": "application/json", "traceparent": traceparent(trace_id, secrets.token_hex(8))},
        )
        with urllib.request.urlopen(req, timeout=10) as resp:
            assert resp.status == 200
        assert collector.trace(trace_id) == []
        assert proc.stop() == 0
        assert sorted(s.name for s in collector.trace(trace_id)) == ["POST /v1/completions", "union"]
    finally:
        engine.kill()


@pytest.fixture(scope="module")
def traced(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Cluster, Collector]]:
    """``motor up`` (a vLLM prefill and decode, simulated) exporting to a collector of the test."""
    collector = Collector()
    tmp: Path = tmp_path_factory.mktemp("up-traced")
    c = Cluster(tmp, env={"OTEL_EXPORTER_OTLP_ENDPOINT": collector.endpoint, **FAST_EXPORT})
    try:
        c.wait_ready()
        yield c, collector
    finally:
        c.cleanup()
        collector.stop()


def _one(spans: list[Span], **match: Any) -> Span:
    found = [s for s in spans if all(getattr(s, k) == v for k, v in match.items())]
    assert len(found) == 1, (match, spans)
    return found[0]


def test_a_request_is_one_trace_through_both_legs_and_both_engines(traced: tuple[Cluster, Collector]) -> None:
    c, collector = traced
    trace_id, client_span = secrets.token_hex(16), secrets.token_hex(8)
    client = openai.OpenAI(base_url=f"{c.base_url}/v1", api_key="none", max_retries=0, timeout=30)
    raw = client.chat.completions.with_raw_response.create(
        model="motor-sim",
        messages=[{"role": "user", "content": "Follow me."}],
        max_tokens=4,
        extra_headers={"traceparent": traceparent(trace_id, client_span)},
    )
    assert raw.parse().choices[0].message.content

    def whole() -> list[Span]:
        spans = collector.trace(trace_id)
        assert {s.name for s in spans} >= {"POST /v1/chat/completions", "prefill", "decode", "llm_request"}
        assert len([s for s in spans if s.name == "llm_request"]) == 2
        return spans

    spans = wait_until(whole, 15, "the request's trace", retry=(AssertionError,))
    http = _one(spans, name="POST /v1/chat/completions")
    assert (http.service, http.kind, http.parent_id) == ("motor-coordinator", SERVER, client_span)
    assert http.attributes["http.response.status_code"] == 200
    assert http.attributes["gen_ai.request.model"] == "motor-sim"
    # The answer names the server span, so a client can find the trace.
    assert raw.headers["traceresponse"] == traceparent(trace_id, http.span_id)

    legs = {}
    for role in ("prefill", "decode"):
        leg = _one(spans, name=role)
        assert (leg.kind, leg.parent_id, leg.attributes["motor.attempt"]) == (CLIENT, http.span_id, 1)
        assert leg.attributes["http.response.status_code"] == 200
        legs[role] = leg
    # Each engine's span is a child of the leg that called it: the traceparent it was sent.
    for role, leg in legs.items():
        engine = _one(spans, name="llm_request", parent_id=leg.span_id)
        assert (engine.service, engine.kind) == (f"motor-sim-{role}", SERVER)
        assert engine.attributes["motor.sim.leg"] == role
        assert engine.attributes["gen_ai.usage.prompt_tokens"] > 0
    assert legs["prefill"].attributes["server.port"] != legs["decode"].attributes["server.port"]
