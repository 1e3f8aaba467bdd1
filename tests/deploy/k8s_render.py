"""deploy/k8s as the tests see it: the kustomization rendered (resources, namespace, images), the
pods its workloads make, and a pod mapped onto this machine: its volumes as directories (a Secret
laid out as the kubelet does), its init containers run for real, its service's command and
environment with ports, paths and Service names moved to local ones."""

from __future__ import annotations

import json
import re
import subprocess
from collections.abc import Collection, Iterator, Mapping
from pathlib import Path
from typing import Any

import yaml

from motor_mesh.common.config import ConfigError, load_config

POD_INDEX = "metadata.labels['apps.kubernetes.io/pod-index']"
MOTOR_SERVICES = ("controller", "coordinator", "nodemanager")
# What render() applies; a kustomization using anything else would be checked as it is not.
KUSTOMIZATION_FIELDS = {"apiVersion", "kind", "namespace", "resources", "images"}
_ADDRESS = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?:\d+$")
_ENV_REF = re.compile(r"\$\((\w+)\)")
_UNITS = {
    "m": 1e-3,
    "k": 1e3,
    "M": 1e6,
    "G": 1e9,
    "T": 1e12,
    "Ki": 2**10,
    "Mi": 2**20,
    "Gi": 2**30,
    "Ti": 2**40,
}

Doc = dict[str, Any]


def render(directory: Path) -> list[Doc]:
    """What ``kubectl kustomize`` makes of ``directory``."""
    kust = yaml.safe_load((directory / "kustomization.yaml").read_text())
    extra = set(kust) - KUSTOMIZATION_FIELDS
    assert not extra, f"kustomization.yaml uses {sorted(extra)}, which this rendering does not apply"
    images = {i["name"]: f"{i.get('newName', i['name'])}:{i['newTag']}" for i in kust.get("images", [])}
    docs = []
    for resource in kust["resources"]:
        for doc in yaml.safe_load_all((directory / resource).read_text()):
            if doc is None:
                continue
            assert "namespace" not in doc["metadata"], f"{resource}: the kustomization sets the namespace"
            doc["metadata"]["namespace"] = kust["namespace"]
            template = doc.get("spec", {}).get("template", {}).get("spec", {})
            for c in template.get("initContainers", []) + template.get("containers", []):
                c["image"] = images.get(c["image"], c["image"])
            docs.append(doc)
    return docs


def matches(selector: Mapping[str, Any], labels: Mapping[str, str]) -> bool:
    """A Service's selector (a plain map) or a LabelSelector (matchLabels, matchExpressions)."""
    if selector and not ({"matchLabels", "matchExpressions"} & set(selector)):
        return all(labels.get(k) == v for k, v in selector.items())
    if not all(labels.get(k) == v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for e in selector.get("matchExpressions", []):
        key, op, values = e["key"], e["operator"], e.get("values", [])
        ok = {
            "In": labels.get(key) in values,
            "NotIn": labels.get(key) not in values,
            "Exists": key in labels,
            "DoesNotExist": key not in labels,
        }[op]
        if not ok:
            return False
    return True


def quantity(q: str | int | float) -> float:
    """A Kubernetes resource quantity ("500m", "2", "1Gi") as a number."""
    m = re.fullmatch(r"([0-9.]+)([a-zA-Z]*)", str(q))
    assert m is not None and (m[2] == "" or m[2] in _UNITS), f"quantity {q!r}"
    return float(m[1]) * _UNITS.get(m[2], 1)


def config_refusals(docs: list[Doc], pods: list[Pod], pod_ip: str) -> list[str]:
    """What Motor's config loader says of each pod's file and environment (the service-link
    variables included unless the pod turns them off: Motor would read MOTOR_CONTROLLER_PORT=
    tcp://... as its own key); [] when every pod would start."""
    links = service_link_env(docs)
    refused = []
    for pod in pods:
        env = pod.env(pod_ip)
        if pod.spec.get("enableServiceLinks", True):
            env = {**links, **env}
        try:
            load_config(str(pod.config_file()), env=env)
        except ConfigError as exc:
            refused.append(f"{pod.name}: {exc}")
    return refused


def service_link_env(docs: list[Doc]) -> dict[str, str]:
    """The variables the kubelet puts into a pod for every Service with a cluster IP, unless the
    pod sets ``enableServiceLinks: false``."""
    env = {}
    for svc in (d for d in docs if d["kind"] == "Service" and d["spec"].get("clusterIP") != "None"):
        prefix, ip = svc["metadata"]["name"].upper().replace("-", "_"), "10.96.0.10"
        ports = svc["spec"]["ports"]
        env[f"{prefix}_SERVICE_HOST"] = ip
        env[f"{prefix}_SERVICE_PORT"] = str(ports[0]["port"])
        env[f"{prefix}_PORT"] = f"{ports[0].get('protocol', 'TCP').lower()}://{ip}:{ports[0]['port']}"
        for p in ports:
            if "name" in p:
                env[f"{prefix}_SERVICE_PORT_{p['name'].upper().replace('-', '_')}"] = str(p["port"])
            proto = p.get("protocol", "TCP")
            var = f"{prefix}_PORT_{p['port']}_{proto}"
            env[var] = f"{proto.lower()}://{ip}:{p['port']}"
            env.update({f"{var}_PROTO": proto.lower(), f"{var}_PORT": str(p["port"]), f"{var}_ADDR": ip})
    return env


def fsgroup_secret_volume(root: Path, files: Mapping[str, bytes]) -> None:
    """A Secret volume as the kubelet writes it with fsGroup set: the files in a timestamped
    directory behind ``..data`` and per-file symlinks, with group read added to mode 0600."""
    data = root / "..2025_01_01_00_00_00.000000000"
    data.mkdir(parents=True)
    (root / "..data").symlink_to(data.name)
    for name, content in files.items():
        (data / name).write_bytes(content)
        (data / name).chmod(0o640)
        (root / name).symlink_to(f"..data/{name}")


class Pod:
    """One pod of a Deployment or StatefulSet (``ordinal``: its index)."""

    def __init__(self, docs: list[Doc], workload: Doc, ordinal: int, files: Path) -> None:
        self.docs, self.workload, self.ordinal = docs, workload, ordinal
        self.template = workload["spec"]["template"]
        self.spec = self.template["spec"]
        self.labels: dict[str, str] = self.template["metadata"]["labels"]
        self.component = self.labels["app.kubernetes.io/component"]
        self.name = f"{workload['metadata']['name']}-{ordinal}"
        self._files = files
        mains = [c for c in self.spec["containers"] if c.get("args", [None])[0] in MOTOR_SERVICES]
        assert len(mains) == 1, f"{self.name}: one container runs a Motor service"
        self.main: Doc = mains[0]

    def all_containers(self) -> list[Doc]:
        return self.spec.get("initContainers", []) + self.spec["containers"]

    def container_ports(self) -> dict[str, int]:
        return {p["name"]: p["containerPort"] for p in self.main.get("ports", [])}

    def resolve_port(self, port: int | str) -> int:
        return port if isinstance(port, int) else self.container_ports()[port]

    def volume(self, name: str) -> Doc:
        for v in self.spec["volumes"]:
            if v["name"] == name:
                return v
        claims = [t["metadata"]["name"] for t in self.workload["spec"].get("volumeClaimTemplates", [])]
        assert name in claims, f"{self.name}: no volume {name}"
        return {"name": name, "persistentVolumeClaim": {"claimName": name}}

    def mount_of(self, path: str, container: Doc | None = None) -> Doc | None:
        """The volume mount ``path`` lies on in ``container`` (the main one by default)."""
        mounts = [
            m
            for m in (container or self.main).get("volumeMounts", [])
            if path == m["mountPath"] or path.startswith(m["mountPath"].rstrip("/") + "/")
        ]
        return max(mounts, key=lambda m: len(m["mountPath"]), default=None)

    def env(self, pod_ip: str) -> dict[str, str]:
        """The main container's environment, with what the downward API gives filled in and
        ``$(VAR)`` references to variables defined before expanded, as the kubelet does."""
        given = {"status.podIP": pod_ip}
        if self.workload["kind"] == "StatefulSet":
            given[POD_INDEX] = str(self.ordinal)
        out = {}
        for e in self.main.get("env", []):
            if "value" in e:
                out[e["name"]] = _ENV_REF.sub(lambda m: out.get(m[1], m[0]), e["value"])
            else:
                ref = e["valueFrom"]["fieldRef"]["fieldPath"]
                assert ref in given, f"{self.name}: {e['name']} from {ref}, which this pod does not have"
                out[e["name"]] = given[ref]
        return out

    def config_file(self) -> Path:
        """The ``--config`` file, taken from the ConfigMap mounted where it points."""
        args = self.main["args"]
        path = args[args.index("--config") + 1]
        mount = self.mount_of(path)
        assert mount is not None, f"{self.name}: --config {path} is on no volume"
        source = self.volume(mount["name"]).get("configMap")
        assert source is not None, f"{self.name}: --config {path} is not from a ConfigMap"
        key = path[len(mount["mountPath"].rstrip("/")) + 1 :]
        cm = next(
            d for d in self.docs if d["kind"] == "ConfigMap" and d["metadata"]["name"] == source["name"]
        )
        assert key in cm["data"], f"ConfigMap {source['name']} has no {key}"
        out = self._files / source["name"] / key
        if not out.exists():
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(cm["data"][key])
        return out

    def local_root(self, where: Path, secrets: Mapping[str, Mapping[str, bytes]]) -> Path:
        """Each container's file system as ``where/roots/<container>`` (the main one ``main``):
        a symlink at every mount path to the volume's directory under ``where/volumes``."""
        for v in self.spec["volumes"] + [
            self.volume(t["metadata"]["name"]) for t in self.workload["spec"].get("volumeClaimTemplates", [])
        ]:
            d = where / "volumes" / v["name"]
            if "secret" in v:
                name = v["secret"]["secretName"]
                if name in secrets:
                    fsgroup_secret_volume(d, secrets[name])
                else:
                    assert v["secret"].get("optional"), f"{self.name}: Secret {name} is required"
                    d.mkdir(parents=True)
            elif "configMap" in v:
                d.mkdir(parents=True)
                cm = next(
                    x
                    for x in self.docs
                    if x["kind"] == "ConfigMap" and x["metadata"]["name"] == v["configMap"]["name"]
                )
                for key, text in cm["data"].items():
                    (d / key).write_text(text)
            else:  # emptyDir, a claim
                d.mkdir(parents=True)
        for c in self.all_containers():
            root = where / "roots" / ("main" if c is self.main else c["name"])
            for m in c.get("volumeMounts", []):
                link = root / m["mountPath"].lstrip("/")
                link.parent.mkdir(parents=True, exist_ok=True)
                link.symlink_to(where / "volumes" / m["name"])
        return where / "roots"

    def run_init_containers(self, roots: Path) -> None:
        """Each init container's command, its paths moved into its root."""
        for c in self.spec.get("initContainers", []):
            root = roots / c["name"]
            argv = [
                str(root / a.lstrip("/")) if a.startswith("/") and (root / a.lstrip("/")).exists() else a
                for a in c.get("command", []) + c.get("args", [])
            ]
            subprocess.run(argv, check=True, timeout=30, capture_output=True)


def pods_of(docs: list[Doc], files: Path, skip: Collection[str] = ()) -> list[Pod]:
    """The pods of every workload but those named in ``skip`` (ones that run no Motor service)."""
    return [
        Pod(docs, d, i, files)
        for d in docs
        if d["kind"] in ("Deployment", "StatefulSet") and d["metadata"]["name"] not in skip
        for i in range(d["spec"].get("replicas", 1))
    ]


def local_pods(
    pods: list[Pod],
    ports: Mapping[str, Mapping[int, int]],
    where: Path,
    secrets: Mapping[str, Mapping[str, bytes]],
    sections: Mapping[str, str],
) -> Iterator[tuple[Pod, list[str], dict[str, str]]]:
    """(pod, ``motor`` arguments, environment) of each pod run here on 127.0.0.1: every port moved
    to ``ports[pod.name][port]``, every path into the pod's root, every Service name to the moved
    ports of the pods it selects (all of them: what a headless name resolves to)."""
    services = {d["metadata"]["name"]: d for d in pods[0].docs if d["kind"] == "Service"}

    def local(address: str) -> list[str]:
        name, _, port = address.removeprefix("dns:///").rpartition(":")
        svc = services[name]
        target = next(p["targetPort"] for p in svc["spec"]["ports"] if p["port"] == int(port))
        return [
            f"127.0.0.1:{ports[p.name][p.resolve_port(target)]}"
            for p in pods
            if matches(svc["spec"]["selector"], p.labels)
        ]

    for pod in pods:
        roots = pod.local_root(where / pod.name, secrets)
        pod.run_init_containers(roots)
        root, moved = roots / "main", ports[pod.name]
        sec = sections[pod.component]
        env = pod.env("127.0.0.1")
        cfg = load_config(str(pod.config_file()), env=env)[sec]
        for key, value in cfg.items():
            if key in ("port", "http_port", "metrics_port") and value in moved:
                value = moved[value]
            elif key == "ports":
                value = [moved[p] for p in value]
            elif key == "host" and value == "0.0.0.0":
                value = "127.0.0.1"
            elif key == "advertise_address" and value:
                value = f"127.0.0.1:{moved[int(value.rpartition(':')[2])]}"
            elif isinstance(value, str) and value.startswith("/") and pod.mount_of(value):
                value = str(root / value.lstrip("/"))
            elif isinstance(value, str) and _ADDRESS.match(value) and value.rpartition(":")[0] in services:
                value = local(value)[0]
            elif isinstance(value, str) and value.startswith("dns:///") and _ADDRESS.match(value[7:]):
                value = ",".join(local(value))  # every pod the name resolves to, in turn
            elif (
                isinstance(value, list)
                and value
                and all(isinstance(v, str) and _ADDRESS.match(v.removeprefix("dns:///")) for v in value)
            ):
                value = [a for v in value for a in local(v)]
            else:
                continue
            env[f"MOTOR_{sec.upper()}_{key.upper()}"] = value if isinstance(value, str) else json.dumps(value)
        args = list(pod.main["args"])
        at = args.index("--config") + 1
        args[at] = str(root / args[at].lstrip("/"))
        env["HOME"] = str(root / "home" / "motor") if pod.mount_of("/home/motor") else str(where / pod.name)
        yield pod, args, env
