"""One Coordinator process: the management gRPC server and the inference HTTP server sharing
one routing table, one routing view and one upstream connection pool."""

from __future__ import annotations

import asyncio

from aiohttp import web
from motor.v1 import coordinator_pb2

from services.common import log
from services.common.config import Config, ConfigError, CoordinatorConfig
from services.common.enums import ROLE_NAMES
from services.common.server import MotorServer
from services.coordinator.health import Breaker
from services.coordinator.http_app import ApiKeys, InferenceApp
from services.coordinator.metrics import Metrics
from services.coordinator.pd import Router
from services.coordinator.policies import make_policy
from services.coordinator.routes import RoutingView, build_view, netloc
from services.coordinator.service import CoordinatorService
from services.coordinator.table import RoutingTable
from services.coordinator.upstream import Engines

HTTP_SHUTDOWN_S = 3.0


def _api_keys(path: str) -> ApiKeys | None:
    if not path:
        return None
    try:
        return ApiKeys.from_file(path)
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise ConfigError(f"coordinator.api_keys_file: cannot use {path}: {reason}") from None


class Coordinator:
    def __init__(self, cfg: CoordinatorConfig) -> None:
        self.cfg = cfg
        self.table = RoutingTable()
        self.view = RoutingView()
        self.metrics = Metrics()
        self._keys = _api_keys(cfg.api_keys_file)
        self._ready_lock = asyncio.Lock()
        self.service = CoordinatorService(self.table, self._on_change)
        self.server = MotorServer(
            "coordinator",
            cfg,
            [(coordinator_pb2.DESCRIPTOR.services_by_name["Coordinator"], self.service)],
            port=cfg.port,
            readiness_gated=True,
        )
        self.breaker = Breaker(lambda: self.view)
        self._runner: web.AppRunner | None = None
        self.http_address = ""
        self._engines: Engines | None = None
        self._router: Router | None = None
        self._http_stop: asyncio.Task[None] | None = None
        self.inference: InferenceApp | None = None

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
        site = web.TCPSite(runner, host, self.cfg.http_port, backlog=2048)
        try:
            await site.start()
        except OSError as exc:
            raise OSError(
                f"cannot bind HTTP {netloc(host, self.cfg.http_port)}: address in use or not available"
            ) from exc
        port = runner.addresses[0][1] if runner.addresses else self.cfg.http_port
        self.http_address = netloc(host, int(port))
        await self.server.start()
        self.breaker.start(self._engines.session)
        self.server.on_stop(self._begin_http_stop)
        self.server.announce(http=self.http_address)

    async def _on_change(self) -> None:
        """Swap in the routing view of the accepted table, then publish readiness."""
        state = self.table.state
        view = build_view(state, self.view.targets)
        self.view = view
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
