"""deploy/k8s: every manifest is a valid object of a current Kubernetes release, and what the pods
run agrees with Motor: probes on the ports the configuration gives each service and on health
names the services register, environments Motor accepts, key files Motor accepts, the image's
user, a network policy that keeps the management ports in the namespace, a grace period longer
than the drain. Last, the pods are run here as processes (their commands, environments and
volumes mapped onto this machine) and answer their probes, their metrics and a request.

No cluster and no kubectl needed: the kustomization is rendered here (and compared with
``kubectl kustomize`` where kubectl is installed).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import stat
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import kubernetes_validate
import pytest
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc

from motor_mesh.common import metrics_http
from motor_mesh.common import server as grpc_server
from motor_mesh.common.config import (
    DEFAULTS,
    ConfigError,
    NodeManagerConfig,
    load,
    load_config,
    read_key_file,
)
from motor_mesh.coordinator import inference
from motor_mesh.coordinator.workers import pool
from motor_mesh.gen.motor.v1 import controller_pb2, coordinator_pb2, nodemanager_pb2
from motor_mesh.nodemanager import app as nodemanager_main
from tests.deploy.k8s_render import (
    Pod,
    config_refusals,
    fsgroup_secret_volume,
    local_pods,
    matches,
    pods_of,
    quantity,
    render,
)
from tests.poll import wait_until
from tests.ports import reserved_pair, reserved_port
from tests.procs import ROOT, Proc, motor_argv

K8S = ROOT / "deploy" / "k8s"
DOC = ROOT / "docs" / "kubernetes.md"
DOCKERFILE = ROOT / "Dockerfile"
# The oldest release the manifests support (the pod-index label, native gRPC probes and the
# preStop sleep action are all there by 1.34) and the newest the validator knows.
VERSIONS = sorted({"1.34.0", kubernetes_validate.latest_version()})
SECTION = {
    "controller": "controller",
    "coordinator": "coordinator",
    "prefill": "nodemanager",
    "decode": "nodemanager",
}
# The gRPC service each Motor server registers, and so the health name it reports SERVING.
HEALTH_NAME = {
    "controller": controller_pb2.DESCRIPTOR.services_by_name["Controller"].full_name,
    "coordinator": coordinator_pb2.DESCRIPTOR.services_by_name["Coordinator"].full_name,
    "nodemanager": nodemanager_pb2.DESCRIPTOR.services_by_name["NodeManager"].full_name,
}
MANAGEMENT_PORT_KEYS = {
    "controller": ["port", "metrics_port"],
    "coordinator": ["port"],
    "nodemanager": ["port", "metrics_port"],
}
POD_IP = "10.1.2.3"
# Keys whose values start with "/" but name no file: etcd_prefix is a prefix of etcd keys.
NOT_PATHS = {"etcd_prefix"}


@pytest.fixture(scope="module")
def docs() -> list[dict[str, Any]]:
    return render(K8S)


@pytest.fixture(scope="module")
def pods(docs: list[dict[str, Any]], tmp_path_factory: pytest.TempPathFactory) -> list[Pod]:
    found = pods_of(docs, tmp_path_factory.mktemp("configmaps"))
    assert {p.component for p in found} == set(SECTION), (
        "a controller, coordinator, prefill and decode workload"
    )
    return found


def section(pod: Pod) -> dict[str, Any]:
    """The configuration the pod's Motor service runs with: its config file, its environment."""
    return load_config(str(pod.config_file()), env=pod.env(POD_IP))[SECTION[pod.component]]


# -- the objects themselves ------------------------------------------------------------------


@pytest.mark.parametrize("version", VERSIONS)
def test_every_manifest_is_a_valid_object_of_a_current_kubernetes(
    docs: list[dict[str, Any]], version: str
) -> None:
    problems = []
    for doc in docs:
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            problems.append(f"{doc['kind']}/{doc['metadata']['name']}: {exc.message} at {list(exc.path)}")
    assert not problems, "\n".join(problems)
    kinds = {d["kind"] for d in docs}
    assert {"ConfigMap", "Service", "StatefulSet", "Deployment", "NetworkPolicy"} <= kinds


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is not installed")
def test_the_rendering_checked_here_is_what_kubectl_applies(docs: list[dict[str, Any]]) -> None:
    out = subprocess.run(
        ["kubectl", "kustomize", str(K8S)], capture_output=True, text=True, timeout=60, check=True
    )
    theirs = [d for d in yaml.safe_load_all(out.stdout) if d]
    key = lambda d: (d["kind"], d["metadata"]["name"])  # noqa: E731
    assert sorted(theirs, key=key) == sorted(docs, key=key)


def test_the_config_file_passes_motor_config_check(pods: list[Pod]) -> None:
    for path in {p.config_file() for p in pods}:
        done = subprocess.run(
            motor_argv("config", "check", str(path)), capture_output=True, text=True, timeout=60
        )
        assert (done.returncode, done.stdout.strip()) == (0, "OK"), done.stderr


def test_every_pod_environment_is_configuration_motor_accepts(
    docs: list[dict[str, Any]], pods: list[Pod]
) -> None:
    assert config_refusals(docs, pods, POD_IP) == []


# -- probes, ports, addresses ----------------------------------------------------------------


def test_probes_are_grpc_on_the_service_port_and_name_what_it_registers(pods: list[Pod]) -> None:
    for pod in pods:
        sec = SECTION[pod.component]
        port, name = section(pod)["port"], HEALTH_NAME[sec]
        for kind in ("startupProbe", "livenessProbe", "readinessProbe"):
            probe = pod.main.get(kind)
            if probe is None:
                continue
            assert probe["grpc"]["port"] == port, f"{pod.name} {kind} is not on {sec}.port {port}"
            assert port in pod.container_ports().values(), f"{pod.name} does not declare port {port}"
            served = probe["grpc"].get("service", "")
            if kind == "readinessProbe":
                # "" is the Coordinator's "routable"; on the others it means the same as the name.
                allowed = {""} if sec == "coordinator" else {"", name}
                assert served in allowed, f"{pod.name}: readiness asks for {served!r}"
            else:
                # Never "" on the Coordinator: one with nothing to route is not dead.
                assert served == name, f"{pod.name} {kind} asks for {served!r}, the server registers {name!r}"
        assert "livenessProbe" in pod.main and "readinessProbe" in pod.main, pod.name
    nodemanagers = [p for p in pods if SECTION[p.component] == "nodemanager"]
    assert all("startupProbe" in p.main for p in nodemanagers)


def test_services_and_the_addresses_in_the_config_reach_the_right_ports(
    docs: list[dict[str, Any]], pods: list[Pod]
) -> None:
    services = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Service"}
    for svc in services.values():
        selected = [p for p in pods if matches(svc["spec"]["selector"], p.labels)]
        assert selected, f"Service {svc['metadata']['name']} selects no pod"
        for port in svc["spec"]["ports"]:
            for p in selected:
                target = p.resolve_port(port["targetPort"])
                assert target == port["port"], (
                    f"{svc['metadata']['name']}:{port['port']} -> {p.name}:{target}"
                )

    def reaches(address: str, component: str, key: str) -> dict[str, Any]:
        name, _, port = address.rpartition(":")
        svc = services.get(name)
        assert svc is not None, f"{address}: no Service {name}"
        assert int(port) in [p["port"] for p in svc["spec"]["ports"]], (
            f"{address}: Service has no port {port}"
        )
        target = next(p for p in pods if p.component == component)
        assert matches(svc["spec"]["selector"], target.labels), f"{address} does not select the {component}"
        assert int(port) == section(target)[key], f"{address} is not the {component}'s {key}"
        return svc

    by_component = {p.component: section(p) for p in pods}
    for peer in by_component["controller"]["coordinators"]:
        # Every address of the name is a Coordinator only with the dns:/// prefix.
        assert peer.startswith("dns:///"), f"{peer}: the Controller would push to one Coordinator"
        svc = reaches(peer.removeprefix("dns:///"), "coordinator", "port")
        # Every Coordinator, ready or not: one is routable only after the Controller pushed to it.
        assert svc["spec"].get("clusterIP") == "None" and svc["spec"].get("publishNotReadyAddresses") is True
    reaches(by_component["coordinator"]["controller"], "controller", "port")
    for role in ("prefill", "decode"):
        reaches(by_component[role]["controller"], "controller", "port")


def test_each_service_binds_where_it_is_reached(pods: list[Pod]) -> None:
    for pod in pods:
        host = section(pod)["host"]
        if SECTION[pod.component] == "nodemanager":
            # Registered with the Controller: the Coordinators and peer engines dial it.
            assert host == POD_IP, f"{pod.name}: nodemanager.host must be the pod IP"
        else:
            assert host in ("0.0.0.0", POD_IP), f"{pod.name}: {host} is not reachable from other pods"


def effective(pod: Pod) -> NodeManagerConfig:
    """The NodeManager configuration the pod runs with, its job and node_rank taken from its
    ordinal (nodemanager.pod_index), as the NodeManager resolves them at start."""
    return nodemanager_main.by_pod_index(load(str(pod.config_file()), env=pod.env(POD_IP)).nodemanager)


def test_each_nodemanager_statefulset_holds_whole_instances(
    docs: list[dict[str, Any]], pods: list[Pod], tmp_path: Path
) -> None:
    jobs = {}
    for component in ("prefill", "decode"):
        ranks = [p for p in pods if p.component == component]
        sts = ranks[0].workload
        assert sts["kind"] == "StatefulSet"
        configs = [section(p) for p in ranks]
        nnodes, dp = configs[0]["parallel"]["nnodes"], configs[0]["parallel"]["dp"]
        assert len(ranks) % nnodes == 0, f"{component}: replicas must be a multiple of parallel.nnodes"
        assert {c["job_name"] for c in configs} == {configs[0]["job_name"]} and configs[0]["job_name"]
        assert {json.dumps(c["parallel"], sort_keys=True) for c in configs} == {
            json.dumps(configs[0]["parallel"], sort_keys=True)
        }
        assert {c["role"] for c in configs} == {component}
        assert [c["pod_index"] for c in configs] == [p.ordinal for p in ranks], "pod_index is the ordinal"
        for p, c in zip(ranks, configs, strict=True):
            assert len(c["ports"]) == dp, f"{p.name}: one engine port per DP rank"
            assert set(c["ports"]) <= set(p.container_ports().values()), (
                f"{p.name} does not declare its engine ports"
            )
        # What `kubectl scale --replicas` makes of it: the pods of three instances group into
        # three whole instances, ranks 0 .. nnodes-1 each, under three job names.
        scaled = [Pod(docs, sts, i, tmp_path) for i in range(3 * nnodes)]
        instances: dict[str, list[int]] = {}
        for p in scaled:
            c = effective(p)
            instances.setdefault(c.job_name, []).append(c.node_rank)
        base = configs[0]["job_name"]
        assert instances == {f"{base}-{k}": list(range(nnodes)) for k in range(3)}, instances
        jobs[component] = base
    assert len(set(jobs.values())) == len(jobs), "two StatefulSets would join one instance"


def test_state_lives_on_writable_volumes_and_the_controllers_persists(pods: list[Pod]) -> None:
    for pod in pods:
        cfg = section(pod)
        for key, value in cfg.items():
            if isinstance(value, str) and value.startswith("/") and key not in NOT_PATHS:
                mount = pod.mount_of(value)
                assert mount is not None, f"{pod.name}: {key} {value} is on no volume"
                if key == "state_dir":
                    assert not mount.get("readOnly"), f"{pod.name}: state_dir is read-only"
        if pod.component == "controller":
            mount = pod.mount_of(cfg["state_dir"])
            claims = [t["metadata"]["name"] for t in pod.workload["spec"].get("volumeClaimTemplates", [])]
            assert mount is not None and mount["name"] in claims, (
                "the Controller's state must survive the pod"
            )
            assert pod.workload["spec"]["replicas"] == 1


def test_prometheus_annotations_name_the_metrics_port(pods: list[Pod]) -> None:
    for pod in pods:
        cfg = section(pod)
        port = cfg["http_port"] if pod.component == "coordinator" else cfg["metrics_port"]
        notes = pod.template["metadata"].get("annotations", {})
        assert port, f"{pod.name}: metrics are off"
        assert notes.get("prometheus.io/scrape") == "true"
        assert notes.get("prometheus.io/path") == "/metrics"
        assert notes.get("prometheus.io/port") == str(port), f"{pod.name}: metrics are on {port}"
        assert port in pod.container_ports().values()


# -- security --------------------------------------------------------------------------------


def dockerfile_user() -> tuple[int, int]:
    """The final stage's USER uid:gid, checked against the user it creates."""
    text = DOCKERFILE.read_text()
    stages = re.split(r"^FROM\s", text, flags=re.M)
    assert len(stages) >= 3, "a build stage and a final stage"
    final = stages[-1]
    users = re.findall(r"^USER\s+(\S+)", final, flags=re.M)
    assert users, "the final stage sets no USER"
    uid, _, gid = users[-1].partition(":")
    assert uid.isdigit() and gid.isdigit(), "numeric USER, so the kubelet can verify runAsNonRoot"
    assert int(uid) != 0
    assert re.search(rf"useradd\b[^\n]*(\\\n[^\n]*)*--uid {uid}\b", final), (
        "the user is created with that uid"
    )
    assert re.search(rf"groupadd\b.*--gid {gid}\b", final)
    assert re.search(r'^ENTRYPOINT \["motor"\]', final, flags=re.M)
    return int(uid), int(gid)


def test_pods_run_as_the_images_user_with_no_privileges(pods: list[Pod]) -> None:
    uid, gid = dockerfile_user()
    for pod in pods:
        ctx = pod.spec["securityContext"]
        assert ctx["runAsNonRoot"] is True
        assert (ctx["runAsUser"], ctx["runAsGroup"], ctx["fsGroup"]) == (uid, gid, gid), pod.name
        assert ctx["seccompProfile"]["type"] == "RuntimeDefault"
        assert pod.spec.get("automountServiceAccountToken") is False
        for c in pod.all_containers():
            sc = c["securityContext"]
            assert sc.get("runAsUser", uid) == uid and sc.get("runAsNonRoot", True) is True
            assert sc["allowPrivilegeEscalation"] is False, f"{pod.name}/{c['name']}"
            assert sc["capabilities"]["drop"] == ["ALL"] and not sc["capabilities"].get("add")
            assert sc["readOnlyRootFilesystem"] is True, f"{pod.name}/{c['name']}"
        tmp = pod.mount_of("/tmp/x")
        assert tmp is not None and "emptyDir" in pod.volume(tmp["name"]), f"{pod.name}: no writable /tmp"


def test_the_manifests_run_the_image_the_docs_build(pods: list[Pod]) -> None:
    commands = re.findall(r"^docker build .*$", DOC.read_text(), flags=re.M)
    built = {tag for command in commands for tag in re.findall(r"-t (\S+)", command)}
    assert "kubectl apply -k deploy/k8s" in DOC.read_text()
    for pod in pods:
        for c in pod.all_containers():
            assert c["image"] in built, f"{pod.name}/{c['name']} runs {c['image']}; the docs build {built}"


def test_secrets_are_mounted_0600_and_motor_accepts_the_key_files(tmp_path: Path, pods: list[Pod]) -> None:
    key = b"k8s-management-key\n"
    for pod in pods:
        volumes = pod.spec["volumes"]
        for v in volumes:
            if "secret" in v:
                assert v["secret"]["defaultMode"] == 0o600, f"{pod.name}: secret {v['name']}"
                assert all(i.get("mode", 0o600) == 0o600 for i in v["secret"].get("items", []))
        assert not [m for m in pod.main["volumeMounts"] if "secret" in pod.volume(m["name"])], (
            f"{pod.name}: the service reads the private copies, not the group-readable Secret volume"
        )
        # Run the pod's init containers on Secret volumes laid out as the kubelet does; then the
        # key files the service is configured with must be files Motor accepts.
        root = pod.local_root(tmp_path / pod.name, secrets={"motor-management-key": {"management.key": key}})
        pod.run_init_containers(root)
        cfg = section(pod)
        for name, value in cfg.items():
            if name.endswith("key_file") and value:
                copy = root / "main" / value.lstrip("/")
                assert stat.S_IMODE(copy.stat().st_mode) == 0o600, f"{pod.name}: {name}"
                assert read_key_file(str(copy)) == key.decode().strip(), f"{pod.name}: {name}"
    original = tmp_path / "original"
    fsgroup_secret_volume(original, {"management.key": key})
    with pytest.raises(ConfigError, match="must not be readable by group"):
        read_key_file(str(original / "management.key"))


def test_the_docs_create_the_secrets_the_pods_mount(pods: list[Pod]) -> None:
    text = DOC.read_text()
    for pod in pods:
        for v in pod.spec["volumes"]:
            if "secret" in v and not v["secret"].get("optional"):
                assert f"create secret generic {v['secret']['secretName']}" in text
        for name, value in section(pod).items():
            if name.endswith("key_file") and value:
                assert f"--from-file={Path(value).name}=" in text, f"{pod.name}: {name}"


def test_network_policy_keeps_management_ports_in_the_namespace(
    docs: list[dict[str, Any]], pods: list[Pod]
) -> None:
    policies = [d for d in docs if d["kind"] == "NetworkPolicy"]

    def rules_for(pod: Pod, port: int) -> list[dict[str, Any]]:
        out = []
        for pol in policies:
            if matches(pol["spec"]["podSelector"], pod.labels) and "Ingress" in pol["spec"]["policyTypes"]:
                for rule in pol["spec"].get("ingress", []):
                    ports = rule.get("ports")
                    if ports is None or any(pod.resolve_port(p["port"]) == port for p in ports):
                        out.append(rule)
        return out

    def in_namespace(rule: dict[str, Any]) -> bool:
        peers = rule.get("from") or []
        return bool(peers) and all(set(peer) == {"podSelector"} for peer in peers)

    for pod in pods:
        cfg = section(pod)
        assert any(matches(p["spec"]["podSelector"], pod.labels) for p in policies), (
            f"{pod.name} is not isolated"
        )
        for key in MANAGEMENT_PORT_KEYS[SECTION[pod.component]]:
            rules = rules_for(pod, cfg[key])
            assert all(in_namespace(r) for r in rules), (
                f"{pod.name}: {key} {cfg[key]} is open beyond the namespace"
            )
            whole_namespace = [r for r in rules if {"podSelector": {}} in r["from"]]
            assert whole_namespace, f"{pod.name}: {key} {cfg[key]} is not open to the pods of its namespace"
        if pod.component == "coordinator":
            rules = rules_for(pod, cfg["http_port"])
            assert any("from" not in r for r in rules), "the inference API must be open to every client"
        if SECTION[pod.component] == "nodemanager":
            coordinator = next(p for p in pods if p.component == "coordinator")
            for port in cfg["ports"]:
                rules = rules_for(pod, port)
                assert any(
                    any(matches(peer["podSelector"], coordinator.labels) for peer in r.get("from", []))
                    for r in rules
                ), f"{pod.name}: the Coordinators cannot reach engine port {port}"


# -- lifecycle and resources -----------------------------------------------------------------


def prestop_drain(pod: Pod) -> list[str] | None:
    """The ``motor drain`` arguments of the pod's preStop hook (a shell line), or None."""
    command = pod.main.get("lifecycle", {}).get("preStop", {}).get("exec", {}).get("command")
    if command is None:
        return None
    assert command[:2] == ["/bin/sh", "-c"], f"{pod.name}: the preStop is one shell line"
    words = shlex.split(command[2])
    assert words[:3] == ["exec", "motor", "drain"], f"{pod.name}: the preStop runs motor drain"
    return words[3:]


def flag(args: list[str], name: str, default: str) -> str:
    return args[args.index(name) + 1] if name in args else default


def drain_s(pod: Pod) -> float:
    """The longest a graceful stop takes, from the code's own timings."""
    grpc_stop = grpc_server.SHUTDOWN_DRAIN_S + grpc_server.STOP_GRACE_S + metrics_http.STOP_GRACE_S
    cfg = section(pod)
    sleep = pod.main.get("lifecycle", {}).get("preStop", {}).get("sleep", {}).get("seconds", 0)
    if pod.component == "coordinator":
        workers = pool.STOP_GRACE_S if cfg["workers"] != 1 else 0
        return sleep + grpc_stop + inference.HTTP_SHUTDOWN_S + workers
    if SECTION[pod.component] == "nodemanager":
        # The preStop's drain (its wait, then one last round of calls), then SIGTERM: the wait
        # for the Controller's Stop, whose engine stop takes the full engine_stop_grace_s.
        drain = prestop_drain(pod) or []
        hook = float(flag(drain, "--max-wait", "0")) + float(flag(drain, "--timeout", "10")) if drain else 0
        engines = max(cfg["engine_stop_grace_s"], nodemanager_main.SHUTDOWN_ENGINE_GRACE_S)
        return hook + cfg["drain_wait_s"] + engines + grpc_stop
    return sleep + grpc_stop


def test_the_grace_period_outlasts_the_drain(pods: list[Pod]) -> None:
    for pod in pods:
        grace = pod.spec["terminationGracePeriodSeconds"]
        assert grace > drain_s(pod), f"{pod.name}: {grace} s grace, {drain_s(pod)} s drain"


def test_the_nodemanagers_drain_their_instance_before_they_stop(pods: list[Pod]) -> None:
    coordinators = section(next(p for p in pods if p.component == "controller"))["coordinators"]
    for pod in pods:
        if SECTION[pod.component] != "nodemanager":
            continue
        drain = prestop_drain(pod)
        assert drain is not None, f"{pod.name}: no preStop drain"
        cfg = section(pod)
        # This pod's own NodeManager, every Coordinator the Controller pushes to, the key the
        # Coordinators want, and a wait that lets requests finish within the drain grace.
        assert flag(drain, "--nodemanager", "") == f"$MOTOR_NODEMANAGER_HOST:{cfg['port']}"
        assert pod.env(POD_IP)["MOTOR_NODEMANAGER_HOST"] == POD_IP == cfg["host"]
        assert [flag(drain, "--coordinator", "")] == coordinators
        key = flag(drain, "--key-file", "")
        assert key == cfg["management_key_file"] and pod.mount_of(key) is not None
        assert float(flag(drain, "--max-wait", "0")) > DEFAULTS["coordinator"]["drain_grace_s"]


def test_every_container_has_requests_within_limits(pods: list[Pod]) -> None:
    for pod in pods:
        for c in pod.all_containers():
            res = c["resources"]
            for what in ("cpu", "memory"):
                req, lim = quantity(res["requests"][what]), quantity(res["limits"][what])
                assert 0 < req <= lim, f"{pod.name}/{c['name']} {what}"


# -- the pods, run here ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def running(
    pods: list[Pod], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[list[tuple[Pod, Proc, dict[int, int]]]]:
    """One pod of each workload (every rank of the NodeManager StatefulSets), each a process here:
    the container's own command and environment, its volumes as directories, its ports moved to
    free ones, Service names resolved to the moved ports, the pod IP 127.0.0.1."""
    tmp = tmp_path_factory.mktemp("pods")
    secrets = {"motor-management-key": {"management.key": os.urandom(16).hex().encode()}}
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
            started.append((pod, Proc(motor_argv(*argv), cwd=tmp, env=env), ports[pod.name]))
        yield started
    finally:
        for _, proc, _ in started:
            proc.signal(signal.SIGTERM)
        for _, proc, _ in started:
            proc.stop()


def serving(proc: Proc, port: int, service: str) -> bool:
    if not proc.alive():  # not a "not yet": the poll stops here
        raise RuntimeError(f"exited {proc.popen.returncode}:\n{proc.tail()}")
    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        status = (
            health_pb2_grpc.HealthStub(ch)
            .Check(health_pb2.HealthCheckRequest(service=service), timeout=2)
            .status
        )
    return status == health_pb2.HealthCheckResponse.SERVING


def test_the_pods_answer_their_probes_metrics_and_a_request(
    running: list[tuple[Pod, Proc, dict[int, int]]],
) -> None:
    for pod, proc, moved in running:
        for kind in ("startupProbe", "livenessProbe", "readinessProbe"):
            probe = pod.main.get(kind)
            if probe is not None:
                port, service = moved[probe["grpc"]["port"]], probe["grpc"].get("service", "")
                # The Coordinator's readiness waits for both NodeManagers' engines to be routable.
                wait_until(
                    lambda: serving(proc, port, service),  # noqa: B023
                    60,
                    f"{pod.name} {kind}",
                    retry=(grpc.RpcError,),  # until it listens
                )
        notes = pod.template["metadata"]["annotations"]
        url = f"http://127.0.0.1:{moved[int(notes['prometheus.io/port'])]}{notes['prometheus.io/path']}"
        with urllib.request.urlopen(url, timeout=10) as resp:
            assert resp.status == 200 and b"motor_" in resp.read(), url
    coordinator, _, moved = next(r for r in running if r[0].component == "coordinator")
    http = moved[section(coordinator)["http_port"]]
    body = {
        "model": section(running[-1][0])["model"],
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 4,
    }
    req = urllib.request.Request(
        f"http://127.0.0.1:{http}/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"content-type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=30) as resp:
        assert resp.status == 200
        assert json.loads(resp.read())["choices"][0]["message"]["content"]


def test_the_nodemanager_prestop_drains_its_instance_on_the_coordinators(
    running: list[tuple[Pod, Proc, dict[int, int]]],
) -> None:
    """Last (it leaves the instances draining): each NodeManager pod's preStop line, run here with
    its NodeManager's address, the Coordinators' and the key file moved to the local ones."""
    (coordinator,) = [moved for pod, _, moved in running if pod.component == "coordinator"]
    coordinator_grpc = f"127.0.0.1:{coordinator[7200]}"
    for pod, proc, moved in running:
        drain = prestop_drain(pod)
        if drain is None:
            continue
        given = pod.main["args"][pod.main["args"].index("--config") + 1]  # the pod's, moved here:
        root = Path(proc.args[proc.args.index("--config") + 1].removesuffix(given))
        key = flag(drain, "--key-file", "")
        line = pod.main["lifecycle"]["preStop"]["exec"]["command"][2]
        line = line.replace(":7300", f":{moved[7300]}").replace(
            flag(drain, "--coordinator", ""), coordinator_grpc
        )
        line = line.replace(key, str(root / key.lstrip("/")))
        env = {**os.environ, "MOTOR_NODEMANAGER_HOST": "127.0.0.1"}
        env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
        done = subprocess.run(["/bin/sh", "-c", line], capture_output=True, text=True, timeout=60, env=env)
        assert done.returncode == 0, done.stderr
        first, *_, last = done.stdout.splitlines()
        assert re.match(r"instance \d+: requests move at ", first), done.stdout
        assert last.startswith("drained: nothing in flight on instance(s) ")
