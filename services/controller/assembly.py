"""Assembly rules as pure functions: when a pending instance is complete, whether one more
registration fits, and what the assembled instance and its StartEngines commands look like.

Layout: an instance has ``dp`` endpoints (one per DP rank) on each node_rank 0 .. nnodes-1:
a rank spans ``nnodes`` nodes, its node_rank-0 endpoint serves requests and the others run
headless. Members are ordered by (node_rank, host, nm_port); each contributes one endpoint per
registered port, numbered in that order, so endpoint ids are node_rank * dp + DP rank. The DP
master is rank 0's endpoint.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from motor_mesh.common.enums import EP_INITIAL, PD_SGLANG
from motor_mesh.controller.model import Instance, JobSpec, Member
from motor_mesh.gen.motor.v1 import common_pb2, nodemanager_pb2


def _endpoints_by_rank(spec: JobSpec, members: Sequence[Member]) -> list[int]:
    counts = [0] * spec.nnodes
    for m in members:
        if m.node_rank < spec.nnodes:
            counts[m.node_rank] += len(m.ports)
    return counts


def is_complete(spec: JobSpec, members: Sequence[Member]) -> bool:
    """``dp`` endpoints on every node_rank."""
    return all(n == spec.dp for n in _endpoints_by_rank(spec, members))


def misfit(spec: JobSpec, members: Sequence[Member], new: Member) -> str:
    """Why ``new`` cannot join ``members`` without overfilling the instance ("" = it fits)."""
    have = _endpoints_by_rank(spec, members)[new.node_rank]
    if have + len(new.ports) > spec.dp:
        where = f" on node_rank {new.node_rank}" if spec.nnodes > 1 else ""
        return f"instance needs {spec.dp} endpoint(s){where} (parallel.dp) and already has {have}"
    return ""


def missing(spec: JobSpec, members: Sequence[Member]) -> str:
    """What an incomplete instance still waits for, in words ("" = nothing)."""
    short = [(rank, n) for rank, n in enumerate(_endpoints_by_rank(spec, members)) if n < spec.dp]
    if not short:
        return ""
    if spec.nnodes == 1:
        return f"has {short[0][1]} of {spec.dp} endpoint(s) (parallel.dp)"
    return "; ".join(f"node_rank {r} has {n} of {spec.dp} endpoint(s)" for r, n in short)


def conflict(members: Sequence[Member], new: Member) -> Member | None:
    """The member holding the same NodeManager address or an engine port ``new`` claims."""
    for m in members:
        if (m.host, m.nm_port) == (new.host, new.nm_port) or m.slots & new.slots:
            return m
    return None


@dataclass
class Plan:
    endpoints: list[common_pb2.Endpoint]
    members: list[Member]  # ordered, each attached to its endpoints
    commands: dict[str, nodemanager_pb2.StartEnginesRequest]  # by NodeManager address


def _device_slice(device_count: int, n_ports: int, j: int) -> list[int]:
    per = device_count // n_ports if n_ports else 0
    return list(range(j * per, (j + 1) * per))


def plan(instance_id: int, job_name: str, spec: JobSpec, members: Sequence[Member]) -> Plan:
    ordered = sorted(members, key=lambda m: (m.node_rank, m.host, m.nm_port))
    sglang = spec.pd_protocol == PD_SGLANG
    endpoints: list[common_pb2.Endpoint] = []
    for m in ordered:
        mine = []
        for j, port in enumerate(m.ports):
            ep = common_pb2.Endpoint(
                id=len(endpoints),
                host=m.host,
                port=port,
                bootstrap_port=port + 1 if sglang else 0,
                status=EP_INITIAL,
                headless=m.node_rank != 0,
                device_ids=_device_slice(m.device_count, len(m.ports), j),
            )
            endpoints.append(ep)
            mine.append(ep)
        m.attach(mine)
    commands = {m.address: _command(instance_id, job_name, spec.role, ordered, m) for m in ordered}
    return Plan(endpoints=endpoints, members=ordered, commands=commands)


def start_command(inst: Instance, member: Member) -> nodemanager_pb2.StartEnginesRequest:
    """The StartEngines one member of an assembled instance gets (also to send it again)."""
    return _command(inst.id, inst.job_name, inst.spec.role, inst.members, member)


def _command(
    instance_id: int, job_name: str, role: int, ordered: Sequence[Member], member: Member
) -> nodemanager_pb2.StartEnginesRequest:
    """The member's endpoints as assigned (without observed status or pid), every DP rank's
    routable endpoint (the DP master first) and the member's peers."""
    heads = sorted(
        (
            common_pb2.Endpoint(id=ep.id, host=ep.host, port=ep.port, bootstrap_port=ep.bootstrap_port)
            for m in ordered
            if m.node_rank == 0
            for ep in m.by_id.values()
        ),
        key=lambda e: e.id,
    )
    master = heads[0].host if heads else ordered[0].host
    endpoints = [
        common_pb2.Endpoint(
            id=ep.id,
            host=ep.host,
            port=ep.port,
            bootstrap_port=ep.bootstrap_port,
            status=EP_INITIAL,
            headless=ep.headless,
            device_ids=ep.device_ids,
        )
        for ep in sorted(member.by_id.values(), key=lambda e: e.id)
    ]
    return nodemanager_pb2.StartEnginesRequest(
        job_name=job_name,
        instance_id=instance_id,
        role=common_pb2.Role.ValueType(role),
        endpoints=endpoints,
        master_host=master,
        node_rank=member.node_rank,
        peers=[o.address for o in ordered if o is not member],
        heads=heads,
    )
