"""The grpc.aio server every Motor service runs on (docs/architecture.md, "Runtime rules").

Health (``""`` plus each served service), reflection, keepalive policy, ``so_reuseport = 0``,
message-size limits, raw-bytes method wrappers, interceptors (tracing, access log, management key),
optional TLS/mTLS, the exposure warning (:mod:`motor_mesh.common.exposure`), the
``event=listening`` line, and the graceful stop sequence (SIGTERM/SIGINT; a second one forces
the exit at once).
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import grpc
from google.protobuf.descriptor import ServiceDescriptor
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection

from motor_mesh.common import exposure, log, telemetry
from motor_mesh.common.config import ConfigError, ServerConfig, read_key_file, read_private_file
from motor_mesh.common.interceptors import AccessLogInterceptor, ManagementKeyInterceptor
from motor_mesh.common.metrics_http import MetricsServer
from motor_mesh.common.rpc import service_handler
from motor_mesh.common.signals import STDIN_GUARD_ENV, install_stop_signals, stop_when_stdin_closes

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
SHUTDOWN_DRAIN_S = 1.0
STOP_GRACE_S = 3.0
MAX_TLS_FILE_BYTES = 1024 * 1024


def server_credentials(cfg: ServerConfig) -> grpc.ServerCredentials | None:
    """TLS with ``tls_cert_file`` + ``tls_key_file``; client certificates required with
    ``tls_ca_file`` too. The private key must be private (``read_private_file``)."""
    # Checked even when unused (no certificate): a private key others can read is a leak already.
    key = read_private_file(cfg.tls_key_file, "TLS key file", MAX_TLS_FILE_BYTES) if cfg.tls_key_file else b""
    if not (cfg.tls_cert_file and cfg.tls_key_file):
        return None
    ca = cfg.tls_ca_file
    return grpc.ssl_server_credentials(
        [(key, read_public_file(cfg.tls_cert_file, "TLS certificate file"))],
        root_certificates=read_public_file(ca, "TLS CA file") if ca else None,
        require_client_auth=bool(ca),
    )


def read_public_file(path: str, what: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read {what}: {exc.strerror or type(exc).__name__}") from None


MAX_STREAMS_PER_CONNECTION = 1024


def server_options(max_message_bytes: int) -> list[tuple[str, Any]]:
    return [
        # Clients ping every 20 s on idle streams; allow down to 10 s so none is cut off with
        # too_many_pings.
        ("grpc.http2.min_recv_ping_interval_without_data_ms", 10000),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_ping_strikes", 0),
        # A second server on the same port must fail loudly, not share it.
        ("grpc.so_reuseport", 0),
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", max_message_bytes),
        # Streams one client connection may hold open at once (heartbeats, watches): a peer
        # cannot pin unbounded handler tasks; the fleet load generators stay well under it.
        ("grpc.max_concurrent_streams", MAX_STREAMS_PER_CONNECTION),
    ]


class MotorServer:
    """One gRPC server. ``readiness_gated``: ``""`` stays NOT_SERVING until ``set_ready(True)``
    (the Coordinator's "routable"), instead of following the server's own liveness.
    ``standby``: the served service names stay NOT_SERVING until ``set_serving(True)`` (a
    standby Controller: alive, but not the one to talk to)."""

    def __init__(
        self,
        name: str,
        cfg: ServerConfig,
        services: Sequence[tuple[ServiceDescriptor, object]],
        *,
        port: int,
        readiness_gated: bool = False,
        standby: bool = False,
    ) -> None:
        self.name = name
        self.cfg = cfg
        self.port = port
        self.host = cfg.host
        self.health = health_aio.HealthServicer()
        self._services = services
        self._readiness_gated = readiness_gated
        self._standby = standby
        self._names: list[str] = []
        self._stop_hooks: list[Callable[[], Awaitable[None] | None]] = []
        self._server: grpc.aio.Server | None = None
        self._stopping = False
        # Read every file before binding anything: a bad key or certificate is a start-up error.
        self._key = read_key_file(cfg.management_key_file) if cfg.management_key_file else None
        self._creds = server_credentials(cfg)

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def on_stop(self, hook: Callable[[], Awaitable[None] | None]) -> None:
        """Run ``hook`` after the drain, before the server stops (to end open streams)."""
        self._stop_hooks.append(hook)

    async def start(self) -> int:
        interceptors: list[Any] = telemetry.server_interceptors(self.name)
        interceptors.append(AccessLogInterceptor())
        if self._key is not None:
            interceptors.append(ManagementKeyInterceptor(self._key))
        server = grpc.aio.server(
            interceptors=interceptors, options=server_options(self.cfg.max_message_bytes)
        )
        names = []
        for descriptor, servicer in self._services:
            server.add_generic_rpc_handlers((service_handler(descriptor, servicer),))
            names.append(descriptor.full_name)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        reflection.enable_server_reflection(
            [*names, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME],
            server,
        )
        bind = f"{self.host}:{self.port}"
        creds = self._creds
        try:
            bound = server.add_secure_port(bind, creds) if creds else server.add_insecure_port(bind)
        except RuntimeError as exc:
            raise OSError(f"cannot bind gRPC {bind}: address in use or not available") from exc
        if not bound:
            raise OSError(f"cannot bind gRPC {bind}: address in use or not available")
        self.port = bound
        exposure.check_management(self.name, self.cfg, self.address)
        await server.start()
        self._server = server
        self._names = names
        for n in names:
            await self.health.set(n, NOT_SERVING if self._standby else SERVING)
        await self.health.set("", NOT_SERVING if self._readiness_gated else SERVING)
        return bound

    def announce(self, **extra: str) -> None:
        log.event("listening", service=self.name, grpc=self.address, **extra)

    async def set_ready(self, ready: bool) -> None:
        await self.health.set("", SERVING if ready else NOT_SERVING)

    async def set_serving(self, serving: bool) -> None:
        """Every served service name (not ``""``) to SERVING or NOT_SERVING."""
        if self._stopping:
            return
        for n in self._names:
            await self.health.set(n, SERVING if serving else NOT_SERVING)

    async def stop(self) -> None:
        """NOT_SERVING everywhere, drain, end streams, then stop with a grace period."""
        if self._stopping or self._server is None:
            return
        self._stopping = True
        log.event("stopping", service=self.name)
        await self.health.enter_graceful_shutdown()
        await asyncio.sleep(SHUTDOWN_DRAIN_S)
        for hook in self._stop_hooks:
            # One failing hook must not leave the server running or skip the others.
            try:
                result = hook()
                if asyncio.iscoroutine(result):
                    await result
            except Exception:
                log.exception("stop_hook_failed", service=self.name, hook=getattr(hook, "__qualname__", "?"))
        await self._server.stop(grace=STOP_GRACE_S)
        telemetry.shutdown()
        log.event("stopped", service=self.name)


def run(amain: Callable[[asyncio.Event], Awaitable[int]], *, fast_loop: bool = False) -> int:
    """Run one service's ``amain(stop)`` on a fresh loop; SIGTERM/SIGINT set ``stop``, a
    second one exits at once (:func:`install_stop_signals`).
    ``fast_loop``: uvloop, for the processes that serve inference traffic (about twice the
    throughput of the default loop there; bench/results/http_stack.md)."""

    # Read before anything starts a process of its own: it is for us, not for our children.
    guard_stdin = os.environ.pop(STDIN_GUARD_ENV, "") == "1"

    async def wrapper() -> int:
        stop = asyncio.Event()
        install_stop_signals(stop.set)
        if guard_stdin:
            stop_when_stdin_closes(stop.set)
        return await amain(stop)

    if fast_loop:
        import uvloop  # only where it is used: the management-only services never load it

        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            return runner.run(wrapper())
    return asyncio.run(wrapper())


async def start_with_metrics(server: MotorServer, scrape: MetricsServer | None) -> None:
    """/metrics, then the gRPC port: SERVING means /metrics answers too. When either cannot
    start, neither is left running."""
    try:
        if scrape is not None:
            await scrape.start()
        await server.start()
    except BaseException:
        if scrape is not None:
            await scrape.stop()
        raise
