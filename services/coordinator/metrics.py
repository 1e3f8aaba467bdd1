"""Prometheus metrics of the inference server, in a per-process registry."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

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


class Metrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry(auto_describe=True)
        self._requests = Counter(
            "motor_coordinator_requests", "Inference requests answered, by route and HTTP status.",
            ["route", "status"], registry=r,
        )  # fmt: skip
        self.in_flight = Gauge(
            "motor_coordinator_requests_in_flight", "Inference requests being served.", registry=r
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
            "motor_coordinator_routed", "Requests routed, by mode (vllm_pd, sglang_pd, union, prefill_only).",
            ["mode"], registry=r,
        )  # fmt: skip
        self.revision = Gauge("motor_coordinator_table_revision", "Instance table revision.", registry=r)
        self.routable = Gauge("motor_coordinator_routable", "1 when a request can be routed.", registry=r)
        self.instances = Gauge(
            "motor_coordinator_routable_instances", "Routable instances by role.", ["role"], registry=r
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
        )
        self.precision_reports_pending = Gauge(
            "motor_coordinator_precision_reports_pending",
            "Precision alarms and clears not yet accepted by the Controller.",
            registry=r,
        )
        # Every result from the start, so a dashboard sees 0 rather than no series.
        for result in ("normal", "anomalous", "error"):
            self._precision_samples.labels(result)
        for result in ("pass", "fail", "error"):
            self._precision_probes.labels(result)
        # labels() costs a dict lookup under a lock; cache the children the hot path uses.
        self._req_children: dict[tuple[str, int], Counter] = {}
        self._lat_children: dict[str, Histogram] = {}
        self._err_children: dict[tuple[str, str], Counter] = {}
        self._leg_children: dict[str, Counter] = {}

    def observe(self, route: str, status: int, seconds: float) -> None:
        key = (route, status)
        c = self._req_children.get(key)
        if c is None:
            c = self._req_children[key] = self._requests.labels(route, str(status))
        c.inc()
        h = self._lat_children.get(route)
        if h is None:
            h = self._lat_children[route] = self._latency.labels(route)
        h.observe(seconds)

    def upstream_error(self, role: str, kind: str) -> None:
        key = (role, kind)
        c = self._err_children.get(key)
        if c is None:
            c = self._err_children[key] = self._upstream_errors.labels(role, kind)
        c.inc()

    def routed(self, mode: str) -> None:
        c = self._leg_children.get(mode)
        if c is None:
            c = self._leg_children[mode] = self._legs.labels(mode)
        c.inc()

    def precision_sample(self, result: str) -> None:
        self._precision_samples.labels(result).inc()

    def precision_probe(self, result: str) -> None:
        self._precision_probes.labels(result).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
