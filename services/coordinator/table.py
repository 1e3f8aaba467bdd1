"""The Coordinator's routing table: the instances the management RPCs set (docs/api.md,
"Coordinator").

Pure data: no I/O, no gRPC context. Every mutation first checks the whole request against the
current table and only then builds a *new* state, so a refused request changes nothing
(all-or-nothing) and readers holding the previous state never see a half-applied change.
Errors are :class:`motor_mesh.common.errors.MotorError` naming the first bad ``instances[i]``.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import grpc
from google.rpc import error_details_pb2

from motor_mesh.common import errors
from motor_mesh.common.enums import ACTIVE, PAUSED, ROLE_UNSPECIFIED, STATUS_UNSPECIFIED
from motor_mesh.gen.motor.v1 import common_pb2

Identity = tuple[int, str, frozenset[tuple[str, int]]]


def identity(inst: common_pb2.Instance) -> Identity:
    """(role, job_name, set of endpoint (host, port)): order, status and pid are not identity."""
    return inst.role, inst.job_name, frozenset((ep.host, ep.port) for ep in inst.endpoints)


def _stored(inst: common_pb2.Instance) -> common_pb2.Instance:
    """The copy the table keeps: status UNSPECIFIED is stored ACTIVE."""
    copy = common_pb2.Instance()
    copy.CopyFrom(inst)
    if copy.status == STATUS_UNSPECIFIED:
        copy.status = ACTIVE
    return copy


Engines = frozenset[tuple[str, int, int]]


def engines(inst: common_pb2.Instance) -> Engines:
    """The engine processes behind an instance: a drain holds for these, and ends when the
    instance comes back with others (a relaunch gives new pids)."""
    return frozenset((ep.host, ep.port, ep.pid) for ep in inst.endpoints)


@dataclass(frozen=True, slots=True)
class Drain:
    """An instance taken out of routing by DrainInstances."""

    move_at: float  # wall-clock time (time.time()) when requests still on it are moved
    engines: Engines  # the engine processes it was drained with
    # The table revision that began it: a worker's count of legs tells only once it routes by
    # this revision or a later one (before, it could still send a request there).
    revision: int = 0


@dataclass(frozen=True)
class TableState:
    """One immutable revision of the table. Never mutated after construction."""

    instances: dict[int, common_pb2.Instance] = field(default_factory=dict)
    paused: frozenset[int] = frozenset()  # paused by PauseInstances
    revision: int = 0
    draining: Mapping[int, Drain] = field(default_factory=dict)  # by DrainInstances

    def is_paused(self, inst: common_pb2.Instance) -> bool:
        return inst.id in self.paused or inst.status == PAUSED

    def is_available(self, inst: common_pb2.Instance) -> bool:
        return inst.status == ACTIVE and not self.is_paused(inst) and inst.id not in self.draining

    def groups(
        self,
    ) -> tuple[list[common_pb2.Instance], list[common_pb2.Instance], list[common_pb2.Instance]]:
        """(available, unavailable, paused), each sorted by id; a draining instance that is not
        paused is unavailable."""
        available, unavailable, paused = [], [], []
        for iid in sorted(self.instances):
            inst = self.instances[iid]
            if self.is_paused(inst):
                paused.append(inst)
            elif inst.status == ACTIVE and iid not in self.draining:
                available.append(inst)
            else:
                unavailable.append(inst)
        return available, unavailable, paused

    def available(self) -> list[common_pb2.Instance]:
        return [i for i in self.instances.values() if self.is_available(i)]


def _role(role: int) -> str:
    """The role's name; the number for one this proto does not define (never raises)."""
    try:
        return common_pb2.Role.Name(role)  # type: ignore[arg-type]
    except ValueError:
        return str(role)


def _conflict(i: int, iid: int, held: common_pb2.Instance) -> errors.MotorError:
    return errors.already_exists(
        "INSTANCE_ID_CONFLICT",
        f"instances[{i}]: id {iid} is held by another instance "
        f"(role {_role(held.role)}, job {held.job_name!r})",
        field=f"instances[{i}].id",
        instance_id=str(iid),
    )


def _not_found(path: str, iid: int) -> errors.MotorError:
    detail = error_details_pb2.ResourceInfo(
        resource_type="instance", resource_name=str(iid), description=f"{path}: no instance with id {iid}"
    )
    return errors.MotorError(grpc.StatusCode.NOT_FOUND, f"{path}: instance {iid} not found", [detail])


def _mismatch(inst: common_pb2.Instance, held: common_pb2.Instance) -> str | None:
    """Which identity field given in a Delete request differs from the stored instance."""
    if inst.role != ROLE_UNSPECIFIED and inst.role != held.role:
        return f"role {_role(inst.role)} != stored {_role(held.role)}"
    if inst.job_name and inst.job_name != held.job_name:
        return f"job_name {inst.job_name!r} != stored {held.job_name!r}"
    if inst.endpoints and identity(inst)[2] != identity(held)[2]:
        return "endpoints differ from the stored endpoint set"
    return None


class RoutingTable:
    """The table behind the management RPCs. Each method returns whether the table changed;
    ``state`` is swapped as one reference only after a request was accepted.

    The Coordinator changes a :meth:`draft` and commits its state (:meth:`commit`) only once the
    inference workers route by it, so ``state`` (what ListInstances shows) never runs ahead of
    them. A revision is never reused: one the workers were given but that was not committed
    stays spent (:meth:`reissue`)."""

    def __init__(self) -> None:
        self.incarnation = uuid.uuid4().hex
        self.state = TableState()
        self._issued = 0  # the newest revision handed out, committed or not

    def draft(self) -> RoutingTable:
        """A copy to make a change on, leaving this table as it is until :meth:`commit`."""
        copy = RoutingTable.__new__(RoutingTable)
        copy.incarnation, copy.state, copy._issued = self.incarnation, self.state, self._issued
        return copy

    def commit(self, state: TableState) -> None:
        """Make ``state`` (a draft's) this table's."""
        self.state = state
        self._issued = max(self._issued, state.revision)

    def reissue(self, spent: int) -> TableState:
        """This table's instances again under a revision after ``spent`` (a draft's that the
        workers may hold but that was not committed): what puts them back on this table."""
        self._issued = max(self._issued, spent) + 1
        return TableState(self.state.instances, self.state.paused, self._issued, self.state.draining)

    def _swap(
        self,
        instances: dict[int, common_pb2.Instance],
        paused: Iterable[int],
        draining: Mapping[int, Drain] | None = None,
    ) -> bool:
        paused_set = frozenset(paused) & instances.keys()
        old = self.state
        # A drain lasts while its instance is held with the engines it was drained with.
        drains = {
            iid: d
            for iid, d in (old.draining if draining is None else draining).items()
            if iid in instances and engines(instances[iid]) == d.engines
        }
        if instances == old.instances and paused_set == old.paused and drains == old.draining:
            return False
        self._issued += 1
        self.state = TableState(instances, paused_set, self._issued, drains)
        return True

    def set(self, instances: Sequence[common_pb2.Instance]) -> bool:
        """Replace the table. The request is authoritative, pause flags included (a paused
        instance is one sent with status PAUSED), so a full resync heals any lost Pause/Resume."""
        return self._swap({inst.id: _stored(inst) for inst in instances}, ())

    def add(self, instances: Sequence[common_pb2.Instance]) -> bool:
        old = self.state
        new = dict(old.instances)
        for i, inst in enumerate(instances):
            held = old.instances.get(inst.id)
            if held is None:
                new[inst.id] = _stored(inst)
            elif identity(held) != identity(inst):
                raise _conflict(i, inst.id, held)
            # Same id and identity: success, nothing changes.
        return self._swap(new, old.paused)

    def delete(self, instances: Sequence[common_pb2.Instance]) -> bool:
        old = self.state
        for i, inst in enumerate(instances):
            held = old.instances.get(inst.id)
            if held is None:
                raise _not_found(f"instances[{i}]", inst.id)
            why = _mismatch(inst, held)
            if why is not None:
                raise errors.precondition(
                    "INSTANCE_IDENTITY_MISMATCH",
                    f"instances[{i}]",
                    f"instances[{i}]: instance {inst.id} identity mismatch: {why}",
                )
        gone = {inst.id for inst in instances}
        new = {iid: inst for iid, inst in old.instances.items() if iid not in gone}
        return self._swap(new, old.paused - gone)

    def _known(self, ids: Sequence[int]) -> None:
        for i, iid in enumerate(ids):
            if iid not in self.state.instances:
                raise _not_found(f"ids[{i}]", iid)

    def pause(self, ids: Sequence[int]) -> bool:
        self._known(ids)
        return self._swap(dict(self.state.instances), self.state.paused | set(ids))

    def resume(self, ids: Sequence[int]) -> bool:
        """Clear the pause flag and any drain; an instance stored with status PAUSED becomes
        ACTIVE, since resuming it is the operator's (or Controller's) way of saying it may serve
        again."""
        self._known(ids)
        old = self.state
        new = dict(old.instances)
        for iid in ids:
            if new[iid].status == PAUSED:
                inst = _stored(new[iid])
                inst.status = ACTIVE
                new[iid] = inst
        drains = {iid: d for iid, d in old.draining.items() if iid not in ids}
        return self._swap(new, old.paused - set(ids), drains)

    def drain(self, ids: Sequence[int], grace_s: float, now: float) -> bool:
        """Take ``ids`` out of routing; requests on them move at ``now + grace_s`` (wall time).
        An instance already draining keeps its deadline."""
        self._known(ids)
        old = self.state
        drains = dict(old.draining)
        revision = self._issued + 1  # what _swap gives the table when a drain is new
        for iid in ids:
            if iid not in drains:
                drains[iid] = Drain(now + grace_s, engines(old.instances[iid]), revision)
        return self._swap(dict(old.instances), old.paused, drains)
