"""What the planner measures, read from the Coordinators (GetEngineMetrics by role, with each
Coordinator's own series) once per interval.

- **Latency, as clients see it**: every Coordinator's ``motor_coordinator_time_to_first_byte_seconds``
  (time to first token) and ``motor_coordinator_inter_token_seconds`` histograms, the change since
  the last read summed over the Coordinators (each serves its own clients), and their p90 read
  off the merged buckets (interpolated inside the bucket, as Prometheus' histogram_quantile).
- **Load per role, as the engines report it**: running and waiting requests, KV cache usage, prompt
  and generation tokens per second, and the prompt tokens per request (the change of the prompt
  token and finished request counters). Every Coordinator scrapes the same engines, so these come
  from one of them (the first by address that answered), not summed.

A counter or bucket that went down (a Coordinator or engine restarted) counts from zero.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Protocol

from motor_mesh.gen.motor.v1 import coordinator_pb2

TTFT = "motor_coordinator_time_to_first_byte_seconds"
ITL = "motor_coordinator_inter_token_seconds"
# vLLM's names, then SGLang's.
RUNNING = ("vllm:num_requests_running", "sglang:num_running_reqs")
WAITING = ("vllm:num_requests_waiting", "sglang:num_queue_reqs")
KV_USAGE = ("vllm:kv_cache_usage_perc", "sglang:token_usage")
PROMPT_TOKENS = ("vllm:prompt_tokens_total", "sglang:prompt_tokens_total")
FINISHED = ("vllm:e2e_request_latency_seconds_count", "sglang:e2e_request_latency_seconds_count")
PROMPT_TPS = "motor:prompt_tokens_per_second"
GENERATION_TPS = "motor:generation_tokens_per_second"

Buckets = dict[float, float]  # upper bound (le) -> cumulative count


class Source(Protocol):
    async def engine_metrics(self) -> Mapping[str, coordinator_pb2.GetEngineMetricsResponse]: ...


@dataclass(frozen=True)
class Window:
    """One latency histogram's change over an interval."""

    buckets: tuple[tuple[float, float], ...] = ()  # (le, cumulative count), ascending

    @property
    def count(self) -> float:
        return self.buckets[-1][1] if self.buckets else 0.0

    def quantile(self, q: float) -> float | None:
        """Seconds; None without observations. Past the last finite bound: that bound."""
        total = self.count
        if total <= 0:
            return None
        rank = q * total
        lower_bound, lower_count = 0.0, 0.0
        for le, cum in self.buckets:
            if cum >= rank:
                if math.isinf(le):
                    return lower_bound
                inside = cum - lower_count
                share = (rank - lower_count) / inside if inside > 0 else 1.0
                return lower_bound + (le - lower_bound) * share
            lower_bound, lower_count = le, cum
        return lower_bound

    def within(self, seconds: float) -> float | None:
        """Fraction of the observations at or below ``seconds`` (by the bucket at or below it)."""
        total = self.count
        if total <= 0:
            return None
        below = max((cum for le, cum in self.buckets if le <= seconds), default=0.0)
        return below / total


@dataclass(frozen=True)
class RoleLoad:
    running: float = 0.0
    waiting: float = 0.0
    kv_usage: float = 0.0
    prompt_tps: float = 0.0
    generation_tps: float = 0.0
    prompt_tokens_per_request: float = 0.0  # 0 = none finished in the interval


@dataclass(frozen=True)
class Sample:
    seconds: float  # the interval it covers
    ttft: Window
    itl: Window
    prefill: RoleLoad
    decode: RoleLoad
    coordinators: int  # how many answered


def _samples(
    families: Iterable[coordinator_pb2.MetricFamily],
) -> dict[str, list[coordinator_pb2.MetricSample]]:
    out: dict[str, list[coordinator_pb2.MetricSample]] = {}
    for fam in families:
        for s in fam.samples:
            out.setdefault(s.name, []).append(s)
    return out


def _buckets(samples: Mapping[str, list[coordinator_pb2.MetricSample]], name: str) -> Buckets:
    out: Buckets = {}
    for s in samples.get(name + "_bucket", []):
        le = s.labels.get("le")
        if le is None:
            continue
        bound = math.inf if le in ("+Inf", "inf", "Inf") else float(le)
        out[bound] = out.get(bound, 0.0) + s.value  # several label sets: summed per bound
    return out


def _delta(now: Mapping[float, float], before: Mapping[float, float] | None) -> Buckets:
    if before is None or any(now.get(k, 0.0) < v for k, v in before.items()):
        return dict(now)
    return {k: v - before.get(k, 0.0) for k, v in now.items()}


def _merge(parts: Iterable[Buckets]) -> Window:
    total: Buckets = {}
    for part in parts:
        for k, v in part.items():
            total[k] = total.get(k, 0.0) + v
    return Window(tuple(sorted(total.items())))


def _role_value(
    samples: Mapping[str, list[coordinator_pb2.MetricSample]], names: Iterable[str] | str, role: str
) -> float:
    for name in (names,) if isinstance(names, str) else names:
        values = [s.value for s in samples.get(name, []) if s.labels.get("role") == role]
        if values:
            return sum(values)
    return 0.0


class Signals:
    def __init__(self, source: Source, clock: Callable[[], float] = time.monotonic) -> None:
        self._source = source
        self._clock = clock
        self._at: float | None = None
        # Per Coordinator: its latency buckets and engine counters at the last read.
        self._latency: dict[str, tuple[Buckets, Buckets]] = {}
        self._counters: dict[str, dict[str, float]] = {}

    async def read(self) -> Sample | None:
        """The interval since the last read; None when no Coordinator answered (or on the first
        read, which only sets the baseline)."""
        answers = await self._source.engine_metrics()
        now = self._clock()
        if not answers:
            return None
        first = self._at is None
        seconds = now - self._at if self._at is not None else 0.0
        self._at = now
        ttft_parts, itl_parts = [], []
        for address, resp in answers.items():
            own = _samples(resp.coordinator_families)
            ttft, itl = _buckets(own, TTFT), _buckets(own, ITL)
            before = self._latency.get(address)
            ttft_parts.append(_delta(ttft, before[0] if before else None))
            itl_parts.append(_delta(itl, before[1] if before else None))
            self._latency[address] = (ttft, itl)
        for gone in set(self._latency) - set(answers):
            del self._latency[gone]
        address = min(answers)
        engines = _samples(answers[address].families)
        counters = {
            f"{role}:{what}": _role_value(engines, names, role)
            for role in ("prefill", "decode")
            for what, names in (("prompt", PROMPT_TOKENS), ("finished", FINISHED))
        }
        before_counters = self._counters.get(address)
        self._counters = {address: counters}
        if first or seconds <= 0:
            return None

        def load(role: str) -> RoleLoad:
            per_request = 0.0
            if before_counters is not None:
                prompt = counters[f"{role}:prompt"] - before_counters.get(f"{role}:prompt", 0.0)
                finished = counters[f"{role}:finished"] - before_counters.get(f"{role}:finished", 0.0)
                if prompt > 0 and finished > 0:
                    per_request = prompt / finished
            return RoleLoad(
                running=_role_value(engines, RUNNING, role),
                waiting=_role_value(engines, WAITING, role),
                kv_usage=_role_value(engines, KV_USAGE, role),  # the role's mean
                prompt_tps=_role_value(engines, PROMPT_TPS, role),
                generation_tps=_role_value(engines, GENERATION_TPS, role),
                prompt_tokens_per_request=per_request,
            )

        return Sample(
            seconds=seconds,
            ttft=_merge(ttft_parts),
            itl=_merge(itl_parts),
            prefill=load("prefill"),
            decode=load("decode"),
            coordinators=len(answers),
        )
