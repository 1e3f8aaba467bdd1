"""How each engine series combines across engines: one table, also in docs/engine-metrics.md.

- counters, histograms' ``_count``/``_sum``, and queue or running gauges: **summed** (the
  pool's total);
- usage, ratio and rate gauges: **averaged**, with the maximum beside as ``<name>_max`` (a pool
  at 40 % KV cache usage on average may hold one engine at 100 %);
- ``*_info`` gauges (configuration as labels, value 1): the **maximum** (each distinct label
  set once);
- histograms: **merged bucket-wise** (the counts at each bound added);
- summaries: ``_count`` and ``_sum`` summed; their quantiles cannot be combined and are dropped.

A gauge not named in :data:`MEAN_GAUGES` is averaged when its name says it is a fraction
(``perc``, ``usage``, ``ratio``, ``rate``, ``utilization``), summed otherwise.
"""

from __future__ import annotations

import enum


class Kind(enum.Enum):
    SUM = "sum"
    MEAN = "mean"  # averaged, with <name>_max beside
    MAX = "max"
    HISTOGRAM = "histogram"
    SUMMARY = "summary"


# Engine families understood by name. Every other vllm:* / sglang:* family combines by its type.
MEAN_GAUGES = frozenset(
    {
        "vllm:kv_cache_usage_perc",
        "vllm:gpu_cache_usage_perc",
        "vllm:cpu_cache_usage_perc",
        "vllm:gpu_prefix_cache_hit_rate",
        "vllm:cpu_prefix_cache_hit_rate",
        "vllm:spec_decode_draft_acceptance_rate",
        "vllm:spec_decode_efficiency",
        "sglang:token_usage",
        "sglang:cache_hit_rate",
        "sglang:spec_accept_length",
        "sglang:utilization",
    }
)
SUM_GAUGES = frozenset(
    {
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:num_requests_swapped",
        "vllm:num_preemptions",
        "sglang:num_running_reqs",
        "sglang:num_queue_reqs",
        "sglang:num_used_tokens",
        "sglang:gen_throughput",
    }
)
_FRACTION_WORDS = ("perc", "usage", "ratio", "rate", "utilization")
# What the collector keeps of an engine's /metrics: other families (process_*, python_gc_*,
# the HTTP server's own) describe the process, not the engine's work.
PREFIXES = ("vllm:", "sglang:")


def kind_of(name: str, typ: str) -> Kind:
    if typ == "histogram" or typ == "gaugehistogram":
        return Kind.HISTOGRAM
    if typ == "summary":
        return Kind.SUMMARY
    if typ == "info" or name.endswith("_info"):
        return Kind.MAX
    if typ == "gauge":
        if name in MEAN_GAUGES:
            return Kind.MEAN
        if name in SUM_GAUGES:
            return Kind.SUM
        return Kind.MEAN if any(w in name for w in _FRACTION_WORDS) else Kind.SUM
    return Kind.SUM  # counter, untyped


# Counters the derived series read, by engine protocol: (prompt, generation, prefix hits,
# prefix queries). Sample names, as exposed.
PROMPT_TOKENS = ("vllm:prompt_tokens_total", "sglang:prompt_tokens_total")
GENERATION_TOKENS = ("vllm:generation_tokens_total", "sglang:generation_tokens_total")
PREFIX_HITS = ("vllm:prefix_cache_hits_total",)
PREFIX_QUERIES = ("vllm:prefix_cache_queries_total",)
SGLANG_HIT_RATE = "sglang:cache_hit_rate"
