"""With OTEL_EXPORTER_OTLP_ENDPOINT set, a service exports a span per RPC to that collector."""

from __future__ import annotations

import asyncio
import json

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from tests.procs import grpcurl


class Collector(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self) -> None:
        self.span_names: list[str] = []

    async def Export(self, request, context):
        for rs in request.resource_spans:
            for ss in rs.scope_spans:
                self.span_names += [s.name for s in ss.spans]
        return trace_service_pb2.ExportTraceServiceResponse()


async def test_rpc_spans_reach_the_otlp_collector(motor_proc) -> None:
    collector = Collector()
    server = grpc.aio.server()
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(collector, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        proc = motor_proc(
            "controller",
            "--port",
            "0",
            env={"OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{port}", "OTEL_BSP_SCHEDULE_DELAY": "100"},
        )
        addr, _ = await asyncio.to_thread(proc.listening)
        await asyncio.to_thread(grpcurl, "-d", json.dumps({}), addr, "motor.v1.Controller/ListInstances")
        for _ in range(100):
            if "/motor.v1.Controller/ListInstances" in collector.span_names:
                break
            await asyncio.sleep(0.1)
        assert "/motor.v1.Controller/ListInstances" in collector.span_names
    finally:
        await server.stop(None)
