"""The desired instance count of each role (SetDesiredInstances, ListDesiredInstances): how many
instances of it the cluster should have, recorded for what runs the processes (``motor up``
while it runs; in Kubernetes an HPA or KEDA following ``motor_desired_instances{role}``). The
Controller itself launches and stops nothing on it.

The counts live in the store like the rest of the state (a restart, or a new leader, loads
them); a set is written first and only then shown, so a failed write (StateWriteError,
UNAVAILABLE) leaves the count as it was everywhere.
"""

from __future__ import annotations

import asyncio
import time

from google.protobuf import timestamp_pb2

from motor_mesh.common import log
from motor_mesh.common.enums import ROLE_NAMES, Role, enum_name
from motor_mesh.controller.store.interface import DesiredCounts, StateStore
from motor_mesh.gen.motor.v1 import common_pb2, controller_pb2


def role_label(role: Role) -> str:
    """``prefill``, ``decode``, ``union`` (a metric label, a log field)."""
    return ROLE_NAMES.get(role) or enum_name(common_pb2.Role, role, "ROLE_").lower()


class DesiredInstances:
    def __init__(self, store: StateStore) -> None:
        self._store = store
        self._counts: DesiredCounts = dict(store.load_desired())
        # One set at a time: memory follows the store in the order the writes landed.
        self._lock = asyncio.Lock()

    def counts(self) -> dict[Role, int]:
        """The recorded count of each role that has one, by role."""
        return {role: replicas for role, (replicas, _) in sorted(self._counts.items())}

    def entries(self) -> list[controller_pb2.DesiredInstances]:
        """ListDesiredInstances: one per role with a recorded count, sorted by role."""
        return [self._message(role) for role in sorted(self._counts)]

    async def set(self, role: Role, replicas: int) -> controller_pb2.DesiredInstances:
        """Record ``replicas`` for ``role`` (validated by the caller). Raises StateWriteError when
        the store refused it: nothing changed then."""
        async with self._lock:
            before = self._counts.get(role)
            at = time.time_ns()
            await self._store.save_desired(role, replicas, at)
            self._counts[role] = (replicas, at)
        log.event(
            "desired_instances_set",
            role=role_label(role),
            replicas=replicas,
            previous="none" if before is None else before[0],
        )
        return self._message(role)

    def _message(self, role: Role) -> controller_pb2.DesiredInstances:
        replicas, at = self._counts[role]
        when = timestamp_pb2.Timestamp()
        when.FromNanoseconds(at)
        return controller_pb2.DesiredInstances(role=role, replicas=replicas, update_time=when)
