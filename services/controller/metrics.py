"""The Controller's Prometheus metrics (``motor_controller_*``), read from its live parts each
time ``/metrics`` is scraped.

Nothing here runs between scrapes: the parts keep plain counters as they work (the heartbeat
hub its ack latency histogram, the fault manager its finished strategies, each Coordinator
pusher its failed calls and since when it is behind, the database writer its failed writes, the
live clock its stalls, each reconcile loop its queue's adds and retries, its failures and
durations) and :class:`ControllerCollector` turns them, with the instance table, the open
streams, the active alarms and the reconciles in flight, into metric families. Coordinators are
read from the pushers present at scrape time, so one added or removed at run time appears or
disappears. The reconcile loops' families follow client-go's workqueue and controller-runtime's
reconcile metrics, labelled ``name`` by loop (assembly, instance, precision, coordinator).

One family is not ``motor_controller_``: ``motor_desired_instances{role}``, the desired instance
counts (SetDesiredInstances), named for what follows it (``motor up``, an HPA or KEDA) rather than
for who records it. Only the roles with a recorded count have a series: 0 is a count someone set.
Nor is ``motor_planner_recommended_instances{role}``, the planner's recommendation, named like it.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from motor_mesh.common.enums import ACTIVE, INACTIVE, INITIAL, PAUSED, ROLE_NAMES, enum_name, status_name
from motor_mesh.controller.alarms.store import CONGESTION, COORDINATOR_FAULT, INSTANCE_FAULT, PRECISION
from motor_mesh.controller.desired import role_label
from motor_mesh.controller.reconcile.runner import DURATION_BUCKETS, FAILURE_KINDS, Reconciler
from motor_mesh.gen.motor.v1 import alarm_pb2, common_pb2

if TYPE_CHECKING:  # app.py and leader/ha.py hand their objects to the collector: types only
    from motor_mesh.controller.app import Controller
    from motor_mesh.controller.leader.election import Leadership
    from motor_mesh.controller.leader.ha import Lead

P = "motor_controller_"
DESIRED = "motor_desired_instances"
RECOMMENDED = "motor_planner_recommended_instances"
# Every live status (DELETED instances are history, not counted) of every role, so a dashboard
# or an alert sees 0 rather than no series.
STATUSES = (INITIAL, ACTIVE, INACTIVE, PAUSED)
STRATEGIES = ("EngineRelaunch", "Terminate")
STRATEGY_OUTCOMES = ("succeeded", "failed", "stopped")
RELAUNCH_OUTCOMES = ("succeeded", "failed")
# The alarms Motor raises, with the severity their sources give them: shown at 0 when inactive.
KNOWN_ALARMS = (
    (INSTANCE_FAULT, alarm_pb2.SEVERITY_MAJOR),
    (COORDINATOR_FAULT, alarm_pb2.SEVERITY_CRITICAL),
    (CONGESTION, alarm_pb2.SEVERITY_MAJOR),
    (PRECISION, alarm_pb2.SEVERITY_MAJOR),
)


def registry(controller: Controller) -> CollectorRegistry:
    r = CollectorRegistry()
    r.register(ControllerCollector(controller))
    return r


def ha_registry(lead: Lead) -> CollectorRegistry:
    """The etcd store's Controllers: the election always, the rest while this one leads."""
    r = CollectorRegistry()
    r.register(LeadCollector(lead))
    return r


def leader_metrics(leadership: Leadership | None) -> Iterator[Metric]:
    """Without an election (SQLite) the one Controller is always the leader, term 0."""
    leading = GaugeMetricFamily(
        P + "leader", "1 while this Controller leads; 0 while it stands by (etcd store)."
    )
    leading.add_metric([], 1 if leadership is None or leadership.valid() else 0)
    yield leading
    term = GaugeMetricFamily(
        P + "leader_term", "The term (leader key create revision in etcd) this Controller leads in; 0 = none."
    )
    term.add_metric([], leadership.term if leadership is not None and leadership.valid() else 0)
    yield term


def workqueue_metrics(loops: Iterable[Reconciler[Any]]) -> Iterator[Metric]:
    """Each reconcile loop's queue and reconciles, labelled ``name`` by loop."""
    depth = GaugeMetricFamily(
        P + "workqueue_depth", "Keys waiting for a worker of the reconcile loop.", labels=["name"]
    )
    adds = CounterMetricFamily(
        P + "workqueue_adds",
        "Keys queued to the reconcile loop (one already waiting is not queued twice).",
        labels=["name"],
    )
    retries = CounterMetricFamily(
        P + "workqueue_retries",
        "Keys queued again after their backoff: a failed reconcile, or one asking to be retried.",
        labels=["name"],
    )
    errors = CounterMetricFamily(
        P + "workqueue_reconcile_errors",
        "Reconciles that failed, by kind: retry (an expected failure: a peer unreachable, a state "
        "write), exception (a bug; also retried), terminal (never retried).",
        labels=["name", "kind"],
    )
    durations = HistogramMetricFamily(
        P + "workqueue_reconcile_duration_seconds",
        "How long one reconcile took, failed ones included.",
        labels=["name"],
    )
    longest = GaugeMetricFamily(
        P + "workqueue_longest_running_reconcile_seconds",
        "How long the oldest reconcile in flight has been running; 0 when none is.",
        labels=["name"],
    )
    for loop in loops:
        name, queue, stats = loop.name, loop.queue, loop.stats
        depth.add_metric([name], len(queue))
        adds.add_metric([name], queue.adds)
        retries.add_metric([name], queue.retries)
        for kind in FAILURE_KINDS:
            errors.add_metric([name, kind], stats.failures[kind])
        # LatencyHistogram.metric makes an unlabelled family: the same cumulative buckets here,
        # one child per loop (its counts are DURATION_BUCKETS' then +Inf's).
        cumulative, buckets = 0, []
        for bound, n in zip((*DURATION_BUCKETS, float("inf")), stats.duration.counts, strict=True):
            cumulative += n
            buckets.append((floatToGoString(bound), cumulative))
        durations.add_metric([name], buckets, stats.duration.total)
        longest.add_metric([name], loop.longest_running_s())
    yield from (depth, adds, retries, errors, durations, longest)


class LeadCollector(Collector):
    def __init__(self, lead: Lead) -> None:
        self._lead = lead

    def collect(self) -> Iterator[Metric]:
        if self._lead.controller is None:
            yield from leader_metrics(self._lead.leadership)
        else:
            yield from ControllerCollector(self._lead.controller).collect()


class ControllerCollector(Collector):
    def __init__(self, controller: Controller) -> None:
        self._c = controller

    def collect(self) -> Iterator[Metric]:
        c = self._c
        yield from leader_metrics(c.leadership)
        yield self._instances()
        yield self._desired()
        yield from self._planner()

        hub = c.hub
        streams = GaugeMetricFamily(P + "nodemanagers_connected", "Open NodeManager heartbeat streams.")
        streams.add_metric([], hub.open_streams)
        yield streams
        beats = CounterMetricFamily(
            P + "heartbeats",
            "Heartbeat stream messages acknowledged, by kind (beat, event).",
            labels=["kind"],
        )
        beats.add_metric(["beat"], hub.beats_acked)
        beats.add_metric(["event"], hub.events_acked)
        yield beats
        yield hub.ack_latency.metric(
            P + "heartbeat_ack_seconds",
            "Time from receiving a beat or engine event to handing its ack to gRPC.",
        )

        yield from self._strategies()
        yield from self._coordinators()
        yield self._alarms()

        writes = CounterMetricFamily(
            P + "state_write_failures", "Database writes that failed (disk full, I/O error); nothing changed."
        )
        writes.add_metric([], c.store.write_failures)
        yield writes
        stalls = CounterMetricFamily(
            P + "loop_stalls",
            "Times the event loop did not run for longer than a heartbeat interval (SIGSTOP, a VM "
            "pause, swapping); heartbeat silence restarts after each.",
        )
        stalls.add_metric([], c.clock.stalls)
        yield stalls
        yield from workqueue_metrics(c.loops)

    def _instances(self) -> Metric:
        counts: collections.Counter[tuple[int, int]] = collections.Counter(
            (i.spec.role, i.status) for i in self._c.table.live.values()
        )
        g = GaugeMetricFamily(P + "instances", "Instances by role and status.", labels=["role", "status"])
        for role, role_name in ROLE_NAMES.items():
            for status in STATUSES:
                g.add_metric([role_name, status_name(status)], counts.pop((role, status), 0))
        for (other_role, other_status), n in sorted(counts.items()):  # one this list lacks
            name = enum_name(common_pb2.Role, other_role, "ROLE_").lower()
            g.add_metric([name, status_name(other_status)], n)
        return g

    def _desired(self) -> Metric:
        g = GaugeMetricFamily(
            DESIRED,
            "Instances the cluster should have, by role, as last set with SetDesiredInstances "
            "(`motor scale`); no series for a role without a recorded count.",
            labels=["role"],
        )
        for role, replicas in self._c.desired.counts().items():
            g.add_metric([role_label(role)], replicas)
        return g

    def _planner(self) -> Iterator[Metric]:
        planner = self._c.planner
        g = GaugeMetricFamily(
            RECOMMENDED,
            "Instances per role the planner's last decision wants (controller.planner); no series "
            "while it is off or still learning.",
            labels=["role"],
        )
        for role, n in planner.recommended().items():
            g.add_metric([role_label(role)], n)
        yield g
        attainment = GaugeMetricFamily(
            P + "planner_attainment",
            "The planner's SLA attainment (0-1): predicted with the split there is, predicted with "
            "the recommended split, and measured (fraction of the last 20 intervals meeting both "
            "p90 targets; -1 before the first).",
            labels=["kind"],
        )
        if planner.recommended():
            attainment.add_metric(["predicted"], planner.last.predicted)
            attainment.add_metric(["recommended"], planner.last.recommended)
            attainment.add_metric(["measured"], planner.measured_attainment())
        yield attainment
        switches = CounterMetricFamily(
            P + "role_switches",
            "Role switches (prefill <-> decode in place) finished, by outcome: succeeded, "
            "rolled_back (refused, the old role restored), cancelled (the instance left routing "
            "during its drain), failed (not even the rollback worked: the instance was removed).",
            labels=["outcome"],
        )
        for outcome, n in self._c.switches.finished.items():
            switches.add_metric([outcome], n)
        yield switches
        running = GaugeMetricFamily(P + "role_switches_running", "Role switches in progress now.")
        running.add_metric([], len(self._c.switches.running()))
        yield running

    def _strategies(self) -> Iterator[Metric]:
        faults = self._c.faults
        finished = CounterMetricFamily(
            P + "strategies",
            "Recovery strategies finished, by strategy and outcome (succeeded, failed, stopped: "
            "preempted or its instance deleted).",
            labels=["strategy", "outcome"],
        )
        done = collections.Counter(faults.finished)
        for name in STRATEGIES:
            for outcome in STRATEGY_OUTCOMES:
                finished.add_metric([name, outcome], done.pop((name, outcome), 0))
        for (name, outcome), n in sorted(done.items()):
            finished.add_metric([name, outcome], n)
        yield finished

        now = collections.Counter(faults.running())
        running = GaugeMetricFamily(
            P + "strategies_running", "Recovery strategies running now.", labels=["strategy"]
        )
        for name in sorted({*STRATEGIES, *now}):
            running.add_metric([name], now[name])
        yield running

        relaunches = CounterMetricFamily(
            P + "relaunches",
            "Engine relaunches the Controller drove (the EngineRelaunch strategy), by outcome.",
            labels=["outcome"],
        )
        for outcome in RELAUNCH_OUTCOMES:
            relaunches.add_metric([outcome], faults.finished["EngineRelaunch", outcome])
        yield relaunches

    def _coordinators(self) -> Iterator[Metric]:
        pushers = sorted(self._c.coordinators.pushers.items())
        now = time.monotonic()
        lag = GaugeMetricFamily(
            P + "push_lag_seconds",
            "How long the Coordinator's instance table has been behind the Controller's (0 in step).",
            labels=["coordinator"],
        )
        failures = CounterMetricFamily(
            P + "push_failures",
            "Calls to the Coordinator (SetInstances, Add/Delete/Pause/ResumeInstances) that failed.",
            labels=["coordinator"],
        )
        reachable = GaugeMetricFamily(
            P + "coordinator_reachable",
            "1 while the Coordinator's health Watch says SERVING.",
            labels=["coordinator"],
        )
        for address, p in pushers:
            lag.add_metric([address], p.lag_s(now))
            failures.add_metric([address], p.failures)
            reachable.add_metric([address], 1 if p.reachable else 0)
        yield lag
        yield failures
        yield reachable

    def _alarms(self) -> Metric:
        g = GaugeMetricFamily(
            P + "alarms_active", "Active alarms by alarm id and severity.", labels=["alarm_id", "severity"]
        )
        active = self._c.alarms.active_counts()
        for key in sorted({*KNOWN_ALARMS, *active}):
            alarm_id, severity = key
            g.add_metric([alarm_id, enum_name(alarm_pb2.Severity, severity, "SEVERITY_")], active[key])
        return g
