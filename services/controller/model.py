"""The Controller's in-memory records: job specs, NodeManager members, sessions, pending
assemblies and instances, with their conversions to protobuf and to the database's JSON.

Endpoints are kept as live ``common_pb2.Endpoint`` messages: a beat updates their status and pid
in place, and every read (ListInstances, the event pusher) copies them into a fresh Instance.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, TypeAlias

from motor.v1 import common_pb2, controller_pb2

Status: TypeAlias = common_pb2.InstanceStatus.ValueType
EpStatus: TypeAlias = common_pb2.EndpointStatus.ValueType


def resolve_pd_protocol(requested: int, engine_type: int) -> common_pb2.PdProtocol.ValueType:
    """The request's protocol, or the engine's own (SGLANG -> SGLANG, anything else -> VLLM)."""
    if requested in (common_pb2.PD_PROTOCOL_VLLM, common_pb2.PD_PROTOCOL_SGLANG):
        return common_pb2.PdProtocol.ValueType(requested)
    if engine_type == common_pb2.ENGINE_TYPE_SGLANG:
        return common_pb2.PD_PROTOCOL_SGLANG
    return common_pb2.PD_PROTOCOL_VLLM


@dataclass(frozen=True)
class JobSpec:
    """What every registration of one job must agree on."""

    role: int
    model_name: str
    engine_type: int
    pd_protocol: int
    dp: int = 1
    tp: int = 1
    pp: int = 1
    ep: int = 1
    nnodes: int = 1

    @classmethod
    def from_request(cls, req: controller_pb2.RegisterRequest) -> JobSpec:
        p = req.parallel
        return cls(
            role=req.role,
            model_name=req.model_name,
            engine_type=req.engine_type,
            pd_protocol=resolve_pd_protocol(req.pd_protocol, req.engine_type),
            dp=p.dp or 1,
            tp=p.tp or 1,
            pp=p.pp or 1,
            ep=p.ep or 1,
            nnodes=p.nnodes or 1,
        )

    def parallel_pb(self) -> common_pb2.ParallelConfig:
        return common_pb2.ParallelConfig(dp=self.dp, tp=self.tp, pp=self.pp, ep=self.ep, nnodes=self.nnodes)

    def differences(self, other: JobSpec) -> list[str]:
        return [name for name in self.__dataclass_fields__ if getattr(self, name) != getattr(other, name)]

    def to_json(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self.__dataclass_fields__}


@dataclass(eq=False)
class Session:
    """One registration of one NodeManager: what its heartbeat stream must present."""

    node_id: int
    epoch: int
    member: Member
    valid: bool = True


@dataclass(eq=False)
class Member:
    """One NodeManager's part of a pending or assembled instance."""

    node_rank: int
    host: str
    nm_port: int
    ports: list[int]
    device_count: int = 0
    # Liveness (monotonic clock). A beat sets last_heard; so does a stream ending, which is how
    # "a broken stream starts the clock at once" works.
    last_heard: float = 0.0
    session: Session | None = None
    open_streams: int = 0
    instance: Instance | None = None  # None while the instance is still assembling
    # Assembled members only: the instance's endpoints this NodeManager serves, looked up by the
    # id it was given in StartEngines, or by port for a NodeManager that reports local ids.
    by_id: dict[int, common_pb2.Endpoint] = field(default_factory=dict)
    by_port: dict[int, common_pb2.Endpoint] = field(default_factory=dict)
    # (id, status, pid) of every endpoint in the last applied beat: an unchanged beat is skipped.
    beat_fingerprint: tuple[tuple[int, int, int], ...] | None = None
    dead_pids: set[int] = field(default_factory=set)

    @property
    def address(self) -> str:
        return f"{self.host}:{self.nm_port}"

    @property
    def slots(self) -> set[tuple[str, int]]:
        return {(self.host, p) for p in self.ports}

    def attach(self, endpoints: list[common_pb2.Endpoint]) -> None:
        self.by_id = {ep.id: ep for ep in endpoints}
        self.by_port = {ep.port: ep for ep in endpoints}
        self.beat_fingerprint = None

    @property
    def endpoints(self) -> list[common_pb2.Endpoint]:
        return list(self.by_id.values())

    def to_json(self) -> dict[str, Any]:
        return {
            "node_rank": self.node_rank,
            "host": self.host,
            "nm_port": self.nm_port,
            "ports": list(self.ports),
            "device_count": self.device_count,
            "endpoint_ids": sorted(self.by_id),
        }

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Member:
        return cls(
            node_rank=int(d["node_rank"]),
            host=str(d["host"]),
            nm_port=int(d["nm_port"]),
            ports=[int(p) for p in d["ports"]],
            device_count=int(d.get("device_count", 0)),
        )

    @classmethod
    def from_request(cls, req: controller_pb2.RegisterRequest) -> Member:
        return cls(
            node_rank=req.node_rank,
            host=req.host,
            nm_port=req.nm_port,
            ports=list(req.ports),
            device_count=req.device_count,
        )


@dataclass(eq=False)
class Pending:
    """Registrations of one job waiting for the rest of their instance."""

    id: int
    job_name: str
    spec: JobSpec
    members: list[Member] = field(default_factory=list)
    last_registration: float = 0.0  # wall clock, so the expiry survives a restart
    completing: bool = False

    def to_json(self) -> dict[str, Any]:
        return {
            "spec": self.spec.to_json(),
            "members": [m.to_json() for m in self.members],
            "last_registration": self.last_registration,
        }


@dataclass(eq=False)
class Instance:
    """An assembled instance (any status, DELETED included)."""

    id: int
    job_name: str
    spec: JobSpec
    status: Status
    endpoints: list[common_pb2.Endpoint]
    members: list[Member]
    # Set by a fault-recovery strategy: the instance stays INACTIVE until it is cleared.
    separated: bool = False

    @property
    def node_managers(self) -> list[str]:
        return [m.address for m in self.members]

    def to_pb(self) -> common_pb2.Instance:
        s = self.spec
        return common_pb2.Instance(
            id=self.id,
            role=common_pb2.Role.ValueType(s.role),
            job_name=self.job_name,
            model_name=s.model_name,
            engine_type=common_pb2.EngineType.ValueType(s.engine_type),
            status=self.status,
            endpoints=self.endpoints,
            parallel=s.parallel_pb(),
            node_managers=self.node_managers,
            pd_protocol=common_pb2.PdProtocol.ValueType(s.pd_protocol),
        )

    def identity_pb(self) -> common_pb2.Instance:
        """What a Coordinator compares on Delete: id, role, job name and endpoint identities."""
        return common_pb2.Instance(
            id=self.id,
            role=common_pb2.Role.ValueType(self.spec.role),
            job_name=self.job_name,
            endpoints=[common_pb2.Endpoint(id=ep.id, host=ep.host, port=ep.port) for ep in self.endpoints],
        )

    def member_at(self, host: str, nm_port: int) -> Member | None:
        for m in self.members:
            if m.host == host and m.nm_port == nm_port:
                return m
        return None

    def to_row(self) -> tuple[bytes, str]:
        members = json.dumps({"spec": self.spec.to_json(), "members": [m.to_json() for m in self.members]})
        return self.to_pb().SerializeToString(), members

    @classmethod
    def from_row(cls, id_: int, blob: bytes, members_json: str) -> Instance:
        pb = common_pb2.Instance.FromString(blob)
        meta = json.loads(members_json)
        spec = JobSpec(**meta["spec"])
        endpoints = [common_pb2.Endpoint() for _ in pb.endpoints]
        for ep, stored in zip(endpoints, pb.endpoints, strict=True):
            ep.CopyFrom(stored)
        members = []
        by_id = {ep.id: ep for ep in endpoints}
        for d in meta["members"]:
            m = Member.from_json(d)
            m.attach([by_id[i] for i in d.get("endpoint_ids", []) if i in by_id])
            members.append(m)
        return cls(
            id=id_, job_name=pb.job_name, spec=spec, status=pb.status, endpoints=endpoints, members=members
        )
