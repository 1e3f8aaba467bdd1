"""deploy/prometheus checked by the real tools: promtool accepts the rules and both scrape
configs and passes the rules' unit tests; a Prometheus started from motor-up.yml scrapes every
component of a running ``motor up`` (the engines' aggregate on the Coordinator's
/metrics/engines too), counts the completions sent through it, evaluates every rule without
error and fires none on a healthy cluster; kubernetes.yml's relabelling turns annotated pods into
the targets it should; every metric the Grafana dashboard, the rules and prometheus-adapter's
rules (deploy/k8s/autoscaling) name is exported by the running cluster, and the adapter's
queries answer one value per HPA metric through kubernetes.yml's motor-engines job, however many
Coordinators serve the aggregate.

Prometheus and promtool come from Debian's ``prometheus`` package (``make system-deps`` installs
it as root); without them the module skips, with one line saying so."""

from __future__ import annotations

import json
import subprocess
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import openai
import pytest
import yaml

from motor_mesh.gen.motor.v1 import common_pb2, controller_pb2, controller_pb2_grpc
from tests.deploy.promql import (
    PROMETHEUS_DIR,
    RULE_TESTS,
    RULES,
    adapter_queries,
    adapter_rules,
    dashboard,
    dashboard_queries,
    exported_names,
    hpa_metrics,
    missing_metrics,
    rule_queries,
    rules,
)
from tests.e2e.cluster import CONTROLLER, CONTROLLER_METRICS, COORDINATOR, HTTP, NM, NM_METRICS, Cluster
from tests.poll import wait_until
from tests.ports import reserved_port
from tests.procs import Exited, Proc, system_binary

pytestmark = pytest.mark.timeout(180)

COMPLETIONS = 5
NODES = {"prefill": 0, "decode": 1}  # default `motor up`: NodeManager i's role


PROMTOOL, PROMETHEUS = system_binary("promtool"), system_binary("prometheus")
if PROMTOOL is None or PROMETHEUS is None:
    pytest.skip(
        "no prometheus/promtool on PATH or in /usr/bin (Debian's `prometheus` package; "
        "`make system-deps` installs it as root): deploy/prometheus tests skipped",
        allow_module_level=True,
    )


def promtool(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(PROMTOOL), *args], capture_output=True, text=True, timeout=60, check=False)


# -- promtool -------------------------------------------------------------------------------------


def test_promtool_accepts_the_rules() -> None:
    done = promtool("check", "rules", str(RULES))
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"SUCCESS: {len(rules())} rules found" in done.stdout


def test_every_alert_fires_on_its_series_and_not_otherwise() -> None:
    # Each alert has a case where it fires and one where it must not (promtool passes a test
    # of an alert name that does not exist, so the names are checked here).
    alerts = {r["alert"] for r in rules() if "alert" in r}
    cases = [c for t in yaml.safe_load(RULE_TESTS.read_text())["tests"] for c in t["alert_rule_test"]]
    assert {c["alertname"] for c in cases} == alerts
    assert {c["alertname"] for c in cases if c["exp_alerts"]} == alerts
    assert {c["alertname"] for c in cases if not c["exp_alerts"]} == alerts
    done = promtool("test", "rules", str(RULE_TESTS))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS" in done.stdout


def test_promtool_accepts_the_motor_up_scrape_config() -> None:
    done = promtool("check", "config", str(PROMETHEUS_DIR / "motor-up.yml"))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "is valid prometheus config file syntax" in done.stdout


def test_promtool_accepts_the_kubernetes_scrape_config() -> None:
    done = promtool("check", "config", str(PROMETHEUS_DIR / "kubernetes.yml"))
    if "field kubernetes_sd_configs not found" in done.stdout + done.stderr:
        # Debian builds Prometheus without Kubernetes discovery; the relabelling is still run
        # for real by test_kubernetes_relabelling_turns_annotated_pods_into_targets.
        pytest.skip("this promtool is built without Kubernetes discovery (Debian's): check skipped")
    assert done.returncode == 0, done.stdout + done.stderr


# -- a real Prometheus ----------------------------------------------------------------------------


class Prometheus:
    """A Prometheus on a reserved loopback port, its config and data in ``tmp``."""

    def __init__(self, config: dict[str, Any], tmp: Path) -> None:
        tmp.mkdir(parents=True, exist_ok=True)
        self.config_file = tmp / "prometheus.yml"
        self.config_file.write_text(yaml.safe_dump(config, sort_keys=False))
        self.port = reserved_port()
        self.proc = Proc(
            [
                str(PROMETHEUS),
                f"--config.file={self.config_file}",
                f"--storage.tsdb.path={tmp / 'data'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
            ],
            cwd=tmp,
        )

    def wait_ready(self) -> None:
        # Refused, or 503 (an HTTPError), until it is ready: urllib's errors are OSErrors.
        wait_until(self._ready, timeout=30, what="prometheus /-/ready", retry=(OSError,))

    def _ready(self) -> bool:
        if not self.proc.alive():
            raise Exited(f"prometheus exited:\n{self.proc.tail()}")
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/-/ready", timeout=2) as resp:
            return bool(resp.status == 200)

    def api(self, path: str, **params: str) -> Any:
        url = f"http://127.0.0.1:{self.port}/api/v1/{path}?{urllib.parse.urlencode(params)}"
        with urllib.request.urlopen(url, timeout=5) as resp:
            body = json.loads(resp.read())
        assert body["status"] == "success", body
        return body["data"]

    def query(self, promql: str) -> dict[tuple[tuple[str, str], ...], float]:
        """{sorted labels: value} of an instant query."""
        data = self.api("query", query=promql)
        return {tuple(sorted(r["metric"].items())): float(r["value"][1]) for r in data["result"]}

    def targets(self, state: str = "active") -> list[dict[str, Any]]:
        return list(self.api("targets", state=state)[f"{state}Targets"])

    def stop(self) -> None:
        self.proc.stop(10)


def fast(config: dict[str, Any]) -> dict[str, Any]:
    """``config`` scraping and evaluating every second, its rule files found from anywhere."""
    config["global"].update(scrape_interval="1s", evaluation_interval="1s")
    config["rule_files"] = [str(PROMETHEUS_DIR / f) for f in config["rule_files"]]
    return config


def shifted(target: str, offset: int) -> str:
    host, port = target.rsplit(":", 1)
    return f"{host}:{int(port) + offset}"


def motor_up_config(offset: int) -> dict[str, Any]:
    """deploy/prometheus/motor-up.yml for a ``motor up --port-offset offset``."""
    config = fast(yaml.safe_load((PROMETHEUS_DIR / "motor-up.yml").read_text()))
    for job in config["scrape_configs"]:
        for group in job["static_configs"]:
            group["targets"] = [shifted(t, offset) for t in group["targets"]]
    return config


def pod(
    name: str,
    component: str,
    metrics_port: int,
    declared: list[int],
    *,
    ip: str = "127.0.0.1",
    phase: str = "Running",
    scrape: str | None = "true",
    part_of: str = "motor",
) -> list[dict[str, Any]]:
    """What Kubernetes pod discovery gives Prometheus for one pod: a target per declared port."""
    labels = {
        "__meta_kubernetes_namespace": "motor",
        "__meta_kubernetes_pod_name": name,
        "__meta_kubernetes_pod_ip": ip,
        "__meta_kubernetes_pod_phase": phase,
        "__meta_kubernetes_pod_label_app_kubernetes_io_part_of": part_of,
        "__meta_kubernetes_pod_label_app_kubernetes_io_component": component,
        "__meta_kubernetes_pod_annotation_prometheus_io_port": str(metrics_port),
        "__meta_kubernetes_pod_annotation_prometheus_io_path": "/metrics",
    }
    if scrape is not None:
        labels["__meta_kubernetes_pod_annotation_prometheus_io_scrape"] = scrape
    host = f"[{ip}]" if ":" in ip else ip
    return [{"targets": [f"{host}:{p}"], "labels": labels} for p in declared]


def pods(off: int) -> list[dict[str, Any]]:
    """Motor's pods as if Kubernetes ran them, at the running cluster's addresses, and pods
    the scrape config must leave alone (pending, not annotated, not Motor's). Two Coordinator
    pods (both the one running here): the aggregate of the same engines twice."""
    ctl, nm0, nm1 = CONTROLLER_METRICS + off, NM_METRICS + off, NM_METRICS + 1 + off
    return [
        *pod("motor-controller-0", "controller", ctl, [CONTROLLER + off, ctl]),
        *pod("motor-coordinator-7f9c-x2", "coordinator", HTTP + off, [HTTP + off, COORDINATOR + off]),
        *pod("motor-coordinator-7f9c-y3", "coordinator", HTTP + off, [HTTP + off, COORDINATOR + off]),
        *pod("motor-prefill-0", "prefill", nm0, [NM + off]),
        *pod("motor-decode-0", "decode", nm1, [NM + 1 + off]),
        *pod("motor-decode-1", "decode", nm1, [NM + 1 + off], ip="::1"),
        *pod("motor-decode-2", "decode", nm1, [NM + 1 + off], phase="Pending"),
        *pod("motor-prefill-1", "prefill", nm0, [NM + off], scrape=None),
        *pod("cert-manager-0", "controller", ctl, [ctl], part_of="cert-manager"),
        *pod("postgres-0", "database", nm0, [5432]),
    ]


def kubernetes_config(offset: int, pods_file: Path) -> dict[str, Any]:
    """deploy/prometheus/kubernetes.yml as it is but for where pods come from: a file standing
    in for the Kubernetes API, holding the labels its pod discovery gives."""
    pods_file.write_text(json.dumps(pods(offset)))
    config = fast(yaml.safe_load((PROMETHEUS_DIR / "kubernetes.yml").read_text()))
    assert [job["job_name"] for job in config["scrape_configs"]] == ["motor", "motor-engines"]
    for job in config["scrape_configs"]:
        assert job.pop("kubernetes_sd_configs") == [{"role": "pod"}]
        job["file_sd_configs"] = [{"files": [str(pods_file)]}]
    return config


def scrape(url: str) -> str:
    with urllib.request.urlopen(url, timeout=5) as resp:
        return str(resp.read().decode())


@dataclass
class Prometheuses:
    motor_up: Prometheus  # from motor-up.yml
    kubernetes: Prometheus  # from kubernetes.yml


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    c = Cluster(tmp_path_factory.mktemp("prom-up"), nodes=2)
    try:
        c.wait_ready()
        yield c
    finally:
        c.cleanup()


@pytest.fixture(scope="module")
def prometheuses(cluster: Cluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Prometheuses]:
    # Started together: each one scrapes only after its first discovery update, ~5 s in.
    tmp = tmp_path_factory.mktemp("prometheus")
    started: list[Prometheus] = []
    try:
        started.append(Prometheus(motor_up_config(cluster.off), tmp / "motor-up"))
        started.append(Prometheus(kubernetes_config(cluster.off, tmp / "pods.json"), tmp / "kubernetes"))
        for p in started:
            p.wait_ready()
        yield Prometheuses(*started)
    finally:
        for p in started:
            p.stop()


@pytest.fixture
def prometheus(prometheuses: Prometheuses) -> Prometheus:
    return prometheuses.motor_up


@pytest.fixture(scope="module")
def completions(cluster: Cluster) -> int:
    """COMPLETIONS completions sent through the Coordinator, once for the module (the request
    metrics exist from the first one on)."""
    client = openai.OpenAI(base_url=f"{cluster.base_url}/v1", api_key="none", max_retries=0, timeout=30)
    for _ in range(COMPLETIONS):
        assert client.completions.create(model="motor-sim", prompt="Say hello", max_tokens=4).choices
    return COMPLETIONS


def all_up(prometheus: Prometheus) -> list[dict[str, Any]]:
    targets = prometheus.targets()
    assert targets and all(t["health"] == "up" for t in targets), [
        (t["scrapeUrl"], t["health"], t["lastError"]) for t in targets
    ]
    return targets


def test_prometheus_scrapes_every_component_of_motor_up(cluster: Cluster, prometheus: Prometheus) -> None:
    targets = wait_until(
        lambda: all_up(prometheus), timeout=30, what="every target up", retry=(AssertionError,)
    )
    assert sorted((t["labels"]["component"], t["scrapeUrl"]) for t in targets) == sorted(
        [
            ("controller", cluster.metrics_url(CONTROLLER_METRICS)),
            ("coordinator", f"{cluster.base_url}/metrics"),
            ("coordinator", f"{cluster.base_url}/metrics/engines?type=role"),
            *((role, cluster.metrics_url(NM_METRICS + i)) for role, i in NODES.items()),
        ]
    )

    def up_series() -> dict[tuple[tuple[str, str], ...], float] | None:
        # The targets page turns "up" when a scrape ends; its sample can reach queries a moment
        # later, so a series may be missing yet (seen under load): not yet, not a failure.
        found = prometheus.query('up{job=~"motor(-.+)?"}')
        return found if len(found) == 5 else None

    up = wait_until(up_series, timeout=30, what="an up series for each of the 5 targets")
    assert set(up.values()) == {1.0}, up


def test_promql_counts_the_completions_sent(prometheus: Prometheus, completions: int) -> None:
    def counted() -> dict[tuple[tuple[str, str], ...], float]:
        got = prometheus.query('sum by (status) (motor_coordinator_requests_total{route="/v1/completions"})')
        assert got == {(("status", "200"),): completions}, got
        return got

    wait_until(
        counted, timeout=30, what=f"Prometheus counting {completions} completions", retry=(AssertionError,)
    )


def test_every_rule_evaluates_and_none_fires_on_a_healthy_cluster(prometheus: Prometheus) -> None:
    wait_until(lambda: all_up(prometheus), timeout=30, what="every target up", retry=(AssertionError,))

    def evaluated_cleanly() -> list[dict[str, Any]]:
        groups = prometheus.api("rules")["groups"]
        loaded = [r for g in groups for r in g["rules"]]
        assert len(loaded) == len(rules()), loaded
        assert all(g["lastEvaluation"] > "2000" for g in groups), "not evaluated yet"
        assert all(r["health"] == "ok" for r in loaded), [(r["name"], r.get("lastError")) for r in loaded]
        assert [a for r in loaded for a in r.get("alerts", [])] == []
        return loaded

    wait_until(
        evaluated_cleanly, timeout=30, what="every rule evaluated, none firing", retry=(AssertionError,)
    )


def test_every_metric_the_dashboard_and_rules_name_is_exported(
    prometheus: Prometheus, completions: int
) -> None:
    targets = wait_until(
        lambda: all_up(prometheus), timeout=30, what="every target up", retry=(AssertionError,)
    )
    exported = set().union(*(exported_names(scrape(t["scrapeUrl"])) for t in targets))
    assert missing_metrics(dashboard_queries(dashboard()), exported) == {}
    assert missing_metrics(rule_queries(), exported) == {}
    assert missing_metrics(adapter_queries(), exported) == {}


def test_kubernetes_relabelling_turns_annotated_pods_into_targets(
    cluster: Cluster, prometheuses: Prometheuses
) -> None:
    prom, off = prometheuses.kubernetes, cluster.off
    done = promtool("check", "config", str(prom.config_file))
    assert done.returncode == 0, done.stdout + done.stderr

    def scraped() -> dict[str, dict[str, Any]]:
        targets = {t["labels"]["pod"]: t for t in prom.targets() if t["labels"]["job"] == "motor"}
        assert len(targets) == 6, targets
        assert all(t["health"] == "up" for p, t in targets.items() if p != "motor-decode-1"), targets
        return targets

    targets = wait_until(scraped, timeout=30, what="the annotated pods scraped", retry=(AssertionError,))
    nm0, nm1 = NM_METRICS + off, NM_METRICS + 1 + off
    want = {
        "motor-controller-0": ("controller", f"127.0.0.1:{CONTROLLER_METRICS + off}"),
        "motor-coordinator-7f9c-x2": ("coordinator", f"127.0.0.1:{HTTP + off}"),
        "motor-coordinator-7f9c-y3": ("coordinator", f"127.0.0.1:{HTTP + off}"),
        "motor-prefill-0": ("prefill", f"127.0.0.1:{nm0}"),
        "motor-decode-0": ("decode", f"127.0.0.1:{nm1}"),
        "motor-decode-1": ("decode", f"[::1]:{nm1}"),
    }
    for name, (component, address) in want.items():
        t = targets[name]
        assert t["labels"] == {
            "job": "motor",
            "namespace": "motor",
            "pod": name,
            "component": component,
            "instance": address,
        }
        assert t["scrapeUrl"] == f"http://{address}/metrics"
    dropped = {
        t["discoveredLabels"]["__meta_kubernetes_pod_name"]
        for t in prom.targets("dropped")
        if t["discoveredLabels"]["job"] == "motor"
    }
    assert dropped == {"motor-decode-2", "motor-prefill-1", "cert-manager-0", "postgres-0"}
    # The NodeManagers' series carry their pod's role, as the rules and the dashboard expect.
    restarts = prom.query("motor_nodemanager_engine_restarts_total")
    assert {dict(k)["component"] for k in restarts} == {"prefill", "decode"}
    # motor-engines: the Coordinator pods alone, each at its annotated port, on /metrics/engines.
    engines = [t for t in prom.targets() if t["labels"]["job"] == "motor-engines"]
    assert sorted((t["labels"]["pod"], t["scrapeUrl"]) for t in engines) == [
        (name, f"http://127.0.0.1:{HTTP + off}/metrics/engines?type=role")
        for name in ("motor-coordinator-7f9c-x2", "motor-coordinator-7f9c-y3")
    ]
    assert all(
        t["labels"]["component"] == "coordinator" and t["labels"]["namespace"] == "motor" for t in engines
    )


def test_the_adapter_queries_answer_per_role_once_whatever_the_coordinators(
    cluster: Cluster, prometheuses: Prometheuses, completions: int
) -> None:
    """prometheus-adapter's rules (deploy/k8s/autoscaling) as the adapter sends them for the
    HPAs (namespace and metric selector in <<.LabelMatchers>>), against the Prometheus of
    kubernetes.yml: one value each, through the motor-engines job, and the same whether one or
    two Coordinator pods serve the aggregate."""
    prom = prometheuses.kubernetes
    # Counts equal to what runs (one prefill, one decode instance): motor up leaves them be.
    with grpc.insecure_channel(cluster.grpc(CONTROLLER)) as ch:
        stub = controller_pb2_grpc.ControllerStub(ch)
        for role in (common_pb2.ROLE_PREFILL, common_pb2.ROLE_DECODE):
            stub.SetDesiredInstances(
                controller_pb2.SetDesiredInstancesRequest(role=role, replicas=1), timeout=10
            )
    wanted = []
    for m in hpa_metrics():
        (rule,) = [r for r in adapter_rules() if m.name in r.names()]
        (series,) = rule.series()
        matchers = ",".join(f'{k}="{v}"' for k, v in {"namespace": "motor", **m.selector}.items())
        wanted.append((m.name, m.selector, rule.query(series, matchers), series))

    def answered() -> dict[str, float]:
        values = {}
        for name, selector, query, series in wanted:
            got = prom.query(query)
            assert len(got) == 1, f"{name} {selector}: {query} answered {got}"
            values[f"{name}{selector}"] = next(iter(got.values()))
            # The series came through the engines' job, labelled with the role it is for.
            if not series.startswith("motor_desired"):
                jobs = {dict(k)["job"] for k in prom.query(series)}
                assert jobs == {"motor-engines"}, (series, jobs)
        return values

    values = wait_until(answered, timeout=30, what="every HPA metric answered", retry=(AssertionError,))
    assert values["motor_desired_instances{'role': 'prefill'}"] == 1.0, values
    assert values["motor_desired_instances{'role': 'decode'}"] == 1.0, values
    # Both Coordinator pods serve the aggregate: counted once after max without (pod, instance).
    workers = 'motor:active_prefill_workers{namespace="motor",role="prefill"}'
    assert prom.query(f"sum({workers})") == {(): 2.0}
    assert prom.query(f"sum(max without (pod, instance) ({workers}))") == {(): 1.0}
