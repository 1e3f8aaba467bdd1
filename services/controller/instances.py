"""The instance table: every assembled instance, its transitions and who hears about them.

Each status change goes through :meth:`InstanceTable.transition`: it is written to the database
first (a failed write raises StateWriteError and leaves memory as it was: the reconcile that
asked retries it), then applied in memory, logged, and handed to every observer in order.
Transitions are serialized, so one decided on a status that changed during another's write is
decided again rather than applied blindly. Observers are objects with
``on_transition(instance, old_status, new_status, reason)``; the calls are synchronous and must
not block: an observer that needs I/O enqueues a key for its reconciler.
"""

from __future__ import annotations

import asyncio
from typing import Protocol

from motor_mesh.common import log
from motor_mesh.common.enums import DELETED, STATUS_UNSPECIFIED, InstanceStatus, status_name
from motor_mesh.controller.model import Instance
from motor_mesh.controller.state_machine import is_routable
from motor_mesh.controller.store.db import StateWriteError
from motor_mesh.controller.store.interface import KEEP_DELETED, StateStore


class Observer(Protocol):
    def on_transition(
        self, inst: Instance, old: InstanceStatus, new: InstanceStatus, reason: str
    ) -> None: ...


class InstanceTable:
    def __init__(self, store: StateStore) -> None:
        self.store = store
        self.live: dict[int, Instance] = {}
        self.deleted: dict[int, Instance] = {}  # oldest first
        self.keep_deleted = KEEP_DELETED
        self.by_job: dict[str, Instance] = {}
        self._observers: list[Observer] = []
        self._lock = asyncio.Lock()

    def subscribe(self, observer: Observer) -> None:
        self._observers.append(observer)

    def unsubscribe(self, observer: Observer) -> None:
        self._observers.remove(observer)

    def load(self, instances: list[Instance], now: float) -> None:
        """Instances from the database; every heartbeat clock starts now."""
        for inst in instances:
            for m in inst.members:
                m.last_heard = now
                m.instance = inst
            if inst.status != DELETED:
                self.live[inst.id] = inst
                self.by_job[inst.job_name] = inst
            else:
                self.deleted[inst.id] = inst

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
        self._notify(inst, STATUS_UNSPECIFIED, inst.status, "assembled")

    async def transition(self, inst: Instance, new: InstanceStatus, reason: str) -> None:
        async with self._lock:
            old = inst.status
            if old == new or old == DELETED:
                return
            await self.store.save_instance(inst, new)
            inst.status = new
            if new == DELETED:
                self.live.pop(inst.id, None)
                if self.by_job.get(inst.job_name) is inst:
                    del self.by_job[inst.job_name]
                self.deleted[inst.id] = inst
                await self._prune_deleted()
        log.event(
            "instance_transition",
            instance_id=inst.id,
            job=inst.job_name,
            old=status_name(old),
            new=status_name(new),
            reason=reason,
        )
        self._notify(inst, old, new, reason)

    async def delete(self, inst: Instance, reason: str) -> None:
        await self.transition(inst, DELETED, reason)

    async def _prune_deleted(self) -> None:
        """Keep the newest ``keep_deleted`` DELETED instances, in memory and on disk. A failed
        prune is tried again at the next deletion (and start-up prunes too)."""
        while len(self.deleted) > self.keep_deleted:
            oldest = next(iter(self.deleted))
            try:
                await self.store.forget_instance(oldest)
            except StateWriteError:
                return
            gone = self.deleted.pop(oldest)
            for m in gone.members:  # no cycle left: freed at once, even from a frozen heap
                m.instance = None

    def find(self, role: int = 0, status: int = 0) -> list[Instance]:
        pool: list[Instance] = list(self.live.values())
        if status == DELETED:
            pool = list(self.deleted.values())
        out = [i for i in pool if (not role or i.spec.role == role) and (not status or i.status == status)]
        out.sort(key=lambda i: i.id)
        return out

    def routable(self) -> list[Instance]:
        """ACTIVE and PAUSED instances: what a full SetInstances carries."""
        return sorted((i for i in self.live.values() if is_routable(i.status)), key=lambda i: i.id)

    def _notify(self, inst: Instance, old: InstanceStatus, new: InstanceStatus, reason: str) -> None:
        for obs in self._observers:
            try:
                obs.on_transition(inst, old, new, reason)
            except Exception:  # one broken observer must not stop the others
                log.exception("observer_failed", observer=type(obs).__name__, instance_id=inst.id)
