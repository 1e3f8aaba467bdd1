"""The inference server of one process: HTTP listener, handlers, router, upstream pool,
circuit breaker and admission, reading whatever routing view its owner holds.

The management process runs one with ``workers = 1``; with more, each worker process runs one
on the shared port (``SO_REUSEPORT``: the kernel spreads connections over the workers).
"""

from __future__ import annotations

import asyncio
import gc
import ssl
from collections.abc import Callable
from typing import TYPE_CHECKING

from motor_mesh.common import log, telemetry
from motor_mesh.common.config import ConfigError, CoordinatorConfig
from motor_mesh.common.httpserver import HttpServer
from motor_mesh.coordinator.admission.gate import Gate
from motor_mesh.coordinator.admission.slots import Slots
from motor_mesh.coordinator.admission.tenants import Directory, load_directory
from motor_mesh.coordinator.engine_metrics.source import EngineMetrics
from motor_mesh.coordinator.health import Breaker
from motor_mesh.coordinator.http_app import InferenceApp
from motor_mesh.coordinator.kv import routing as kv_routing
from motor_mesh.coordinator.metrics import Metrics
from motor_mesh.coordinator.migration.budget import StateBudget
from motor_mesh.coordinator.pd import CompletedSink, Migration, Router
from motor_mesh.coordinator.policies import Policy, least_load, make_policy
from motor_mesh.coordinator.routes import RoutingView, netloc
from motor_mesh.coordinator.upstream import Deadlines, Engines

if TYPE_CHECKING:
    from motor_mesh.coordinator.context_budget import ContextBudget
    from motor_mesh.coordinator.tracing import RequestTracer

HTTP_SHUTDOWN_S = 3.0


def tenants(cfg: CoordinatorConfig) -> Directory | None:
    """The tenants and keys of ``tenants_file`` and ``api_keys_file``; None: the API is open.
    Raises ConfigError."""
    return load_directory(cfg.tenants_file, cfg.api_keys_file)


def https(cfg: CoordinatorConfig) -> ssl.SSLContext | None:
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


def deadlines(cfg: CoordinatorConfig) -> Deadlines:
    return Deadlines(cfg.prefill_timeout_s, cfg.decode_first_byte_timeout_s, cfg.decode_idle_timeout_s)


def request_tracer() -> RequestTracer | None:
    """The inference spans' source when tracing is on (docs/tracing.md), else None. Called in
    the process that serves HTTP, so each inference worker sets up its own provider."""
    if not telemetry.enabled():
        return None
    from motor_mesh.coordinator.tracing import RequestTracer

    return RequestTracer(telemetry.hold("coordinator"))


def make_router(
    cfg: CoordinatorConfig,
    metrics: Metrics,
    breaker: Breaker,
    view: Callable[[], RoutingView] | None,
    kv_shared_dir: str | None = None,
    workers: int = 1,
) -> Router:
    """``view``: the routing view a kv_aware policy follows; None for a router that only sends
    pinned requests (the management process's, beside its inference workers).
    ``kv_shared_dir``: where an inference worker reads the management process's KV index.
    ``workers``: how many processes share the Coordinator's continuation state bound."""
    engines = Engines(metrics, breaker.refused, deadlines(cfg))
    kv = None
    if view is not None and kv_routing.wanted(cfg):
        kv = kv_routing.KvRouting(cfg, view, metrics, kv_shared_dir)

    migration = Migration(
        cfg.migration_limit if view is not None else 0,  # pinned requests never continue
        cfg.migration_delay_s,
        StateBudget.share(cfg.max_migration_state_bytes, cfg.max_migration_state_total_bytes, workers),
    )
    prefill, decode = _policy(cfg.prefill_policy, kv), _policy(cfg.decode_policy, kv)
    return Router(engines, prefill, decode, kv, migration, cfg.pd_min_prompt_tokens)


def _policy(name: str, kv: kv_routing.KvRouting | None) -> Policy:
    if name != kv_routing.POLICY:
        return make_policy(name)
    return kv.policy if kv is not None else least_load


class InferenceServer:
    """Must be created inside the running loop. Files (API keys, TLS) are read by the caller
    first, so a bad one stops the process before any port binds."""

    def __init__(
        self,
        cfg: CoordinatorConfig,
        view: Callable[[], RoutingView],
        metrics: Metrics,
        directory: Directory | None,
        ssl_context: ssl.SSLContext | None,
        *,
        workers: int = 1,
        worker: int | None = None,
        kv_shared_dir: str | None = None,
        engine_metrics: EngineMetrics | None = None,
    ) -> None:
        self.cfg = cfg
        self.metrics = metrics
        self._ssl = ssl_context
        self._workers = workers
        self.breaker = Breaker(view, metrics.endpoints_down.set)
        self.router = make_router(cfg, metrics, self.breaker, view, kv_shared_dir, workers)
        self.gate = Gate(cfg, directory, workers, asyncio.get_running_loop().time())
        self.tracer = request_tracer()
        scheme = "https" if ssl_context is not None else "http"
        self.app = InferenceApp(
            cfg, view, self.router, metrics, self.gate, worker, self.tracer, scheme, engine_metrics
        )
        self.http = HttpServer(self.app.handler(), max_body_bytes=cfg.max_body_bytes)
        self.http.on_reject = self.app.rejected
        self.address = ""
        self._view = view
        self._budget: ContextBudget | None = None  # made the first time clamp_max_tokens is on

    @property
    def admission(self) -> Slots:
        """The concurrency slots and their queue (``active``, ``queued``, their limits)."""
        return self.gate.slots

    def reconfigure(self, cfg: CoordinatorConfig, replicas: int, directory: Directory | None) -> None:
        """Settings changed while running (docs/admission.md, docs/configuration-reload.md):
        admission and rate limits (``directory``: the tenants and API keys files as read again,
        off the loop, by the caller), timeouts, continuation, policies and their weights."""
        self.gate.reconfigure(cfg, directory, replicas, asyncio.get_running_loop().time())
        router = self.router
        router.engines.deadlines = deadlines(cfg)
        router.min_prompt_tokens = cfg.pd_min_prompt_tokens
        router.migration = Migration(cfg.migration_limit, cfg.migration_delay_s, router.migration.budget)
        kv = router.kv
        if kv is not None:
            kv.policy.prefix_weight = cfg.kv_prefix_weight
            kv.policy.load_weight = cfg.kv_load_weight
            kv.policy.load_gate = cfg.kv_load_gate
            kv.policy.gate_topn = cfg.kv_affinity_load_gate_topn
        for role, name in (("prefill", cfg.prefill_policy), ("decode", cfg.decode_policy)):
            if name == kv_routing.POLICY and kv is None:
                log.warn("policy_needs_restart", role=role, policy=name, reason="kv_aware was off at start")
        if cfg.prefill_policy != self.cfg.prefill_policy:  # a policy keeps its state (a rotation)
            router.prefill_policy = _policy(cfg.prefill_policy, kv)
        if cfg.decode_policy != self.cfg.decode_policy:
            router.decode_policy = _policy(cfg.decode_policy, kv)
        self.cfg = cfg
        self.clamp(cfg.clamp_max_tokens)

    def set_replicas(self, replicas: int) -> None:
        """How many Coordinators share the deployment's limits (the Controller's count)."""
        self.gate.set_replicas(replicas, asyncio.get_running_loop().time())

    def set_completed(self, sink: CompletedSink | None) -> None:
        self.router.completed = sink

    def clamp(self, on: bool) -> None:
        """``coordinator.clamp_max_tokens`` on or off, at start and on a reload: while on, the
        context budget follows the routing view and fits each request; off, the request path
        does not look at it and its task does not run."""
        budget = self._budget
        if on and budget is None:
            from motor_mesh.coordinator.context_budget import ContextBudget  # loaded only when on

            kv = self.router.kv
            tokenizers = kv.tokenizers if kv is not None else None  # one load per tokenizer
            budget = self._budget = ContextBudget(self.cfg, self._view, self.metrics, tokenizers)
        if budget is None:
            return
        if on:
            budget.start()
            self.app.budget = budget
        else:
            self.app.budget = None
            budget.pause()

    async def start(self) -> str:
        """Bind the HTTP port; returns its ``host:port``."""
        host, port = self.cfg.host, self.cfg.http_port
        try:
            bound = await self.http.listen(host, port, ssl_context=self._ssl, reuse_port=self._workers > 1)
        except OSError as exc:
            raise OSError(f"cannot bind HTTP {netloc(host, port)}: address in use or not available") from exc
        self.address = netloc(host, bound)
        self.breaker.start()
        if self.router.kv is not None:
            await self.router.kv.start()
        self.clamp(self.cfg.clamp_max_tokens)
        self.metrics.start_flushing()
        # Everything alive now (modules, config, the server) lives as long as the process: out
        # of the collector's sight, a full collection walks only what requests allocate, which
        # keeps its pauses off the latency tail.
        gc.collect()
        gc.freeze()
        return self.address

    async def stop(self, grace_s: float = HTTP_SHUTDOWN_S) -> None:
        """Let requests in flight finish (up to ``grace_s``), then close everything."""
        self.app.draining = True
        await self.http.close(grace_s)
        await self.breaker.stop()
        if self.router.kv is not None:
            await self.router.kv.stop()
        if self._budget is not None:
            await self._budget.stop()
        await self.router.close()
        self.router.engines.close()
        await self.metrics.stop_flushing()
        if self.tracer is not None:
            self.tracer = None
            await telemetry.release()  # the last spans leave before the process does
