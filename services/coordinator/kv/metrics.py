"""Metrics of KV-aware routing, in the Coordinator's registry (see services/coordinator/metrics.py
for how inference workers share it).

The prefix hit ratio per route is ``rate(motor_coordinator_kv_cached_prompt_tokens_total) /
rate(motor_coordinator_kv_prompt_tokens_total)``: the share of prompt tokens the chosen engine
already held, by the index, when the request was routed.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from services.common.enums import ROLE_NAMES
from services.coordinator.tally import CounterTally, Tallies

LAG_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
ROLES = ("prefill", "decode", "union")
REPLAY_OUTCOMES = ("ok", "truncated", "timeout", "none")
RESET_REASONS = ("left", "restart", "gap")


class KvMetrics:
    """Also the subscriptions' ``Stats`` (batch, replay, reset). Part of every Coordinator's
    metrics, kv_aware or not, so dashboards see 0 rather than no series."""

    def __init__(self, r: CollectorRegistry, tallies: Tallies) -> None:
        self._tallies = tallies
        prompt = Counter(
            "motor_coordinator_kv_prompt_tokens",
            "Prompt tokens of requests routed by kv_aware, by role of the instance chosen.",
            ["role"],
            registry=r,
        )
        cached = Counter(
            "motor_coordinator_kv_cached_prompt_tokens",
            "Of those, the tokens the chosen engine held in its KV cache (by its events) when the "
            "request was routed: the prefix hit ratio's numerator.",
            ["role"],
            registry=r,
        )
        self._prompt: dict[str, CounterTally] = {}
        self._cached: dict[str, CounterTally] = {}
        for role in ROLES:
            self._prompt[role] = self._tallies.counter(lambda role=role: prompt.labels(role))  # type: ignore[misc]
            self._cached[role] = self._tallies.counter(lambda role=role: cached.labels(role))  # type: ignore[misc]
        self.index_blocks = Gauge(
            "motor_coordinator_kv_index_blocks",
            "Blocks in the KV index (one per engine endpoint holding it).",
            registry=r,
            multiprocess_mode="livemax",
        )
        self.subscriptions = Gauge(
            "motor_coordinator_kv_subscriptions",
            "Engine endpoints whose KV events this Coordinator subscribes to.",
            registry=r,
            multiprocess_mode="livemax",
        )
        self._lag = Histogram(
            "motor_coordinator_kv_event_lag_seconds",
            "From an event batch's engine timestamp to the index applying it.",
            buckets=LAG_BUCKETS,
            registry=r,
        )
        self._events = Counter(
            "motor_coordinator_kv_events", "KV cache events applied to the index.", registry=r
        )
        self._replays = Counter(
            "motor_coordinator_kv_replays",
            "Replays asked of an engine after a gap in its event sequence, by outcome: ok, "
            "truncated (the engine's buffer no longer had them), timeout, none (no replay port).",
            ["outcome"],
            registry=r,
        )
        self._resets = Counter(
            "motor_coordinator_kv_index_resets",
            "An endpoint's blocks dropped from the index, by reason: left (the table no longer "
            "routes to it), restart (another engine process behind it) or gap (events lost for good).",
            ["reason"],
            registry=r,
        )
        self._lag_t = self._tallies.histogram(lambda: self._lag, LAG_BUCKETS)
        self._events_t = self._tallies.counter(lambda: self._events)
        for outcome in REPLAY_OUTCOMES:
            self._replays.labels(outcome)
        for reason in RESET_REASONS:
            self._resets.labels(reason)

    def tallies(self, role: int) -> tuple[CounterTally, CounterTally]:
        """What a request routed to an instance of ``role`` adds its prompt tokens to, and the
        tokens of them the chosen engine held (kv_aware keeps them per role: its request path
        adds to them directly)."""
        name = ROLE_NAMES.get(role, "union")  # type: ignore[call-overload]
        return self._prompt[name], self._cached[name]

    # -- Stats of the subscriptions -------------------------------------------------------

    def batch(self, lag_s: float, events: int) -> None:
        self._lag_t.observe(max(0.0, lag_s))
        self._events_t.n += events

    def replay(self, outcome: str) -> None:
        self._replays.labels(outcome).inc()

    def reset(self, reason: str) -> None:
        self._resets.labels(reason).inc()
