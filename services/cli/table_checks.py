"""What ``motor register`` refuses before it writes, given the Coordinator's table as it reads it.

The Coordinator refuses the same things itself (an id held by another identity, a Delete whose
identity does not match), all-or-nothing; checking first gives the operator a sentence naming the
instance in the way, and also catches what the Coordinator allows but an operator never means:
one engine serving in two instances, or a ``set`` that wipes instances a Controller manages.
"""

from __future__ import annotations

from collections.abc import Sequence

from motor_mesh.cli import standalone as sa
from motor_mesh.common import enums
from motor_mesh.gen.motor.v1 import common_pb2, coordinator_pb2

Held = dict[int, common_pb2.Instance]


def hex_id(iid: int) -> str:
    return f"{iid:#x}"


def describe(inst: common_pb2.Instance) -> str:
    role = enums.ROLE_NAMES.get(inst.role, "?")
    eps = ",".join(sa.EndpointSpec(e.host, e.port).address for e in inst.endpoints)
    return f"{hex_id(inst.id)} ({role} {eps})"


def held_of(table: coordinator_pb2.CoordinatorListInstancesResponse) -> Held:
    return {i.id: i for group in (table.available, table.unavailable, table.paused) for i in group}


def _endpoints(inst: common_pb2.Instance) -> frozenset[tuple[str, int]]:
    return frozenset((e.host.lower(), e.port) for e in inst.endpoints)


def _same_identity(a: common_pb2.Instance, b: common_pb2.Instance) -> bool:
    return a.role == b.role and a.job_name == b.job_name and _endpoints(a) == _endpoints(b)


def refuse_overlaps(instances: Sequence[common_pb2.Instance]) -> None:
    """Within one request: two instances with one id, or one engine in two instances."""
    ids: dict[int, str] = {}
    owners: dict[tuple[str, int], str] = {}
    for inst in instances:
        name = describe(inst)
        if inst.id in ids:
            raise sa.InputError(f"{name} and {ids[inst.id]} have the same id {hex_id(inst.id)}")
        ids[inst.id] = name
        for ep in _endpoints(inst):
            other = owners.setdefault(ep, name)
            if other != name:
                raise sa.InputError(f"{ep[0]}:{ep[1]} is in two instances: {other} and {name}")


def refuse_add_conflicts(new: Sequence[common_pb2.Instance], held: Held) -> None:
    """An id held by another identity, or an engine already serving in another instance."""
    owner = {ep: i for i in held.values() for ep in _endpoints(i)}
    for inst in new:
        have = held.get(inst.id)
        if have is not None and not _same_identity(have, inst):
            raise sa.InputError(
                f"id {hex_id(inst.id)} is already held by {describe(have)} job {have.job_name!r}; "
                "delete it first or give another --id"
            )
        for ep in _endpoints(inst):
            other = owner.get(ep)
            if other is not None and other.id != inst.id:
                raise sa.InputError(f"{ep[0]}:{ep[1]} already serves in instance {describe(other)}")


def refuse_set_conflicts(held: Held, force: bool) -> None:
    """A Controller's instances (ids below bit 30) would vanish from routing until its next
    full sync: almost certainly a Coordinator given to the wrong command."""
    managed = sorted(i for i in held if not i & sa.STANDALONE_BIT)
    if managed and not force:
        raise sa.InputError(
            f"the table holds {len(managed)} instance(s) a Controller manages (id {managed[0]}...); "
            "set would drop them until its next sync: use add, or --force"
        )


def delete_targets(
    named: Sequence[tuple[int, sa.InstanceSpec | None]], held: Held, coordinator: str
) -> list[common_pb2.Instance]:
    """The stored instances a ``del`` names, each (id, the spec it was derived from or None for
    --id) read from the table first: an unknown id, or an id held by other endpoints, is refused."""
    out: list[common_pb2.Instance] = []
    for iid, spec in named:
        what = spec.describe() if spec is not None else "--id"
        have = held.get(iid)
        if have is None:
            raise sa.InputError(f"no instance {hex_id(iid)} ({what}) on the Coordinator at {coordinator}")
        if spec is not None and sa.spec_of(have).key != spec.key:
            raise sa.InputError(f"id {hex_id(iid)} is held by {describe(have)}, not {what}")
        if have not in out:
            out.append(have)
    return out


def identity_only(inst: common_pb2.Instance) -> common_pb2.Instance:
    """What a Delete sends: the stored identity, so an instance replaced meanwhile is refused
    (FAILED_PRECONDITION) rather than removed."""
    return common_pb2.Instance(
        id=inst.id,
        role=inst.role,
        job_name=inst.job_name,
        endpoints=[common_pb2.Endpoint(host=e.host, port=e.port) for e in inst.endpoints],
    )
