"""Prometheus metrics under vLLM's names, so scrapers written for vLLM work unchanged.

The hot path only bumps plain integers; a collector turns them into metric families at scrape
time. prometheus_client's own Counter/Histogram objects take a lock per update, which showed up
as a measurable share of the instant engine's per-request CPU.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0)
TPOT_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
# vLLM's own bounds for end-to-end latency.
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0)
FINISH_REASONS = ("length", "stop", "abort")
SIDES = ("prefill", "decode")
PROTOCOLS = ("vllm", "sglang")


class Histogram:
    __slots__ = ("bounds", "counts", "total")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.total = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1
        self.total += value

    def family(self, name: str, doc: str, model: str) -> HistogramMetricFamily:
        h = HistogramMetricFamily(name, doc, labels=["model_name"])
        cumulative, buckets = 0, []
        for bound, count in zip((*self.bounds, float("inf")), self.counts, strict=True):
            cumulative += count
            buckets.append(("+Inf" if bound == float("inf") else repr(bound), cumulative))
        h.add_metric([model], buckets, self.total)
        return h


class Metrics(Collector):
    def __init__(self, model: str, read_gauges: Callable[[], tuple[int, int, float]]) -> None:
        self.model = model
        self._read_gauges = read_gauges
        self.success = dict.fromkeys(FINISH_REASONS, 0)
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.prefix_queries = 0  # prompt tokens looked up in the prefix cache
        self.prefix_hits = 0  # of which were cached
        self.ttft = Histogram(TTFT_BUCKETS)
        self.tpot = Histogram(TPOT_BUCKETS)
        self.e2e = Histogram(E2E_BUCKETS)
        self.legs = {(side, proto): 0 for side in SIDES for proto in PROTOCOLS}
        self.tickets = {"known": 0, "unknown": 0}
        self.faults: dict[str, int] = {}
        self.bootstrap_timeouts = 0
        self.traceparents = 0
        self.requests = 0  # completion requests received, whatever their answer
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self)

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def collect(self) -> Iterator[Metric]:
        model = self.model
        running, waiting, kv_usage = self._read_gauges()
        for name, doc, value in (
            ("vllm:num_requests_running", "Requests in model execution batches.", running),
            ("vllm:num_requests_waiting", "Requests waiting to be processed.", waiting),
            ("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", kv_usage),
        ):
            g = GaugeMetricFamily(name, doc, labels=["model_name"])
            g.add_metric([model], value)
            yield g
        c = CounterMetricFamily(
            "vllm:request_success", "Finished requests.", labels=["model_name", "finished_reason"]
        )
        for reason, n in self.success.items():
            c.add_metric([model, reason], n)
        yield c
        for name, doc, value in (
            ("vllm:prompt_tokens", "Prefill tokens processed.", self.prompt_tokens),
            ("vllm:generation_tokens", "Generation tokens processed.", self.generation_tokens),
            ("vllm:prefix_cache_queries", "Prefix cache queries, in tokens.", self.prefix_queries),
            ("vllm:prefix_cache_hits", "Prefix cache hits, in tokens.", self.prefix_hits),
        ):
            c = CounterMetricFamily(name, doc, labels=["model_name"])
            c.add_metric([model], value)
            yield c
        yield self.ttft.family("vllm:time_to_first_token_seconds", "Time to first token in seconds.", model)
        yield self.tpot.family(
            "vllm:time_per_output_token_seconds", "Time per output token in seconds.", model
        )
        yield self.e2e.family(
            "vllm:e2e_request_latency_seconds", "End-to-end request latency in seconds.", model
        )
        c = CounterMetricFamily(
            "motor_sim_pd_legs", "PD legs served by this engine.", labels=["side", "protocol"]
        )
        for (side, proto), n in self.legs.items():
            c.add_metric([side, proto], n)
        yield c
        c = CounterMetricFamily(
            "motor_sim_kv_tickets",
            "vLLM decode legs by whether their prefill ticket was issued by this process.",
            labels=["result"],
        )
        for result, n in self.tickets.items():
            c.add_metric([result], n)
        yield c
        c = CounterMetricFamily(
            "motor_sim_fault_injections", "Requests that suffered an injected fault.", labels=["mode"]
        )
        for mode, n in self.faults.items():
            c.add_metric([mode], n)
        yield c
        yield CounterMetricFamily(
            "motor_sim_bootstrap_timeouts",
            "SGLang decode legs whose room never filled.",
            value=self.bootstrap_timeouts,
        )
        # Refusals too (vLLM counts none of them): it shows whether a router sent a request at all.
        yield CounterMetricFamily(
            "motor_sim_completion_requests",
            "Completion requests received, whatever their answer (a 400 included).",
            value=self.requests,
        )
        # Counted whether or not this engine exports spans: it shows what its router sends.
        yield CounterMetricFamily(
            "motor_sim_traceparent_requests",
            "Completion requests that carried a W3C traceparent header.",
            value=self.traceparents,
        )
