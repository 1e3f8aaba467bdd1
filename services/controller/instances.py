"""The instance table: every assembled instance, its transitions and who hears about them.

Each status change goes through :meth:`InstanceTable.transition`: it is written to the database
first (a failed write raises StateWriteError and leaves memory as it was: the reconcile that
asked retries it), then applied in memory, logged, and handed to every observer in order.
Transitions are serialized, so one decided on a status that changed during another's write is
decided again rather than applied blindly. Observers are objects with
``on_transition(instance, old_status, new_status, reason)``; the calls are synchronous and must
not block: an observer that needs I/O enqueues a key for its reconciler.

One deletion path: whoever wants an instance gone (the reconcile on a heartbeat timeout or a
failed start, a re-registering NodeManager, TerminateInstance, the fault manager's escalation, a
precision recovery) calls :meth:`InstanceTable.doom` with a typed reason; the wish is stored with
the instance first, then the instance reconcile carries it out (reconcile/teardown.py) and
:meth:`wait_deleted`/:meth:`wait_torn_down` let a caller wait for that.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable, Iterable
from typing import Any, Protocol

from motor_mesh.common import log
from motor_mesh.common.enums import DELETED, STATUS_UNSPECIFIED, InstanceStatus, status_name
from motor_mesh.controller.model import Instance, Removal, Teardown
from motor_mesh.controller.state_machine import is_routable
from motor_mesh.controller.store.db import StateWriteError
from motor_mesh.controller.store.interface import KEEP_DELETED, StateStore


class Observer(Protocol):
    def on_transition(
        self, inst: Instance, old: InstanceStatus, new: InstanceStatus, reason: str
    ) -> None: ...


class InstanceTable:
    def __init__(self, store: StateStore, enqueue: Callable[[int], None] = lambda _: None) -> None:
        self.store = store
        self.enqueue = enqueue  # the instance reconcile's
        self.live: dict[int, Instance] = {}
        self.deleted: dict[int, Instance] = {}  # oldest first
        self.keep_deleted = KEEP_DELETED
        self.by_job: dict[str, Instance] = {}
        self._observers: list[Observer] = []
        self._lock = asyncio.Lock()
        # Callers of wait_deleted / wait_torn_down, by instance id.
        self._waiters: dict[int, list[tuple[bool, asyncio.Future[Teardown]]]] = {}

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
        assert new != DELETED or inst.teardown is not None, "deletion goes through doom()"
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
        if new == DELETED:
            self._wake(inst)

    async def update(self, inst: Instance, **changes: Any) -> None:
        """Change stored fields of the instance (its ``strategy``, ``teardown``): the changed copy
        is written first, then the instance changes in memory."""
        async with self._lock:
            await self.store.save_instance(dataclasses.replace(inst, **changes))
            for name, value in changes.items():
                setattr(inst, name, value)
        if inst.teardown is not None:
            self._wake(inst)

    async def doom(
        self,
        inst: Instance,
        reason: Removal,
        detail: str = "",
        *,
        stop: Iterable[str] = (),
        after: int = 0,
        precision: tuple[int, int] | None = None,
        drain: bool = False,
    ) -> None:
        """Record that the instance must go (and which NodeManagers get Stop; with ``drain``, a
        planned removal, the Coordinators drain it first); the instance reconcile deletes it.
        The first reason stands: a second wish changes nothing."""
        if inst.teardown is not None or inst.status == DELETED:
            return
        td = Teardown(reason, detail, stop=tuple(stop), after=after, precision=precision, drain=drain)
        await self.update(inst, teardown=td)
        log.event(
            "instance_doomed",
            instance_id=inst.id,
            reason=str(reason),
            detail=detail,
            stop=",".join(td.stop),
            drain=drain,
        )
        self.enqueue(inst.id)

    async def remove(self, inst: Instance) -> None:
        """Delete a doomed instance (the teardown's first step)."""
        assert inst.teardown is not None
        td = inst.teardown
        await self.transition(inst, DELETED, f"{td.reason}: {td.detail}" if td.detail else str(td.reason))

    async def wait_deleted(self, inst: Instance) -> None:
        """Until the doomed instance is DELETED."""
        if inst.status != DELETED:
            await self._wait(inst, whole=False)

    async def wait_torn_down(self, inst: Instance) -> Teardown:
        """Until the doomed instance's teardown is done (deleted, Stop sent, alarm cleared)."""
        return await self._wait(inst, whole=True)

    async def _wait(self, inst: Instance, whole: bool) -> Teardown:
        fut: asyncio.Future[Teardown] = asyncio.get_running_loop().create_future()
        self._waiters.setdefault(inst.id, []).append((whole, fut))
        self._wake(inst)
        try:
            return await fut
        finally:
            waiters = self._waiters.get(inst.id, [])
            if (whole, fut) in waiters:
                waiters.remove((whole, fut))
            if not waiters:
                self._waiters.pop(inst.id, None)

    def _wake(self, inst: Instance) -> None:
        td = inst.teardown
        if td is None:
            return
        for whole, fut in self._waiters.get(inst.id, []):
            if not fut.done() and (td.done if whole else inst.status == DELETED):
                fut.set_result(td)

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

    def gone(self, instance_id: int) -> bool:
        """The instance existed and does not any more: DELETED, or older than every DELETED one
        kept (pruned). An id this Controller never saw is not gone."""
        if instance_id in self.live:
            return False
        return instance_id in self.deleted or bool(self.deleted and instance_id < next(iter(self.deleted)))

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
