"""Reconciling a pending job into an instance.

``reconcile(job)`` looks at the job's pending assembly as it is now: expired → dropped; members
silent for the heartbeat timeout → dropped; not complete → look again when the next deadline
falls due; complete → probe every NodeManager with ``GetStatus`` (the silent ones are dropped
with their endpoints) and, when it is still complete and unchanged afterwards, assemble it
(status INITIAL). Starting its engines is the instance reconciler's job.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from motor_mesh.common import log
from motor_mesh.common.config import ControllerConfig
from motor_mesh.controller import assembly
from motor_mesh.controller import state_machine as sm
from motor_mesh.controller.instances import InstanceTable
from motor_mesh.controller.model import Instance, Pending
from motor_mesh.controller.nodes.client import NodeManagerClients
from motor_mesh.controller.nodes.pending import PendingAssemblies
from motor_mesh.controller.reconcile.runner import DONE, REQUEUE_NOW, Result
from motor_mesh.controller.store.interface import StateStore

# An assembly that has not changed for this long says what it still waits for (NodeManagers of
# one instance register within seconds of each other).
INCOMPLETE_WARN_S = 10.0


class Assembler:
    def __init__(
        self,
        cfg: ControllerConfig,
        pending: PendingAssemblies,
        table: InstanceTable,
        store: StateStore,
        nm_clients: NodeManagerClients,
        enqueue_instance: Callable[[int], None],
        clock: Callable[[], float] = time.monotonic,
        *,
        settings: Callable[[], ControllerConfig] | None = None,
    ) -> None:
        self.clock = clock
        self.pending = pending
        self.table = table
        self.store = store
        self.nm_clients = nm_clients
        self.enqueue_instance = enqueue_instance
        self.assemble_timeout_s = cfg.instance_assemble_timeout_s
        self._warned: dict[str, tuple[int, int, float]] = {}  # job → the state last warned about
        # Read when used: a reload replaces the running section (controller/settings.py).
        self._cfg = settings or (lambda: cfg)

    @property
    def heartbeat_timeout_s(self) -> float:
        return self._cfg().instance_heartbeat_timeout_s

    async def reconcile(self, job: str) -> Result:
        # Decisions and writes hold the job's lock; the probes in between do not, so a
        # registration arriving meanwhile is taken at once (and this looks again).
        async with self.pending.locked(job):
            p = self.pending.get(job)
            if p is None:
                self._warned.pop(job, None)
                return DONE
            p, wait = await self._check(p)
            if wait is not None:
                return wait
        answers = await asyncio.gather(*(self.nm_clients.reachable(m.address) for m in p.members))
        async with self.pending.locked(job):
            if self.pending.get(job) is not p:
                return REQUEUE_NOW  # a registration changed it meanwhile: look again
            unreachable = [m for m, ok in zip(p.members, answers, strict=True) if not ok]
            if unreachable:
                await self.pending.drop(p, unreachable, "unreachable")
                return REQUEUE_NOW
            await self._assemble(p)
        self._warned.pop(job, None)
        return DONE

    async def _check(self, p: Pending) -> tuple[Pending, Result | None]:
        """Expire it, drop its silent members; a Result when it is not ready to assemble."""
        now, wall = self.clock(), time.time()
        expires_in = p.last_registration + self.assemble_timeout_s - wall
        if expires_in < 0:
            await self.pending.expire(p)
            self._warned.pop(p.job_name, None)
            return p, DONE
        silent = [m for m in p.members if now - m.last_heard > self.heartbeat_timeout_s]
        if silent:
            p = await self.pending.drop(p, silent, "heartbeat_timeout")
        if not assembly.is_complete(p.spec, p.members):
            # Look again when the assembly expires, its quietest member would time out, or it is
            # time to say what it waits for.
            deadlines = [expires_in] + [m.last_heard + self.heartbeat_timeout_s - now for m in p.members]
            waited = wall - p.last_registration
            if waited >= INCOMPLETE_WARN_S:
                self._warn_incomplete(p, waited, expires_in)
            else:
                deadlines.append(INCOMPLETE_WARN_S - waited)
            return p, Result(requeue_after=max(min(deadlines), 0.0) + 0.01)
        return p, None

    def _warn_incomplete(self, p: Pending, waited: float, expires_in: float) -> None:
        """One warning per state of the assembly: an instance that cannot complete (a
        NodeManager with too few ports, one that never came) must not wait silently."""
        key = (p.id, len(p.members), p.last_registration)
        if self._warned.get(p.job_name) == key:
            return
        self._warned[p.job_name] = key
        log.warn(
            "assembly_incomplete",
            job=p.job_name,
            pending_id=p.id,
            waited_s=round(waited, 1),
            expires_in_s=round(expires_in, 1),
            reason=f"instance {assembly.missing(p.spec, p.members)}; waiting for more NodeManagers",
        )

    async def _assemble(self, p: Pending) -> None:
        plan = assembly.plan(p.id, p.job_name, p.spec, p.members)
        inst = Instance(
            id=p.id,
            job_name=p.job_name,
            spec=p.spec,
            status=sm.INITIAL,
            endpoints=plan.endpoints,
            members=plan.members,
        )
        await self.store.assemble(inst)
        self.pending.assembled(p)
        for m in inst.members:
            m.instance = inst
        self.table.add(inst)
        self.enqueue_instance(inst.id)
