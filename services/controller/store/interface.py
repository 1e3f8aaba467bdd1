"""What the Controller asks of the place its state lives, whichever backend holds it.

Two backends: :class:`~motor_mesh.controller.store.sqlite.Store` (SQLite under ``state_dir``, one
Controller) and :class:`~motor_mesh.controller.store.etcd.EtcdStore` (etcd, shared by a leader and
its standbys). Both keep the same promises:

- the ``load_*`` reads are synchronous and run once, at start-up, before anything is served;
- every write is a coroutine that is durable when it returns and all or nothing: a write that
  fails raises :class:`StateWriteError` (counted in ``write_failures``) and changed nothing, so a
  caller changes memory only after the write returned;
- instance ids and alarm sequences are never handed out twice, pruned rows or not.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import grpc
from google.rpc import error_details_pb2

from motor_mesh.common import errors
from motor_mesh.common.enums import InstanceStatus, Role
from motor_mesh.controller.model import Instance, Pending
from motor_mesh.controller.store.db import StateWriteError
from motor_mesh.gen.motor.v1 import alarm_pb2

if TYPE_CHECKING:
    from motor_mesh.gen.etcd.etcdserverpb import rpc_pb2

# A node's reported faults by code: (level, reason).
NodeFaults = dict[str, tuple[int, str]]
# The desired instance counts (SetDesiredInstances) by role (a motor.v1.Role value): (replicas,
# when it was set, in nanoseconds since the Unix epoch).
DesiredCounts = dict[Role, tuple[int, int]]


@dataclass(frozen=True)
class StoredSettings:
    """What the last reload that changed something set (ReloadConfig, controller/settings.py):
    its revision, and every reloadable key of the coordinator and of the controller section with
    its value, as JSON."""

    revision: int
    coordinator: Mapping[str, Any]
    controller: Mapping[str, Any]


def settings_of(revision: int, coordinator: object, controller: object) -> StoredSettings:
    """A stored settings record read back, its shape checked: a wrong one raises ValueError,
    which the stores report as an unreadable state."""
    if not isinstance(coordinator, dict) or not isinstance(controller, dict) or revision < 1:
        raise ValueError("settings: expected a revision of 1 or more and two JSON objects")
    return StoredSettings(revision, coordinator, controller)


# DELETED instances kept for ListInstances(status=DELETED), in memory and in the store; older
# ones are pruned as new ones are deleted and at start-up. The id counter is stored apart from
# the instances, so pruning never lets an id come back.
KEEP_DELETED = 1000


class NotLeader(StateWriteError):
    """A write refused because this Controller is not (or no longer) the leader: nothing was
    written, and the caller should go to the Controller that leads now."""

    def __init__(self, what: str, why: str) -> None:
        errors.MotorError.__init__(
            self,
            grpc.StatusCode.UNAVAILABLE,
            f"not the leader: {why}; {what} was not changed",
            [
                error_details_pb2.ErrorInfo(
                    reason="NOT_LEADER", domain=errors.DOMAIN, metadata={"operation": what, "leader": ""}
                ),
                error_details_pb2.RetryInfo(retry_delay={"seconds": 1}),
            ],
        )


class Fence(Protocol):
    """The condition under which a leader may write to etcd (its leadership)."""

    def compares(self) -> list[rpc_pb2.Compare]:
        """Compares every write's transaction carries; raises NotLeader when no write may even be
        sent (the leadership has ended, or its lease deadline has passed)."""
        ...

    def lost(self) -> None:
        """A write's compares failed in etcd: another Controller leads now."""
        ...


class StateStore(Protocol):
    @property
    def write_failures(self) -> int:
        """Writes that failed (StateWriteError) since the start."""
        ...

    # ---- start-up reads ----------------------------------------------------------------------

    def load_instances(self) -> list[Instance]:
        """Every stored instance by id, DELETED ones pruned to the newest KEEP_DELETED."""
        ...

    def load_pending(self) -> list[Pending]: ...

    def load_node_faults(self) -> dict[str, NodeFaults]: ...

    def load_fault_history(self) -> dict[int, list[str]]: ...

    def load_alarms(self) -> tuple[list[alarm_pb2.Alarm], list[alarm_pb2.Alarm], int]:
        """The history (oldest first), the active alarms (by sequence) and the last sequence
        handed out."""
        ...

    def load_desired(self) -> DesiredCounts:
        """The desired instance count of each role that has one."""
        ...

    def load_settings(self) -> StoredSettings | None:
        """The settings of the last reload that changed something; None before any."""
        ...

    # ---- writes ------------------------------------------------------------------------------

    async def next_instance_id(self) -> int:
        """Reserve the next instance id (stored before it is handed out)."""
        ...

    async def save_instance(self, inst: Instance, status: InstanceStatus | None = None) -> None:
        """Write the instance (with ``status`` instead of its own, when given); a DELETED
        instance's strategy history goes with it."""
        ...

    async def assemble(self, inst: Instance) -> None:
        """The pending assembly with the instance's id becomes the instance, atomically."""
        ...

    async def forget_instance(self, instance_id: int) -> None:
        """Drop a DELETED instance (history pruning; its id stays used)."""
        ...

    async def save_pending(self, p: Pending) -> None: ...

    async def delete_pending(self, pending_id: int) -> None: ...

    async def save_node_faults(self, nodes: dict[str, NodeFaults]) -> None:
        """Replace the stored faults of each node in ``nodes`` (an empty dict clears it)."""
        ...

    async def add_fault_history(self, instance_id: int, entry: str, keep: int) -> None:
        """Append to an instance's strategy history, keeping its newest ``keep`` entries."""
        ...

    async def save_alarms(
        self,
        history: Sequence[tuple[int, bytes]],
        active: Mapping[str, tuple[int, bytes] | None],
        last_sequence: int,
        keep: int,
    ) -> None:
        """One alarm report: new history records ``(sequence, alarm)``, active alarms by dedupe
        key (None: no longer active), the sequence counter, and the history trimmed to the newest
        ``keep`` sequences (the sequences are contiguous)."""
        ...

    async def save_desired(self, role: Role, replicas: int, update_time_ns: int) -> None:
        """Record ``replicas`` as the desired instance count of ``role``, set at ``update_time_ns``."""
        ...

    async def save_settings(self, settings: StoredSettings) -> None:
        """Replace the stored settings (one record, whatever its revision)."""
        ...

    async def close(self) -> None:
        """Wait for the writes in flight, then release the store."""
        ...
