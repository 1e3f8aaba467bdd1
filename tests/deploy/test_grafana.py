"""deploy/grafana/motor.json is a dashboard Grafana imports as it is: one Prometheus data source
chosen at import (the ``datasource`` variable), panels that do not overlap, every query in
PromQL with its metrics named. That those metrics exist on a running ``motor up`` is
tests/deploy/test_prometheus.py's (it needs Prometheus); the Controller's are checked here too,
against what its collector renders in process."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from prometheus_client import generate_latest

from motor_mesh.controller import metrics
from motor_mesh.controller.app import Controller
from tests.controller.fakes import controller_cfg
from tests.deploy.promql import (
    dashboard,
    dashboard_queries,
    exported_names,
    metric_names,
    missing_metrics,
    panels,
)


@pytest.fixture(scope="module")
def dash() -> dict[str, Any]:
    return dashboard()


def test_dashboard_asks_for_its_prometheus_at_import(dash: dict[str, Any]) -> None:
    assert dash["uid"] and dash["title"] == "Motor"
    assert 36 <= dash["schemaVersion"] <= 41
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    for where, holder in [
        ("variable namespace", variables["namespace"]),
        *((p["title"], p) for p in panels(dash)),
    ]:
        if holder.get("type") == "row":
            continue
        assert holder["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, where
        for t in holder.get("targets", []):
            assert t["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, where


def test_panels_have_queries_unique_ids_and_do_not_overlap(dash: dict[str, Any]) -> None:
    ids = [p["id"] for p in panels(dash)]
    assert len(ids) == len(set(ids))
    taken: set[tuple[int, int]] = set()
    for p in panels(dash):
        g = p["gridPos"]
        assert g["x"] + g["w"] <= 24, p["title"]
        cells = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert not cells & taken, f"panel {p['title']!r} overlaps another"
        taken |= cells
        if p["type"] != "row":
            refs = [t["refId"] for t in p["targets"]]
            assert refs and len(refs) == len(set(refs)), p["title"]
            assert all(t["expr"].strip() for t in p["targets"]), p["title"]


def test_dashboard_shows_what_operators_look_for(dash: dict[str, Any]) -> None:
    names = set().union(*(metric_names(q) for _, q in dashboard_queries(dash)))
    for metric in [
        "motor_coordinator_requests_total",
        "motor_coordinator_time_to_first_byte_seconds_bucket",
        "motor_coordinator_phase_duration_seconds_bucket",
        "motor_controller_instances",
        "motor_coordinator_retries_total",
        "motor_controller_relaunches_total",
        "motor_controller_strategies_total",
        "motor_controller_alarms_active",
        "motor_controller_heartbeat_ack_seconds_bucket",
        "motor_controller_push_lag_seconds",
        "motor_nodemanager_engine_restarts_total",
        "motor_controller_workqueue_depth",
        "motor_controller_workqueue_adds_total",
        "motor_controller_workqueue_retries_total",
        "motor_controller_workqueue_reconcile_errors_total",
        "motor_controller_workqueue_reconcile_duration_seconds_bucket",
        "motor_controller_workqueue_longest_running_reconcile_seconds",
        # Engine pools: the engines' own series, aggregated per role by the Coordinators.
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:kv_cache_usage_perc_max",
        "motor:prompt_tokens_per_second",
        "motor:generation_tokens_per_second",
        "vllm:time_to_first_token_seconds_bucket",
        "vllm:time_per_output_token_seconds_bucket",
        "motor:prefix_cache_hit_rate",
        "motor:active_prefill_workers",
        "motor:active_decode_workers",
        "motor_desired_instances",
    ]:
        assert metric in names, metric
    exprs = [q for _, q in dashboard_queries(dash)]
    ttft = [q for q in exprs if "time_to_first_byte_seconds_bucket" in q]
    assert {q.split(",")[0] for q in ttft} >= {f"histogram_quantile({p}" for p in ("0.5", "0.9", "0.99")}
    assert any("by (le, phase)" in q for q in exprs if "phase_duration_seconds_bucket" in q)
    for histogram in ("vllm:time_to_first_token_seconds_bucket", "vllm:time_per_output_token_seconds_bucket"):
        merged = [q for q in exprs if histogram in q]
        assert {q.split(",")[0] for q in merged} == {f"histogram_quantile({p}" for p in ("0.5", "0.99")}
        assert all("sum by (le, role)" in q for q in merged), merged


def test_engine_pool_gauges_count_each_coordinator_once(dash: dict[str, Any]) -> None:
    # Every Coordinator serves the same aggregate of the same engines: a sum or average over
    # the engines' gauges first keeps one copy per series (the histograms' quantiles are left
    # as they are by the copies, the _max and max() ones too).
    for where, q in dashboard_queries(dash):
        engine = {n for n in metric_names(q) if n.startswith(("vllm:", "motor:", "sglang:"))}
        if engine and not q.startswith(("histogram_quantile(", "max by (role) (")):
            assert "max without (pod, instance)" in q, f"{where}: {q}"


async def test_every_controller_metric_the_dashboard_names_is_exported(
    dash: dict[str, Any], tmp_path: Path
) -> None:
    controller = Controller(controller_cfg(tmp_path / "state"))
    try:
        exported = exported_names(generate_latest(metrics.registry(controller)).decode())
    finally:
        await controller.stop()
    missing = {
        where: names
        for where, q in dashboard_queries(dash)
        if (
            names := {
                n
                for n in metric_names(q)
                if n.startswith("motor_controller_") or n == "motor_desired_instances"
            }
            - exported
        )
    }
    assert missing == {}


@pytest.mark.parametrize(
    ("expr", "names"),
    [
        (
            'histogram_quantile(0.99, sum by (le, phase) (rate(a_seconds_bucket{x=~"$namespace"}[$__rate_interval])))',
            {"a_seconds_bucket"},
        ),
        ('sum(rate(a_total{status=~"5.."}[5m])) / sum(rate(b_total[5m])) > 1e3', {"a_total", "b_total"}),
        ("(sum by (ns, role) (c > 0)) unless on (ns, role) (sum without (x) (d offset 5m))", {"c", "d"}),
        ('absent(up{component="controller"}) or e == bool 1', {"up", "e"}),
        ("label_values(f_gauge, namespace)", {"f_gauge"}),
        ("vector(1) + inf", set()),
    ],
)
def test_metric_names_of_promql(expr: str, names: set[str]) -> None:
    assert metric_names(expr) == names


def test_a_panel_naming_an_unexported_metric_is_reported(dash: dict[str, Any]) -> None:
    exported = set().union(*(metric_names(q) for _, q in dashboard_queries(dash)))
    assert missing_metrics(dashboard_queries(dash), exported) == {}
    extra = {
        "type": "timeseries",
        "title": "Made up",
        "targets": [{"refId": "A", "expr": "rate(motor_nobody_total[5m])"}],
    }
    dash = {**dash, "panels": [*dash["panels"], extra]}
    assert missing_metrics(dashboard_queries(dash), exported) == {"panel 'Made up' A": {"motor_nobody_total"}}
