"""One Coordinator: the management gRPC server and its routing table, plus the inference HTTP
server, in this process (``workers = 1``) or in worker processes that get every table revision
over ZeroMQ (``workers > 1``; docs/architecture.md, "Inference workers")."""

from __future__ import annotations

import asyncio
import json
import math
from typing import Any

from motor_mesh.common import errors, exposure, log, sighup
from motor_mesh.common.config import Config, ConfigError, CoordinatorConfig, read_key_file
from motor_mesh.common.enums import ROLE_NAMES
from motor_mesh.common.server import MotorServer
from motor_mesh.coordinator.congestion import CongestionMonitor
from motor_mesh.coordinator.engine_metrics.collector import Collector
from motor_mesh.coordinator.engine_metrics.snapshot import SnapshotFile
from motor_mesh.coordinator.engine_metrics.source import EngineMetrics
from motor_mesh.coordinator.health import Breaker
from motor_mesh.coordinator.inference import InferenceServer, https, make_router, tenants
from motor_mesh.coordinator.kv import routing as kv_routing
from motor_mesh.coordinator.kv.feed import KvFeed
from motor_mesh.coordinator.kv.shared import SharedWriter
from motor_mesh.coordinator.metrics import Metrics, use_own_process
from motor_mesh.coordinator.pd import Router
from motor_mesh.coordinator.precision.reporter import AlarmReporter, service_ip
from motor_mesh.coordinator.precision.sampler import GroupGone, PrecisionMonitor
from motor_mesh.coordinator.routes import RoutingView, build_view, netloc
from motor_mesh.coordinator.service import CoordinatorService
from motor_mesh.coordinator.settings import changed_keys, check_tenants, pushed
from motor_mesh.coordinator.table import RoutingTable, TableState
from motor_mesh.coordinator.workers.pool import WorkerPool, WorkersUnavailable, worker_count
from motor_mesh.gen.motor.v1 import coordinator_pb2


def _controller_key(cfg: CoordinatorConfig) -> str | None:
    """The key alarms are reported with (precision, congestion: the latter is always on)."""
    if not cfg.controller_key_file:
        return None
    try:
        return read_key_file(cfg.controller_key_file)
    except ConfigError as err:
        raise ConfigError([f"coordinator.controller_key_file: {e}" for e in err.errors]) from None


class Coordinator:
    def __init__(self, cfg: CoordinatorConfig) -> None:
        self.cfg = cfg
        # Settings that change while running (settings.py): the file's section (SIGHUP replaces
        # it), the Controller's settings revision in force (0: the file's values) and replicas.
        self.own_cfg = cfg
        self.settings_revision = 0
        self.replicas = 1
        self._settings_lock = asyncio.Lock()
        self.workers = worker_count(cfg.workers)
        self.table = RoutingTable()
        self.view = RoutingView()
        # Files are read here, not in start(): a bad one must stop the process before any port binds.
        self._tenants = tenants(cfg)
        self._ssl = https(cfg)
        self._controller_key = _controller_key(cfg)
        self.pool: WorkerPool | None = None
        if self.workers > 1:
            # Before Metrics() and before any gRPC object: the workers are fork+exec'd children.
            self.pool = WorkerPool(cfg, self.workers)
        else:
            use_own_process()
        self.metrics = Metrics()
        # The engines' own metrics: scraped here, once, whoever serves HTTP.
        self.collector: Collector | None = None
        self.engine_metrics: EngineMetrics | None = None
        if cfg.engine_metrics_interval_s > 0:
            self.collector = Collector(
                lambda: self.table.state,
                cfg.engine_metrics_interval_s,
                cfg.engine_metrics_stale_s,
                SnapshotFile(self.pool.dir) if self.pool is not None else None,
                self.metrics.engine_metrics_round,
            )
            collector = self.collector
            self.engine_metrics = EngineMetrics(
                lambda: collector.snapshot, lambda: self.table.state, blocking_read=False
            )
        self.service = CoordinatorService(
            self.table,
            self._route_by,
            self._dismiss_precision,
            self.pool,
            legs=self._legs,
            drain_grace_s=cfg.drain_grace_s,
            engine_metrics=self.engine_metrics,
            own_metrics=self.metrics.render,
            apply_settings=self._apply_pushed,
            settings_state=lambda: (self.settings_revision, self.replicas),
        )
        self.server = MotorServer(
            "coordinator",
            cfg,
            [(coordinator_pb2.DESCRIPTOR.services_by_name["Coordinator"], self.service)],
            port=cfg.port,
            readiness_gated=True,
        )
        self.inference: InferenceServer | None = None
        self.http_address = ""
        self._router: Router | None = None  # precision exchanges when workers serve HTTP
        self._breaker: Breaker | None = None
        self._http_stop: asyncio.Task[None] | None = None
        # Precision detection (coordinator.precision_check_enabled); None while it is off.
        self.precision: PrecisionMonitor | None = None
        self._alarms: AlarmReporter | None = None
        self.congestion: CongestionMonitor | None = None
        # With inference workers, the KV index is fed here, once, and shared with them.
        self._kv_feed: KvFeed | None = None

    @property
    def grpc_address(self) -> str:
        return self.server.address

    async def start(self) -> None:
        """Bind both servers, then log the one ``event=listening`` line. HTTP binds first: its
        port is the one most likely to be taken, and failing before gRPC started stops at once."""
        if self.pool is None:
            self.inference = InferenceServer(
                self.cfg,
                lambda: self.view,
                self.metrics,
                self._tenants,
                self._ssl,
                engine_metrics=self.engine_metrics,
            )
            self.http_address = await self.inference.start()
            self._router = self.inference.router
        else:
            if kv_routing.wanted(self.cfg):
                writer = SharedWriter(self.pool.dir, self.cfg.kv_index_max_blocks)
                # The workers' legs in flight say which engines served while their events were
                # silent (kv_events_stale_s).
                self._kv_feed = KvFeed(
                    self.cfg,
                    lambda: self.view,
                    self.metrics.kv,
                    kv_routing.roles(self.cfg),
                    writer,
                    legs=lambda: self._legs(0)[0],
                )
                await self._kv_feed.start()
                self.metrics.start_flushing()  # the feed's counters reach the workers' scrapes
            self.http_address = await self.pool.start(self.table.state)
            self._breaker = Breaker(lambda: self.view)
            self._router = make_router(self.cfg, self.metrics, self._breaker, None)
            self._breaker.start()
        exposure.check_inference(self.cfg, self.http_address)
        await self.server.start()
        self._start_congestion()
        if self.cfg.precision_check_enabled:
            await self._start_precision()
        if self.collector is not None:
            self.collector.start()
        self.server.on_stop(self._begin_http_stop)
        # http= stays host:port whatever the scheme, so the line parses the same with TLS on.
        tls = {"https": "true"} if self._ssl is not None else {}
        extra = {"workers": str(self.workers)} if self.pool is not None else {}
        self.server.announce(http=self.http_address, **tls, **extra)
        sighup.on_reload(self._reload_file)

    async def apply_settings(self, cfg: CoordinatorConfig, revision: int, replicas: int) -> None:
        """Run by ``cfg`` from now on, its rate limits divided by ``replicas``: the Controller's
        settings (ApplySettings) or the file's again (SIGHUP). All or nothing: a tenants file
        that cannot be used raises FAILED_PRECONDITION and the settings in force stay."""
        async with self._settings_lock:  # one at a time, in the order they came
            directory = await check_tenants(cfg)
            if self.inference is not None:
                self.inference.reconfigure(cfg, replicas, directory)
            elif self.pool is not None:
                await self.pool.reconfigure(cfg, replicas)  # each worker reads the files itself
            if cfg.log_level != self.cfg.log_level:
                log.set_level(cfg.log_level)
            changed = changed_keys(self.cfg, cfg)
            self.cfg, self.settings_revision, self.replicas = cfg, revision, replicas
            self.service.drain_grace_s = cfg.drain_grace_s
        shown = ",".join(changed) or "none"
        log.event("settings_applied", revision=revision, replicas=replicas, changed=shown)

    async def _apply_pushed(self, revision: int, settings_json: str, replicas: int) -> None:
        """ApplySettings: the Controller's values over this Coordinator's file's ("" keeps the
        file's); raises INVALID_ARGUMENT for values their checks refuse."""
        await self.apply_settings(pushed(self.own_cfg, settings_json), revision, replicas)

    async def _reload_file(self, new: Config) -> None:
        """SIGHUP: this Coordinator's file again (its reloadable keys; sighup.py refused any
        other change), until the Controller's next push brings back its values."""
        await self.apply_settings(new.coordinator, 0, self.replicas)
        self.own_cfg = new.coordinator

    async def _start_precision(self) -> None:
        cfg = self.cfg
        m = self.metrics
        self._alarms = AlarmReporter(cfg, self._controller_key, m.precision_reports_pending.set)
        self._alarms.start()
        ip = await service_ip(cfg.host, cfg.controller)
        self.precision = PrecisionMonitor(cfg, self._exchange, self._alarms, m, ip)
        if self.inference is not None:
            self.inference.set_completed(self.precision.record)
        elif self.pool is not None:
            self.pool.on_sample(self.precision.record)
        log.event(
            "precision_check_enabled",
            interval_s=cfg.precision_interval_s,
            issue_threshold=cfg.precision_issue_threshold,
            clear_threshold=cfg.precision_clear_threshold,
            controller=cfg.controller,
            service_ip=ip,
        )

    def _start_congestion(self) -> None:
        cfg = self.cfg
        reporter = AlarmReporter(cfg, self._controller_key, kind="congestion")

        async def address() -> str:
            return netloc(await service_ip(cfg.host, cfg.controller), self.server.port)

        # self.cfg read at every sample: a settings reload may replace it.
        self.congestion = CongestionMonitor(
            lambda: self.cfg, self._admission, reporter, self.metrics, address
        )
        self.congestion.start()

    def _admission(self) -> tuple[int, int]:
        """Requests running and queued in every process serving HTTP."""
        if self.pool is not None:
            return self.pool.hub.admission()
        if self.inference is None:
            return 0, 0
        admission = self.inference.admission  # each time: it may be replaced on a reload
        return admission.active, admission.queued

    async def _exchange(
        self, p: int, d: int, path: str, body: dict[str, Any], timeout_s: float
    ) -> tuple[int, bytes]:
        """Precision samples and probes: one request to the pair (p, d) of the current view."""
        by_id = {t.id: t for t in self.view.targets}
        dt = by_id.get(d)
        pt = by_id.get(p) if p else None
        if dt is None or (p and pt is None) or self._router is None:
            raise GroupGone(f"group p={p} d={d} is not routable")
        raw = json.dumps(body, separators=(",", ":"), ensure_ascii=False).encode()
        answer = await self._router.exchange(path, raw, body, pt, dt, timeout_s)
        return answer.status, answer.body

    def _legs(self, since: int) -> tuple[dict[int, int], int]:
        """Legs in flight per instance, this process's own and, with workers, theirs; and how
        many workers have not reported since they routed by revision ``since``."""
        legs = self.view.legs()
        if self.pool is None:
            return legs, 0
        theirs, behind = self.pool.hub.legs(since)
        for iid, n in theirs.items():
            legs[iid] = legs.get(iid, 0) + n
        return legs, behind

    def _dismiss_precision(self, p: int, d: int) -> bool:
        return self.precision.dismiss(p, d) if self.precision is not None else False

    async def _route_by(self, state: TableState | None) -> None:
        """Before a management write changes the table: make every inference worker route by
        ``state``, then publish readiness. None (the write changed nothing) makes sure the
        workers hold the table as it is. UNAVAILABLE when a worker did not take it: the table
        must then stay as it is, so the workers are put back on it."""
        if self.pool is not None:
            await self._publish(state)
        if state is not None and state.revision != self.view.revision:
            self.view = build_view(state, self.view.targets, self.view.retired)
            if self.precision is not None:
                self.precision.retain(set(state.instances))
            self._set_gauges(state)
        # The service calls this for one write at a time, so readiness follows them in order.
        await self.server.set_ready(self.view.routable)

    async def _publish(self, state: TableState | None) -> None:
        assert self.pool is not None
        # After a failed write the workers hold the table under a newer revision than its own
        # (see below): that is the one an unchanged write waits for.
        wanted = state if state is not None else self.pool.hub.state
        try:
            await self.pool.publish(wanted)
        except WorkersUnavailable as exc:
            log.warn("workers_behind", revision=wanted.revision, error=str(exc))
            if state is not None:
                # The workers that took ``state`` would route by a table ListInstances never
                # shows: a newer revision of the table puts them back.
                await self.pool.announce(self.table.reissue(state.revision))
            raise errors.unavailable(f"{exc}; the table was not changed, retry the request") from None

    def _set_gauges(self, state: TableState) -> None:
        view, m = self.view, self.metrics
        m.revision.set(state.revision)
        m.routable.set(1 if view.routable else 0)
        for role, name in ROLE_NAMES.items():
            m.instances.labels(name).set(sum(1 for t in view.targets if t.role == role))
        available, unavailable, paused = state.groups()
        for label, group in (("available", available), ("unavailable", unavailable), ("paused", paused)):
            for role, name in ROLE_NAMES.items():
                m.table_instances.labels(name, label).set(sum(1 for i in group if i.role == role))

    def _begin_http_stop(self) -> None:
        # Runs after the gRPC drain; the HTTP server drains at the same time as gRPC's grace.
        if self.inference is not None:
            self._http_stop = asyncio.create_task(self.inference.stop())
        elif self.pool is not None:
            self._http_stop = asyncio.create_task(self.pool.stop())

    async def stop(self) -> None:
        sighup.on_reload(None)
        if self.inference is not None:
            self.inference.app.draining = True
        await self.server.stop()
        if self._http_stop is not None:
            await self._http_stop
        elif self.inference is not None:
            await self.inference.stop()
        elif self.pool is not None:
            await self.pool.stop()
        if self.collector is not None:
            await self.collector.stop()
        if self.congestion is not None:
            await self.congestion.close()
        if self.precision is not None:
            await self.precision.close()
        if self._alarms is not None:
            await self._alarms.close()
        for target in self.view.targets:
            target.retire(math.inf)  # stopping: nothing is moved
        if self._breaker is not None:
            await self._breaker.stop()
            assert self._router is not None
            await self._router.close()
            self._router.engines.close()
        if self._kv_feed is not None:
            await self._kv_feed.stop()
            await self.metrics.stop_flushing()


async def serve(cfg: Config, stop: asyncio.Event) -> int:
    coordinator = Coordinator(cfg.coordinator)
    try:
        await coordinator.start()
        await stop.wait()
    finally:
        await coordinator.stop()
    return 0
