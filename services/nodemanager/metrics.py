"""The NodeManager's Prometheus metrics (``motor_nodemanager_*``), read from the engine
supervisor, the Controller link and the engine output queue each time ``/metrics`` is scraped.

Nothing here runs between scrapes: the supervisor counts relaunches, deaths and probes as they
happen, and :class:`NodeManagerCollector` turns those counts and the engines' current statuses
(as reported to the Controller) into metric families.
"""

from __future__ import annotations

import collections
from collections.abc import Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from motor_mesh.common import enums
from motor_mesh.common.enums import endpoint_status_name
from motor_mesh.nodemanager.engine_output import STDOUT, Output
from motor_mesh.nodemanager.link import ControllerLink
from motor_mesh.nodemanager.supervisor import EngineSupervisor

P = "motor_nodemanager_"
# Every endpoint status, so a dashboard or an alert sees 0 rather than no series.
STATUSES = (enums.EP_INITIAL, enums.EP_WAIT, enums.EP_NORMAL, enums.EP_ABNORMAL, enums.EP_PAUSED)


def registry(collector: NodeManagerCollector) -> CollectorRegistry:
    r = CollectorRegistry()
    r.register(collector)
    return r


class NodeManagerCollector(Collector):
    """``link`` is set once the Controller link exists; it stays None when registration is
    disabled (no job name): never connected."""

    def __init__(self, supervisor: EngineSupervisor, output: Output = STDOUT) -> None:
        self._sup = supervisor
        self._output = output
        self.link: ControllerLink | None = None

    def collect(self) -> Iterator[Metric]:
        sup = self._sup
        counts = collections.Counter(ep.status for ep in sup.endpoints())
        engines = GaugeMetricFamily(
            P + "engines",
            "Engine endpoints by the status reported to the Controller (INITIAL while relaunching, "
            "PAUSED while paused).",
            labels=["status"],
        )
        for status in sorted({*STATUSES, *counts}):
            engines.add_metric([endpoint_status_name(status)], counts[status])
        yield engines

        yield _counter(
            "engine_restarts",
            "Engine relaunches (RestartEngines; GetStatus relaunch_count).",
            sup.relaunch_count,
        )
        yield _counter(
            "engine_exits", "Engine process groups that died without being asked to stop.", sup.engine_exits
        )
        yield sup.probe_latency.metric(
            P + "probe_duration_seconds",
            "Health probe latency (/health, then /v1/models) of engines that were up once or are past "
            "their start-up window (polling a loading engine is not counted).",
        )
        yield _counter(
            "probe_failures",
            "Health probes that failed, of engines that were up once or are past their start-up window.",
            sup.probe_failures,
        )
        yield _counter(
            "inference_probe_failures",
            "Inference probes (nodemanager.engine_probe_inference: a one-token completion sent to DP "
            "rank 0) that failed or missed their deadline.",
            sup.inference_probe_failures,
        )
        yield _gauge(
            "frozen",
            "1 while the pod-restart fallback is held off (frozen_until in the future).",
            1 if sup.freeze.until is not None else 0,
        )
        connected = self.link is not None and self.link.connected
        yield _gauge(
            "controller_connected",
            "1 while the heartbeat stream to the Controller is open.",
            1 if connected else 0,
        )
        yield _counter(
            "engine_output_dropped_lines",
            "Engine output lines dropped because this process's stdout did not keep up.",
            self._output.dropped_total,
        )


def _counter(name: str, documentation: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(P + name, documentation, value=value)


def _gauge(name: str, documentation: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(P + name, documentation, value=value)
