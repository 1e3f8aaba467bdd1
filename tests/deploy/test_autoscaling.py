"""deploy/k8s/autoscaling: every manifest is a valid object of a current Kubernetes; each HPA scales
a role's StatefulSet in whole instances, drains before it removes one, and names only External
metrics a prometheus-adapter rule serves; the rules never count a series once per Coordinator;
and every series the rules read is exported by a running ``motor up`` (the Coordinator's
/metrics/engines?type=role, the Controller's /metrics), with the role label the rule selects.

That Prometheus itself serves those series through the scrape jobs of deploy/prometheus, and
that the adapter's queries answer there, is tests/deploy/test_prometheus.py's (it needs
Prometheus).
"""

from __future__ import annotations

import copy
import json
import urllib.error
import urllib.request
from collections.abc import Iterator

import grpc
import kubernetes_validate
import pytest
import yaml

from motor_mesh.common.config import load_config
from motor_mesh.gen.motor.v1 import common_pb2, controller_pb2, controller_pb2_grpc
from tests.deploy.k8s_render import Doc, Pod, pods_of, quantity, render
from tests.deploy.promql import (
    ADAPTER,
    AUTOSCALING,
    AdapterRule,
    adapter_rules,
    hpa_metrics,
    metric_names,
    samples,
)
from tests.deploy.test_k8s import K8S, POD_IP, VERSIONS
from tests.e2e.cluster import CONTROLLER, CONTROLLER_METRICS, Cluster
from tests.poll import wait_until

KUSTOMIZATION = "kustomization.yaml"
ROLES = {"prefill": common_pb2.ROLE_PREFILL, "decode": common_pb2.ROLE_DECODE}
# Where the series the rules read come from: the engines' (aggregated by the Coordinator) or the
# Controller's own.
ENGINE_SERIES = ("vllm:", "sglang:", "motor:")


def manifests() -> list[tuple[str, Doc]]:
    """(file, object) of every Kubernetes object in deploy/k8s/autoscaling, listed in the
    kustomization or not (the kustomization itself is kustomize's, not an object)."""
    out = []
    for path in sorted(AUTOSCALING.glob("*.y*ml")):
        if path.name == KUSTOMIZATION:
            continue
        out += [(path.name, d) for d in yaml.safe_load_all(path.read_text()) if d]
    return out


def refusals(docs: list[tuple[str, Doc]], version: str) -> list[str]:
    """What ``kubernetes-validate --strict`` says of each object ([] when all pass). An object of
    a kind it has no schema for (a CRD) is refused too: the command line only warns of it."""
    problems = []
    for name, doc in docs:
        where = f"{name}: {doc.get('kind')}/{doc.get('metadata', {}).get('name')}"
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            problems.append(f"{where}: {exc.message} at {list(exc.path)}")
        except Exception as exc:  # no schema for the kind, or not an object at all
            problems.append(f"{where}: {type(exc).__name__}: {exc}")
    return problems


@pytest.fixture(scope="module")
def hpas() -> list[Doc]:
    return [d for _, d in manifests() if d["kind"] == "HorizontalPodAutoscaler"]


@pytest.fixture(scope="module")
def role_sets(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Doc, int]]:
    """{StatefulSet name: (the StatefulSet, parallel.nnodes its pods run with)} of deploy/k8s."""
    docs = render(K8S)
    out = {}
    for pod in pods_of(docs, tmp_path_factory.mktemp("configmaps")):
        if pod.workload["kind"] == "StatefulSet" and pod.component in ROLES:
            out[pod.workload["metadata"]["name"]] = (pod.workload, nnodes(pod))
    return out


def nnodes(pod: Pod) -> int:
    cfg = load_config(str(pod.config_file()), env=pod.env(POD_IP))["nodemanager"]
    return int(cfg["parallel"]["nnodes"])


# -- the objects ----------------------------------------------------------------------------------


@pytest.mark.parametrize("version", VERSIONS)
def test_every_manifest_is_a_valid_object_of_a_current_kubernetes(version: str) -> None:
    docs = manifests()
    assert refusals(docs, version) == []
    kinds = sorted(d["kind"] for _, d in docs)
    assert kinds == ["ConfigMap"] + ["HorizontalPodAutoscaler"] * 4, kinds


def test_the_validation_refuses_a_bad_manifest() -> None:
    (name, hpa), *_ = [(n, d) for n, d in manifests() if d["kind"] == "HorizontalPodAutoscaler"]
    unknown_field = copy.deepcopy(hpa)
    unknown_field["spec"]["maxReplica"] = 3
    wrong_type = copy.deepcopy(hpa)
    wrong_type["spec"]["minReplicas"] = "one"
    crd = {"apiVersion": "keda.sh/v1alpha1", "kind": "ScaledObject", "metadata": {"name": "x"}, "spec": {}}
    for bad in (unknown_field, wrong_type, crd):
        assert len(refusals([(name, bad)], VERSIONS[-1])) == 1, bad


def test_the_kustomization_holds_the_signal_hpas_and_deploy_k8s_leaves_it_out() -> None:
    docs = render(AUTOSCALING)
    assert sorted((d["kind"], d["metadata"]["name"], d["metadata"]["namespace"]) for d in docs) == [
        ("HorizontalPodAutoscaler", "motor-decode", "motor"),
        ("HorizontalPodAutoscaler", "motor-prefill", "motor"),
    ]
    # Needs prometheus-adapter: never applied with the base.
    base = yaml.safe_load((K8S / KUSTOMIZATION).read_text())["resources"]
    assert not [r for r in base if "autoscaling" in r]
    # The adapter's ConfigMap goes to the adapter's namespace, and names it.
    (configmap,) = [d for n, d in manifests() if n == ADAPTER.name]
    assert configmap["metadata"].get("namespace"), "the adapter's namespace"
    assert "externalRules" in yaml.safe_load(configmap["data"]["config.yaml"])


def test_no_two_hpas_applied_together_scale_one_statefulset() -> None:
    for group in (render(AUTOSCALING), [d for n, d in manifests() if n == "hpa-desired.yaml"]):
        targets = [d["spec"]["scaleTargetRef"]["name"] for d in group]
        assert len(targets) == len(set(targets)) == 2, targets


def test_each_hpa_scales_a_role_statefulset_in_whole_instances_and_slowly_down(
    hpas: list[Doc], role_sets: dict[str, tuple[Doc, int]]
) -> None:
    for hpa in hpas:
        name, spec = hpa["metadata"]["name"], hpa["spec"]
        ref = spec["scaleTargetRef"]
        assert (ref["apiVersion"], ref["kind"]) == ("apps/v1", "StatefulSet"), name
        assert ref["name"] in role_sets, f"{name} scales {ref['name']}, not a role's StatefulSet"
        sts, n = role_sets[ref["name"]]
        component = sts["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/component"]
        assert hpa["metadata"]["labels"]["app.kubernetes.io/component"] == component, name
        # Replicas are pods, parallel.nnodes per instance: every count is whole instances.
        assert 1 <= spec["minReplicas"] <= spec["maxReplicas"], name
        assert spec["minReplicas"] % n == 0 and spec["maxReplicas"] % n == 0, name
        assert sts["spec"]["replicas"] % n == 0
        behavior = spec["behavior"]
        for direction in ("scaleUp", "scaleDown"):
            for policy in behavior[direction].get("policies", []):
                assert policy["type"] == "Pods", f"{name} {direction}: a percent is not whole instances"
                assert policy["value"] % n == 0, f"{name} {direction}"
        down = behavior["scaleDown"]
        if name.endswith("-desired"):
            # Follows a count someone decided: exactly, at once.
            (metric,) = spec["metrics"]
            target = metric["external"]["target"]
            assert target["type"] == "AverageValue" and quantity(target["averageValue"]) == 1 / n, name
            assert metric["external"]["metric"]["selector"]["matchLabels"] == {"role": component}
            assert quantity(down["tolerance"]) == 0 == quantity(behavior["scaleUp"]["tolerance"])
        else:
            # One instance at a time, after a quiet while: each removed pod drains first.
            assert down["stabilizationWindowSeconds"] >= 120, name
            assert down["selectPolicy"] == "Min" and down["policies"], name
            assert all(p["value"] == n for p in down["policies"]), name
    # The pods an HPA removes drain their instance before they stop (tests/deploy/test_k8s.py
    # checks what the hook runs).
    for sts, _ in role_sets.values():
        (container,) = sts["spec"]["template"]["spec"]["containers"]
        assert "motor drain" in " ".join(container["lifecycle"]["preStop"]["exec"]["command"])


def test_the_signals_are_the_ones_documented(hpas: list[Doc]) -> None:
    by_hpa: dict[str, set[tuple[str, str]]] = {}
    for hpa in hpas:
        by_hpa[hpa["metadata"]["name"]] = {
            (m["external"]["metric"]["name"], m["external"]["target"]["type"]) for m in hpa["spec"]["metrics"]
        }
    assert by_hpa == {
        "motor-prefill": {("motor_prefill_requests_waiting", "AverageValue")},
        "motor-decode": {
            ("motor_decode_kv_cache_usage", "Value"),
            ("motor_decode_generation_tokens_per_second", "AverageValue"),
        },
        "motor-prefill-desired": {("motor_desired_instances", "AverageValue")},
        "motor-decode-desired": {("motor_desired_instances", "AverageValue")},
    }


# -- the adapter's rules --------------------------------------------------------------------------


def rule_of(name: str) -> AdapterRule:
    rules = [r for r in adapter_rules() if name in r.names()]
    assert len(rules) == 1, f"{len(rules)} adapter rules serve {name}"
    return rules[0]


def test_every_metric_an_hpa_names_is_served_by_an_adapter_rule() -> None:
    served = {n for r in adapter_rules() for n in r.names()}
    for m in hpa_metrics():
        assert m.name in served, f"{m.hpa}: no adapter rule serves {m.name} (rules serve {sorted(served)})"
        rule = rule_of(m.name)
        # The selector's labels reach the query through <<.LabelMatchers>>, and the series the
        # rule finds carry them.
        assert "<<.LabelMatchers>>" in rule.metrics_query, m.name
        for label in m.selector:
            assert label in rule.series_query, f"{m.hpa}: {m.name}'s series need not carry {label}"


def test_the_rules_are_well_formed_and_count_each_coordinator_once() -> None:
    rules = adapter_rules()
    names = [n for r in rules for n in r.names()]
    assert len(names) == len(set(names)), names
    for r in rules:
        (series,) = r.series()
        assert r.names(), f"name.matches {r.matches!r} skips {series}"
        assert "<<.Series>>" in r.metrics_query and "<<.LabelMatchers>>" in r.metrics_query
        assert metric_names(r.query(series, 'namespace="motor"')) == {series}
        if series.startswith(ENGINE_SERIES):
            # Every Coordinator serves the same aggregate: one copy per role before any sum.
            assert "max without (pod, instance)" in r.metrics_query, series
            assert r.selected().get("role") in ROLES, f"{series}: the rule selects no role"
            assert f'role="{r.selected()["role"]}"' in r.metrics_query, series


# -- a running cluster ----------------------------------------------------------------------------


def wanted_series() -> dict[str, list[dict[str, str]]]:
    """{series name: the label sets that must be exported} of every rule: the labels its
    seriesQuery selects, and each selector an HPA adds to it (role: prefill, role: decode)."""
    out: dict[str, list[dict[str, str]]] = {}
    for r in adapter_rules():
        (series,) = r.series()
        selectors = [m.selector for m in hpa_metrics() if m.name in r.names() and m.selector]
        out[series] = [{**r.selected(), **s} for s in selectors] or [r.selected()]
    return out


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    c = Cluster(tmp_path_factory.mktemp("autoscaling-up"), nodes=2)
    try:
        c.wait_ready()
        yield c
    finally:
        c.cleanup()


def get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as resp:
        return str(resp.read().decode())


def complete(cluster: Cluster) -> None:
    body = {"model": "motor-sim", "prompt": "Say hello", "max_tokens": 4}
    req = urllib.request.Request(
        f"{cluster.base_url}/v1/completions",
        data=json.dumps(body).encode(),
        headers={"content-type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=30) as resp:
        assert resp.status == 200


def test_every_series_the_rules_read_is_exported_by_a_running_cluster(cluster: Cluster) -> None:
    for _ in range(3):
        complete(cluster)
    # Counts equal to what runs (one prefill, one decode instance): motor up leaves them be.
    with grpc.insecure_channel(cluster.grpc(CONTROLLER)) as ch:
        stub = controller_pb2_grpc.ControllerStub(ch)
        for role in ROLES.values():
            stub.SetDesiredInstances(
                controller_pb2.SetDesiredInstancesRequest(role=role, replicas=1), timeout=10
            )
    engines_url = f"{cluster.base_url}/metrics/engines?type=role"
    try:
        get(engines_url)
    except urllib.error.HTTPError as err:
        pytest.fail(f"GET {engines_url}: {err.code} {err.reason} (the Coordinator serves no engine metrics)")
    wanted = wanted_series()

    def all_exported() -> bool:
        exported = samples(get(engines_url)) + samples(get(cluster.metrics_url(CONTROLLER_METRICS)))
        absent = {
            name: gone
            for name, label_sets in wanted.items()
            if (
                gone := [
                    want
                    for want in label_sets
                    if not any(n == name and want.items() <= labels.items() for n, labels in exported)
                ]
            )
        }
        assert not absent, f"not exported: {absent}"
        return True

    # The first collection round of the engines' metrics ends a few seconds after start.
    wait_until(all_exported, timeout=30, what="every series the adapter rules read", retry=(AssertionError,))


def test_the_series_wanted_cover_every_rule_and_hpa_selector() -> None:
    wanted = wanted_series()
    assert set(wanted) == {s for r in adapter_rules() for s in r.series()}
    assert wanted["motor_desired_instances"] == [{"role": "prefill"}, {"role": "decode"}]
    assert wanted["vllm:num_requests_waiting"] == [{"role": "prefill"}]
