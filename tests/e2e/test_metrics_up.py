"""``motor up`` turns on ``/metrics`` of the Controller (9100 + offset) and of every NodeManager
(9300 + i + offset), and each exports every one of its metrics with the cluster's state."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.e2e.cluster import CONTROLLER_METRICS, COORDINATOR, NM_METRICS, Cluster
from tests.metrics import Scrape, scrape
from tests.poll import wait_until

CONTROLLER_NAMES = [
    "motor_controller_instances",
    "motor_controller_nodemanagers_connected",
    "motor_controller_heartbeats_total",
    "motor_controller_heartbeat_ack_seconds",
    "motor_controller_strategies_total",
    "motor_controller_strategies_running",
    "motor_controller_relaunches_total",
    "motor_controller_push_lag_seconds",
    "motor_controller_push_failures_total",
    "motor_controller_coordinator_reachable",
    "motor_controller_alarms_active",
    "motor_controller_state_write_failures_total",
    "motor_controller_loop_stalls_total",
    "motor_controller_workqueue_depth",
    "motor_controller_workqueue_adds_total",
    "motor_controller_workqueue_retries_total",
    "motor_controller_workqueue_reconcile_errors_total",
    "motor_controller_workqueue_reconcile_duration_seconds",
    "motor_controller_workqueue_longest_running_reconcile_seconds",
]
NODEMANAGER_NAMES = [
    "motor_nodemanager_engines",
    "motor_nodemanager_engine_restarts_total",
    "motor_nodemanager_engine_exits_total",
    "motor_nodemanager_probe_duration_seconds",
    "motor_nodemanager_probe_failures_total",
    "motor_nodemanager_frozen",
    "motor_nodemanager_controller_connected",
    "motor_nodemanager_engine_output_dropped_lines_total",
]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    c = Cluster(tmp_path_factory.mktemp("metrics-up"), nodes=2)
    try:
        c.wait_ready()
        yield c
    finally:
        c.stop()


def test_the_controller_exports_every_metric_with_the_cluster_state(cluster: Cluster) -> None:
    port = CONTROLLER_METRICS + cluster.off
    assert cluster.proc.search(rf"\[controller\] .*event=listening .*metrics=127\.0\.0\.1:{port}\b")
    coordinator = cluster.grpc(COORDINATOR)

    def settled() -> Scrape:
        m = scrape(cluster.metrics_url(CONTROLLER_METRICS))
        assert m.value("motor_controller_instances", role="prefill", status="ACTIVE") == 1
        assert m.value("motor_controller_instances", role="decode", status="ACTIVE") == 1
        assert m.value("motor_controller_coordinator_reachable", coordinator=coordinator) == 1
        assert m.value("motor_controller_push_lag_seconds", coordinator=coordinator) == 0
        return m

    m = wait_until(settled, 20, "both instances ACTIVE and the Coordinator in step", retry=(AssertionError,))
    assert [n for n in CONTROLLER_NAMES if not m.has(n)] == []
    assert m.value("motor_controller_nodemanagers_connected") == 2
    assert m.value("motor_controller_heartbeats_total", kind="beat") >= 2
    assert m.value("motor_controller_heartbeat_ack_seconds_count") >= 2
    assert m.value("motor_controller_instances", role="union", status="ACTIVE") == 0
    assert m.value("motor_controller_alarms_active", alarm_id="0xFC001002") == 0
    assert m.value("motor_controller_state_write_failures_total") == 0


@pytest.mark.parametrize("i", [0, 1])
def test_each_nodemanager_exports_every_metric_with_its_engine_normal(cluster: Cluster, i: int) -> None:
    def up() -> Scrape:
        m = scrape(cluster.metrics_url(NM_METRICS + i))
        assert m.value("motor_nodemanager_engines", status="NORMAL") == 1
        assert m.value("motor_nodemanager_controller_connected") == 1
        return m

    m = wait_until(up, 20, f"nm-{i}'s engine NORMAL", retry=(AssertionError,))
    assert [n for n in NODEMANAGER_NAMES if not m.has(n)] == []
    assert m.value("motor_nodemanager_engines", status="ABNORMAL") == 0
    assert m.value("motor_nodemanager_engine_restarts_total") == 0
    assert m.value("motor_nodemanager_frozen") == 0
    port = NM_METRICS + i + cluster.off
    assert cluster.proc.search(rf"\[nm-{i}\] .*event=listening .*metrics=127\.0\.0\.1:{port}\b")
