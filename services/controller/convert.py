"""Conversions between the Controller's records (model.py) and the outside: protobuf messages
(requests, ListInstances, what the Coordinators are sent) and database rows (store/sqlite.py).
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from motor_mesh.common import enums
from motor_mesh.common.enums import InstanceStatus
from motor_mesh.controller.model import (
    Instance,
    JobSpec,
    Member,
    Pending,
    Removal,
    RoleSwitch,
    StrategyRecord,
    Teardown,
)
from motor_mesh.gen.motor.v1 import common_pb2, controller_pb2

# ---- requests ----------------------------------------------------------------------------------


def spec_of(req: controller_pb2.RegisterRequest) -> JobSpec:
    p = req.parallel
    return JobSpec(
        role=req.role,
        model_name=req.model_name,
        engine_type=req.engine_type,
        pd_protocol=enums.pd_protocol_of(req.pd_protocol, req.engine_type),
        dp=p.dp or 1,
        tp=p.tp or 1,
        pp=p.pp or 1,
        ep=p.ep or 1,
        nnodes=p.nnodes or 1,
    )


def member_of(req: controller_pb2.RegisterRequest) -> Member:
    return Member(
        node_rank=req.node_rank,
        host=req.host,
        nm_port=req.nm_port,
        ports=list(req.ports),
        device_count=req.device_count,
        incarnation=req.incarnation,
    )


# ---- protobuf ----------------------------------------------------------------------------------


def instance_pb(inst: Instance, status: InstanceStatus | None = None) -> common_pb2.Instance:
    s = inst.spec
    return common_pb2.Instance(
        id=inst.id,
        role=common_pb2.Role.ValueType(s.role),
        job_name=inst.job_name,
        model_name=s.model_name,
        engine_type=common_pb2.EngineType.ValueType(s.engine_type),
        status=inst.status if status is None else status,
        endpoints=inst.endpoints,
        parallel=common_pb2.ParallelConfig(dp=s.dp, tp=s.tp, pp=s.pp, ep=s.ep, nnodes=s.nnodes),
        node_managers=inst.node_managers,
        pd_protocol=common_pb2.PdProtocol.ValueType(s.pd_protocol),
    )


def identity_pb(inst: Instance) -> common_pb2.Instance:
    """What a Coordinator compares on Delete: id, role, job name and endpoint identities."""
    return common_pb2.Instance(
        id=inst.id,
        role=common_pb2.Role.ValueType(inst.spec.role),
        job_name=inst.job_name,
        endpoints=[common_pb2.Endpoint(id=ep.id, host=ep.host, port=ep.port) for ep in inst.endpoints],
    )


# ---- database rows -----------------------------------------------------------------------------


def _spec_json(spec: JobSpec) -> dict[str, Any]:
    return {name: getattr(spec, name) for name in spec.__dataclass_fields__}


def _member_json(m: Member) -> dict[str, Any]:
    return {
        "node_rank": m.node_rank,
        "host": m.host,
        "nm_port": m.nm_port,
        "ports": list(m.ports),
        "device_count": m.device_count,
        "incarnation": m.incarnation,
        "endpoint_ids": sorted(m.by_id),
    }


def _member_from_json(d: dict[str, Any]) -> Member:
    return Member(
        node_rank=int(d["node_rank"]),
        host=str(d["host"]),
        nm_port=int(d["nm_port"]),
        ports=[int(p) for p in d["ports"]],
        device_count=int(d.get("device_count", 0)),
        incarnation=int(d.get("incarnation", 0)),
    )


def _strategy_json(r: StrategyRecord) -> dict[str, Any]:
    d = dataclasses.asdict(r)
    d["base"] = {a: list(v) for a, v in r.base.items()}
    return d


def _strategy_from_json(d: dict[str, Any]) -> StrategyRecord:
    known = {f.name for f in dataclasses.fields(StrategyRecord)}
    d = {k: v for k, v in d.items() if k in known}
    d["base"] = {a: (int(v[0]), int(v[1])) for a, v in d.get("base", {}).items()}
    for k in ("dispatched", "accepted", "failed_accepted"):
        d[k] = tuple(d.get(k, ()))
    return StrategyRecord(**d)


def _teardown_json(t: Teardown) -> dict[str, Any]:
    return dataclasses.asdict(t)


def _teardown_from_json(d: dict[str, Any]) -> Teardown:
    known = {f.name for f in dataclasses.fields(Teardown)}
    d = {k: v for k, v in d.items() if k in known}
    d["reason"] = Removal(d["reason"])
    for k in ("stop", "unreached", "drained"):
        d[k] = tuple(d.get(k, ()))
    if d.get("precision") is not None:
        d["precision"] = (int(d["precision"][0]), int(d["precision"][1]))
    return Teardown(**d)


def _switch_json(r: RoleSwitch) -> dict[str, Any]:
    return dataclasses.asdict(r)


def _switch_from_json(d: dict[str, Any]) -> RoleSwitch:
    known = {f.name for f in dataclasses.fields(RoleSwitch)}
    d = {k: v for k, v in d.items() if k in known}
    for k in ("dispatched", "accepted"):
        d[k] = tuple(d.get(k, ()))
    d["attempts"] = {str(a): int(n) for a, n in d.get("attempts", {}).items()}
    return RoleSwitch(**d)


def instance_row(inst: Instance, status: InstanceStatus | None = None) -> tuple[bytes, str]:
    """(the Instance message; the members, the recovery strategy and the teardown as JSON);
    ``status`` overrides the record's own, so a transition can be written before memory changes
    (a new strategy or teardown is written from a copy: InstanceTable.update)."""
    meta: dict[str, Any] = {"spec": _spec_json(inst.spec), "members": [_member_json(m) for m in inst.members]}
    if inst.strategy != StrategyRecord():
        meta["strategy"] = _strategy_json(inst.strategy)
    if inst.teardown is not None:
        meta["teardown"] = _teardown_json(inst.teardown)
    if inst.switch is not None:
        meta["switch"] = _switch_json(inst.switch)
    if inst.switched_at:
        meta["switched_at"] = inst.switched_at
    return instance_pb(inst, status).SerializeToString(), json.dumps(meta)


def instance_from_row(id_: int, blob: bytes, members_json: str) -> Instance:
    pb = common_pb2.Instance.FromString(blob)
    meta = json.loads(members_json)
    endpoints = [common_pb2.Endpoint() for _ in pb.endpoints]
    for ep, stored in zip(endpoints, pb.endpoints, strict=True):
        ep.CopyFrom(stored)
        # A row written by a newer version may carry fields this one does not know: pushed on,
        # they would be refused by every Coordinator and NodeManager (unknown fields).
        ep.DiscardUnknownFields()
    members = []
    by_id = {ep.id: ep for ep in endpoints}
    for d in meta["members"]:
        m = _member_from_json(d)
        m.attach([by_id[i] for i in d.get("endpoint_ids", []) if i in by_id])
        m.started = None  # its first beat after the restart tells
        members.append(m)
    return Instance(
        id=id_,
        job_name=pb.job_name,
        spec=JobSpec(**meta["spec"]),
        status=pb.status,
        endpoints=endpoints,
        members=members,
        strategy=_strategy_from_json(meta["strategy"]) if "strategy" in meta else StrategyRecord(),
        teardown=_teardown_from_json(meta["teardown"]) if "teardown" in meta else None,
        switch=_switch_from_json(meta["switch"]) if "switch" in meta else None,
        switched_at=float(meta.get("switched_at", 0.0)),
    )


def pending_row(p: Pending) -> str:
    return json.dumps(
        {
            "spec": _spec_json(p.spec),
            "members": [_member_json(m) for m in p.members],
            "last_registration": p.last_registration,
        }
    )


def pending_from_row(id_: int, job: str, data: str) -> Pending:
    d = json.loads(data)
    return Pending(
        id=id_,
        job_name=job,
        spec=JobSpec(**d["spec"]),
        members=[_member_from_json(m) for m in d["members"]],
        last_registration=float(d.get("last_registration", 0.0)),
    )
