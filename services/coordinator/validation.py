"""Request checks for motor.v1.Coordinator: each returns [(field_path, problem)].

They run before the handler (``VALIDATORS``), so a malformed request never reaches the table.
"""

from __future__ import annotations

from collections.abc import Sequence

from motor_mesh.common.enums import PD_SGLANG, PREFILL, ROLE_UNSPECIFIED, pd_protocol_of
from motor_mesh.gen.motor.v1 import common_pb2, coordinator_pb2

_ROLES = frozenset(common_pb2.Role.values()) - {ROLE_UNSPECIFIED}
_ENGINE_TYPES = frozenset(common_pb2.EngineType.values())
_PD_PROTOCOLS = frozenset(common_pb2.PdProtocol.values())
_STATUSES = frozenset(common_pb2.InstanceStatus.values())
_EP_STATUSES = frozenset(common_pb2.EndpointStatus.values())
MAX_GRACE_S = 86400  # a drain longer than a day is a typo


def instance(inst: common_pb2.Instance, path: str) -> list[tuple[str, str]]:
    bad: list[tuple[str, str]] = []
    if not inst.id:
        bad.append((f"{path}.id", "required"))
    if inst.role == ROLE_UNSPECIFIED:
        bad.append((f"{path}.role", "required"))
    elif inst.role not in _ROLES:
        bad.append((f"{path}.role", f"unknown role {inst.role}"))
    if not inst.model_name:
        bad.append((f"{path}.model_name", "required"))
    if inst.engine_type not in _ENGINE_TYPES:
        bad.append((f"{path}.engine_type", f"unknown engine type {inst.engine_type}"))
    if inst.pd_protocol not in _PD_PROTOCOLS:
        bad.append((f"{path}.pd_protocol", f"unknown PD protocol {inst.pd_protocol}"))
    if inst.status not in _STATUSES:
        bad.append((f"{path}.status", f"unknown status {inst.status}"))
    if not inst.endpoints:
        bad.append((f"{path}.endpoints", "at least one endpoint required"))
    elif all(ep.headless for ep in inst.endpoints):
        bad.append((f"{path}.endpoints", "at least one endpoint must serve requests (not headless)"))
    # The SGLang decode leg meets its prefill on the prefill endpoint's bootstrap port.
    needs_bootstrap = inst.role == PREFILL and pd_protocol_of(inst.pd_protocol, inst.engine_type) == PD_SGLANG
    seen: dict[tuple[str, int], int] = {}
    for j, ep in enumerate(inst.endpoints):
        ep_path = f"{path}.endpoints[{j}]"
        if not ep.host:
            bad.append((f"{ep_path}.host", "required"))
        if not 0 < ep.port < 65536:
            bad.append((f"{ep_path}.port", "must be 1..65535"))
        if ep.bootstrap_port > 65535:
            bad.append((f"{ep_path}.bootstrap_port", "must be 0..65535"))
        elif needs_bootstrap and not ep.headless and not ep.bootstrap_port:
            bad.append((f"{ep_path}.bootstrap_port", "required for an SGLang prefill endpoint"))
        for name in ("kv_events_port", "kv_events_replay_port"):
            if getattr(ep, name) > 65535:
                bad.append((f"{ep_path}.{name}", "must be 0..65535"))
        if ep.status not in _EP_STATUSES:
            bad.append((f"{ep_path}.status", f"unknown status {ep.status}"))
        key = (ep.host, ep.port)
        if ep.host and key in seen:
            bad.append((ep_path, f"duplicate endpoint {ep.host}:{ep.port} (also endpoints[{seen[key]}])"))
        seen.setdefault(key, j)
    return bad


def instance_list(instances: Sequence[common_pb2.Instance]) -> list[tuple[str, str]]:
    bad: list[tuple[str, str]] = []
    seen: dict[int, int] = {}
    for i, inst in enumerate(instances):
        bad += instance(inst, f"instances[{i}]")
        if inst.id and inst.id in seen:
            bad.append((f"instances[{i}].id", f"duplicate id {inst.id} (also instances[{seen[inst.id]}])"))
        seen.setdefault(inst.id, i)
    return bad


def set_instances(req: coordinator_pb2.SetInstancesRequest) -> list[tuple[str, str]]:
    return instance_list(req.instances)


def add_instances(req: coordinator_pb2.AddInstancesRequest) -> list[tuple[str, str]]:
    return instance_list(req.instances)


def delete_instances(req: coordinator_pb2.DeleteInstancesRequest) -> list[tuple[str, str]]:
    """Only the id is required; role, job_name and endpoints are compared when given, so a role
    this proto does not define can never match: refused here, by name."""
    bad: list[tuple[str, str]] = []
    seen: set[int] = set()
    for i, inst in enumerate(req.instances):
        if not inst.id:
            bad.append((f"instances[{i}].id", "required"))
        elif inst.id in seen:
            bad.append((f"instances[{i}].id", f"duplicate id {inst.id}"))
        seen.add(inst.id)
        if inst.role != ROLE_UNSPECIFIED and inst.role not in _ROLES:
            bad.append((f"instances[{i}].role", f"unknown role {inst.role}"))
    return bad


def id_list(ids: Sequence[int]) -> list[tuple[str, str]]:
    bad: list[tuple[str, str]] = []
    seen: dict[int, int] = {}
    for i, iid in enumerate(ids):
        if not iid:
            bad.append((f"ids[{i}]", "required (non-zero)"))
        elif iid in seen:
            bad.append((f"ids[{i}]", f"duplicate id {iid} (also ids[{seen[iid]}])"))
        seen.setdefault(iid, i)
    return bad


def pause_instances(req: coordinator_pb2.PauseInstancesRequest) -> list[tuple[str, str]]:
    return id_list(req.ids)


def resume_instances(req: coordinator_pb2.ResumeInstancesRequest) -> list[tuple[str, str]]:
    return id_list(req.ids)


def drain_instances(req: coordinator_pb2.DrainInstancesRequest) -> list[tuple[str, str]]:
    bad = id_list(req.ids)
    if req.HasField("grace"):
        g = req.grace
        if g.seconds < 0 or g.nanos < 0:
            bad.append(("grace", "must not be negative"))
        elif g.seconds > MAX_GRACE_S or not 0 <= g.nanos < 1_000_000_000:
            bad.append(("grace", f"must be at most {MAX_GRACE_S} s with nanos 0..999999999"))
    return bad


def clear_precision_alarm(req: coordinator_pb2.ClearPrecisionAlarmRequest) -> list[tuple[str, str]]:
    return [] if req.d_instance_id else [("d_instance_id", "required")]


_VIEWS = frozenset(coordinator_pb2.EngineMetricsView.values())


def get_engine_metrics(req: coordinator_pb2.GetEngineMetricsRequest) -> list[tuple[str, str]]:
    bad: list[tuple[str, str]] = []
    if req.view not in _VIEWS:
        bad.append(("view", f"unknown view {req.view}"))
    if req.role != ROLE_UNSPECIFIED and req.role not in _ROLES:
        bad.append(("role", f"unknown role {req.role}"))
    return bad


# ApplySettings: Coordinators one Controller may count (far beyond any deployment: a typo).
MAX_REPLICAS = 100_000


def apply_settings(req: coordinator_pb2.ApplySettingsRequest) -> list[tuple[str, str]]:
    if not 1 <= req.replicas <= MAX_REPLICAS:
        return [("replicas", f"must be 1..{MAX_REPLICAS}: the Coordinators that share the load")]
    return []


VALIDATORS = {
    "SetInstances": set_instances,
    "AddInstances": add_instances,
    "DeleteInstances": delete_instances,
    "PauseInstances": pause_instances,
    "DrainInstances": drain_instances,
    "ResumeInstances": resume_instances,
    "ClearPrecisionAlarm": clear_precision_alarm,
    "GetEngineMetrics": get_engine_metrics,
    "ApplySettings": apply_settings,
}
