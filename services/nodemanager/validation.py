"""Request checks for motor.v1.NodeManager: each returns [(field_path, problem)]."""

from __future__ import annotations

from motor_mesh.gen.motor.v1 import common_pb2, nodemanager_pb2


def start_engines(req: nodemanager_pb2.StartEnginesRequest) -> list[tuple[str, str]]:
    bad: list[tuple[str, str]] = []
    if not req.job_name:
        bad.append(("job_name", "required"))
    if not req.instance_id:
        bad.append(("instance_id", "required"))
    if req.role == common_pb2.ROLE_UNSPECIFIED:
        bad.append(("role", "required"))
    elif req.role not in common_pb2.Role.values():
        bad.append(("role", f"unknown role {req.role}"))
    if not req.endpoints:
        bad.append(("endpoints", "at least one endpoint required"))
    ids: set[int] = set()
    addresses: set[tuple[str, int]] = set()
    for i, ep in enumerate(req.endpoints):
        if not ep.host:
            bad.append((f"endpoints[{i}].host", "required"))
        if not 0 < ep.port < 65536:
            bad.append((f"endpoints[{i}].port", "must be 1..65535"))
        if ep.id in ids:
            bad.append((f"endpoints[{i}].id", f"duplicate id {ep.id}"))
        if (ep.host.lower(), ep.port) in addresses:
            bad.append((f"endpoints[{i}].port", f"duplicate endpoint {ep.host}:{ep.port}"))
        ids.add(ep.id)
        addresses.add((ep.host.lower(), ep.port))
    return bad


def restart_engines(req: nodemanager_pb2.RestartEnginesRequest) -> list[tuple[str, str]]:
    if req.action not in (nodemanager_pb2.RESTART_ACTION_RESTART, nodemanager_pb2.RESTART_ACTION_ABORT):
        return [("action", "must be RESTART_ACTION_RESTART or RESTART_ACTION_ABORT")]
    return []


def switch_role(req: nodemanager_pb2.SwitchRoleRequest) -> list[tuple[str, str]]:
    bad: list[tuple[str, str]] = []
    if not req.instance_id:
        bad.append(("instance_id", "required"))
    if req.role not in (common_pb2.ROLE_PREFILL, common_pb2.ROLE_DECODE):
        bad.append(("role", "must be ROLE_PREFILL or ROLE_DECODE"))
    return bad


VALIDATORS = {"StartEngines": start_engines, "RestartEngines": restart_engines, "SwitchRole": switch_role}
