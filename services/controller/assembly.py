"""Assembly rules as pure functions: when a pending instance is complete, whether one more
registration fits, and what the assembled instance and its StartEngines commands look like.

Layout: members are ordered by (node_rank, host, nm_port); each contributes one endpoint per
registered port, numbered 0, 1, … in that order (the DP rank). Endpoints of node_rank ≠ 0 are
headless. The DP master is the first node_rank-0 member's host.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from motor.v1 import common_pb2, nodemanager_pb2

from .model import JobSpec, Member


def is_complete(spec: JobSpec, members: Sequence[Member]) -> bool:
    """``dp`` routable endpoints (one node), or ``dp * nnodes`` NodeManagers (several nodes)."""
    if spec.nnodes > 1:
        return len(members) == spec.dp * spec.nnodes
    return sum(len(m.ports) for m in members) == spec.dp


def misfit(spec: JobSpec, members: Sequence[Member], new: Member) -> str:
    """Why ``new`` cannot join ``members`` without overfilling the instance ("" = it fits)."""
    if spec.nnodes > 1:
        same_rank = sum(1 for m in members if m.node_rank == new.node_rank)
        if same_rank >= spec.dp:
            return f"node_rank {new.node_rank} already has {spec.dp} NodeManager(s) (parallel.dp)"
        return ""
    have = sum(len(m.ports) for m in members)
    if have + len(new.ports) > spec.dp:
        return f"instance needs {spec.dp} endpoint(s) (parallel.dp) and already has {have}"
    return ""


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
    sglang = spec.pd_protocol == common_pb2.PD_PROTOCOL_SGLANG
    endpoints: list[common_pb2.Endpoint] = []
    per_member: list[list[common_pb2.Endpoint]] = []
    for m in ordered:
        mine = []
        for j, port in enumerate(m.ports):
            ep = common_pb2.Endpoint(
                id=len(endpoints),
                host=m.host,
                port=port,
                bootstrap_port=port + 1 if sglang else 0,
                status=common_pb2.ENDPOINT_STATUS_INITIAL,
                headless=m.node_rank != 0,
                device_ids=_device_slice(m.device_count, len(m.ports), j),
            )
            endpoints.append(ep)
            mine.append(ep)
        per_member.append(mine)
    master = next((m.host for m in ordered if m.node_rank == 0), ordered[0].host if ordered else "")
    commands = {}
    for m, mine in zip(ordered, per_member, strict=True):
        m.attach(mine)
        commands[m.address] = nodemanager_pb2.StartEnginesRequest(
            job_name=job_name,
            instance_id=instance_id,
            role=common_pb2.Role.ValueType(spec.role),
            endpoints=mine,
            master_host=master,
            node_rank=m.node_rank,
            peers=[o.address for o in ordered if o is not m],
        )
    return Plan(endpoints=endpoints, members=ordered, commands=commands)
