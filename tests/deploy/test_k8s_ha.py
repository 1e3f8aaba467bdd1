"""deploy/k8s/ha: the highly available variant of deploy/k8s. Every object is valid for the same
Kubernetes releases; the files it shares with deploy/k8s are the base's; the Controllers keep
their state in etcd, advertise their pod IP, are Ready only while leading and are reached by
their clients through a headless Service; the etcd cluster is consistent and only the
Controllers reach its client port. Last, the Motor pods run here (on a local etcd): one
Controller is Ready, the others live and name it, and a request is served.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import urllib.request
from collections.abc import Iterator
from typing import Any

import grpc
import kubernetes_validate
import pytest
import yaml
from google.rpc import error_details_pb2

from motor_mesh.common import server as grpc_server
from motor_mesh.common.config import load_config
from motor_mesh.common.errors import details_of
from motor_mesh.common.interceptors import KEY_METADATA
from motor_mesh.controller.leader.ha import ETCD_TIMEOUT_S
from motor_mesh.gen.motor.v1 import controller_pb2, controller_pb2_grpc
from tests.deploy.k8s_render import Doc, Pod, config_refusals, local_pods, matches, pods_of, quantity, render
from tests.deploy.test_k8s import HEALTH_NAME, K8S, POD_IP, SECTION, VERSIONS, serving
from tests.etcd import EtcdServer
from tests.poll import wait_until
from tests.ports import reserved_pair, reserved_port
from tests.procs import ROOT, Proc, motor_argv

HA = K8S / "ha"
DOC = ROOT / "docs" / "kubernetes.md"
# Copies of the base's files, kept equal (kustomize cannot make deploy/k8s/ha an overlay of the
# directory that contains it).
SHARED = ("coordinator.yaml", "prefill.yaml", "decode.yaml", "networkpolicy.yaml")
ETCD = "motor-etcd"  # the StatefulSet and its headless Service
ETCD_IMAGE = re.compile(r"quay\.io/coreos/etcd:v3\.5\.\d+")
CONTROLLER_HEALTH = HEALTH_NAME["controller"]
KEY = os.urandom(16).hex()  # the Secret motor-management-key of the pods run here


@pytest.fixture(scope="module")
def docs() -> list[Doc]:
    return render(HA)


@pytest.fixture(scope="module")
def pods(docs: list[Doc], tmp_path_factory: pytest.TempPathFactory) -> list[Pod]:
    """The Motor pods (etcd runs no Motor service)."""
    return pods_of(docs, tmp_path_factory.mktemp("configmaps"), skip={ETCD})


def obj(docs: list[Doc], kind: str, name: str) -> Doc:
    (found,) = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    return found


def section(pod: Pod) -> dict[str, Any]:
    return load_config(str(pod.config_file()), env=pod.env(POD_IP))[SECTION[pod.component]]


def controllers(pods: list[Pod]) -> list[Pod]:
    return [p for p in pods if p.component == "controller"]


def etcd_args(docs: list[Doc]) -> dict[str, str]:
    (c,) = obj(docs, "StatefulSet", ETCD)["spec"]["template"]["spec"]["containers"]
    return dict(a.removeprefix("--").split("=", 1) for a in c["args"])


# -- the objects ----------------------------------------------------------------------------


@pytest.mark.parametrize("version", VERSIONS)
def test_every_object_is_a_valid_object_of_a_current_kubernetes(docs: list[Doc], version: str) -> None:
    problems = []
    for doc in docs:
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            problems.append(f"{doc['kind']}/{doc['metadata']['name']}: {exc.message} at {list(exc.path)}")
    assert not problems, "\n".join(problems)
    assert {(d["kind"], d["metadata"]["name"]) for d in docs} >= {
        ("Deployment", "motor-controller"),
        ("Service", "motor-controller"),
        ("Service", "motor-controller-peers"),
        ("StatefulSet", ETCD),
        ("Service", ETCD),
        ("PodDisruptionBudget", ETCD),
        ("NetworkPolicy", ETCD),
    }
    assert not [d for d in docs if d["kind"] == "StatefulSet" and d["metadata"]["name"] == "motor-controller"]


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is not installed")
def test_the_rendering_checked_here_is_what_kubectl_applies(docs: list[Doc]) -> None:
    out = subprocess.run(
        ["kubectl", "kustomize", str(HA)], capture_output=True, text=True, timeout=60, check=True
    )
    theirs = [d for d in yaml.safe_load_all(out.stdout) if d]
    key = lambda d: (d["kind"], d["metadata"]["name"])  # noqa: E731
    assert sorted(theirs, key=key) == sorted(docs, key=key)


def test_what_it_shares_with_the_base_is_the_base(docs: list[Doc]) -> None:
    for name in SHARED:
        assert (HA / name).read_text() == (K8S / name).read_text(), (
            f"deploy/k8s/ha/{name} differs from the base's"
        )
    base = render(K8S)
    assert obj(docs, "Service", "motor-controller") == obj(base, "Service", "motor-controller")
    mine = json.loads(obj(docs, "ConfigMap", "motor-config")["data"]["config.json"])
    theirs = json.loads(obj(base, "ConfigMap", "motor-config")["data"]["config.json"])
    # The differences, and nothing else: the store, and the clients' Controller address.
    del theirs["controller"]["state_dir"]
    for key in ("store", "etcd_endpoints", "etcd_prefix", "leader_lease_s", "advertise_address"):
        theirs["controller"][key] = mine["controller"][key]
    for sec in ("coordinator", "nodemanager"):
        theirs[sec]["controller"] = mine[sec]["controller"]
    assert mine == theirs


def test_the_config_file_passes_motor_config_check(pods: list[Pod]) -> None:
    (path,) = {p.config_file() for p in pods}
    done = subprocess.run(
        motor_argv("config", "check", str(path)), capture_output=True, text=True, timeout=60
    )
    assert (done.returncode, done.stdout.strip()) == (0, "OK"), done.stderr


def test_every_pod_environment_is_configuration_motor_accepts(docs: list[Doc], pods: list[Pod]) -> None:
    assert config_refusals(docs, pods, POD_IP) == []


# -- the Controllers -------------------------------------------------------------------------


def test_the_controllers_keep_their_state_in_etcd_and_advertise_their_pod_ip(pods: list[Pod]) -> None:
    found = controllers(pods)
    workload = found[0].workload
    assert workload["kind"] == "Deployment"
    assert 2 <= workload["spec"]["replicas"] <= 3 and len(found) == workload["spec"]["replicas"]
    # Standbys are never Ready: a rolling update would wait on them forever.
    assert workload["spec"]["strategy"]["type"] == "Recreate"
    assert "volumeClaimTemplates" not in workload["spec"]
    for pod in found:
        cfg = section(pod)
        assert cfg["store"] == "etcd" and cfg["etcd_prefix"].startswith("/")
        assert cfg["advertise_address"] == f"{POD_IP}:{cfg['port']}", "standbys must name this pod's address"
        assert cfg["host"] == "0.0.0.0"


def test_the_etcd_endpoints_are_the_members_client_ports(docs: list[Doc], pods: list[Pod]) -> None:
    sts, svc = obj(docs, "StatefulSet", ETCD), obj(docs, "Service", ETCD)
    (c,) = sts["spec"]["template"]["spec"]["containers"]
    client = {p["name"]: p["containerPort"] for p in c["ports"]}["client"]
    members = [f"{ETCD}-{i}.{sts['spec']['serviceName']}:{client}" for i in range(sts["spec"]["replicas"])]
    assert section(controllers(pods)[0])["etcd_endpoints"] == members
    assert sts["spec"]["serviceName"] == svc["metadata"]["name"]
    assert svc["spec"]["clusterIP"] == "None" and svc["spec"]["publishNotReadyAddresses"] is True
    assert matches(svc["spec"]["selector"], sts["spec"]["template"]["metadata"]["labels"])
    assert {(p["port"], p["targetPort"]) for p in svc["spec"]["ports"]} == {
        (client, "client"),
        (2380, "peer"),
    }


def test_only_the_leader_is_ready_and_liveness_is_the_process(pods: list[Pod]) -> None:
    for pod in controllers(pods):
        port = section(pod)["port"]
        probes = {k: pod.main[k]["grpc"] for k in ("startupProbe", "livenessProbe", "readinessProbe")}
        assert {p["port"] for p in probes.values()} == {port} and port in pod.container_ports().values()
        # A standby is alive ("" SERVING) but never serves motor.v1.Controller.
        assert probes["readinessProbe"]["service"] == CONTROLLER_HEALTH
        assert probes["livenessProbe"].get("service", "") == ""
        assert probes["startupProbe"].get("service", "") == ""


def test_clients_dial_every_controller_and_operators_the_leader(docs: list[Doc], pods: list[Pod]) -> None:
    port = section(controllers(pods)[0])["port"]
    peers = obj(docs, "Service", "motor-controller-peers")
    # Standbys included: a client that reaches one is told where the leader is.
    assert peers["spec"]["clusterIP"] == "None" and peers["spec"]["publishNotReadyAddresses"] is True
    assert [p["port"] for p in peers["spec"]["ports"]] == [port]
    for svc in (peers, obj(docs, "Service", "motor-controller")):
        assert {p.component for p in pods if matches(svc["spec"]["selector"], p.labels)} == {"controller"}
    for pod in pods:
        if pod.component != "controller":
            assert section(pod)["controller"] == f"dns:///motor-controller-peers:{port}", pod.name


def test_the_controllers_grace_period_outlasts_the_drain_and_the_resignation(pods: list[Pod]) -> None:
    stop = grpc_server.SHUTDOWN_DRAIN_S + grpc_server.STOP_GRACE_S + ETCD_TIMEOUT_S
    for pod in controllers(pods):
        assert pod.spec["terminationGracePeriodSeconds"] > stop


def test_motor_pods_run_unprivileged(docs: list[Doc], pods: list[Pod]) -> None:
    etcd = obj(docs, "StatefulSet", ETCD)["spec"]["template"]["spec"]
    for name, spec in [*((p.name, p.spec) for p in controllers(pods)), (ETCD, etcd)]:
        ctx = spec["securityContext"]
        assert ctx["runAsNonRoot"] is True and ctx["seccompProfile"]["type"] == "RuntimeDefault", name
        assert spec["automountServiceAccountToken"] is False and spec["enableServiceLinks"] is False, name
        for c in spec.get("initContainers", []) + spec["containers"]:
            sc = c["securityContext"]
            assert sc["allowPrivilegeEscalation"] is False and sc["readOnlyRootFilesystem"] is True, name
            assert sc["capabilities"]["drop"] == ["ALL"], name
            for what in ("cpu", "memory"):
                req, lim = (
                    quantity(c["resources"]["requests"][what]),
                    quantity(c["resources"]["limits"][what]),
                )
                assert 0 < req <= lim, f"{name}/{c['name']} {what}"


# -- etcd ------------------------------------------------------------------------------------


def test_the_etcd_members_form_one_cluster(docs: list[Doc]) -> None:
    sts = obj(docs, "StatefulSet", ETCD)
    spec, replicas = sts["spec"], sts["spec"]["replicas"]
    assert replicas >= 3 and replicas % 2 == 1, "a quorum that survives a member lost"
    # No member is Ready before a quorum runs: one at a time would never start the second.
    assert spec["podManagementPolicy"] == "Parallel"
    (c,) = spec["template"]["spec"]["containers"]
    assert ETCD_IMAGE.fullmatch(c["image"]), c["image"]
    env = {e["name"]: e for e in c["env"]}
    assert env["POD_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    args, svc = etcd_args(docs), spec["serviceName"]
    assert args["name"] == "$(POD_NAME)"
    assert args["initial-advertise-peer-urls"] == f"http://$(POD_NAME).{svc}:2380"
    assert args["advertise-client-urls"] == f"http://$(POD_NAME).{svc}:2379"
    assert args["initial-cluster"] == ",".join(
        f"{ETCD}-{i}=http://{ETCD}-{i}.{svc}:2380" for i in range(replicas)
    )
    claims = [t["metadata"]["name"] for t in spec["volumeClaimTemplates"]]
    mounts = [m for m in c["volumeMounts"] if args["data-dir"].startswith(m["mountPath"].rstrip("/") + "/")]
    assert [m["name"] for m in mounts] == claims, "the data directory is on the member's claim"
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert c["readinessProbe"]["httpGet"]["port"] == "metrics" and args["listen-metrics-urls"].endswith(
        f":{ports['metrics']}"
    )
    pdb = obj(docs, "PodDisruptionBudget", ETCD)
    assert pdb["spec"]["maxUnavailable"] == 1 and matches(
        pdb["spec"]["selector"], spec["template"]["metadata"]["labels"]
    )


def test_only_the_controllers_reach_the_etcd_client_port(docs: list[Doc], pods: list[Pod]) -> None:
    etcd_labels = obj(docs, "StatefulSet", ETCD)["spec"]["template"]["metadata"]["labels"]
    policies = [
        p
        for p in docs
        if p["kind"] == "NetworkPolicy"
        and matches(p["spec"]["podSelector"], etcd_labels)
        and "Ingress" in p["spec"]["policyTypes"]
    ]
    assert policies, "the etcd pods are not isolated"

    def admitted(port: int, labels: dict[str, str]) -> bool:
        for pol in policies:
            for rule in pol["spec"].get("ingress", []):
                if rule.get("ports") is not None and port not in [p["port"] for p in rule["ports"]]:
                    continue
                peers = rule.get("from")
                if peers is None or any(matches(peer.get("podSelector", {}), labels) for peer in peers):
                    return True
        return False

    for pod in pods:
        assert admitted(2379, pod.labels) == (pod.component == "controller"), pod.name
        assert not admitted(2380, pod.labels), pod.name
    assert admitted(2380, etcd_labels)


def test_the_docs_describe_the_variant() -> None:
    text = DOC.read_text()
    assert "## High availability" in text and "kubectl apply -k deploy/k8s/ha" in text


# -- the pods, run here on a local etcd -------------------------------------------------------


@pytest.fixture(scope="module")
def running(
    pods: list[Pod], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[list[tuple[Pod, Proc, dict[int, int]]]]:
    """Every Controller, one Coordinator and every NodeManager as processes here (as in
    test_k8s.py), on one local etcd in place of the StatefulSet."""
    tmp = tmp_path_factory.mktemp("ha-pods")
    etcd = EtcdServer(tmp / "etcd").start()
    secrets = {"motor-management-key": {"management.key": KEY.encode()}}
    chosen = [p for p in pods if p.component != "coordinator" or p.ordinal == 0]
    ports = {
        p.name: {
            port: (reserved_pair() if name.startswith("engine") else reserved_port())
            for name, port in p.container_ports().items()
        }
        for p in chosen
    }
    started = []
    try:
        for pod, argv, env in local_pods(chosen, ports, tmp, secrets, SECTION):
            if pod.component == "controller":
                env["MOTOR_CONTROLLER_ETCD_ENDPOINTS"] = json.dumps([etcd.endpoint])
            started.append((pod, Proc(motor_argv(*argv), cwd=tmp, env=env), ports[pod.name]))
        yield started
    finally:
        for _, proc, _ in started:
            proc.signal(signal.SIGTERM)
        for _, proc, _ in started:
            proc.stop()
        etcd.stop()


def health_of(pod: Pod, proc: Proc, moved: dict[int, int], probe: str) -> bool:
    grpc_probe = pod.main[probe]["grpc"]
    return serving(proc, moved[grpc_probe["port"]], grpc_probe.get("service", ""))


def test_one_controller_is_ready_the_others_live_and_name_it(
    running: list[tuple[Pod, Proc, dict[int, int]]],
) -> None:
    ctl = [r for r in running if r[0].component == "controller"]
    for pod, proc, moved in ctl:
        wait_until(
            lambda: health_of(pod, proc, moved, "livenessProbe"),  # noqa: B023
            60,
            f"{pod.name} liveness",
            retry=(grpc.RpcError,),  # until it listens
        )

    def ready() -> list[tuple[Pod, Proc, dict[int, int]]] | None:
        found = [r for r in ctl if health_of(*r, "readinessProbe")]
        return found if len(found) == 1 else None

    ((leader, _, leader_ports),) = wait_until(ready, 60, "exactly one Controller Ready")
    leader_address = f"127.0.0.1:{leader_ports[section(leader)['port']]}"
    for pod, _, moved in ctl:
        if pod is not leader:  # a standby learns the leader by a watch: soon, not at once
            addr = f"127.0.0.1:{moved[section(pod)['port']]}"
            wait_until(lambda: named_leader(addr) == leader_address, 20, f"{pod.name} naming the leader")  # noqa: B023


def named_leader(addr: str) -> str:
    """The leader a standby names in its refusal of a motor.v1.Controller call."""
    with grpc.insecure_channel(addr) as ch, pytest.raises(grpc.RpcError) as caught:
        controller_pb2_grpc.ControllerStub(ch).ListInstances(
            controller_pb2.ListInstancesRequest(), timeout=5, metadata=[(KEY_METADATA, KEY)]
        )
    assert caught.value.code() == grpc.StatusCode.UNAVAILABLE, caught.value
    (info,) = [d for d in details_of(caught.value) if isinstance(d, error_details_pb2.ErrorInfo)]
    assert info.reason == "NOT_LEADER"
    return info.metadata["leader"]


def test_the_other_pods_answer_their_probes_and_a_request_is_served(
    running: list[tuple[Pod, Proc, dict[int, int]]],
) -> None:
    for pod, proc, moved in running:
        if pod.component == "controller":
            continue
        for kind in ("startupProbe", "livenessProbe", "readinessProbe"):
            if kind in pod.main:
                wait_until(
                    lambda: health_of(pod, proc, moved, kind),  # noqa: B023
                    60,
                    f"{pod.name} {kind}",
                    retry=(grpc.RpcError,),  # until it listens
                )
    coordinator, _, moved = next(r for r in running if r[0].component == "coordinator")
    body = {"model": "motor-sim", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    req = urllib.request.Request(
        f"http://127.0.0.1:{moved[section(coordinator)['http_port']]}/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"content-type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=30) as resp:
        assert resp.status == 200
        assert json.loads(resp.read())["choices"][0]["message"]["content"]
