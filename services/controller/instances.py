"""The instance table: every assembled instance, its transitions and who hears about them.

Each status change goes through :meth:`InstanceTable.transition`: it is persisted, logged, and
handed to every observer in order. Observers are plain objects with any of

- ``on_transition(instance, old_status, new_status, reason)`` — the event pusher today; the fault
  manager and the alarm store subscribe the same way;
- ``on_engine_event(instance, endpoint, event)`` — an engine died or turned unhealthy (the fault
  manager's input).

Observer calls are synchronous and must not block: an observer that needs I/O queues work for
its own task.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from motor.v1 import common_pb2, controller_pb2

from services.common import log

from . import state_machine as sm
from .model import Instance, Status
from .store import KEEP_DELETED, Store


class InstanceTable:
    def __init__(self, store: Store) -> None:
        self.store = store
        self.live: dict[int, Instance] = {}
        self.deleted: dict[int, Instance] = {}  # oldest first
        self.keep_deleted = KEEP_DELETED
        self.by_job: dict[str, Instance] = {}
        self._observers: list[Any] = []

    def subscribe(self, observer: Any) -> None:
        self._observers.append(observer)

    def load(self, instances: list[Instance], now: float) -> None:
        """Instances from the database; every heartbeat clock starts now."""
        for inst in instances:
            for m in inst.members:
                m.last_heard = now
                m.instance = inst
            if sm.is_live(inst.status):
                self.live[inst.id] = inst
                self.by_job[inst.job_name] = inst
            else:
                self.deleted[inst.id] = inst

    def get(self, instance_id: int) -> Instance | None:
        return self.live.get(instance_id) or self.deleted.get(instance_id)

    def add(self, inst: Instance) -> None:
        """A newly assembled instance (status INITIAL); the caller has persisted it."""
        self.live[inst.id] = inst
        self.by_job[inst.job_name] = inst
        log.event(
            "instance_assembled",
            instance_id=inst.id,
            job=inst.job_name,
            endpoints=len(inst.endpoints),
            node_managers=",".join(inst.node_managers),
        )
        self._notify("on_transition", inst, common_pb2.INSTANCE_STATUS_UNSPECIFIED, inst.status, "assembled")

    def evaluate(self, inst: Instance) -> None:
        """Re-run the state machine after endpoint statuses changed."""
        new, reason = sm.next_status(
            inst.status, ((ep.status, ep.headless) for ep in inst.endpoints), separated=inst.separated
        )
        if new != inst.status:
            self.transition(inst, new, reason)

    def transition(self, inst: Instance, new: Status, reason: str) -> None:
        old = inst.status
        if old == new or old == sm.DELETED:
            return
        inst.status = new
        if new == sm.DELETED:
            self.live.pop(inst.id, None)
            if self.by_job.get(inst.job_name) is inst:
                del self.by_job[inst.job_name]
            self.deleted[inst.id] = inst
        self.store.save_instance(inst)
        if new == sm.DELETED:
            self._prune_deleted()
        log.event(
            "instance_transition",
            instance_id=inst.id,
            job=inst.job_name,
            old=sm.name(old),
            new=sm.name(new),
            reason=reason,
        )
        self._notify("on_transition", inst, old, new, reason)

    def delete(self, inst: Instance, reason: str) -> None:
        self.transition(inst, sm.DELETED, reason)

    def _prune_deleted(self) -> None:
        """Keep the newest ``keep_deleted`` DELETED instances, in memory and on disk."""
        while len(self.deleted) > self.keep_deleted:
            gone = self.deleted.pop(next(iter(self.deleted)))
            self.store.forget_instance(gone.id)
            for m in gone.members:  # no cycle left: freed at once, even from a frozen heap
                m.instance = None

    def set_separated(self, inst: Instance, separated: bool, reason: str) -> None:
        """For fault strategies: hold the instance INACTIVE (no routing) until cleared."""
        inst.separated = separated
        new, why = sm.next_status(
            inst.status, ((ep.status, ep.headless) for ep in inst.endpoints), separated=separated
        )
        if new != inst.status:
            self.transition(inst, new, reason or why)

    def engine_event(
        self, inst: Instance, endpoint: common_pb2.Endpoint | None, event: controller_pb2.EngineEvent
    ) -> None:
        self._notify("on_engine_event", inst, endpoint, event)

    def find(self, role: int = 0, status: int = 0) -> list[Instance]:
        pool: list[Instance] = list(self.live.values())
        if status == sm.DELETED:
            pool = list(self.deleted.values())
        out = [i for i in pool if (not role or i.spec.role == role) and (not status or i.status == status)]
        out.sort(key=lambda i: i.id)
        return out

    def routable(self) -> list[Instance]:
        """ACTIVE and PAUSED instances: what a full SetInstances carries."""
        return sorted((i for i in self.live.values() if sm.is_routable(i.status)), key=lambda i: i.id)

    def _notify(self, method: str, *args: Any) -> None:
        for obs in self._observers:
            fn: Callable[..., None] | None = getattr(obs, method, None)
            if fn is None:
                continue
            try:
                fn(*args)
            except Exception as exc:  # one broken observer must not stop the others
                log.error("observer_failed", observer=type(obs).__name__, method=method, error=repr(exc))
