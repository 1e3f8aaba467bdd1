"""Metrics of KV-aware routing, in the Coordinator's registry (see services/coordinator/metrics.py
for how inference workers share it).

The prefix hit ratio per route is ``rate(motor_coordinator_kv_cached_prompt_tokens_total) /
rate(motor_coordinator_kv_prompt_tokens_total)``: the share of prompt tokens the chosen engine
already held, by the index, when the request was routed.
"""

from __future__ import annotations

from array import array

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from motor_mesh.common.enums import ROLE_NAMES
from motor_mesh.coordinator.tally import Tallies

LAG_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
ROLES = ("prefill", "decode", "union")
REPLAY_OUTCOMES = ("ok", "truncated", "timeout", "none")
RESET_REASONS = ("left", "restart", "gap", "stale")


class PromptTally:
    """The prompt tokens of the requests kv_aware routed to one role's instances, and of them the
    tokens the chosen engine held, as two 64-bit integers the C request path adds to in place
    (as :mod:`motor_mesh.coordinator.tally`'s tallies, flushed into the counters)."""

    __slots__ = ("_cached", "_prompt", "sums")

    def __init__(self, prompt: Counter, cached: Counter) -> None:
        self._prompt = prompt
        self._cached = cached
        self.sums = array("q", [0, 0])

    def flush(self) -> None:
        tokens, cached = self.sums
        self.sums[0] = self.sums[1] = 0
        if tokens:
            self._prompt.inc(tokens)
        if cached:
            self._cached.inc(cached)


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
        self._by_role = {
            role: tallies.add(PromptTally(prompt.labels(role), cached.labels(role))) for role in ROLES
        }
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
        self.stale_endpoints = Gauge(
            "motor_coordinator_kv_events_stale_endpoints",
            "Engine endpoints whose KV events went silent (no batch, no answer from the replay "
            "socket) for coordinator.kv_events_stale_s while they served: their cached blocks "
            "count as unknown, routed by load alone, until their events flow again.",
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
            "routes to it), restart (another engine process behind it), gap (events lost for good) "
            "or stale (its events went silent while it served).",
            ["reason"],
            registry=r,
        )
        self._lag_t = self._tallies.histogram(lambda: self._lag, LAG_BUCKETS)
        self._events_t = self._tallies.counter(lambda: self._events)
        for outcome in REPLAY_OUTCOMES:
            self._replays.labels(outcome)
        for reason in RESET_REASONS:
            self._resets.labels(reason)

    def tallies(self, role: int) -> array[int]:
        """What a request routed to an instance of ``role`` adds its prompt tokens, and the
        tokens of them the chosen engine held, to: [prompt tokens, cached tokens] (kv_aware
        keeps them per role: its request path adds to them directly)."""
        return self._by_role[ROLE_NAMES.get(role, "union")].sums  # type: ignore[call-overload]

    # -- Stats of the subscriptions -------------------------------------------------------

    def batch(self, lag_s: float, events: int) -> None:
        self._lag_t.observe(max(0.0, lag_s))
        self._events_t.n += events

    def replay(self, outcome: str) -> None:
        self._replays.labels(outcome).inc()

    def reset(self, reason: str) -> None:
        self._resets.labels(reason).inc()
