"""Pending assemblies: registrations of one job waiting for the rest of their instance.

Every change is written to the database before memory changes, so a failed write leaves both
as they were. A :class:`Pending` is replaced, never edited in place: a reconcile that holds one
across an await can tell it changed by identity. What decides on a job's assembly and then
writes (a registration, the assembler) holds :meth:`PendingAssemblies.locked` for that job, so
no decision is made on a state that another one's write is about to change.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator, Iterable

from motor_mesh.common import log
from motor_mesh.controller.model import Member, Pending
from motor_mesh.controller.nodes.sessions import SessionTable
from motor_mesh.controller.store.interface import StateStore


class PendingAssemblies:
    def __init__(self, store: StateStore, sessions: SessionTable) -> None:
        self._store = store
        self._sessions = sessions
        self._by_job: dict[str, Pending] = {}
        self._locks: dict[str, tuple[asyncio.Lock, int]] = {}  # job -> (lock, holders and waiters)

    @contextlib.asynccontextmanager
    async def locked(self, job: str) -> AsyncIterator[None]:
        lock, users = self._locks.get(job) or (asyncio.Lock(), 0)
        self._locks[job] = (lock, users + 1)
        try:
            async with lock:
                yield
        finally:
            lock, users = self._locks[job]
            if users == 1:
                del self._locks[job]  # one lock per job in flight, not per job ever seen
            else:
                self._locks[job] = (lock, users - 1)

    def load(self, pendings: Iterable[Pending], now: float) -> None:
        """Pending assemblies from the database: their NodeManagers must register again."""
        for p in pendings:
            for m in p.members:
                m.last_heard = now
            self._by_job[p.job_name] = p

    def get(self, job: str) -> Pending | None:
        return self._by_job.get(job)

    def jobs(self) -> list[str]:
        return list(self._by_job)

    def __len__(self) -> int:
        return len(self._by_job)

    async def put(self, p: Pending) -> None:
        """Store ``p`` as its job's pending assembly (new, or replacing the previous one)."""
        await self._store.save_pending(p)
        self._by_job[p.job_name] = p

    async def drop(self, p: Pending, members: list[Member], reason: str) -> Pending:
        """``p`` without ``members``, whose sessions end (they must register again)."""
        remaining = dataclasses.replace(p, members=[m for m in p.members if m not in members])
        await self.put(remaining)
        for m in members:
            self.release(p, m, reason)
        return remaining

    def release(self, p: Pending, m: Member, reason: str) -> None:
        """End the session of a member no longer in ``p``: it must register again."""
        self._sessions.close(m)
        log.warn(
            "registration_dropped", job=p.job_name, pending_id=p.id, node_manager=m.address, reason=reason
        )

    async def expire(self, p: Pending) -> None:
        await self._store.delete_pending(p.id)
        del self._by_job[p.job_name]
        for m in p.members:
            self._sessions.close(m)
        log.warn("assembly_expired", job=p.job_name, pending_id=p.id, members=len(p.members))

    def assembled(self, p: Pending) -> None:
        """``p`` became an instance (the store moved its row in the same transaction)."""
        del self._by_job[p.job_name]
