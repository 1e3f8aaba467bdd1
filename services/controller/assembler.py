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

from services.common.config import ControllerConfig

from . import assembly
from . import state_machine as sm
from .instances import InstanceTable
from .model import Instance, Pending
from .nm_client import NodeManagerClients
from .pending import PendingAssemblies
from .reconciler import DONE, Result
from .store import Store


class Assembler:
    def __init__(
        self,
        cfg: ControllerConfig,
        pending: PendingAssemblies,
        table: InstanceTable,
        store: Store,
        nm_clients: NodeManagerClients,
        enqueue_instance: Callable[[int], None],
    ) -> None:
        self.pending = pending
        self.table = table
        self.store = store
        self.nm_clients = nm_clients
        self.enqueue_instance = enqueue_instance
        self.heartbeat_timeout_s = cfg.instance_heartbeat_timeout_s
        self.assemble_timeout_s = cfg.instance_assemble_timeout_s

    async def reconcile(self, job: str) -> Result:
        p = self.pending.get(job)
        if p is None:
            return DONE
        now, wall = time.monotonic(), time.time()
        expires_in = p.last_registration + self.assemble_timeout_s - wall
        if expires_in < 0:
            self.pending.expire(p)
            return DONE
        silent = [m for m in p.members if now - m.last_heard > self.heartbeat_timeout_s]
        if silent:
            p = self.pending.drop(p, silent, "heartbeat_timeout")
        if not assembly.is_complete(p.spec, p.members):
            # Look again when the assembly expires or its quietest member would time out.
            deadlines = [expires_in] + [m.last_heard + self.heartbeat_timeout_s - now for m in p.members]
            return Result(requeue_after=max(min(deadlines), 0.0) + 0.01)
        answers = await asyncio.gather(*(self.nm_clients.reachable(m.address) for m in p.members))
        if self.pending.get(job) is not p:
            return Result(requeue_after=0)  # a registration changed it meanwhile: look again
        unreachable = [m for m, ok in zip(p.members, answers, strict=True) if not ok]
        if unreachable:
            self.pending.drop(p, unreachable, "unreachable")
            return Result(requeue_after=0)
        self._assemble(p)
        return DONE

    def _assemble(self, p: Pending) -> None:
        plan = assembly.plan(p.id, p.job_name, p.spec, p.members)
        inst = Instance(
            id=p.id,
            job_name=p.job_name,
            spec=p.spec,
            status=sm.INITIAL,
            endpoints=plan.endpoints,
            members=plan.members,
        )
        self.store.assemble(inst)
        self.pending.assembled(p)
        for m in inst.members:
            m.instance = inst
        self.table.add(inst)
        self.enqueue_instance(inst.id)
