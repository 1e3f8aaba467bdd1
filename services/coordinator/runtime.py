"""One Coordinator process: the management gRPC server and the inference HTTP server sharing
one routing table, one routing view and one upstream connection pool."""

from __future__ import annotations

import asyncio
import json
import ssl
from typing import Any

import aiohttp
from aiohttp import web
from motor.v1 import coordinator_pb2

from services.common import exposure, log
from services.common.config import Config, ConfigError, CoordinatorConfig, read_key_file
from services.common.enums import ROLE_NAMES
from services.common.server import MotorServer
from services.coordinator.health import Breaker
from services.coordinator.http_app import ApiKeys, InferenceApp
from services.coordinator.metrics import Metrics
from services.coordinator.pd import Router
from services.coordinator.policies import make_policy
from services.coordinator.precision.reporter import AlarmReporter, service_ip
from services.coordinator.precision.sampler import GroupGone, PrecisionMonitor
from services.coordinator.routes import RoutingView, build_view, netloc
from services.coordinator.service import CoordinatorService
from services.coordinator.table import RoutingTable
from services.coordinator.upstream import CONNECT_S, Engines

HTTP_SHUTDOWN_S = 3.0


def _api_keys(path: str) -> ApiKeys | None:
    if not path:
        return None
    try:
        return ApiKeys.from_file(path)
    except ConfigError as err:
        raise ConfigError([f"coordinator.api_keys_file: {e}" for e in err.errors]) from None
    except (UnicodeDecodeError, ValueError) as exc:
        raise ConfigError(f"coordinator.api_keys_file: cannot use {path}: {exc}") from None


def _controller_key(cfg: CoordinatorConfig) -> str | None:
    """The key precision alarms are reported with; only read when detection is on."""
    if not (cfg.precision_check_enabled and cfg.controller_key_file):
        return None
    try:
        return read_key_file(cfg.controller_key_file)
    except ConfigError as err:
        raise ConfigError([f"coordinator.controller_key_file: {e}" for e in err.errors]) from None


def _https(cfg: CoordinatorConfig) -> ssl.SSLContext | None:
    """The inference port's TLS: the same certificate and key as the gRPC port.

    Client certificates are never asked for, even with ``tls_ca_file``: OpenAI SDK clients and
    load-balancer probes do not carry them. The API is guarded by ``api_keys_file`` instead."""
    if not (cfg.tls_cert_file and cfg.tls_key_file):
        return None
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        ctx.load_cert_chain(cfg.tls_cert_file, cfg.tls_key_file)
    except OSError as exc:  # ssl.SSLError included: not PEM, or a key that does not match
        files = f"{cfg.tls_cert_file}, {cfg.tls_key_file}"
        raise ConfigError(f"{files}: cannot load TLS certificate and key: {exc.strerror or exc}") from None
    return ctx


class Coordinator:
    def __init__(self, cfg: CoordinatorConfig) -> None:
        self.cfg = cfg
        self.table = RoutingTable()
        self.view = RoutingView()
        self.metrics = Metrics()
        # Files are read here, not in start(): a bad one must stop the process before any port binds.
        self._keys = _api_keys(cfg.api_keys_file)
        self._controller_key = _controller_key(cfg)
        self._ready_lock = asyncio.Lock()
        self.service = CoordinatorService(self.table, self._on_change, self._dismiss_precision)
        self.server = MotorServer(
            "coordinator",
            cfg,
            [(coordinator_pb2.DESCRIPTOR.services_by_name["Coordinator"], self.service)],
            port=cfg.port,
            readiness_gated=True,
        )
        self._ssl = _https(cfg)
        self.breaker = Breaker(lambda: self.view)
        self._runner: web.AppRunner | None = None
        self.http_address = ""
        self._engines: Engines | None = None
        self._router: Router | None = None
        self._http_stop: asyncio.Task[None] | None = None
        self.inference: InferenceApp | None = None
        # Precision detection (coordinator.precision_check_enabled); None while it is off.
        self.precision: PrecisionMonitor | None = None
        self._alarms: AlarmReporter | None = None

    @property
    def grpc_address(self) -> str:
        return self.server.address

    async def start(self) -> None:
        """Bind both servers, then log the one ``event=listening`` line. HTTP binds first: its
        port is the one most likely to be taken, and failing before gRPC started stops at once."""
        # The client session is created here, inside the running loop.
        self._engines = Engines(self.metrics, self.breaker.refused)
        self._router = Router(
            self._engines, make_policy(self.cfg.prefill_policy), make_policy(self.cfg.decode_policy)
        )
        self.inference = InferenceApp(lambda: self.view, self._router, self.metrics, self._keys)
        app = self.inference.make_app()
        # handler_cancellation: a client that goes away cancels its handler, which closes the
        # upstream legs: both legs stop with the client.
        runner = web.AppRunner(
            app, access_log=None, handler_cancellation=True, shutdown_timeout=HTTP_SHUTDOWN_S
        )
        await runner.setup()
        self._runner = runner
        host = self.cfg.host
        site = web.TCPSite(runner, host, self.cfg.http_port, backlog=2048, ssl_context=self._ssl)
        try:
            await site.start()
        except OSError as exc:
            raise OSError(
                f"cannot bind HTTP {netloc(host, self.cfg.http_port)}: address in use or not available"
            ) from exc
        port = runner.addresses[0][1] if runner.addresses else self.cfg.http_port
        self.http_address = netloc(host, int(port))
        exposure.check_inference(self.cfg, self.http_address)
        await self.server.start()
        self.breaker.start(self._engines.session)
        if self.cfg.precision_check_enabled:
            await self._start_precision()
        self.server.on_stop(self._begin_http_stop)
        # http= stays host:port whatever the scheme, so the line parses the same with TLS on.
        tls = {"https": "true"} if self._ssl is not None else {}
        self.server.announce(http=self.http_address, **tls)

    async def _start_precision(self) -> None:
        cfg = self.cfg
        m = self.metrics
        self._alarms = AlarmReporter(cfg, self._controller_key, m.precision_reports_pending.set)
        self._alarms.start()
        ip = await service_ip(cfg.host, cfg.controller)
        self.precision = PrecisionMonitor(cfg, self._exchange, self._alarms, m, ip)
        assert self._router is not None
        self._router.completed = self.precision.record
        log.event(
            "precision_check_enabled",
            interval_s=cfg.precision_interval_s,
            issue_threshold=cfg.precision_issue_threshold,
            clear_threshold=cfg.precision_clear_threshold,
            controller=cfg.controller,
            service_ip=ip,
        )

    async def _exchange(
        self, p: int, d: int, path: str, body: dict[str, Any], timeout_s: float
    ) -> tuple[int, bytes]:
        """Precision samples and probes: one request to the pair (p, d) of the current view."""
        by_id = {t.id: t for t in self.view.targets}
        dt = by_id.get(d)
        pt = by_id.get(p) if p else None
        if dt is None or (p and pt is None) or self._router is None:
            raise GroupGone(f"group p={p} d={d} is not routable")
        deadline = aiohttp.ClientTimeout(total=timeout_s, sock_connect=min(CONNECT_S, timeout_s))
        raw = json.dumps(body, separators=(",", ":"), ensure_ascii=False).encode()
        answer = await self._router.exchange(path, raw, body, pt, dt, deadline)
        return answer.status, answer.body

    def _dismiss_precision(self, p: int, d: int) -> bool:
        return self.precision.dismiss(p, d) if self.precision is not None else False

    async def _on_change(self) -> None:
        """Swap in the routing view of the accepted table, then publish readiness."""
        state = self.table.state
        view = build_view(state, self.view.targets)
        self.view = view
        if self.precision is not None:
            self.precision.retain(set(state.instances))
        m = self.metrics
        m.revision.set(state.revision)
        m.routable.set(1 if view.routable else 0)
        for role, name in ROLE_NAMES.items():
            m.instances.labels(name).set(sum(1 for t in view.targets if t.role == role))
        async with self._ready_lock:
            # Read the newest view under the lock: concurrent changes publish in order.
            await self.server.set_ready(self.view.routable)

    def _begin_http_stop(self) -> None:
        # Runs after the gRPC drain; the HTTP server drains at the same time as gRPC's grace.
        if self._runner is not None:
            self._http_stop = asyncio.create_task(self._runner.cleanup())

    async def stop(self) -> None:
        if self.inference is not None:
            self.inference.draining = True
        await self.server.stop()
        if self._http_stop is not None:
            await self._http_stop
        elif self._runner is not None:
            await self._runner.cleanup()
        await self.breaker.stop()
        if self.precision is not None:
            await self.precision.close()
        if self._alarms is not None:
            await self._alarms.close()
        for target in self.view.targets:
            target.retire()
        if self._router is not None:
            await self._router.close()
        if self._engines is not None:
            await self._engines.close()


async def serve(cfg: Config, stop: asyncio.Event) -> int:
    c = cfg.coordinator
    if c.workers > 1:
        log.warn(
            "workers_not_supported",
            workers=c.workers,
            detail="multi-process inference workers come later; serving from one process",
        )
    coordinator = Coordinator(c)
    try:
        await coordinator.start()
        await stop.wait()
    finally:
        await coordinator.stop()
    return 0
