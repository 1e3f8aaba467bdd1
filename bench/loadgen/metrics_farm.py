"""Metrics-only stand-in engines: ``python -m bench.loadgen.metrics_farm [--count 62] [--seed 1]``.

One asyncio process listening on ``--count`` ports of 127.0.0.1, each answering ``GET /metrics``
with what one vLLM V1 engine (one model, ``engine="0"``) exports, and ``GET /health`` with 200.
Nothing else: no completion is served, so the instances they stand for go in the routing table
under a model no client asks for (:data:`MODEL`), and the Coordinator only scrapes them.

The exposition is what a recent vLLM API server writes with prometheus_client (text format
0.0.4, labels sorted, a ``*_created`` family after each counter and histogram):

- ``vllm/v1/metrics/loggers.py`` (``PrometheusStatLogger``): the scheduler gauges
  (``num_requests_running``, ``num_requests_waiting``, ``num_requests_waiting_by_reason``,
  ``engine_sleep_state``, ``kv_cache_usage_perc``), ``cache_config_info``, the counters (prefix
  cache, external prefix cache, multi-modal cache, preemptions, prompt tokens in total, by
  source, cached and recomputed, generation tokens, ``request_success`` by finished_reason),
  and the histograms with vLLM's own bounds: request prompt, generation, max-generation,
  ``max_tokens``, ``n`` and prefill-computed token counts (1-2-5 bounds up to max_model_len
  32768), ``iteration_tokens_total``, ``time_to_first_token_seconds``,
  ``inter_token_latency_seconds``, ``request_time_per_output_token_seconds`` (and
  ``time_per_output_token_seconds``, the older name some versions export beside it), and the
  request-latency family (e2e, queue, inference, prefill, decode);
- the NixlConnector's ``vllm:nixl_*`` histograms and counters (a PD deployment's KV transfer);
- prometheus-fastapi-instrumentator's ``http_*`` families (the API server's requests);
- prometheus_client's process and Python collectors (``process_*``, ``python_*``).

Counters and histograms advance at every scrape by the time since the last one (each endpoint
has its own request rate; prefill-like and decode-like endpoints alternate), and the gauges
move, so a scraper's parser and rates do the work they do on a real fleet. Rendering reuses a
template (the text between values is built once), so a scrape costs the farm well under a
millisecond: the farm's CPU stays small beside the Coordinator's.

Prints ``event=listening ports=P1,P2,... bytes=N`` on stderr (N: one exposition's size), and
``event=stopped scrapes=N`` when stopped (SIGTERM or SIGINT). ``GET /farm/stats`` (any of its
ports) answers the scrapes served so far and when each arrived since the previous call.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import random
import signal
import socket
import sys
import time
from dataclasses import dataclass

from aiohttp import web
from prometheus_client.utils import floatToGoString

MODEL = "farm-model"
MAX_MODEL_LEN = 32768
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
STEPS_PER_S = 40.0  # engine steps a second, for iteration_tokens_total
HTTP_HANDLERS = {"/v1/chat/completions": 0.85, "/v1/completions": 0.149, "/v1/models": 0.001}


def _1_2_5(max_value: int) -> list[float]:
    """vLLM's build_1_2_5_buckets: 1, 2, 5, 10, ... up to ``max_value``."""
    out: list[float] = []
    exp = 0
    while True:
        for m in (1, 2, 5):
            v = m * 10**exp
            if v > max_value:
                return out
            out.append(float(v))
        exp += 1


TOKENS = _1_2_5(MAX_MODEL_LEN)
TTFT = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0]
TTFT += [20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
ITL = [
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
]
LATENCY = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0]
LATENCY += [480.0, 960.0, 1920.0, 7680.0]
ITERATION = [1.0, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]
N_PARAM = [1.0, 2, 5, 10, 20]
NIXL_TIME = [0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 5.0]
NIXL_BYTES = [float(2 ** (10 + i)) for i in range(1, 25, 2)]
NIXL_DESCRIPTORS = [10.0, 20, 30, 50, 75, 100, 200, 400, 1000, 2000, 4000, 10000, 20000, 50000]
HTTP_HIGHR = [
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.25,
    0.5,
    0.75,
    1,
    1.5,
    2,
    2.5,
    3,
    3.5,
    4,
    4.5,
    5,
    7.5,
    10,
    30,
    60,
]
HTTP_FEW = [0.1, 0.5, 1.0]

# Each family's help text, as its exporter writes it.
HELP = {
    "vllm:num_requests_running": "Number of requests in model execution batches.",
    "vllm:num_requests_waiting": "Number of requests waiting to be processed.",
    "vllm:num_requests_waiting_by_reason": "Number of waiting requests by reason. Reason labels: "
    "'capacity' = waiting for scheduling capacity; 'deferred' = deferred by transient constraints "
    "(LoRA budget, KV transfer, blocked status). Sum of all reasons equals vllm:num_requests_waiting.",
    "vllm:engine_sleep_state": "Engine sleep state; awake = 0 means engine is sleeping; awake = 1 means "
    "engine is awake; weights_offloaded = 1 means sleep level 1; discard_all = 1 means sleep level 2.",
    "vllm:kv_cache_usage_perc": "KV-cache usage. 1 means 100 percent usage.",
    "vllm:cache_config_info": "Information of the LLMEngine CacheConfig",
    "vllm:prefix_cache_queries": "Prefix cache queries, in terms of number of queried tokens.",
    "vllm:prefix_cache_hits": "Prefix cache hits, in terms of number of cached tokens.",
    "vllm:external_prefix_cache_queries": "External prefix cache queries from KV connector cross-instance "
    "cache sharing, in terms of number of queried tokens.",
    "vllm:external_prefix_cache_hits": "External prefix cache hits from KV connector cross-instance cache "
    "sharing, in terms of number of cached tokens.",
    "vllm:mm_cache_queries": "Multi-modal cache queries, in terms of number of queried items.",
    "vllm:mm_cache_hits": "Multi-modal cache hits, in terms of number of cached items.",
    "vllm:num_preemptions": "Cumulative number of preemption from the engine.",
    "vllm:prompt_tokens": "Number of prefill tokens processed.",
    "vllm:prompt_tokens_by_source": "Number of prompt tokens by source.",
    "vllm:prompt_tokens_cached": "Number of cached prompt tokens (local + external).",
    "vllm:prompt_tokens_recomputed": "Number of cached tokens recomputed for forward pass.",
    "vllm:generation_tokens": "Number of generation tokens processed.",
    "vllm:request_success": "Count of successfully processed requests.",
    "vllm:request_prompt_tokens": "Number of prefill tokens processed.",
    "vllm:request_generation_tokens": "Number of generation tokens processed.",
    "vllm:iteration_tokens_total": "Histogram of number of tokens per engine_step.",
    "vllm:request_max_num_generation_tokens": "Histogram of maximum number of requested generation tokens.",
    "vllm:request_params_n": "Histogram of the n request parameter.",
    "vllm:request_params_max_tokens": "Histogram of the max_tokens request parameter.",
    "vllm:time_to_first_token_seconds": "Histogram of time to first token in seconds.",
    "vllm:inter_token_latency_seconds": "Histogram of inter-token latency in seconds.",
    "vllm:time_per_output_token_seconds": "Histogram of time per output token in seconds.",
    "vllm:request_time_per_output_token_seconds": "Histogram of time_per_output_token_seconds per request.",
    "vllm:e2e_request_latency_seconds": "Histogram of e2e request latency in seconds.",
    "vllm:request_queue_time_seconds": "Histogram of time spent in WAITING phase for request.",
    "vllm:request_inference_time_seconds": "Histogram of time spent in RUNNING phase for request.",
    "vllm:request_prefill_time_seconds": "Histogram of time spent in PREFILL phase for request.",
    "vllm:request_decode_time_seconds": "Histogram of time spent in DECODE phase for request.",
    "vllm:request_prefill_kv_computed_tokens": "Histogram of new KV tokens computed during prefill "
    "(excluding cached tokens).",
    "vllm:nixl_xfer_time_seconds": "Histogram of transfer duration for NIXL KV Cache transfers.",
    "vllm:nixl_post_time_seconds": "Histogram of transfer post time for NIXL KV Cache transfers.",
    "vllm:nixl_bytes_transferred": "Histogram of bytes transferred per NIXL KV Cache transfers.",
    "vllm:nixl_num_descriptors": "Histogram of number of descriptors per NIXL  KV Cache transfers.",
    "vllm:nixl_num_failed_transfers": "Number of failed NIXL KV Cache transfers.",
    "vllm:nixl_num_failed_notifications": "Number of failed NIXL KV Cache notifications.",
    "vllm:nixl_num_kv_expired_reqs": "Number of requests that had their KV expire. NOTE: This metric is "
    "tracked on the P instance.",
    "http_requests": "Total number of requests by method, status and handler.",
    "http_request_size_bytes": "Content length of incoming requests by handler. Only value of header is "
    "respected. Otherwise ignored. No percentile calculated. ",
    "http_response_size_bytes": "Content length of outgoing responses by handler. Only value of header "
    "is respected. Otherwise ignored. No percentile calculated. ",
    "http_request_duration_highr_seconds": "Latency with many buckets but no API specific labels. Made "
    "for more accurate percentile calculations. ",
    "http_request_duration_seconds": "Latency with only few buckets by handler. Made to be only used if "
    "aggregation by handler is important. ",
    "process_virtual_memory_bytes": "Virtual memory size in bytes.",
    "process_resident_memory_bytes": "Resident memory size in bytes.",
    "process_start_time_seconds": "Start time of the process since unix epoch in seconds.",
    "process_cpu_seconds": "Total user and system CPU time spent in seconds.",
    "process_open_fds": "Number of open file descriptors.",
    "process_max_fds": "Maximum number of open file descriptors.",
    "python_info": "Python platform information",
    "python_gc_objects_collected": "Objects collected during gc",
    "python_gc_objects_uncollectable": "Uncollectable objects found during GC",
    "python_gc_collections": "Number of times this generation was collected",
}

Labels = dict[str, str]


def _labels(labels: Labels) -> str:
    return "{" + ",".join(f'{k}="{v}"' for k, v in sorted(labels.items())) + "}" if labels else ""


def _lognormal_weights(bounds: list[float], median: float, sigma: float) -> list[float]:
    """Share of observations in each bucket (the last one: above every bound) for a lognormal."""
    scale = sigma * math.sqrt(2)
    cdf = [0.5 * (1 + math.erf(math.log(b / median) / scale)) for b in bounds]
    cdf.append(1.0)
    return [cdf[0]] + [cdf[i] - cdf[i - 1] for i in range(1, len(cdf))]


class Template:
    """The exposition as fixed text around a list of values: built once, rendered per scrape."""

    def __init__(self) -> None:
        self.parts: list[str] = [""]
        self.values: list[float] = []

    def head(self, name: str, typ: str) -> None:
        base = name if name in HELP else name.removesuffix("_created")
        base = base if base in HELP else base.removesuffix("_total")
        self.parts[-1] += f"# HELP {name} {HELP[base]}\n# TYPE {name} {typ}\n"

    def sample(self, name: str, labels: Labels, value: float) -> int:
        self.parts[-1] += f"{name}{_labels(labels)} "
        self.values.append(value)
        self.parts.append("\n")
        return len(self.values) - 1

    def render(self) -> bytes:
        fmt = floatToGoString
        out = [p + fmt(v) for p, v in zip(self.parts, self.values, strict=False)]
        out.append(self.parts[-1])
        return "".join(out).encode()


@dataclass
class Hist:
    """One histogram series: where its values are, and how its observations fall."""

    buckets: list[int]  # template index of each cumulative bucket, +Inf last
    count: int
    total: int
    weights: list[float]  # share of the observations per bucket, not cumulative
    mean: float
    per: float  # observations per request (per second for a per-step histogram)
    acc: list[float]  # observations per bucket so far (fractional; shown floored)


class Engine:
    """One stand-in vLLM engine endpoint."""

    def __init__(self, index: int, rng: random.Random, now: float) -> None:
        self.rng = rng
        self.prefill = index % 2 == 0  # the bench puts even ones in the table as prefill
        self.rate = rng.uniform(2.0, 12.0)  # requests per second it pretends to serve
        self.at = now
        self.carry = 0.0
        self.scrapes = 0
        self.t = Template()
        self.hists: list[Hist] = []
        self.step_hists: list[Hist] = []  # observed per engine step, not per request
        self.counters: list[tuple[int, float]] = []  # (template index, increase per request)
        self.acc: dict[int, float] = {}  # a counter's exact value; shown floored (counts are whole)
        self.created = now - rng.uniform(3600, 48 * 3600)
        self.uptime = now - self.created
        self.served = self.rate * self.uptime * 0.3  # requests so far: busy part of the time
        self._vllm()
        self._http()
        self._process()
        for idx, _ in self.counters:
            self.acc[idx] = self.t.values[idx]
            self.t.values[idx] = math.floor(self.t.values[idx])

    def _vllm(self) -> None:
        rng, prefill = self.rng, self.prefill
        base = {"engine": "0", "model_name": MODEL}
        prompt = rng.uniform(800, 2500)  # mean prompt tokens
        gen = 1.0 if prefill else rng.uniform(150, 400)  # a prefill leg generates one token
        hit = rng.uniform(0.2, 0.7)  # prefix cache hit rate
        computed = prompt * (1 - hit) if prefill else 1.0  # decode gets the prompt's KV by transfer
        ext = 0.0 if prefill else prompt
        ttft = rng.uniform(0.08, 0.4) if prefill else rng.uniform(0.02, 0.08)
        itl = rng.uniform(0.015, 0.05)
        decode_s = 0.0 if prefill else gen * itl
        max_tokens = 1.0 if prefill else 1024.0
        on_decode = 0.0 if prefill else 1.0
        self.running = self.gauge("vllm:num_requests_running", [base], 0.0)[0]
        self.waiting = self.gauge("vllm:num_requests_waiting", [base], 0.0)[0]
        reasons = [base | {"reason": r} for r in ("capacity", "deferred")]
        self.waiting_reason = self.gauge("vllm:num_requests_waiting_by_reason", reasons, 0.0)[0]
        states = [base | {"sleep_state": s} for s in ("awake", "weights_offloaded", "discard_all")]
        self.t.values[self.gauge("vllm:engine_sleep_state", states, 0.0)[0]] = 1.0
        self.kv = self.gauge("vllm:kv_cache_usage_perc", [base], rng.uniform(0.1, 0.8))[0]
        self.counter("vllm:prefix_cache_queries", [(base, prompt if prefill else 0.0)])
        self.counter("vllm:prefix_cache_hits", [(base, prompt * hit if prefill else 0.0)])
        self.counter("vllm:external_prefix_cache_queries", [(base, ext)])
        self.counter("vllm:external_prefix_cache_hits", [(base, ext)])
        self.counter("vllm:mm_cache_queries", [(base, 0.0)])
        self.counter("vllm:mm_cache_hits", [(base, 0.0)])
        self.counter("vllm:num_preemptions", [(base, 0.002)])
        self.counter("vllm:prompt_tokens", [(base, computed)])
        sources = {
            "local_compute": computed,
            "local_cache_hit": prompt * hit if prefill else 0.0,
            "external_kv_transfer": ext - 1 if ext else 0.0,
        }
        self.counter("vllm:prompt_tokens_by_source", [(base | {"source": s}, n) for s, n in sources.items()])
        self.counter("vllm:prompt_tokens_cached", [(base, prompt - computed)])
        self.counter("vllm:prompt_tokens_recomputed", [(base, 0.01)])
        self.counter("vllm:generation_tokens", [(base, gen)])
        reasons_ = {"stop": 0.78, "length": 0.2, "abort": 0.019, "error": 0.001}
        self.counter(
            "vllm:request_success", [(base | {"finished_reason": r}, n) for r, n in reasons_.items()]
        )
        # (name, bounds, median, sigma, observations per request)
        for name, bounds, median, sigma, per in (
            ("vllm:request_prompt_tokens", TOKENS, prompt, 0.8, 1.0),
            ("vllm:request_generation_tokens", TOKENS, gen, 0.6, 1.0),
            ("vllm:request_max_num_generation_tokens", TOKENS, max_tokens, 0.3, 1.0),
            ("vllm:request_params_n", N_PARAM, 1.0, 0.05, 1.0),
            ("vllm:request_params_max_tokens", TOKENS, max_tokens, 0.3, 1.0),
            ("vllm:time_to_first_token_seconds", TTFT, ttft, 0.7, 1.0),
            ("vllm:inter_token_latency_seconds", ITL, itl, 0.4, gen - 1),
            ("vllm:time_per_output_token_seconds", ITL, itl, 0.4, gen - 1),
            ("vllm:request_time_per_output_token_seconds", ITL, itl, 0.3, on_decode),
            ("vllm:e2e_request_latency_seconds", LATENCY, ttft + decode_s + 0.05, 0.7, 1.0),
            ("vllm:request_queue_time_seconds", LATENCY, 0.02, 1.2, 1.0),
            ("vllm:request_inference_time_seconds", LATENCY, 0.8 * ttft + decode_s, 0.7, 1.0),
            ("vllm:request_prefill_time_seconds", LATENCY, 0.8 * ttft, 0.7, 1.0),
            ("vllm:request_decode_time_seconds", LATENCY, max(decode_s, 0.001), 0.7, 1.0),
            ("vllm:request_prefill_kv_computed_tokens", TOKENS, max(computed, 1.0), 0.9, 1.0),
            ("vllm:nixl_xfer_time_seconds", NIXL_TIME[1:], 0.02, 0.6, on_decode),
            ("vllm:nixl_post_time_seconds", NIXL_TIME, 0.002, 0.6, on_decode),
            ("vllm:nixl_bytes_transferred", NIXL_BYTES, prompt * 131072, 0.8, on_decode),
            ("vllm:nixl_num_descriptors", NIXL_DESCRIPTORS, prompt / 8, 0.8, on_decode),
        ):
            self.histogram(name, [base], bounds, median, sigma, [per])
        per_step = self.histogram(
            "vllm:iteration_tokens_total", [base], ITERATION, 512 if prefill else 48, 1.0
        )
        self.step_hists += per_step
        for name in ("vllm:nixl_num_failed_transfers", "vllm:nixl_num_failed_notifications"):
            self.counter(name, [(base, 0.0)])
        self.counter("vllm:nixl_num_kv_expired_reqs", [(base, 0.0)])
        info = {
            "block_size": "16",
            "cache_dtype": "auto",
            "calculate_kv_scales": "False",
            "cpu_kvcache_space_bytes": "None",
            "cpu_offload_gb": "0",
            "enable_prefix_caching": "True",
            "engine": "0",
            "gpu_memory_utilization": "0.9",
            "is_attention_free": "False",
            "kv_cache_memory_bytes": "None",
            "kv_offloading_backend": "None",
            "kv_offloading_size": "None",
            "kv_sharing_fast_prefill": "False",
            "mamba_cache_dtype": "auto",
            "mamba_page_size_padded": "None",
            "num_cpu_blocks": "None",
            "num_gpu_blocks": str(rng.randrange(20000, 60000)),
            "num_gpu_blocks_override": "None",
            "prefix_caching_hash_algo": "sha256",
            "sliding_window": "None",
            "swap_space": "4",
            "swap_space_bytes": "4294967296",
        }
        self.gauge("vllm:cache_config_info", [info], 1.0)
        self.e2e = ttft + decode_s + 0.05
        self.sizes = (prompt * 5, gen * 6 + 400)

    def _http(self) -> None:
        """prometheus-fastapi-instrumentator's default metrics, as vLLM's API server mounts them."""
        req = [{"handler": h, "method": "GET" if h == "/v1/models" else "POST"} for h in HTTP_HANDLERS]
        share = [HTTP_HANDLERS[lab["handler"]] for lab in req]
        self.counter(
            "http_requests", [(lab | {"status": "2xx"}, s) for lab, s in zip(req, share, strict=True)]
        )
        handlers = [{"handler": h} for h in HTTP_HANDLERS]
        for name, size in zip(
            ("http_request_size_bytes", "http_response_size_bytes"), self.sizes, strict=True
        ):
            self.summary(name, [(lab, s, s * size) for lab, s in zip(handlers, share, strict=True)])
        self.histogram("http_request_duration_highr_seconds", [{}], HTTP_HIGHR, self.e2e, 0.7, [1.0])
        self.histogram("http_request_duration_seconds", req, HTTP_FEW, self.e2e, 0.7, share)

    def _process(self) -> None:
        """prometheus_client's process and platform collectors."""
        rng, t = self.rng, self.t
        per_s = 1.0 / self.rate  # a counter advancing by x a second advances by x * per_s a request
        self.gauge("process_virtual_memory_bytes", [{}], float(rng.randrange(30, 60) << 30))
        self.rss = self.gauge("process_resident_memory_bytes", [{}], float(rng.randrange(3, 8) << 30))[0]
        self.gauge("process_start_time_seconds", [{}], float(int(self.created)))
        t.head("process_cpu_seconds_total", "counter")
        self.process_cpu = t.sample("process_cpu_seconds_total", {}, self.uptime * 1.3)
        self.fds = self.gauge("process_open_fds", [{}], float(rng.randrange(200, 400)))[0]
        self.gauge("process_max_fds", [{}], 1048576.0)
        python = {"implementation": "CPython", "major": "3", "minor": "12", "patchlevel": "11"}
        self.gauge("python_info", [python | {"version": "3.12.11"}], 1.0)
        for name, per_second in (
            ("python_gc_objects_collected", 800.0),
            ("python_gc_objects_uncollectable", 0.0),
            ("python_gc_collections", 3.0),
        ):
            t.head(f"{name}_total", "counter")  # no _created: the collector reports none
            for gen, share in (("0", 0.9), ("1", 0.09), ("2", 0.01)):
                i = t.sample(f"{name}_total", {"generation": gen}, per_second * share * self.uptime)
                self.counters.append((i, per_second * share * per_s))

    # -- building: each series starts where ``served`` requests would have taken it --

    def gauge(self, name: str, label_sets: list[Labels], value: float) -> list[int]:
        self.t.head(name, "gauge")
        return [self.t.sample(name, lab, value) for lab in label_sets]

    def _created(self, name: str, label_sets: list[Labels]) -> None:
        self.t.head(f"{name}_created", "gauge")
        for lab in label_sets:
            self.t.sample(f"{name}_created", lab, self.created)

    def counter(self, name: str, series: list[tuple[Labels, float]]) -> None:
        """``series``: (labels, increase per request)."""
        self.t.head(f"{name}_total", "counter")
        for lab, per in series:
            self.counters.append((self.t.sample(f"{name}_total", lab, per * self.served), per))
        self._created(name, [lab for lab, _ in series])

    def summary(self, name: str, series: list[tuple[Labels, float, float]]) -> None:
        """``series``: (labels, observations per request, their sum per request)."""
        self.t.head(name, "summary")
        for lab, count, total in series:
            self.counters.append((self.t.sample(f"{name}_count", lab, count * self.served), count))
            self.counters.append((self.t.sample(f"{name}_sum", lab, total * self.served), total))
        self._created(name, [lab for lab, _, _ in series])

    def histogram(
        self,
        name: str,
        label_sets: list[Labels],
        bounds: list[float],
        median: float,
        sigma: float,
        per: list[float] | None = None,
    ) -> list[Hist]:
        """``per``: observations per request of each series; None: a per-engine-step histogram."""
        t = self.t
        t.head(name, "histogram")
        weights = _lognormal_weights([float(b) for b in bounds], median, sigma)
        mean = median * math.exp(sigma * sigma / 2)
        out = []
        for i, lab in enumerate(label_sets):
            le = [floatToGoString(b) for b in [*bounds, math.inf]]
            buckets = [t.sample(f"{name}_bucket", lab | {"le": b}, 0.0) for b in le]
            count = t.sample(f"{name}_count", lab, 0.0)
            total = t.sample(f"{name}_sum", lab, 0.0)
            rate = STEPS_PER_S / self.rate if per is None else per[i]
            h = Hist(buckets, count, total, weights, mean, rate, [0.0] * len(weights))
            self._observe(h, self.served * h.per)
            out.append(h)
            if per is not None:
                self.hists.append(h)
        self._created(name, label_sets)
        return out

    # -- running --

    def _observe(self, h: Hist, n: float) -> None:
        if n <= 0:
            return
        v = self.t.values
        acc = h.acc
        cumulative = 0.0
        for i, (w, idx) in enumerate(zip(h.weights, h.buckets, strict=True)):
            acc[i] += n * w
            cumulative += math.floor(acc[i])
            v[idx] = cumulative
        v[h.count] = cumulative
        v[h.total] += n * h.mean

    def advance(self, now: float) -> None:
        """Move every series on by the time since the last scrape."""
        rng = self.rng
        dt = max(0.0, now - self.at)
        self.at = now
        x = self.rate * dt * rng.uniform(0.6, 1.4) + self.carry
        n = math.floor(x)
        self.carry = x - n
        v, acc = self.t.values, self.acc
        for idx, per in self.counters:
            acc[idx] += n * per
            v[idx] = math.floor(acc[idx])
        for h in self.hists:
            self._observe(h, n * h.per)
        for h in self.step_hists:
            self._observe(h, dt * STEPS_PER_S)
        waiting = float(rng.choice((0, 0, 0, 0, 1, 2, 5)))
        v[self.running] = max(0.0, round(self.rate * (0.4 if self.prefill else 6.0) * rng.uniform(0.6, 1.4)))
        v[self.waiting] = waiting
        v[self.waiting_reason] = waiting
        v[self.kv] = min(1.0, max(0.0, v[self.kv] + rng.uniform(-0.05, 0.05)))
        v[self.process_cpu] += dt * 1.3
        v[self.rss] += rng.choice((-1, 0, 1)) * 4096.0
        v[self.fds] = max(100.0, v[self.fds] + rng.choice((-1, 0, 1)))

    def scrape(self) -> bytes:
        self.scrapes += 1
        self.advance(time.time())
        return self.t.render()


class Farm:
    def __init__(self, count: int, seed: int) -> None:
        now = time.time()
        self.engines = [Engine(i, random.Random(seed * 1000 + i), now) for i in range(count)]
        self.by_port: dict[int, Engine] = {}
        self.times: list[float] = []  # when each scrape arrived (time.time()), since the last /farm/stats

    async def metrics(self, request: web.Request) -> web.Response:
        sock = request.transport.get_extra_info("sockname") if request.transport else None
        engine = self.by_port.get(sock[1]) if sock else None
        if engine is None:
            return web.Response(status=404)
        self.times.append(time.time())
        return web.Response(body=engine.scrape(), headers={"Content-Type": CONTENT_TYPE})

    async def health(self, request: web.Request) -> web.Response:
        return web.Response()

    async def stats(self, request: web.Request) -> web.Response:
        """The bench's view: scrapes so far, and the arrival time of each since the last call."""
        times, self.times = self.times, []
        return web.json_response({"scrapes": sum(e.scrapes for e in self.engines), "times": times})


async def serve(count: int, seed: int) -> None:
    farm = Farm(count, seed)
    app = web.Application()
    app.router.add_get("/metrics", farm.metrics)
    app.router.add_get("/health", farm.health)
    app.router.add_get("/farm/stats", farm.stats)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    ports = []
    for engine in farm.engines:
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
        farm.by_port[port] = engine
        await web.SockSite(runner, sock).start()
        ports.append(port)
    size = len(Engine(0, random.Random(seed), time.time()).scrape())
    print(f"event=listening ports={','.join(map(str, ports))} bytes={size}", file=sys.stderr, flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    scrapes = sum(e.scrapes for e in farm.engines)
    print(f"event=stopped scrapes={scrapes}", file=sys.stderr, flush=True)
    await runner.cleanup()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.loadgen.metrics_farm")
    p.add_argument("--count", type=int, default=62, help="stand-in engine endpoints (one port each)")
    p.add_argument("--seed", type=int, default=1)
    args = p.parse_args(argv)
    asyncio.run(serve(args.count, args.seed))
    return 0


if __name__ == "__main__":
    sys.exit(main())
