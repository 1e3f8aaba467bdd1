"""What ``motor top`` shows, computed from the Coordinator's aggregated engine metrics
(GetEngineMetrics) and, when there is one, the Controller's instances and alarms: one document
per refresh (what ``-o json`` prints; top_view.py lays it out as tables).

Latency percentiles come from histogram buckets as Prometheus' ``histogram_quantile`` reads them
(linear interpolation within a bucket), over the interval between the two newest collections
seen (the difference of their cumulative buckets); with only one seen (the first frame,
``--once``) over the cumulative buckets, i.e. since each engine started. Tokens/s are the
difference of the token counters over that same interval, or the Coordinator's derived
``motor:*_tokens_per_second`` series when there is no interval yet.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from google.protobuf import timestamp_pb2

from motor_mesh.cli.status import alarm_entry, iso
from motor_mesh.common import enums
from motor_mesh.gen.motor.v1 import alarm_pb2, coordinator_pb2

# Each figure from the first of these series a group has: vLLM's names, then SGLang's.
RUNNING = ("vllm:num_requests_running", "sglang:num_running_reqs")
WAITING = ("vllm:num_requests_waiting", "sglang:num_queue_reqs")
# (the mean over the group's engines, the max beside it)
KV_USAGE = (
    ("vllm:kv_cache_usage_perc", "vllm:kv_cache_usage_perc_max"),
    ("vllm:gpu_cache_usage_perc", "vllm:gpu_cache_usage_perc_max"),
    ("sglang:token_usage", "sglang:token_usage_max"),
)
TTFT = ("vllm:time_to_first_token_seconds", "sglang:time_to_first_token_seconds")
TPOT = (
    "vllm:time_per_output_token_seconds",
    "vllm:inter_token_latency_seconds",
    "sglang:inter_token_latency_seconds",
    "sglang:time_per_output_token_seconds",
)
PROMPT_RATE = "motor:prompt_tokens_per_second"
GENERATION_RATE = "motor:generation_tokens_per_second"
PROMPT_TOKENS = ("vllm:prompt_tokens_total", "sglang:prompt_tokens_total")
GENERATION_TOKENS = ("vllm:generation_tokens_total", "sglang:generation_tokens_total")
ACTIVE_WORKERS = {"prefill": "motor:active_prefill_workers", "decode": "motor:active_decode_workers"}
MIGRATIONS = "motor_coordinator_migrations_total"
# The roles always in the document (union only when the cluster has it).
ROLES = ("prefill", "decode")
ROLE_ORDER = ("prefill", "decode", "union")
QUANTILES = (("p50", 0.5), ("p99", 0.99))

Buckets = dict[float, float]  # upper bound (le) -> cumulative count


# ---- histograms ------------------------------------------------------------------------------


def quantile(q: float, buckets: Mapping[float, float]) -> float | None:
    """The q-quantile (0 < q <= 1) of a histogram's cumulative ``buckets``, as Prometheus'
    ``histogram_quantile``: linear interpolation within the bucket the rank falls in (from 0 for
    the first bucket), the largest finite bound when it falls in +Inf. None where Prometheus
    answers NaN: fewer than two buckets, no +Inf bucket, no observations."""
    ordered = sorted(buckets.items())
    if len(ordered) < 2 or ordered[-1][0] != math.inf:
        return None
    counts: list[float] = []
    for _, c in ordered:  # cumulative counts never go down (Prometheus evens out float noise)
        counts.append(max(c, counts[-1]) if counts else c)
    total = counts[-1]
    if not total > 0:
        return None
    rank = q * total
    b = next((i for i in range(len(ordered) - 1) if counts[i] >= rank), len(ordered) - 1)
    if b == len(ordered) - 1:
        return ordered[-2][0]
    end = ordered[b][0]
    if b == 0 and end <= 0:
        return end
    start, below = (0.0, 0.0) if b == 0 else (ordered[b - 1][0], counts[b - 1])
    in_bucket = counts[b] - below
    if in_bucket <= 0:
        return start
    return start + (end - start) * (rank - below) / in_bucket


def bucket_delta(current: Mapping[float, float], earlier: Mapping[float, float] | None) -> Buckets:
    """What was observed between ``earlier`` and ``current`` (cumulative buckets of one
    histogram); a series that went back (its engine restarted, or left the aggregate) or changed
    its bounds counts from zero, as Prometheus' ``rate`` takes a counter reset."""
    if not earlier:
        return dict(current)
    if set(earlier) != set(current) or any(current[le] < earlier[le] for le in current):
        return dict(current)
    return {le: current[le] - earlier[le] for le in current}


def parse_le(text: str) -> float | None:
    try:
        return float(text)  # "+Inf" included
    except ValueError:
        return None


# ---- series, grouped ---------------------------------------------------------------------------


@dataclass
class Series:
    """A group's samples (one instance's, one role's): each sample name's values (one per
    series: several where another label, e.g. model_name, tells them apart), and each
    histogram's buckets merged over its series."""

    values: dict[str, list[float]] = field(default_factory=dict)
    buckets: dict[str, Buckets] = field(default_factory=dict)
    role: str = ""

    def add(self, name: str, labels: Mapping[str, str], value: float) -> None:
        le = parse_le(labels["le"]) if name.endswith("_bucket") and "le" in labels else None
        if le is not None:
            merged = self.buckets.setdefault(name.removesuffix("_bucket"), {})
            merged[le] = merged.get(le, 0.0) + value
        elif not name.endswith("_bucket"):
            self.values.setdefault(name, []).append(value)

    def first(self, names: Iterable[str]) -> tuple[str, list[float]] | None:
        for name in names:
            if self.values.get(name):
                return name, self.values[name]
        return None

    def sum(self, names: Iterable[str]) -> float | None:
        found = self.first(names)
        return math.fsum(found[1]) if found else None

    def histogram(self, names: Iterable[str]) -> tuple[str, Buckets] | None:
        for name in names:
            if self.buckets.get(name):
                return name, self.buckets[name]
        return None


def role_label(text: str) -> str:
    """``prefill`` for "prefill", "PREFILL" or "ROLE_PREFILL"."""
    return text.strip().lower().removeprefix("role_")


def instance_label(labels: Mapping[str, str]) -> int | None:
    try:
        return int(labels.get("instance_id", ""), 0)
    except ValueError:
        return None


def grouped(
    families: Iterable[coordinator_pb2.MetricFamily], key: Callable[[Mapping[str, str]], Any]
) -> dict[Any, Series]:
    """Every sample of ``families`` into the group ``key(labels)`` names (None: left out)."""
    groups: dict[Any, Series] = {}
    for family in families:
        for s in family.samples:
            k = key(s.labels)
            if k is None:
                continue
            g = groups.setdefault(k, Series())
            g.role = g.role or role_label(s.labels.get("role", ""))
            g.add(s.name, s.labels, s.value)
    return groups


def by_instance(resp: coordinator_pb2.GetEngineMetricsResponse) -> dict[int, Series]:
    return grouped(resp.families, instance_label)


def by_role(resp: coordinator_pb2.GetEngineMetricsResponse) -> dict[str, Series]:
    return grouped(resp.families, lambda labels: role_label(labels["role"]) if "role" in labels else None)


def sample_sum(families: Iterable[coordinator_pb2.MetricFamily], name: str) -> float | None:
    """The sum of every sample named ``name``; None when there is none."""
    values = [s.value for f in families for s in f.samples if s.name == name]
    return math.fsum(values) if values else None


# ---- the interval between two collections --------------------------------------------------------


@dataclass
class Collection:
    at: float | None  # collect_time, seconds since the epoch; None before the first collection
    groups: dict[Any, Series]


class Window:
    """The two newest distinct collections of one view. The Coordinator collects on its own
    clock (coordinator.engine_metrics_interval_s): a refresh that finds the same collection
    again keeps the interval it had, rather than seeing nothing happen."""

    def __init__(self) -> None:
        self.earlier: Collection | None = None
        self.current: Collection | None = None

    def push(self, c: Collection) -> None:
        if self.current is not None and c.at is not None and c.at == self.current.at:
            self.current = c
            return
        self.earlier, self.current = self.current, c
        if c.at is None or (self.earlier is not None and self.earlier.at is None):
            self.earlier = None

    @property
    def seconds(self) -> float | None:
        """How long the interval is; None while there is only one collection."""
        if self.earlier is None or self.current is None or self.earlier.at is None or self.current.at is None:
            return None
        span = self.current.at - self.earlier.at
        return span if span > 0 else None

    def base(self, key: Any) -> Series | None:
        """The group's series at the start of the interval (empty for a group new since)."""
        if self.seconds is None or self.earlier is None:
            return None
        return self.earlier.groups.get(key, Series())


# ---- one group's figures ---------------------------------------------------------------------


def latency(g: Series, base: Series | None, names: Sequence[str], prefix: str) -> dict[str, float | None]:
    """``{prefix}_p50_s`` and ``{prefix}_p99_s``: over the interval when there is one (``base``),
    else since the engines started. None when nothing was observed in it."""
    found = g.histogram(names)
    if found is None:
        return {f"{prefix}_{label}_s": None for label, _ in QUANTILES}
    name, current = found
    buckets = current if base is None else bucket_delta(current, base.buckets.get(name))
    return {f"{prefix}_{label}_s": quantile(q, buckets) for label, q in QUANTILES}


def token_rate(
    g: Series, base: Series | None, seconds: float | None, counters: Sequence[str], derived: str
) -> float | None:
    """Tokens per second over the interval from the counters; without an interval (or counters)
    the Coordinator's derived rate."""
    found = g.first(counters)
    if base is not None and seconds and found is not None:
        name, values = found
        grown = math.fsum(values) - math.fsum(base.values.get(name, []))
        if grown >= 0:
            return grown / seconds
        return math.fsum(values) / seconds  # a restart: counted from zero
    return g.sum([derived])


def kv_usage(g: Series) -> tuple[float | None, float | None]:
    """(mean, max) of the KV cache usage (0..1) over the group's engines."""
    for mean_name, max_name in KV_USAGE:
        means = g.values.get(mean_name)
        if means:
            maxes = g.values.get(max_name) or means
            return math.fsum(means) / len(means), max(maxes)
    return None, None


def figures(g: Series | None, base: Series | None, seconds: float | None) -> dict[str, Any]:
    g = g or Series()
    kv_mean, kv_max = kv_usage(g)
    return {
        "running": g.sum(RUNNING),
        "waiting": g.sum(WAITING),
        "kv_cache_usage": kv_mean,
        "kv_cache_usage_max": kv_max,
        "prompt_tokens_per_second": token_rate(g, base, seconds, PROMPT_TOKENS, PROMPT_RATE),
        "generation_tokens_per_second": token_rate(g, base, seconds, GENERATION_TOKENS, GENERATION_RATE),
        **latency(g, base, TTFT, "ttft"),
        **latency(g, base, TPOT, "tpot"),
    }


# ---- what the Controller adds ---------------------------------------------------------------


@dataclass
class ControllerView:
    """What the Controller said this refresh. ``address`` None: none was given (standalone);
    ``error`` set: it did not answer (then ``statuses`` and ``alarms`` are None)."""

    address: str | None = None
    statuses: dict[int, str] | None = None
    alarms: list[alarm_pb2.Alarm] | None = None
    error: dict[str, str] | None = None


def seconds_of(ts: timestamp_pb2.Timestamp) -> float:
    return ts.ToNanoseconds() / 1e9


def migrations(families: Sequence[coordinator_pb2.MetricFamily]) -> dict[str, Any] | None:
    """The Coordinator's migrations (motor_coordinator_migrations_total{reason,outcome}): the
    total, by outcome and by reason; None when it did not send its series."""
    if not families:
        return None
    samples = [s for f in families for s in f.samples if s.name == MIGRATIONS]
    by_outcome: dict[str, float] = {}
    by_reason: dict[str, float] = {}
    for s in samples:
        outcome, reason = s.labels.get("outcome", ""), s.labels.get("reason", "")
        by_outcome[outcome] = by_outcome.get(outcome, 0.0) + s.value
        by_reason[reason] = by_reason.get(reason, 0.0) + s.value
    return {
        "total": int(math.fsum(by_outcome.values())),
        "by_outcome": {k: int(v) for k, v in sorted(by_outcome.items())},
        "by_reason": {k: int(v) for k, v in sorted(by_reason.items())},
        "new": None,
    }


# ---- the document ----------------------------------------------------------------------------


def engine_entry(e: coordinator_pb2.EngineScrape) -> dict[str, Any]:
    return {
        "host": e.host,
        "port": e.port,
        "dp_rank": e.dp_rank,
        "fresh": e.fresh,
        "error": e.error or None,
        "last_success_time": iso(e.last_success_time) if e.HasField("last_success_time") else None,
    }


def role_order(role: str) -> tuple[int, str]:
    return (ROLE_ORDER.index(role) if role in ROLE_ORDER else len(ROLE_ORDER), role)


class TopModel:
    """The state kept across refreshes: the newest distinct collections of each view, and the
    migrations count last shown."""

    def __init__(self, coordinator: str) -> None:
        self.coordinator = coordinator
        self.instances = Window()
        self.roles = Window()
        self._migrations_total: int | None = None

    def update(
        self,
        per_instance: coordinator_pb2.GetEngineMetricsResponse,
        per_role: coordinator_pb2.GetEngineMetricsResponse,
        controller: ControllerView,
    ) -> dict[str, Any]:
        """The document for a refresh: ``per_instance`` is the INSTANCE view (with the
        Coordinator's own series), ``per_role`` the ROLE view."""
        at = seconds_of(per_instance.collect_time) if per_instance.HasField("collect_time") else None
        role_at = seconds_of(per_role.collect_time) if per_role.HasField("collect_time") else None
        self.instances.push(Collection(at, by_instance(per_instance)))
        self.roles.push(Collection(role_at, by_role(per_role)))
        instances = self._instances(per_instance, controller)
        moved = migrations(per_instance.coordinator_families)
        if moved is not None:
            if self._migrations_total is not None:
                moved["new"] = max(0, moved["total"] - self._migrations_total)
            self._migrations_total = moved["total"]
        alarms = None
        if controller.alarms is not None:
            alarms = [alarm_entry(a) for a in sorted(controller.alarms, key=lambda a: -a.sequence)]
        return {
            "coordinator": self.coordinator,
            "collect_time": iso(per_instance.collect_time) if at is not None else None,
            "window_s": round(self.instances.seconds, 3) if self.instances.seconds else None,
            "roles": self._roles(instances),
            "active_workers": {
                role: (int(v) if (v := sample_sum(per_role.families, name)) is not None else None)
                for role, name in ACTIVE_WORKERS.items()
            },
            "instances": instances,
            "migrations": moved,
            "controller": (
                None
                if controller.address is None
                else {"address": controller.address, "error": controller.error}
            ),
            "alarms": alarms,
        }

    def _instances(
        self, resp: coordinator_pb2.GetEngineMetricsResponse, controller: ControllerView
    ) -> list[dict[str, Any]]:
        """Every instance the Coordinator scrapes (and any its series name), by id."""
        engines: dict[int, list[coordinator_pb2.EngineScrape]] = {}
        for e in resp.engines:
            engines.setdefault(e.instance_id, []).append(e)
        current = self.instances.current
        groups: dict[int, Series] = current.groups if current else {}
        seconds = self.instances.seconds
        found = []
        for iid in sorted(set(engines) | set(groups)):
            mine = sorted(engines.get(iid, []), key=lambda e: e.dp_rank)
            g = groups.get(iid)
            role = next((enums.ROLE_NAMES.get(e.role, "") for e in mine if e.role), "") or (
                g.role if g else ""
            )
            status = controller.statuses.get(iid) if controller.statuses is not None else None
            found.append(
                {
                    "instance_id": iid,
                    "role": role or None,
                    "status": status,
                    **figures(g, self.instances.base(iid), seconds),
                    "engines": [engine_entry(e) for e in mine],
                }
            )
        return found

    def _roles(self, instances: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
        current = self.roles.current
        groups: dict[str, Series] = current.groups if current else {}
        names = set(ROLES) | set(groups) | {i["role"] for i in instances if i["role"]}
        roles = {}
        for role in sorted(names, key=role_order):
            mine = [i for i in instances if i["role"] == role]
            engines = [e for i in mine for e in i["engines"]]
            roles[role] = {
                "instances": len(mine),
                "engines": len(engines),
                "stale_engines": sum(1 for e in engines if not e["fresh"]),
                **figures(groups.get(role), self.roles.base(role), self.roles.seconds),
            }
        return roles
