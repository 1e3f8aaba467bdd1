"""Request checks for motor.v1.Controller: each returns [(field_path, problem)]."""

from __future__ import annotations

import contextlib
import ipaddress
import re

from motor_mesh.common import enums
from motor_mesh.common.config.checks import split_problem
from motor_mesh.controller.alarms.pages import BadToken, decode_token
from motor_mesh.controller.alarms.store import CONGESTION, PRECISION
from motor_mesh.gen.motor.v1 import alarm_pb2, common_pb2, controller_pb2

_ROLES = frozenset(common_pb2.Role.values()) - {common_pb2.ROLE_UNSPECIFIED}
_ENGINE_TYPES = frozenset(common_pb2.EngineType.values())
_PD_PROTOCOLS = frozenset(common_pb2.PdProtocol.values())
_ROLE_NAMES = frozenset(common_pb2.Role.values())
_STATUSES = frozenset(common_pb2.InstanceStatus.values())

# A job name ends up in logs, metrics labels, alarm text and Kubernetes-style tooling: printable,
# shell- and label-safe, and short. A model name is what clients send as "model" (often a path
# or "org/model"): anything printable.
JOB_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
MODEL_NAME = re.compile(r"[^\x00-\x1f\x7f-\x9f]{1,256}")
# RFC 1123 host names; the Controller dials what a registration names, so nothing else.
_HOST_LABEL = re.compile(r"(?!-)[A-Za-z0-9-]{1,63}(?<!-)")
MAX_PORTS = 1024
# Parallel sizes and device counts far beyond any machine or cluster: the Controller sizes lists
# by them, so an absurd one must be refused, not allocated.
MAX_PARALLEL = 65_536
MAX_DEVICES = 4096
# SetDesiredInstances: instances of one role the cluster may be asked to have.
MAX_DESIRED_REPLICAS = 1024


def _host_problem(host: str) -> str | None:
    if not host:
        return "required"
    with contextlib.suppress(ValueError):
        ipaddress.ip_address(host)
        return None  # an IP address
    if len(host) > 253 or not all(_HOST_LABEL.fullmatch(label) for label in host.rstrip(".").split(".")):
        return "must be an IP address or a DNS host name"
    return None


def register(req: controller_pb2.RegisterRequest) -> list[tuple[str, str]]:
    bad: list[tuple[str, str]] = []
    if not req.job_name:
        bad.append(("job_name", "required"))
    elif not JOB_NAME.fullmatch(req.job_name):
        bad.append(
            (
                "job_name",
                "1-128 characters: letters, digits, '.', '_' or '-', starting with a letter or digit",
            )
        )
    if req.role == common_pb2.ROLE_UNSPECIFIED:
        bad.append(("role", "required"))
    elif req.role not in _ROLES:
        bad.append(("role", f"unknown role {req.role}"))
    if not req.model_name:
        bad.append(("model_name", "required (the served model name)"))
    elif not MODEL_NAME.fullmatch(req.model_name):
        bad.append(("model_name", "1-256 printable characters"))
    if req.engine_type not in _ENGINE_TYPES:
        bad.append(("engine_type", f"unknown engine type {req.engine_type}"))
    if req.pd_protocol not in _PD_PROTOCOLS:
        bad.append(("pd_protocol", f"unknown PD protocol {req.pd_protocol}"))
    host_problem = _host_problem(req.host)
    if host_problem:
        bad.append(("host", host_problem))
    if not 0 < req.nm_port < 65536:
        bad.append(("nm_port", "must be 1..65535"))
    if not req.ports:
        bad.append(("ports", "at least one engine port required"))
    elif len(req.ports) > MAX_PORTS:
        bad.append(("ports", f"at most {MAX_PORTS} engine ports"))
        return bad
    seen: set[int] = set()
    # An instance handing off through SGLang bootstrap rooms also uses port + 1.
    top = 65534 if enums.pd_protocol_of(req.pd_protocol, req.engine_type) == enums.PD_SGLANG else 65535
    for i, p in enumerate(req.ports):
        if not 0 < p <= top:
            bad.append((f"ports[{i}]", f"must be 1..{top}"))
        elif p in seen:
            bad.append((f"ports[{i}]", f"duplicate port {p}"))
        seen.add(p)
    if req.device_count > MAX_DEVICES:
        bad.append(("device_count", f"at most {MAX_DEVICES}"))
    for name in ("dp", "tp", "pp", "ep", "nnodes"):
        if getattr(req.parallel, name) > MAX_PARALLEL:
            bad.append((f"parallel.{name}", f"at most {MAX_PARALLEL}"))
    if any(path.startswith("parallel.") for path, _ in bad):
        return bad
    nnodes = req.parallel.nnodes or 1
    if req.node_rank >= nnodes:
        bad.append(("node_rank", f"must be below parallel.nnodes ({nnodes})"))
    tp, pp = req.parallel.tp or 1, req.parallel.pp or 1
    if tp * pp % nnodes:
        bad.append(("parallel.nnodes", split_problem(tp, pp, nnodes)))
    dp = req.parallel.dp or 1
    if len(req.ports) > dp:
        bad.append(
            ("ports", f"{len(req.ports)} engine ports but parallel.dp is {dp} (one endpoint per DP rank)")
        )
    return bad


def terminate_instance(req: controller_pb2.TerminateInstanceRequest) -> list[tuple[str, str]]:
    return [] if req.instance_id else [("instance_id", "required")]


def list_instances(req: controller_pb2.ListInstancesRequest) -> list[tuple[str, str]]:
    bad: list[tuple[str, str]] = []
    if req.role not in _ROLE_NAMES:
        bad.append(("role", f"unknown role {req.role}"))
    if req.status not in _STATUSES:
        bad.append(("status", f"unknown status {req.status}"))
    return bad


_LEVELS = frozenset(controller_pb2.FaultLevel.values())


def report_faults(req: controller_pb2.ReportFaultsRequest) -> list[tuple[str, str]]:
    bad: list[tuple[str, str]] = []
    if not req.faults:
        bad.append(("faults", "at least one fault required"))
    for i, f in enumerate(req.faults):
        if not f.host:
            bad.append((f"faults[{i}].host", "required"))
        if not 0 < f.nm_port < 65536:
            bad.append((f"faults[{i}].nm_port", "must be 1..65535"))
        if f.level not in _LEVELS:
            bad.append((f"faults[{i}].level", f"unknown level {f.level}"))
        elif f.level == controller_pb2.FAULT_LEVEL_UNSPECIFIED and not f.cleared:
            bad.append((f"faults[{i}].level", "required unless cleared (FAULT_LEVEL_L1 .. FAULT_LEVEL_L6)"))
    return bad


_CATEGORIES = frozenset(alarm_pb2.AlarmCategory.values()) - {alarm_pb2.ALARM_CATEGORY_UNSPECIFIED}
_SEVERITIES = frozenset(alarm_pb2.Severity.values())
# One report is applied and announced at once; a bound keeps that burst well inside what a
# watcher may have waiting (alarm_watch.WATCH_BUFFER).
MAX_ALARMS_PER_REPORT = 1000


def report_alarms(req: controller_pb2.ReportAlarmsRequest) -> list[tuple[str, str]]:
    bad: list[tuple[str, str]] = []
    if len(req.alarms) > MAX_ALARMS_PER_REPORT:
        bad.append(("alarms", f"at most {MAX_ALARMS_PER_REPORT} alarms per request"))
    for i, a in enumerate(req.alarms):
        if not a.alarm_id:
            bad.append((f"alarms[{i}].alarm_id", 'required, e.g. "0xFC001002"'))
        if a.category == alarm_pb2.ALARM_CATEGORY_UNSPECIFIED:
            bad.append((f"alarms[{i}].category", "required (ALARM, CLEAR or EVENT)"))
        elif a.category not in _CATEGORIES:
            bad.append((f"alarms[{i}].category", f"unknown category {a.category}"))
        if a.severity not in _SEVERITIES:
            bad.append((f"alarms[{i}].severity", f"unknown severity {a.severity}"))
        if a.alarm_id == PRECISION and not a.moi:
            bad.append((f"alarms[{i}].moi", "required for a precision alarm (it is the dedupe key)"))
        if a.alarm_id == CONGESTION and not a.moi:
            bad.append((f"alarms[{i}].moi", "required for a congestion alarm (it is the dedupe key)"))
    return bad


def list_alarms(req: controller_pb2.ListAlarmsRequest) -> list[tuple[str, str]]:
    bad: list[tuple[str, str]] = []
    if req.page_size < 0:
        bad.append(("page_size", "must not be negative"))
    try:
        decode_token(req)
    except BadToken as err:
        bad.append(("page_token", str(err)))
    return bad


def set_desired_instances(req: controller_pb2.SetDesiredInstancesRequest) -> list[tuple[str, str]]:
    bad: list[tuple[str, str]] = []
    if req.role == common_pb2.ROLE_UNSPECIFIED:
        bad.append(("role", "required: ROLE_PREFILL, ROLE_DECODE or ROLE_UNION"))
    elif req.role not in _ROLES:
        bad.append(("role", f"unknown role {req.role}"))
    if req.replicas > MAX_DESIRED_REPLICAS:
        bad.append(("replicas", f"at most {MAX_DESIRED_REPLICAS}"))
    return bad


def reload_config(req: controller_pb2.ReloadConfigRequest) -> list[tuple[str, str]]:
    return [] if req.config_text.strip() else [("config_text", "required: the configuration file's text")]


VALIDATORS = {
    "Register": register,
    "ReportAlarms": report_alarms,
    "ListAlarms": list_alarms,
    "TerminateInstance": terminate_instance,
    "ListInstances": list_instances,
    "ReportFaults": report_faults,
    "SetDesiredInstances": set_desired_instances,
    "ReloadConfig": reload_config,
}
