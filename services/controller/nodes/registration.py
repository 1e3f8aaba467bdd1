"""The Register RPC: which registrations are accepted, and what each one records.

Registrations are grouped by job name into a pending instance that owns a fresh id; completing
and assembling it is the assembler's reconcile, which this only enqueues. A NodeManager that
registers again carrying the id of a live instance (after a Controller restart or a lost stream)
is re-attached: new session, engines untouched. A NodeManager that restarted (a new process at
the same address, proven by that address answering with the new incarnation) retires its old
instance at once (doomed; the instance reconcile deletes it while the registration waits), and
it is then assembled again.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Callable

import grpc

from motor_mesh.common import errors, log
from motor_mesh.common.config import ControllerConfig
from motor_mesh.common.enums import DELETED, InstanceStatus, status_name
from motor_mesh.controller import assembly, convert
from motor_mesh.controller.instances import InstanceTable
from motor_mesh.controller.model import Instance, Member, Pending, Removal
from motor_mesh.controller.nodes.client import NodeManagerClients
from motor_mesh.controller.nodes.pending import PendingAssemblies
from motor_mesh.controller.nodes.sessions import SessionTable
from motor_mesh.controller.store.interface import StateStore
from motor_mesh.gen.motor.v1 import controller_pb2 as pb

# Jobs waiting for the rest of their NodeManagers at once. Each holds a row, sessions and a
# reconcile for up to instance_assemble_timeout_s, so a caller inventing job names must hit a
# wall; a real fleet assembles within seconds of registering and stays far below it.
MAX_PENDING_JOBS = 20_000
# How long a restarted NodeManager's Register waits for the instance reconcile to delete its old
# instance (milliseconds, unless the store is failing); after that it is asked to retry.
DELETE_WAIT_S = 5.0


class Registrar:
    def __init__(
        self,
        cfg: ControllerConfig,
        table: InstanceTable,
        pending: PendingAssemblies,
        sessions: SessionTable,
        store: StateStore,
        enqueue_job: Callable[[str], None],
        nm_clients: NodeManagerClients,
        clock: Callable[[], float] = time.monotonic,
        *,
        settings: Callable[[], ControllerConfig] | None = None,
    ) -> None:
        self.clock = clock
        self.max_pending = MAX_PENDING_JOBS
        self.table = table
        self.nm_clients = nm_clients
        self.pending = pending
        self.sessions = sessions
        self.store = store
        self.enqueue_job = enqueue_job
        self.heartbeat_interval_ms = int(cfg.heartbeat_interval_s * 1000)
        # Enabled: a NodeManager whose engine died holds its pod-restart fallback while the
        # fault manager relaunches the engines in place.
        self.relaunch_enabled = cfg.enable_engine_relaunch
        # Read when used: a reload replaces the running section (controller/settings.py).
        self._cfg = settings or (lambda: cfg)

    @property
    def heartbeat_timeout_s(self) -> float:
        return self._cfg().instance_heartbeat_timeout_s

    async def register(self, req: pb.RegisterRequest) -> pb.RegisterResponse:
        """A NodeManager restarted in place (a later incarnation at the address of a live
        instance's member) first retires that instance, so it is rebuilt now rather than after
        the heartbeat timeout; then the registration is handled as any other."""
        self.nm_clients.registered(f"{req.host}:{req.nm_port}")
        inst = self._restart_candidate(req)
        if inst is not None and await self._proves_restart(req):
            member = inst.member_at(req.host, req.nm_port)
            log.warn(
                "node_manager_restarted",
                instance_id=inst.id,
                job=inst.job_name,
                node_manager=f"{req.host}:{req.nm_port}",
                old_incarnation=member.incarnation if member else 0,
                incarnation=req.incarnation,
            )
            # The other members of a multi-node instance are stopped: their ranks cannot go on
            # without this one's, so their pods restart and every rank comes back together.
            others = [m.address for m in inst.members if m is not member]
            await self.table.doom(
                inst, Removal.NODE_MANAGER_RESTARTED, f"{req.host}:{req.nm_port} restarted", stop=others
            )
            try:
                await asyncio.wait_for(self.table.wait_deleted(inst), DELETE_WAIT_S)
            except TimeoutError:
                raise errors.unavailable(
                    f"instance {inst.id} of this NodeManager is still being deleted; register again"
                ) from None
        async with self.pending.locked(req.job_name):
            return await self.register_now(req)

    def _restart_candidate(self, req: pb.RegisterRequest) -> Instance | None:
        """The live instance of the job whose member at this address is an earlier process."""
        if req.instance_id or not req.incarnation:
            return None
        inst = self.table.by_job.get(req.job_name)
        member = inst.member_at(req.host, req.nm_port) if inst is not None else None
        if member is None or req.incarnation <= member.incarnation:
            return None
        return inst

    async def _proves_restart(self, req: pb.RegisterRequest) -> bool:
        """The proof: the process answering at that address now is the one registering. The
        earlier one held the port while alive, so it is gone, and the new one stopped its
        engines before registering. A stale or forged registration fails this check."""
        try:
            status = await self.nm_clients.status_now(f"{req.host}:{req.nm_port}")
        except grpc.RpcError:
            return False
        return status.incarnation == req.incarnation

    async def register_now(self, req: pb.RegisterRequest) -> pb.RegisterResponse:
        """Under the job's lock: decided on the state as it is, written before it changes."""
        now = self.clock()
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
                f"job {job} already has instance {live.id} ({status_name(live.status)}); "
                "only a re-register carrying its instance_id is accepted",
                instance_id=str(live.id),
                job_name=job,
            )
        spec = convert.spec_of(req)
        new = convert.member_of(req)
        pending = self.pending.get(job)
        replaced: Member | None = None
        if pending is not None:
            diff = spec.differences(pending.spec)
            if diff:
                raise errors.precondition(
                    "JOB_MISMATCH",
                    f"job/{job}",
                    f"registration disagrees with the other NodeManagers of job {job} on {', '.join(diff)}",
                )
            replaced = assembly.conflict(pending.members, new)
            if replaced is not None and self._alive(replaced, now):
                raise errors.already_exists(
                    "DUPLICATE_REGISTRATION",
                    f"job {job} node_rank {replaced.node_rank} already has NodeManager {replaced.address} "
                    f"with engine ports {replaced.ports}",
                    job_name=job,
                    node_manager=replaced.address,
                )
            # A silent earlier registration (a restarted NodeManager, or one known only from
            # before a Controller restart) gives its slot to the new one.
        others = [m for m in pending.members if m is not replaced] if pending else []
        why = assembly.misfit(spec, others, new)
        if why:
            raise errors.precondition("INSTANCE_FULL", f"job/{job}", why)
        if pending is None and len(self.pending) >= self.max_pending:
            raise errors.resource_exhausted(
                f"{len(self.pending)} jobs are already waiting for NodeManagers to complete their "
                f"instances (the most at once is {self.max_pending}); retry when some have assembled "
                "or expired",
                retry_after_s=5.0,
            )
        if pending is None:
            pending = Pending(id=await self.store.next_instance_id(), job_name=job, spec=spec)
        joined = dataclasses.replace(pending, members=[*others, new], last_registration=time.time())
        await self.pending.put(joined)
        if replaced is not None:
            self.pending.release(pending, replaced, "replaced")
        session = self.sessions.open(new, now)
        log.event(
            "registered",
            node_id=session.node_id,
            job=job,
            pending_id=pending.id,
            node_rank=new.node_rank,
            node_manager=new.address,
            ports=",".join(map(str, new.ports)),
            members=len(others) + 1,
        )
        self.enqueue_job(job)
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
        if req.incarnation < member.incarnation:
            # An earlier process's registration arriving late must not take the live one's session.
            raise errors.already_exists(
                "STALE_INCARNATION",
                f"NodeManager {member.address} registered a later process (incarnation "
                f"{member.incarnation}) than this registration ({req.incarnation})",
                instance_id=str(inst.id),
                node_manager=member.address,
            )
        member.incarnation = req.incarnation
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

    def on_transition(self, inst: Instance, old: InstanceStatus, new: InstanceStatus, reason: str) -> None:
        """A deleted instance's NodeManagers must register again (a new instance if they can)."""
        if new == DELETED:
            for m in inst.members:
                self.sessions.close(m)
