"""Registration and assembly (behaviour.md "Registration and assembly").

Registrations are grouped by job name into a pending instance that owns a fresh id. Once it is
complete, every NodeManager is probed with ``GetStatus`` (the silent ones are dropped with their
endpoints), the instance is assembled (status INITIAL) and each NodeManager gets its
``StartEngines``. A NodeManager that registers again carrying the id of a live instance (after a
Controller restart or a lost stream) is re-attached: new session, engines untouched.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from motor.v1 import controller_pb2 as pb

from services.common import errors, log
from services.common.config import ControllerConfig

from . import assembly
from . import state_machine as sm
from .instances import InstanceTable
from .model import Instance, JobSpec, Member, Pending, Status
from .nm_client import NodeManagerClients
from .sessions import SessionTable
from .store import Store


class Assembler:
    def __init__(
        self,
        cfg: ControllerConfig,
        table: InstanceTable,
        sessions: SessionTable,
        store: Store,
        nm: NodeManagerClients,
    ) -> None:
        self.table = table
        self.sessions = sessions
        self.store = store
        self.nm = nm
        self.heartbeat_interval_ms = int(cfg.heartbeat_interval_s * 1000)
        self.heartbeat_timeout_s = cfg.instance_heartbeat_timeout_s
        self.assemble_timeout_s = cfg.instance_assemble_timeout_s
        self.start_retries = cfg.start_command_retries
        # No EngineRelaunchStrategy runs yet: answering "enabled" would make every NodeManager
        # freeze its pod-restart fallback after an engine death while nothing relaunches it.
        self.relaunch_enabled = False
        if cfg.enable_engine_relaunch:
            log.warn("engine_relaunch_unavailable", reason="strategy not built; pods restart instead")
        self.pending: dict[str, Pending] = {}
        self._tasks: set[asyncio.Task] = set()

    def load(self, pendings: list[Pending], now: float) -> None:
        """Pending assemblies from the database: their NodeManagers must register again."""
        for p in pendings:
            for m in p.members:
                m.last_heard = now
            self.pending[p.job_name] = p

    # ---- Register ----------------------------------------------------------------------------

    def register(self, req: pb.RegisterRequest) -> pb.RegisterResponse:
        now = time.monotonic()
        if req.instance_id:
            inst = self.table.live.get(req.instance_id)
            if inst is not None:
                return self._reattach(inst, req, now)
            # An unknown or DELETED id: the instance is gone, so this is a new registration.
        job = req.job_name
        live = self.table.by_job.get(job)
        if live is not None:
            raise errors.already_exists(
                "JOB_ALREADY_ASSEMBLED",
                f"job {job} already has instance {live.id} ({sm.name(live.status)}); "
                "only a re-register carrying its instance_id is accepted",
                instance_id=str(live.id),
                job_name=job,
            )
        spec = JobSpec.from_request(req)
        new = Member.from_request(req)
        pending = self.pending.get(job)
        if pending is not None:
            diff = spec.differences(pending.spec)
            if diff:
                raise errors.precondition(
                    "JOB_MISMATCH",
                    f"job/{job}",
                    f"registration disagrees with the other NodeManagers of job {job} on {', '.join(diff)}",
                )
            other = assembly.conflict(pending.members, new)
            if other is not None:
                if self._alive(other, now):
                    raise errors.already_exists(
                        "DUPLICATE_REGISTRATION",
                        f"job {job} node_rank {other.node_rank} already has NodeManager {other.address} "
                        f"with engine ports {other.ports}",
                        job_name=job,
                        node_manager=other.address,
                    )
                # Its earlier registration went silent (a restarted NodeManager, or one known only
                # from before a Controller restart): the new one takes the slot.
                self._drop_member(pending, other, "replaced")
        why = assembly.misfit(spec, pending.members if pending else [], new)
        if why:
            raise errors.precondition("INSTANCE_FULL", f"job/{job}", why)
        if pending is None:
            pending = Pending(id=self.store.next_instance_id(), job_name=job, spec=spec)
            self.pending[job] = pending
        pending.members.append(new)
        pending.last_registration = time.time()
        session = self.sessions.open(new, now)
        self.store.save_pending(pending)
        log.event(
            "registered",
            node_id=session.node_id,
            job=job,
            pending_id=pending.id,
            node_rank=new.node_rank,
            node_manager=new.address,
            ports=",".join(map(str, new.ports)),
            members=len(pending.members),
        )
        if assembly.is_complete(spec, pending.members) and not pending.completing:
            self._spawn(self._complete(pending))
        return self._response(session.node_id, session.epoch, 0)

    def _reattach(self, inst: Instance, req: pb.RegisterRequest, now: float) -> pb.RegisterResponse:
        if inst.job_name != req.job_name:
            raise errors.precondition(
                "INSTANCE_MISMATCH",
                f"instance/{inst.id}",
                f"instance {inst.id} belongs to job {inst.job_name}, not {req.job_name}",
            )
        member = inst.member_at(req.host, req.nm_port)
        if member is None:
            raise errors.already_exists(
                "JOB_ALREADY_ASSEMBLED",
                f"instance {inst.id} of job {inst.job_name} has no NodeManager at {req.host}:{req.nm_port}",
                instance_id=str(inst.id),
                job_name=inst.job_name,
            )
        session = self.sessions.open(member, now)
        log.event(
            "reregistered",
            node_id=session.node_id,
            instance_id=inst.id,
            job=inst.job_name,
            node_manager=member.address,
        )
        return self._response(session.node_id, session.epoch, inst.id)

    def _response(self, node_id: int, epoch: int, instance_id: int) -> pb.RegisterResponse:
        return pb.RegisterResponse(
            node_id=node_id,
            session_epoch=epoch,
            heartbeat_interval_ms=self.heartbeat_interval_ms,
            engine_relaunch_enabled=self.relaunch_enabled,
            instance_id=instance_id,
        )

    def _alive(self, m: Member, now: float) -> bool:
        return m.session is not None and (
            m.open_streams > 0 or now - m.last_heard <= self.heartbeat_timeout_s
        )

    def _drop_member(self, p: Pending, m: Member, reason: str) -> None:
        p.members.remove(m)
        self.sessions.close(m)
        log.warn(
            "registration_dropped", job=p.job_name, pending_id=p.id, node_manager=m.address, reason=reason
        )

    # ---- completion --------------------------------------------------------------------------

    async def _complete(self, pending: Pending) -> None:
        """Probe every member; assemble when the instance is still complete afterwards."""
        job = pending.job_name
        pending.completing = True
        try:
            while self.pending.get(job) is pending and assembly.is_complete(pending.spec, pending.members):
                probed = list(pending.members)
                answers = await asyncio.gather(*(self.nm.reachable(m.address) for m in probed))
                if self.pending.get(job) is not pending:
                    return
                silent = [m for m, ok in zip(probed, answers, strict=True) if not ok and m in pending.members]
                for m in silent:
                    self._drop_member(pending, m, "unreachable")
                if silent:
                    self.store.save_pending(pending)
                    continue
                if all(m in probed for m in pending.members):
                    self._assemble(pending)
                    return
        finally:
            pending.completing = False

    def _assemble(self, pending: Pending) -> None:
        plan = assembly.plan(pending.id, pending.job_name, pending.spec, pending.members)
        inst = Instance(
            id=pending.id,
            job_name=pending.job_name,
            spec=pending.spec,
            status=sm.INITIAL,
            endpoints=plan.endpoints,
            members=plan.members,
        )
        for m in inst.members:
            m.instance = inst
        del self.pending[pending.job_name]
        self.store.assemble(inst)
        self.table.add(inst)
        self._spawn(self._start(inst, plan.commands))

    async def _start(self, inst: Instance, commands: dict[str, Any]) -> None:
        addresses = list(commands)
        results = await asyncio.gather(
            *(self.nm.start_engines(a, commands[a], self.start_retries) for a in addresses),
            return_exceptions=True,
        )
        if inst.status == sm.DELETED:
            return
        failed = {a: r for a, r in zip(addresses, results, strict=True) if isinstance(r, BaseException)}
        if failed:
            for a, exc in failed.items():
                code = getattr(exc, "code", lambda: None)()
                log.error(
                    "start_engines_failed",
                    instance_id=inst.id,
                    node_manager=a,
                    code=getattr(code, "name", type(exc).__name__),
                    attempts=self.start_retries + 1,
                )
            self.table.delete(inst, "start_failed")
            return
        for a, resp in zip(addresses, results, strict=True):
            member = next(m for m in inst.members if m.address == a)
            for reported in getattr(resp, "endpoints", ()):
                ep = member.by_id.get(reported.id)
                if ep is not None and reported.pid:
                    ep.pid = reported.pid
        log.event("engines_started", instance_id=inst.id, job=inst.job_name, node_managers=len(addresses))
        self.table.evaluate(inst)

    # ---- observer and timers -----------------------------------------------------------------

    def on_transition(self, inst: Instance, old: Status, new: Status, reason: str) -> None:
        """A deleted instance's NodeManagers must register again (a new instance if they can)."""
        if new == sm.DELETED:
            for m in inst.members:
                self.sessions.close(m)

    def sweep(self, now: float, wall: float) -> None:
        for p in list(self.pending.values()):
            if wall - p.last_registration > self.assemble_timeout_s:
                del self.pending[p.job_name]
                for m in p.members:
                    self.sessions.close(m)
                self.store.delete_pending(p.id)
                log.warn("assembly_expired", job=p.job_name, pending_id=p.id, members=len(p.members))
                continue
            silent = [m for m in p.members if now - m.last_heard > self.heartbeat_timeout_s]
            for m in silent:
                self._drop_member(p, m, "heartbeat_timeout")
            if silent:
                self.store.save_pending(p)

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def close(self) -> None:
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
