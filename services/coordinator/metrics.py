"""Prometheus metrics of the Coordinator.

With one process they live in a per-process registry. With inference workers
(``coordinator.workers > 1``) every process of the Coordinator writes its values to files in one
shared directory (prometheus_client's multiprocess mode) and whichever worker answers
``/metrics`` renders the sum: counters and histograms add up across workers, gauges are
summed or the maximum of the live processes as each one's meaning asks.
"""

from __future__ import annotations

import asyncio
import os
import time
from typing import TYPE_CHECKING, Final

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
    multiprocess,
    values,
)

from motor_mesh.common.tasks import supervise
from motor_mesh.coordinator.kv.metrics import KvMetrics
from motor_mesh.coordinator.tally import CounterTally, HistogramTally, Tallies

if TYPE_CHECKING:
    from motor_mesh.coordinator.engine_metrics.snapshot import Snapshot

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"
FLUSH_S = 1.0

LATENCY_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    300.0,
)

# Time to first token: fine from 50 ms to 5 s, where TTFT SLAs (p90) sit and the planner reads
# them (interpolating inside a wide bucket would read 1.1 s as 2 s).
TTFT_BUCKETS = (
    0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.6, 0.75, 0.9, 1.0,
    1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 4.0, 5.0, 7.5, 10.0, 30.0, 60.0, 300.0,
)  # fmt: skip

# Inter-token gaps: 1 ms to 10 s, fine between 5 ms and 500 ms where decode SLAs (p90) sit: the
# planner reads a p90 interpolated inside a bucket, so a wide one (50 to 75 ms) would read 52 as 72.
ITL_BUCKETS = (
    0.001, 0.0025, 0.005, 0.0075, 0.01, 0.0125, 0.015, 0.0175, 0.02, 0.025, 0.03, 0.035, 0.04,
    0.045, 0.05, 0.06, 0.07, 0.08, 0.09, 0.1, 0.125, 0.15, 0.175, 0.2, 0.25, 0.3, 0.4, 0.5,
    0.75, 1.0, 2.5, 5.0, 10.0,
)  # fmt: skip

GAP_BUCKETS = (0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0, 30.0)
MIGRATION_REASONS = ("disconnect", "closed", "timeout", "status", "engine_error", "drain", "left")
MIGRATION_OUTCOMES = ("continued", "completed", "refused", "exhausted", "unroutable")


def use_shared_dir(path: str) -> None:
    """Write every metric created from now on to files in ``path`` (call before Metrics())."""
    os.environ[MULTIPROC_ENV] = path
    values.ValueClass = values.MultiProcessValue()


def use_own_process() -> None:
    """Keep every metric in this process's memory, whatever the environment says: a
    PROMETHEUS_MULTIPROC_DIR inherited from a parent (another Coordinator's workers, a
    container's defaults) names a directory this process does not own and that may be gone."""
    os.environ.pop(MULTIPROC_ENV, None)
    values.ValueClass = values.MutexValue


def forget_process(pid: int) -> None:
    """A worker died: its live gauges (in flight, queue) stop counting; its counters stay."""
    path = os.environ.get(MULTIPROC_ENV)
    if path:
        multiprocess.mark_process_dead(pid, path)


class Metrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry(auto_describe=True)
        self._shared = os.environ.get(MULTIPROC_ENV)
        self._requests = Counter(
            "motor_coordinator_requests", "Inference requests answered, by route and HTTP status.",
            ["route", "status"], registry=r,
        )  # fmt: skip
        self.in_flight = Gauge(
            "motor_coordinator_requests_in_flight", "Inference requests being served.", registry=r,
            multiprocess_mode="livesum",
        )  # fmt: skip
        self._queued = Gauge(
            "motor_coordinator_queue_depth",
            "Completion requests waiting for a slot (max_concurrent_requests reached).",
            registry=r,
            multiprocess_mode="livesum",
        )
        self._refused = Counter(
            "motor_coordinator_admission_refused",
            "Requests refused at admission, by the limit that refused them (requests_per_minute, "
            "tokens_per_minute, rate_limit.max_requests, rate_limit.max_tokens_per_window, "
            "too_many_requests: queue full or taken by a higher class, queue_timeout) and the "
            "tenant's priority class.",
            ["reason", "priority"],
            registry=r,
        )
        self._ttft = Histogram(
            "motor_coordinator_time_to_first_byte_seconds",
            "Time from a completion request to the first byte of its answer (for a stream, the "
            "first event: time to first token).",
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self._itl = Histogram(
            "motor_coordinator_inter_token_seconds",
            "Time between two consecutive chunks of a streamed answer as the client receives them "
            "(each chunk normally one token): inter-token latency.",
            buckets=ITL_BUCKETS,
            registry=r,
        )
        self._phase = Histogram(
            "motor_coordinator_phase_duration_seconds",
            "Duration of one leg: prefill (the vLLM hand-off's prefill request), decode (the leg "
            "that answers the client, to its last byte), whole (union / prefill-only).",
            ["phase"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self._retries = Counter(
            "motor_coordinator_retries",
            "Legs retried on another instance (or pair) after the first could not be reached, by role.",
            ["role"],
            registry=r,
        )
        self.endpoints_down = Gauge(
            "motor_coordinator_endpoints_out_of_rotation",
            "Engine endpoints the circuit breaker took out of rotation (refused connections), "
            "the most any worker has.",
            registry=r,
            multiprocess_mode="livemax",
        )
        self._latency = Histogram(
            "motor_coordinator_request_duration_seconds",
            "Time from request to the end of the response, by route.",
            ["route"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self._upstream_errors = Counter(
            "motor_coordinator_upstream_errors",
            "Failed upstream legs, by role and kind (connect, disconnect, timeout, status).",
            ["role", "kind"],
            registry=r,
        )
        self._legs = Counter(
            "motor_coordinator_routed",
            "Requests routed, by mode (vllm_pd, decode_only: a short prompt without a prefill leg, "
            "sglang_pd, union, prefill_only).",
            ["mode"], registry=r,
        )  # fmt: skip
        self._migrations = Counter(
            "motor_coordinator_migrations",
            "Answering legs that broke after the request was routed, by why (disconnect, closed, "
            "timeout, status, engine_error, drain, left) and what followed: continued (on another "
            "instance), completed (the output was whole already), refused (the request cannot "
            "continue; the log says why), exhausted (migration_limit reached), unroutable.",
            ["reason", "outcome"],
            registry=r,
        )
        self._gap = Histogram(
            "motor_coordinator_migration_gap_seconds",
            "The pause a streaming client saw across a continuation: from the last event before "
            "the break to the first event after it.",
            buckets=GAP_BUCKETS,
            registry=r,
        )
        # Set by the process that owns the table (the management process).
        mode: Final = "livemax"
        self.revision = Gauge(
            "motor_coordinator_table_revision", "Instance table revision.", registry=r, multiprocess_mode=mode
        )
        self.routable = Gauge(
            "motor_coordinator_routable",
            "1 when a request can be routed.",
            registry=r,
            multiprocess_mode=mode,
        )
        self.instances = Gauge(
            "motor_coordinator_routable_instances", "Routable instances by role.", ["role"], registry=r,
            multiprocess_mode=mode,
        )  # fmt: skip
        self.table_instances = Gauge(
            "motor_coordinator_instances",
            "Instances in the table by role and state (available, unavailable, paused).",
            ["role", "state"],
            registry=r,
            multiprocess_mode=mode,
        )
        self._precision_samples = Counter(
            "motor_coordinator_precision_samples",
            "Precision samples (shadow requests) by verdict: normal, anomalous, or error (no verdict).",
            ["result"],
            registry=r,
        )
        self._precision_probes = Counter(
            "motor_coordinator_precision_probes",
            "Probe questions asked of suspect groups, by outcome (pass, fail, error).",
            ["result"],
            registry=r,
        )
        self.precision_alarms_active = Gauge(
            "motor_coordinator_precision_alarms_active",
            "PD groups with an active precision alarm.",
            registry=r,
            multiprocess_mode=mode,
        )
        self.precision_reports_pending = Gauge(
            "motor_coordinator_precision_reports_pending",
            "Precision alarms and clears not yet accepted by the Controller.",
            registry=r,
            multiprocess_mode=mode,
        )
        self.admission_use = Gauge(
            "motor_coordinator_admission_use",
            "Requests running and queued in every inference worker over max_concurrent_requests "
            "plus max_queued_requests (1: full); the congestion alarm 0xFC001005 is raised at 0.85 "
            "held for congestion_raise_s, cleared below 0.75.",
            registry=r,
            multiprocess_mode=mode,
        )
        self.congestion_alarm = Gauge(
            "motor_coordinator_congestion_alarm",
            "1 while this Coordinator's congestion alarm (0xFC001005) is raised.",
            registry=r,
            multiprocess_mode=mode,
        )
        self.engine_endpoints = Gauge(
            "motor_coordinator_engine_metrics_endpoints",
            "Engine endpoints the engine-metrics collector scrapes, by state: fresh (in the "
            "aggregate), stale (failing, values older than engine_metrics_stale_s, left out).",
            ["state"],
            registry=r,
            multiprocess_mode=mode,
        )
        self._scrape_failures = Counter(
            "motor_coordinator_engine_metrics_scrape_failures",
            "Engine /metrics scrapes that failed (no answer within the deadline, refused, not 200, "
            "not an exposition).",
            registry=r,
        )
        # Every result from the start, so a dashboard sees 0 rather than no series.
        for result in ("normal", "anomalous", "error"):
            self._precision_samples.labels(result)
        for result in ("pass", "fail", "error"):
            self._precision_probes.labels(result)
        for reason in MIGRATION_REASONS:
            for outcome in MIGRATION_OUTCOMES:
                self._migrations.labels(reason, outcome)
        for role in ("prefill", "decode", "union"):
            self._retries.labels(role)
            for kind in ("connect", "disconnect", "timeout", "status"):
                self._upstream_errors.labels(role, kind)
        # The request path counts in plain integers (tally.py); flush() publishes them.
        self.tallies = Tallies()
        self.kv = KvMetrics(r, self.tallies)
        self._requests_t: dict[tuple[str, int], CounterTally] = {}
        self._latency_t: dict[str, HistogramTally] = {}
        self._routed_t: dict[str, CounterTally] = {}
        self._refused_t: dict[tuple[str, str], CounterTally] = {}
        self._phase_t: dict[str, HistogramTally] = {}
        self._ttft_t = self.tallies.histogram(lambda: self._ttft, TTFT_BUCKETS)
        self._itl_t = self.tallies.histogram(lambda: self._itl, ITL_BUCKETS)
        self.in_flight_now = 0
        self.queued_now = 0
        self._err_children: dict[tuple[str, str], Counter] = {}
        self._retry_children: dict[str, Counter] = {}
        self._flusher: asyncio.Task[None] | None = None

    def observe(self, route: str, status: int, seconds: float) -> None:
        key = (route, status)
        c = self._requests_t.get(key)
        if c is None:
            c = self._requests_t[key] = self.tallies.counter(
                lambda: self._requests.labels(route, str(status))
            )
        c.n += 1
        h = self._latency_t.get(route)
        if h is None:
            h = self._latency_t[route] = self.tallies.histogram(
                lambda: self._latency.labels(route), LATENCY_BUCKETS
            )
        h.observe(seconds)

    def refused(self, reason: str, priority: str) -> None:
        key = (reason, priority)
        c = self._refused_t.get(key)
        if c is None:
            c = self._refused_t[key] = self.tallies.counter(lambda: self._refused.labels(reason, priority))
        c.n += 1

    def upstream_error(self, role: str, kind: str) -> None:
        key = (role, kind)
        c = self._err_children.get(key)
        if c is None:
            c = self._err_children[key] = self._upstream_errors.labels(role, kind)
        c.inc()

    def routed(self, mode: str) -> None:
        c = self._routed_t.get(mode)
        if c is None:
            c = self._routed_t[mode] = self.tallies.counter(lambda: self._legs.labels(mode))
        c.n += 1

    def first_byte(self, seconds: float) -> None:
        self._ttft_t.observe(seconds)

    def inter_token(self, seconds: float) -> None:
        """The gap before a streamed chunk other than the first (once per chunk: the tally only)."""
        self._itl_t.observe(seconds)

    def phase(self, name: str, seconds: float) -> None:
        h = self._phase_t.get(name)
        if h is None:
            h = self._phase_t[name] = self.tallies.histogram(
                lambda: self._phase.labels(name), LATENCY_BUCKETS
            )
        h.observe(seconds)

    def retry(self, role: str) -> None:
        c = self._retry_children.get(role)
        if c is None:
            c = self._retry_children[role] = self._retries.labels(role)
        c.inc()

    def migration(self, reason: str, outcome: str) -> None:
        self._migrations.labels(reason, outcome).inc()

    def migration_gap(self, seconds: float) -> None:
        self._gap.observe(seconds)

    def queued(self, step: int) -> None:
        self.queued_now += step

    def flush(self) -> None:
        """Publish what the request path counted since the last flush."""
        self.tallies.flush()
        self.in_flight.set(self.in_flight_now)
        self._queued.set(self.queued_now)

    def start_flushing(self, every_s: float = FLUSH_S) -> None:
        """Flush every ``every_s`` (other workers' scrapes read the shared files meanwhile)."""

        async def loop() -> None:
            while True:
                await asyncio.sleep(every_s)
                self.flush()

        self._flusher = asyncio.create_task(supervise("metrics_flush", loop))

    async def stop_flushing(self) -> None:
        if self._flusher is not None:
            self._flusher.cancel()
            await asyncio.gather(self._flusher, return_exceptions=True)
        self.flush()

    def precision_sample(self, result: str) -> None:
        self._precision_samples.labels(result).inc()

    def precision_probe(self, result: str) -> None:
        self._precision_probes.labels(result).inc()

    def engine_metrics_round(self, snap: Snapshot, failed: int) -> None:
        """After each round of the engine-metrics collector (the management process)."""
        now = time.time()
        fresh = sum(1 for e in snap.engines if e.fresh(now, snap.stale_s))
        self.engine_endpoints.labels("fresh").set(fresh)
        self.engine_endpoints.labels("stale").set(len(snap.engines) - fresh)
        if failed:
            self._scrape_failures.inc(failed)

    async def render(self) -> bytes:
        self.flush()
        if self._shared is None:
            return generate_latest(self.registry)
        # Reading every process's files is disk I/O: off the event loop.
        return await asyncio.to_thread(_render_shared, self._shared)


def _render_shared(path: str) -> bytes:
    registry = CollectorRegistry()
    multiprocess.MultiProcessCollector(registry, path)
    return generate_latest(registry)
