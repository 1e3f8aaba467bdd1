"""OpenTelemetry tracing, on only when an OTLP endpoint is set.

The standard ``OTEL_EXPORTER_OTLP_ENDPOINT`` (or ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``) variable
switches it on, ``OTEL_SDK_DISABLED=true`` off again; without it nothing of OpenTelemetry is even
imported, no provider is installed and no interceptor is added, so tracing costs nothing. The
provider's sampler, batch processor and exporter read the other standard variables themselves
(``OTEL_TRACES_SAMPLER``, ``OTEL_BSP_*``, ``OTEL_EXPORTER_OTLP_*``).

One provider per process, made on first use: a process that serves gRPC and inference HTTP
(the Coordinator with ``workers = 1``) exports both kinds of spans through it, and each
inference worker process makes its own.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Mapping
from typing import Any

_provider: Any = None
# Inference servers still sending spans through the provider: a gRPC server stopping before
# them (its drain ends first) only flushes, the last of them shuts the provider down.
_holders = 0


def endpoint() -> str:
    """Where spans go, or "" when tracing is off."""
    if os.environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return ""
    return os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or os.environ.get(
        "OTEL_EXPORTER_OTLP_ENDPOINT", ""
    )


def enabled() -> bool:
    return bool(endpoint())


def new_provider(service_name: str | None, otlp_endpoint: str | None = None) -> Any:
    """A batching OTLP/gRPC tracer provider. ``service_name`` None leaves ``service.name`` to
    ``OTEL_SERVICE_NAME``; ``otlp_endpoint`` None leaves the endpoint to the OTLP variables."""
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    # The sampler is the SDK's default: it reads OTEL_TRACES_SAMPLER / OTEL_TRACES_SAMPLER_ARG.
    attributes = {"service.name": service_name} if service_name else {}
    provider = TracerProvider(resource=Resource.create(attributes))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=otlp_endpoint)))
    return provider


def provider(service: str) -> Any:
    """This process's provider (``service.name`` ``motor-<service>``), made on first use."""
    global _provider
    if _provider is None:
        from opentelemetry import trace

        _provider = new_provider(f"motor-{service}")
        trace.set_tracer_provider(_provider)
    return _provider


def hold(service: str) -> Any:
    """The provider, for a user that releases it with :func:`release` when it stops."""
    global _holders
    _holders += 1
    return provider(service)


async def release() -> None:
    """One holder is done; the last one flushes and shuts the provider down (off the loop: an
    unreachable collector makes that wait for the exporter's timeout)."""
    global _holders
    _holders = max(0, _holders - 1)
    if _holders == 0:
        await asyncio.to_thread(shutdown)


def incoming_context(headers: Mapping[bytes, bytes]) -> Any:
    """The context an HTTP request's W3C ``traceparent`` (and ``tracestate``) name, for a span's
    parent: None without the header, an empty context when it is malformed. Header names are
    lower-case bytes, as the HTTP server gives them."""
    parent = headers.get(b"traceparent")
    if parent is None:
        return None
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    carrier = {"traceparent": parent.decode("latin-1")}
    state = headers.get(b"tracestate")
    if state:
        carrier["tracestate"] = state.decode("latin-1")
    return TraceContextTextMapPropagator().extract(carrier)


def server_interceptors(service: str) -> list[Any]:
    """A span per unary-response RPC served. Streaming responses get none: OpenTelemetry's aio
    interceptor iterates every stream handler, and handlers written with ``context.write`` (the
    health service's ``Watch``, the Heartbeat stream) are coroutines, which it breaks
    (opentelemetry-python-contrib#3066); a span the length of a stream says little anyway."""
    if not enabled():
        return []
    from opentelemetry.instrumentation.grpc import aio_server_interceptor

    return [_unary_only(aio_server_interceptor(tracer_provider=provider(service)))]


def _unary_only(inner: Any) -> Any:
    import grpc

    class UnaryOnly(grpc.aio.ServerInterceptor):
        async def intercept_service(self, continuation: Any, details: Any) -> Any:
            handler = await continuation(details)
            if handler is None or handler.response_streaming:
                return handler

            async def resolved(_: Any) -> Any:
                return handler

            return await inner.intercept_service(resolved, details)

    return UnaryOnly()


def client_interceptors(service: str) -> list[Any]:
    if not enabled():
        return []
    from opentelemetry.instrumentation.grpc import aio_client_interceptors

    return list(aio_client_interceptors(tracer_provider=provider(service)))


def shutdown() -> None:
    """Export what is left and stop, unless a holder still sends spans: then only export."""
    global _provider
    if _provider is None:
        return
    if _holders:
        _provider.force_flush()
        return
    _provider.shutdown()
    _provider = None
