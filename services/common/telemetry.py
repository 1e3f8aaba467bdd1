"""OpenTelemetry tracing for gRPC servers and clients, on only when an OTLP endpoint is set.

The standard ``OTEL_EXPORTER_OTLP_ENDPOINT`` variable switches it on; without it no provider is
installed and no interceptor is added, so tracing costs nothing.
"""

from __future__ import annotations

import os
from typing import Any

_provider: Any = None


def enabled() -> bool:
    return bool(os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT"))


def _ensure_provider(service: str) -> Any:
    global _provider
    if _provider is None:
        from opentelemetry import trace
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        provider = TracerProvider(resource=Resource.create({"service.name": f"motor-{service}"}))
        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
        trace.set_tracer_provider(provider)
        _provider = provider
    return _provider


def server_interceptors(service: str) -> list[Any]:
    if not enabled():
        return []
    from opentelemetry.instrumentation.grpc import aio_server_interceptor

    return [aio_server_interceptor(tracer_provider=_ensure_provider(service))]


def client_interceptors(service: str) -> list[Any]:
    if not enabled():
        return []
    from opentelemetry.instrumentation.grpc import aio_client_interceptors

    return list(aio_client_interceptors(tracer_provider=_ensure_provider(service)))


def shutdown() -> None:
    if _provider is not None:
        _provider.shutdown()
