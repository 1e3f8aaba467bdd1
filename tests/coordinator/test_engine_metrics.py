"""Aggregation of the engines' metrics by meaning (services/coordinator/engine_metrics): the
rules table, every view, histograms with different bounds, the derived series, and the three
output forms checked by their own parsers."""

from __future__ import annotations

import math

import pytest
from google.protobuf import json_format
from hypothesis import given
from hypothesis import strategies as st
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest
from prometheus_client.parser import text_string_to_metric_families

from motor_mesh.coordinator.engine_metrics import exposition, parse
from motor_mesh.coordinator.engine_metrics.aggregate import aggregate
from motor_mesh.coordinator.engine_metrics.rules import Kind, kind_of
from motor_mesh.coordinator.engine_metrics.snapshot import Engine, Snapshot, decode, encode


def vllm_text(running: int, waiting: int, usage: float, prompt: int, gen: int, ttft: list[int],
              bounds: tuple[str, ...] = ("0.1", "1.0"), engine: str = "0", hits: int = 0,
              queries: int = 0) -> str:  # fmt: skip
    """A vLLM-like exposition: ``ttft`` is the count per bucket (not cumulative), +Inf last."""
    lines = [
        "# HELP process_cpu_seconds_total CPU.",
        "# TYPE process_cpu_seconds_total counter",
        "process_cpu_seconds_total 12.0",
        "# HELP vllm:num_requests_running Running.",
        "# TYPE vllm:num_requests_running gauge",
        f'vllm:num_requests_running{{engine="{engine}",model_name="m"}} {running}',
        "# HELP vllm:num_requests_waiting Waiting.",
        "# TYPE vllm:num_requests_waiting gauge",
        f'vllm:num_requests_waiting{{engine="{engine}",model_name="m"}} {waiting}',
        "# HELP vllm:kv_cache_usage_perc KV usage.",
        "# TYPE vllm:kv_cache_usage_perc gauge",
        f'vllm:kv_cache_usage_perc{{engine="{engine}",model_name="m"}} {usage}',
        "# HELP vllm:prompt_tokens_total Prompt tokens.",
        "# TYPE vllm:prompt_tokens_total counter",
        f'vllm:prompt_tokens_total{{engine="{engine}",model_name="m"}} {prompt}',
        f'vllm:prompt_tokens_created{{engine="{engine}",model_name="m"}} 1.7e9',
        "# HELP vllm:generation_tokens_total Generation tokens.",
        "# TYPE vllm:generation_tokens_total counter",
        f'vllm:generation_tokens_total{{engine="{engine}",model_name="m"}} {gen}',
        "# HELP vllm:prefix_cache_hits_total Hits.",
        "# TYPE vllm:prefix_cache_hits_total counter",
        f'vllm:prefix_cache_hits_total{{engine="{engine}",model_name="m"}} {hits}',
        "# HELP vllm:prefix_cache_queries_total Queries.",
        "# TYPE vllm:prefix_cache_queries_total counter",
        f'vllm:prefix_cache_queries_total{{engine="{engine}",model_name="m"}} {queries}',
        "# HELP vllm:time_to_first_token_seconds TTFT.",
        "# TYPE vllm:time_to_first_token_seconds histogram",
    ]
    cumulative = 0
    for le, n in zip((*bounds, "+Inf"), ttft, strict=True):
        cumulative += n
        lines.append(
            f'vllm:time_to_first_token_seconds_bucket{{engine="{engine}",le="{le}",model_name="m"}} {cumulative}'
        )
    lines.append(f'vllm:time_to_first_token_seconds_count{{engine="{engine}",model_name="m"}} {cumulative}')
    lines.append(
        f'vllm:time_to_first_token_seconds_sum{{engine="{engine}",model_name="m"}} {cumulative * 0.5}'
    )
    return "\n".join(lines) + "\n"


def engine(iid: int, role: str, text: str, host: str = "10.0.0.1", port: int = 10000, rank: int = 0,
           prev: str | None = None, elapsed: float = 3.0) -> Engine:  # fmt: skip
    fams = parse.parse(text)
    rates = parse.rates(fams, parse.parse(prev) if prev else (), elapsed)
    return Engine(iid, role, host, port, rank, 1.0, "", fams, rates)


def samples(families: list, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    return {k: v for f in families for s, k, v in f.samples if s == name}


def one(families: list, name: str, **labels: str) -> float:
    found = [v for k, v in samples(families, name).items() if labels.items() <= dict(k).items()]
    assert len(found) == 1, (name, labels, found)
    return found[0]


@pytest.fixture
def pool() -> list[Engine]:
    return [
        engine(1, "prefill", vllm_text(2, 5, 0.2, 1000, 10, [1, 2, 0]), port=10000),
        engine(2, "prefill", vllm_text(1, 3, 0.6, 500, 5, [3, 0, 1]), port=10002, host="10.0.0.2"),
        engine(3, "decode", vllm_text(8, 0, 0.9, 0, 400, [4, 0, 0]), port=10004, rank=1),
    ]


def test_the_rules_table_sums_queues_averages_usage_and_keeps_histograms() -> None:
    assert kind_of("vllm:num_requests_waiting", "gauge") is Kind.SUM
    assert kind_of("vllm:kv_cache_usage_perc", "gauge") is Kind.MEAN
    assert kind_of("sglang:token_usage", "gauge") is Kind.MEAN
    assert kind_of("sglang:num_queue_reqs", "gauge") is Kind.SUM
    assert kind_of("vllm:some_new_ratio", "gauge") is Kind.MEAN
    assert kind_of("vllm:cache_config_info", "gauge") is Kind.MAX
    assert kind_of("vllm:prompt_tokens", "counter") is Kind.SUM
    assert kind_of("vllm:time_to_first_token_seconds", "histogram") is Kind.HISTOGRAM
    assert kind_of("vllm:x", "summary") is Kind.SUMMARY


def test_parse_keeps_only_the_engines_families_and_drops_created() -> None:
    fams = parse.parse(vllm_text(1, 0, 0.5, 10, 1, [1, 0, 0]))
    names = {s for f in fams for s, _, _ in f.samples}
    assert "process_cpu_seconds_total" not in names
    assert "vllm:prompt_tokens_total" in names
    assert not any(n.endswith("_created") for n in names)


def test_the_full_view_sums_counters_and_queues_and_averages_usage(pool: list[Engine]) -> None:
    fams = aggregate(pool, "full")
    assert one(fams, "vllm:num_requests_running") == 11
    assert one(fams, "vllm:num_requests_waiting") == 8
    assert one(fams, "vllm:prompt_tokens_total") == 1500
    assert one(fams, "vllm:kv_cache_usage_perc") == pytest.approx((0.2 + 0.6 + 0.9) / 3)
    assert one(fams, "vllm:kv_cache_usage_perc_max") == 0.9
    # The engine label is dropped, model_name kept.
    assert all("engine" not in dict(k) for f in fams for _, k, _ in f.samples)
    assert dict(next(iter(samples(fams, "vllm:num_requests_running")))) == {"model_name": "m"}


def test_each_view_adds_its_labels(pool: list[Engine]) -> None:
    by_role = aggregate(pool, "role")
    assert one(by_role, "vllm:num_requests_waiting", role="prefill") == 8
    assert one(by_role, "vllm:num_requests_running", role="decode") == 8
    assert one(by_role, "vllm:kv_cache_usage_perc", role="prefill") == pytest.approx(0.4)
    assert one(by_role, "vllm:kv_cache_usage_perc_max", role="prefill") == 0.6
    by_instance = aggregate(pool, "instance")
    assert one(by_instance, "vllm:num_requests_running", instance_id="2", role="prefill") == 1
    assert len(samples(by_instance, "vllm:num_requests_running")) == 3
    by_dp = aggregate(pool, "dp")
    assert one(by_dp, "vllm:num_requests_running", instance_id="3", dp_rank="1", host="10.0.0.1") == 8
    by_node = aggregate(pool, "node")
    assert one(by_node, "vllm:num_requests_running", host="10.0.0.1") == 10
    assert one(by_node, "vllm:num_requests_running", host="10.0.0.2") == 1
    # An unknown view is the full one.
    assert aggregate(pool, "bogus") == aggregate(pool, "full")


def test_histograms_merge_bucket_wise(pool: list[Engine]) -> None:
    fams = aggregate(pool, "role")
    buckets = {dict(k)["le"]: v for k, v in samples(fams, "vllm:time_to_first_token_seconds_bucket").items()
               if dict(k)["role"] == "prefill"}  # fmt: skip
    assert buckets == {"0.1": 4, "1.0": 6, "+Inf": 7}
    assert one(fams, "vllm:time_to_first_token_seconds_count", role="prefill") == 7


def test_histograms_with_different_bounds_merge_on_every_bound() -> None:
    a = engine(1, "decode", vllm_text(0, 0, 0, 0, 0, [1, 1, 1], bounds=("0.1", "1.0")))
    b = engine(2, "decode", vllm_text(0, 0, 0, 0, 0, [2, 2, 2], bounds=("0.5", "1.0")), port=2)
    fams = aggregate([a, b], "full")
    buckets = {dict(k)["le"]: v for k, v in samples(fams, "vllm:time_to_first_token_seconds_bucket").items()}
    # b has no 0.1 bound: it counts 0 there (nothing at or below it that it knows of); a has no
    # 0.5 bound: it counts what it has at 0.1.
    assert buckets == {"0.1": 1, "0.5": 1 + 2, "1.0": 2 + 4, "+Inf": 3 + 6}
    values = [buckets[k] for k in ("0.1", "0.5", "1.0", "+Inf")]
    assert values == sorted(values)  # still cumulative


def test_derived_series_rates_workers_and_hit_rate() -> None:
    before = vllm_text(0, 0, 0, 1000, 100, [0, 0, 0], hits=100, queries=1000)
    after_p = vllm_text(0, 0, 0, 1600, 103, [0, 0, 0], hits=400, queries=1600)
    after_d = vllm_text(0, 0, 0, 1000, 400, [0, 0, 0])
    p = engine(1, "prefill", after_p, prev=before, elapsed=3.0)
    d = engine(2, "decode", after_d, prev=before, elapsed=3.0, port=2)
    fams = aggregate([p, d], "full")
    assert one(fams, "motor:prompt_tokens_per_second", role="prefill") == pytest.approx(200)
    assert one(fams, "motor:generation_tokens_per_second", role="decode") == pytest.approx(100)
    assert one(fams, "motor:active_prefill_workers") == 1
    assert one(fams, "motor:active_decode_workers") == 1
    # Over the interval: prefill 300 hits of 600 queries; decode's counters went down (a
    # restarted engine): it adds no delta.
    assert one(fams, "motor:prefix_cache_hit_rate") == pytest.approx(0.5)
    first = engine(1, "prefill", after_p)  # no earlier scrape: no rate yet
    assert one(aggregate([first], "full"), "motor:prompt_tokens_per_second", role="prefill") == 0
    assert one(aggregate([first], "full"), "motor:prefix_cache_hit_rate") == pytest.approx(0.25)


def test_the_prometheus_text_parses_back_to_the_same_values(pool: list[Engine]) -> None:
    fams = aggregate(pool, "instance")
    text = exposition.prometheus(fams).decode()
    parsed = {(s.name, tuple(sorted(s.labels.items()))): s.value
              for f in text_string_to_metric_families(text) for s in f.samples}  # fmt: skip
    expected = {(s, tuple(sorted(k))): v for f in fams for s, k, v in f.samples}
    assert parsed == expected
    assert "# TYPE vllm:time_to_first_token_seconds histogram" in text
    assert "# TYPE vllm:prompt_tokens_total counter" in text


def test_otlp_json_is_a_valid_export_request(pool: list[Engine]) -> None:
    fams = aggregate(pool, "role")
    body = exposition.otlp_json(fams, 1700000000.5)
    req = json_format.Parse(body, ExportMetricsServiceRequest())
    metrics = {m.name: m for m in req.resource_metrics[0].scope_metrics[0].metrics}
    hist = metrics["vllm:time_to_first_token_seconds"].histogram
    point = next(
        p
        for p in hist.data_points
        if {a.key: a.value.string_value for a in p.attributes}["role"] == "prefill"
    )
    assert list(point.explicit_bounds) == [0.1, 1.0]
    assert list(point.bucket_counts) == [4, 2, 1]  # per bucket, not cumulative
    assert point.count == 7
    counter = metrics["vllm:prompt_tokens"].sum
    assert counter.is_monotonic and counter.aggregation_temporality == 2
    assert metrics["vllm:num_requests_running"].gauge.data_points[0].time_unix_nano == 1700000000500000000


def test_protos_carry_every_sample(pool: list[Engine]) -> None:
    fams = aggregate(pool, "full")
    protos = exposition.protos(fams)
    assert [p.name for p in protos] == [f.name for f in fams]
    assert sum(len(p.samples) for p in protos) == sum(len(f.samples) for f in fams)


def test_a_snapshot_survives_its_file_form(pool: list[Engine]) -> None:
    nan = engine(9, "union", vllm_text(0, 0, math.nan, 0, 0, [0, 0, 0]), port=9)
    snap = Snapshot(3, 12.5, 15.0, (*pool, nan))
    back = decode(encode(snap))
    assert back.engines[:3] == snap.engines[:3]
    assert math.isnan(one(aggregate([back.engines[3]], "full"), "vllm:kv_cache_usage_perc"))
    with pytest.raises((ValueError, KeyError, TypeError)):
        decode(b'{"seq": 1}')


def test_the_text_writer_escapes_what_the_format_needs() -> None:
    text = (
        "# HELP vllm:odd A help\\nover two lines with a \\\\ in it.\n"
        "# TYPE vllm:odd gauge\n"
        'vllm:odd{model_name="a \\"quoted\\" \\\\ name\\nwith a newline"} 1.5\n'
        "# HELP vllm:inf Infinite.\n"
        "# TYPE vllm:inf gauge\n"
        "vllm:inf +Inf\n"
    )
    fams = aggregate([engine(1, "decode", text)], "full")
    out = exposition.prometheus(fams).decode()
    back = {f.name: f for f in text_string_to_metric_families(out)}
    assert back["vllm:odd"].documentation == "A help\nover two lines with a \\ in it."
    assert back["vllm:odd"].samples[0].labels["model_name"] == 'a "quoted" \\ name\nwith a newline'
    assert back["vllm:inf"].samples[0].value == math.inf


ODD = """# HELP vllm:a_total A counter\\nwith two lines and a \\\\.
# TYPE vllm:a_total counter
vllm:a_total{engine="0",model_name="m"} 3
vllm:a_created{engine="0",model_name="m"} 1.7e9
# TYPE vllm:b counter
vllm:b{model_name="m"} 2
# HELP vllm:s A summary.
# TYPE vllm:s summary
vllm:s{quantile="0.5"} 1
vllm:s_count 4
vllm:s_sum 8.5
vllm:stray{x="y z"} 7
vllm:s_count 5
# TYPE vllm:h histogram
vllm:h_bucket{le="0.5",model_name="m"} 1
vllm:h_bucket{le="+Inf",model_name="m"} 2
vllm:h_count{model_name="m"} 2
vllm:h_sum{model_name="m"} 1.25
vllm:h_created{model_name="m"} 1.7e9
# HELP vllm:u An untyped one.
vllm:u{model_name="a } brace"} NaN
vllm:v -Inf
sglang:w{a="1"} 1.5 1700000000000
"""


def test_the_series_cache_parses_as_prometheus_client_does() -> None:
    parser = parse.Parser()
    for text in (ODD, vllm_text(2, 5, 0.2, 1000, 10, [1, 2, 0]), ODD):  # ODD twice: warm cache
        assert repr(parser.parse(text)) == repr(parse.whole(text))
    # A sample line it does not handle (a quoted name) goes to prometheus_client whole.
    quoted = '# TYPE vllm:q gauge\nvllm:q{"odd name"="1"} 2\n'
    assert parser.parse(quoted) == parse.whole(quoted)
    with pytest.raises(ValueError):
        parser.parse("# TYPE vllm:x\n")
    with pytest.raises(ValueError):
        parser.parse("vllm:x{a=1} 2\n")


label_value = st.text(st.characters(codec="utf-8", exclude_characters='"\\\n\r'), max_size=8)


@given(
    st.lists(
        st.tuples(
            st.sampled_from(["vllm:g", "vllm:c_total", "vllm:h_bucket", "vllm:h_count", "sglang:x"]),
            st.dictionaries(st.sampled_from(["engine", "model_name", "le", "k"]), label_value, max_size=3),
            st.floats(allow_nan=False, width=32),
        ),
        max_size=12,
    ),
    st.lists(
        st.sampled_from(["# TYPE vllm:h histogram", "# TYPE vllm:c_total counter", "# HELP vllm:g G."]),
        max_size=3,
    ),
)
def test_any_exposition_parses_as_prometheus_client_does(
    samples: list[tuple[str, dict[str, str], float]], comments: list[str]
) -> None:
    lines = list(comments)
    for name, labels, value in samples:
        inner = ",".join(f'{k}="{v}"' for k, v in labels.items())
        lines.append(f"{name}{{{inner}}} {value!r}" if labels else f"{name} {value!r}")
    text = "\n".join(lines) + "\n"
    try:
        expected = parse.whole(text)
    except ValueError:
        with pytest.raises(ValueError):
            parse.Parser().parse(text)
        return
    parser = parse.Parser()
    assert repr(parser.parse(text)) == repr(expected)
    assert repr(parser.parse(text)) == repr(expected)  # from the cache
