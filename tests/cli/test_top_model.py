"""``motor top``'s arithmetic (services/cli/top_model.py): percentiles from histogram buckets as
Prometheus' histogram_quantile reads them, the interval between two collections (bucket and
counter differences, resets, a collection seen twice), and the document built from hand-built
GetEngineMetrics answers."""

from __future__ import annotations

import math

import pytest

from motor_mesh.cli.top_model import (
    Collection,
    ControllerView,
    Series,
    TopModel,
    Window,
    bucket_delta,
    quantile,
)
from motor_mesh.gen.motor.v1 import alarm_pb2, coordinator_pb2
from tests.cli.top_data import T0, Cluster, Instance, realistic

INF = math.inf
INSTANCE = coordinator_pb2.GetEngineMetricsRequest(
    view=coordinator_pb2.ENGINE_METRICS_VIEW_INSTANCE, include_coordinator=True
)
ROLE = coordinator_pb2.GetEngineMetricsRequest(view=coordinator_pb2.ENGINE_METRICS_VIEW_ROLE)


def refresh(model: TopModel, cluster: Cluster, controller: ControllerView | None = None) -> dict:
    return model.update(cluster.response(INSTANCE), cluster.response(ROLE), controller or ControllerView())


def instance(doc: dict, iid: int) -> dict:
    return next(i for i in doc["instances"] if i["instance_id"] == iid)


# ---- quantile -------------------------------------------------------------------------------------


def test_quantile_interpolates_linearly_within_the_bucket_the_rank_falls_in() -> None:
    buckets = {0.1: 10, 0.5: 30, 1.0: 40, INF: 40}
    # rank 20 of 40: in (0.1, 0.5], 10 of its 20 observations in -> halfway.
    assert quantile(0.5, buckets) == pytest.approx(0.3)
    # rank 39.6: in (0.5, 1.0], 9.6 of its 10 in.
    assert quantile(0.99, buckets) == pytest.approx(0.98)
    # The first bucket starts at 0.
    assert quantile(0.05, buckets) == pytest.approx(0.02)


def test_quantile_of_nothing_is_none_like_prometheus_nan() -> None:
    assert quantile(0.5, {}) is None
    assert quantile(0.5, {0.1: 0, 1.0: 0, INF: 0}) is None  # no observations
    assert quantile(0.5, {INF: 12}) is None  # +Inf only: fewer than two buckets
    assert quantile(0.5, {0.1: 3, 1.0: 5}) is None  # no +Inf bucket


def test_a_rank_in_the_inf_bucket_is_the_largest_finite_bound() -> None:
    assert quantile(0.99, {0.1: 1, 1.0: 2, INF: 10}) == 1.0
    assert quantile(0.5, {0.25: 0, INF: 4}) == 0.25


def test_a_first_bucket_at_or_below_zero_answers_its_bound() -> None:
    assert quantile(0.5, {0.0: 5, 1.0: 6, INF: 6}) == 0.0


def test_float_noise_that_makes_buckets_go_down_is_evened_out() -> None:
    # 30 then 29.999999 (float sums of merged buckets): taken as 30 from there on.
    noisy = {0.1: 10, 0.5: 30, 1.0: 29.999999, INF: 40}
    even = {0.1: 10, 0.5: 30, 1.0: 30, INF: 40}
    for q in (0.5, 0.7, 0.75, 0.76, 0.99):
        assert quantile(q, noisy) == quantile(q, even)
    assert quantile(0.7, noisy) == pytest.approx(0.1 + 0.4 * 18 / 20)


# ---- the interval ---------------------------------------------------------------------------------


def test_bucket_delta_is_what_was_observed_in_between() -> None:
    earlier = {0.1: 10, 1.0: 20, INF: 20}
    current = {0.1: 10, 1.0: 25, INF: 30}
    assert bucket_delta(current, earlier) == {0.1: 0, 1.0: 5, INF: 10}
    assert quantile(0.5, bucket_delta(current, earlier)) == 1.0  # rank 5 of 10: top of (0.1, 1]


def test_bucket_delta_counts_from_zero_after_a_reset_or_with_nothing_before() -> None:
    current = {0.1: 2, 1.0: 3, INF: 3}
    assert bucket_delta(current, {0.1: 5, 1.0: 9, INF: 9}) == current  # the engine restarted
    assert bucket_delta(current, {0.5: 1, INF: 1}) == current  # other bounds
    assert bucket_delta(current, None) == current
    assert bucket_delta(current, {}) == current


def test_an_interval_with_no_observations_has_no_percentiles() -> None:
    same = {0.1: 4, 1.0: 8, INF: 8}
    assert quantile(0.5, bucket_delta(same, dict(same))) is None


def test_the_window_spans_the_two_newest_distinct_collections() -> None:
    w = Window()
    w.push(Collection(None, {}))  # before the first collection
    assert w.seconds is None
    w.push(Collection(100.0, {"a": Series()}))
    assert w.seconds is None and w.base("a") is None  # one collection: cumulative
    w.push(Collection(103.0, {}))
    assert w.seconds == 3.0 and w.base("a") is not None and w.base("new") == Series()
    # The same collection again (a refresh faster than the Coordinator collects): the interval stays.
    w.push(Collection(103.0, {}))
    assert w.seconds == 3.0 and w.earlier is not None and w.earlier.at == 100.0
    w.push(Collection(109.0, {}))
    assert w.seconds == 6.0


# ---- the document ---------------------------------------------------------------------------------


def test_the_first_frame_is_cumulative_and_takes_tokens_per_second_from_the_derived_series() -> None:
    doc = refresh(TopModel("c:1"), realistic())
    assert doc["window_s"] is None
    p = instance(doc, 1)
    assert p["prompt_tokens_per_second"] == 1500  # motor:prompt_tokens_per_second
    # 50 TTFT observations since start: 40 at 0.05, 9 at 0.09, 1 at 0.3.
    assert p["ttft_p50_s"] == pytest.approx(0.04 + 0.02 * 25 / 40)
    assert p["ttft_p99_s"] == pytest.approx(0.25 + 0.25 * 0.5)
    assert p["tpot_p50_s"] is None  # a prefill engine: no TPOT observations


def test_later_frames_use_the_interval_between_collections() -> None:
    cluster = realistic()
    model = TopModel("c:1")
    refresh(model, cluster)
    p = cluster.instances[0]
    # 3 s later: 30 more requests, all slow; 4500 more prompt tokens.
    cluster.collect_time = T0 + 3
    p.ttft += [0.7] * 30
    p.prompt_tokens += 4500
    doc = refresh(model, cluster)
    assert doc["window_s"] == 3.0
    i1 = instance(doc, 1)
    assert i1["prompt_tokens_per_second"] == pytest.approx(1500.0)  # 4500 tokens / 3 s
    # Only the 30 new ones, all in (0.5, 1.0].
    assert i1["ttft_p50_s"] == pytest.approx(0.5 + 0.5 * 15 / 30)
    assert i1["ttft_p99_s"] == pytest.approx(0.5 + 0.5 * 29.7 / 30)
    assert doc["roles"]["prefill"]["ttft_p50_s"] == pytest.approx(i1["ttft_p50_s"])
    # Nothing happened on decode in between: no percentiles, no tokens.
    i2 = instance(doc, 2)
    assert i2["tpot_p50_s"] is None and i2["generation_tokens_per_second"] == 0
    # A refresh that finds the same collection shows the same interval.
    again = refresh(model, cluster)
    assert again["window_s"] == 3.0 and instance(again, 1) == i1


def test_a_restarted_engine_counts_from_zero() -> None:
    cluster = realistic()
    model = TopModel("c:1")
    refresh(model, cluster)
    p = cluster.instances[0]
    cluster.collect_time = T0 + 2
    p.ttft = [0.015] * 4
    p.prompt_tokens = 100
    i1 = instance(refresh(model, cluster), 1)
    assert i1["prompt_tokens_per_second"] == pytest.approx(50.0)
    assert i1["ttft_p50_s"] == pytest.approx(0.01 + 0.01 * 0.5)


def test_every_scraped_instance_is_listed_with_nulls_until_it_has_data() -> None:
    doc = refresh(TopModel("c:1"), realistic())
    assert [i["instance_id"] for i in doc["instances"]] == [1, 2, 3]
    i3 = instance(doc, 3)
    assert i3["role"] == "decode" and i3["engines"][0]["fresh"] is False
    assert i3["engines"][0]["last_success_time"] is None
    figures = {k: v for k, v in i3.items() if k not in ("instance_id", "role", "status", "engines")}
    assert set(figures.values()) == {None}
    i2 = instance(doc, 2)
    assert [e["fresh"] for e in i2["engines"]] == [True, False]
    assert i2["engines"][1]["error"] == "connection refused"
    assert i2["kv_cache_usage"] == pytest.approx(0.625) and i2["kv_cache_usage_max"] == 0.75


def test_roles_sum_the_load_and_average_the_kv_cache_with_its_max() -> None:
    cluster = realistic()
    cluster.instances.append(
        Instance(id=4, role="decode", running=3, waiting=2, kv=[0.1], generation_tps=200)
    )
    doc = refresh(TopModel("c:1"), cluster)
    decode = doc["roles"]["decode"]
    assert (decode["running"], decode["waiting"]) == (10, 2)
    assert decode["kv_cache_usage"] == pytest.approx((0.5 + 0.75 + 0.1) / 3)
    assert decode["kv_cache_usage_max"] == 0.75
    assert decode["generation_tokens_per_second"] == 1000
    assert (decode["instances"], decode["engines"], decode["stale_engines"]) == (3, 4, 2)
    assert doc["active_workers"] == {"prefill": 1, "decode": 2}


def test_sglang_series_fill_the_same_columns() -> None:
    cluster = Cluster(
        instances=[
            Instance(
                id=5,
                role="decode",
                engine="sglang",
                running=4,
                waiting=1,
                kv=[0.4],
                tpot=[0.03] * 10,
                ttft=[0.05] * 10,
            )
        ]
    )
    doc = refresh(TopModel("c:1"), cluster)
    i5 = instance(doc, 5)
    assert (i5["running"], i5["waiting"], i5["kv_cache_usage"]) == (4, 1, 0.4)
    assert i5["tpot_p50_s"] == pytest.approx(0.025 + 0.025 * 0.5)  # 5 of the 10 in (0.025, 0.05]
    assert i5["ttft_p50_s"] == pytest.approx(0.04 + 0.02 * 0.5)
    assert doc["roles"]["decode"]["tpot_p50_s"] == pytest.approx(i5["tpot_p50_s"])


def test_prefill_and_decode_are_always_there_even_with_no_engines() -> None:
    empty = Cluster(instances=[], collect_time=None)
    doc = refresh(TopModel("c:1"), empty)
    assert list(doc["roles"]) == ["prefill", "decode"]
    assert doc["roles"]["decode"]["running"] is None and doc["roles"]["decode"]["instances"] == 0
    assert doc["instances"] == [] and doc["collect_time"] is None
    union = Cluster(instances=[Instance(id=9, role="union", running=1)])
    assert list(refresh(TopModel("c:1"), union)["roles"]) == ["prefill", "decode", "union"]


def test_migrations_total_by_outcome_by_reason_and_since_the_last_frame() -> None:
    cluster = realistic()
    model = TopModel("c:1")
    first = refresh(model, cluster)["migrations"]
    assert first == {
        "total": 3,
        "by_outcome": {"completed": 1, "continued": 2, "refused": 0},
        "by_reason": {"disconnect": 2, "drain": 1, "timeout": 0},
        "new": None,
    }
    cluster.migrations[("disconnect", "continued")] += 2
    assert refresh(model, cluster)["migrations"]["new"] == 2


def test_no_coordinator_series_no_migrations() -> None:
    cluster = realistic()
    doc = TopModel("c:1").update(cluster.response(ROLE), cluster.response(ROLE), ControllerView())
    assert doc["migrations"] is None


def test_the_controller_adds_status_and_alarms_newest_first() -> None:
    alarms = [
        alarm_pb2.Alarm(
            sequence=4, alarm_id="0xFC001002", severity=alarm_pb2.SEVERITY_MAJOR, instance_id=2, reason="r4"
        ),
        alarm_pb2.Alarm(sequence=9, alarm_id="0xFC001004", severity=alarm_pb2.SEVERITY_CRITICAL, reason="r9"),
    ]
    view = ControllerView(address="h:7100", statuses={1: "ACTIVE", 2: "INACTIVE"}, alarms=alarms)
    doc = refresh(TopModel("c:1"), realistic(), view)
    assert [instance(doc, i)["status"] for i in (1, 2, 3)] == ["ACTIVE", "INACTIVE", None]
    assert [a["sequence"] for a in doc["alarms"]] == [9, 4]
    assert doc["alarms"][1] == {
        "sequence": 4,
        "alarm_id": "0xFC001002",
        "severity": "MAJOR",
        "instance_id": 2,
        "reason": "r4",
        "time": None,
    }
    assert doc["controller"] == {"address": "h:7100", "error": None}
    # Without a Controller: nothing from it, said so.
    alone = refresh(TopModel("c:1"), realistic())
    assert alone["controller"] is None and alone["alarms"] is None
    assert {i["status"] for i in alone["instances"]} == {None}
