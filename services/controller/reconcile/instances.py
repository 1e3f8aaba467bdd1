"""Reconciling one assembled instance with what its NodeManagers report.

``reconcile(instance_id)`` compares the instance with the latest observations (the heartbeat
handlers record them and enqueue the id):

0. a doomed instance (instances.py ``doom``, whoever asked) → its teardown's next step
   (reconcile/teardown.py): deleted, its NodeManagers stopped, its precision alarm cleared. This
   also runs for a DELETED instance whose teardown a restart interrupted;
1. a NodeManager silent for ``instance_heartbeat_timeout_s`` → doomed; the other members of a
   multi-node instance get Stop (their ranks cannot go on without the lost one's: their pods
   restart, and all ranks come back together). One whose stream just broke and that does not
   answer a probe → its endpoints ABNORMAL (the instance leaves routing now; the heartbeat
   timeout or its restart decides the rest);
2. the endpoint statuses → the state machine's next status (persisted, then observers told);
3. members whose engines are not running yet → ``StartEngines``. A failed round is retried with
   the key's backoff up to ``start_command_retries`` times, then the instance is doomed;
   a NodeManager answering NODE_MISMATCH (the command is not for that node) is not retried;
4. the fault manager: the instance's separation, and one step of its recovery strategy
   (faults/manager.py), looked at again when the step asks;
5. a role switch in progress (planner/switches.py): its next step. While the switch has the
   instance out of routing the fault manager's strategies wait (the switch relaunches the
   engines itself, and hands a failed one to the fault manager when it ends).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import grpc

from motor_mesh.common import errors, log, retry
from motor_mesh.common.config import ControllerConfig
from motor_mesh.controller import assembly
from motor_mesh.controller import state_machine as sm
from motor_mesh.controller.faults.manager import FaultManager
from motor_mesh.controller.instances import InstanceTable
from motor_mesh.controller.model import Instance, Member, Removal, observe_kv_ports
from motor_mesh.controller.nodes.client import NodeManagerClients
from motor_mesh.controller.planner.switches import RoleSwitches
from motor_mesh.controller.reconcile.runner import DONE, REQUEUE_NOW, Result, Retry, Terminal
from motor_mesh.controller.reconcile.teardown import Teardowns
from motor_mesh.controller.store.db import StateWriteError

# Retrying a StartEngines cannot fix these; every other failure (the NodeManager down or slow,
# an engine that failed to launch) may be transient.
START_POLICY = retry.policy(
    {
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.UNAUTHENTICATED,
        grpc.StatusCode.PERMISSION_DENIED,
        grpc.StatusCode.UNIMPLEMENTED,
    }
)


class InstanceReconciler:
    def __init__(
        self,
        cfg: ControllerConfig,
        table: InstanceTable,
        nm_clients: NodeManagerClients,
        faults: FaultManager,
        teardowns: Teardowns,
        clock: Callable[[], float] = time.monotonic,
        *,
        settings: Callable[[], ControllerConfig] | None = None,
        switches: RoleSwitches | None = None,
    ) -> None:
        self.clock = clock
        self.table = table
        self.nm_clients = nm_clients
        self.faults = faults
        self.teardowns = teardowns
        self.switches = switches
        # Read when used: a reload replaces the running section (controller/settings.py).
        self._cfg = settings or (lambda: cfg)

    @property
    def heartbeat_timeout_s(self) -> float:
        return self._cfg().instance_heartbeat_timeout_s

    @property
    def start_retries(self) -> int:
        return self._cfg().start_command_retries

    async def reconcile(self, instance_id: int) -> Result:
        inst = self.table.live.get(instance_id)
        if inst is None:
            gone = self.table.deleted.get(instance_id)
            if gone is not None and gone.teardown is not None and not gone.teardown.done:
                return _after(await self.teardowns.advance(gone))
            return DONE
        if inst.teardown is not None:
            return _after(await self.teardowns.advance(inst))
        now = self.clock()
        silent = [m for m in inst.members if now - m.last_heard > self.heartbeat_timeout_s]
        if silent:
            first = silent[0]
            log.warn(
                "heartbeat_timeout",
                instance_id=inst.id,
                node_manager=first.address,
                silent_s=round(now - first.last_heard, 3),
                stream_open=first.open_streams > 0,
            )
            survivors = [m.address for m in inst.members if m not in silent]
            detail = f"{','.join(m.address for m in silent)} silent"
            await self.table.doom(inst, Removal.HEARTBEAT_TIMEOUT, detail, stop=survivors)
            return _after(await self.teardowns.advance(inst))
        lost = [m for m in inst.members if m.stream_lost and not m.open_streams]
        if lost:
            await self._probe_lost(inst, lost)
        # A status the disk would not take does not hold back healing: the fault manager acts on
        # the engines (a relaunch needs no status write), and the reconcile is retried for it.
        unwritten: StateWriteError | None = None
        try:
            await self.evaluate(inst)
        except StateWriteError as err:
            unwritten = err
        if unwritten is None and any(m.started is False for m in inst.members):
            await self._start(inst)
            await self.evaluate(inst)
        if self.faults.separate(inst) and unwritten is None:
            await self.evaluate(inst)  # separated, or no longer
        waits: list[float | None] = []
        if inst.switch is not None and self.switches is not None and unwritten is None:
            waits.append(await self.switches.advance(inst))
            if inst.teardown is None:
                await self.evaluate(inst)  # out of routing for the switch, or back
        if not inst.switching and inst.teardown is None:
            waits.append(await self.faults.step(inst))
        if inst.teardown is not None:  # the escalation (or a failed switch) doomed it
            return _after(await self.teardowns.advance(inst))
        if unwritten is not None:
            raise unwritten
        return _after(min((w for w in waits if w is not None), default=None))

    async def _probe_lost(self, inst: Instance, lost: list[Member]) -> None:
        answers = await asyncio.gather(*(self.nm_clients.reachable(m.address) for m in lost))
        for m, alive in zip(lost, answers, strict=True):
            if m.open_streams:
                continue  # it came back while we asked
            m.stream_lost = False
            if alive:
                continue  # its stream will be back; its beats tell the rest
            log.warn("node_manager_unreachable", instance_id=inst.id, node_manager=m.address)
            for ep in m.by_id.values():
                ep.status = sm.EP_ABNORMAL
            m.beat_fingerprint = None  # its next beat, if any, is applied in full

    async def evaluate(self, inst: Instance) -> None:
        """Run the state machine on the endpoint statuses last reported."""
        new, reason = sm.next_status(
            inst.status,
            ((ep.status, ep.headless) for ep in inst.endpoints),
            separated=inst.separated,
            switching=inst.switching,
        )
        if new != inst.status:
            await self.table.transition(inst, new, reason)

    async def _start(self, inst: Instance) -> None:
        members = [m for m in inst.members if m.started is False]
        results = await asyncio.gather(
            *(self.nm_clients.start_engines(m.address, assembly.start_command(inst, m)) for m in members),
            return_exceptions=True,
        )
        if inst.status == sm.DELETED or inst.teardown is not None:
            return
        failed: list[tuple[Member, errors.RpcFailure]] = []
        for m, result in zip(members, results, strict=True):
            if isinstance(result, grpc.RpcError):
                failed.append((m, errors.RpcFailure.of(result)))
            elif isinstance(result, BaseException):
                raise result
            else:
                m.started = True
                for reported in result.endpoints:
                    ep = m.by_id.get(reported.id)
                    if ep is None:
                        continue
                    observe_kv_ports(ep, reported)
                    if reported.pid:
                        ep.pid = reported.pid
        if not failed:
            inst.start_failures = 0
            log.event("engines_started", instance_id=inst.id, job=inst.job_name, node_managers=len(members))
            return
        inst.start_failures += 1
        for m, failure in failed:
            log.error(
                "start_engines_failed",
                instance_id=inst.id,
                node_manager=m.address,
                code=failure.code.name,
                reason=failure.reason,
                message=failure.message,
                attempt=inst.start_failures,
            )
        mismatch = next((f for _, f in failed if f.reason == "NODE_MISMATCH"), None)
        terminal = mismatch or next((f for _, f in failed if not START_POLICY.retryable(f.code)), None)
        if terminal is not None or inst.start_failures > self.start_retries:
            why = terminal or failed[0][1]
            await self.table.doom(inst, Removal.START_FAILED, str(why))
            await self.teardowns.advance(inst)
            raise Terminal(f"instance {inst.id}: StartEngines failed ({why}); instance dropped")
        raise Retry(f"instance {inst.id}: StartEngines failed on {len(failed)} NodeManager(s)")


def _after(seconds: float | None) -> Result:
    """The reconcile's answer to a step that wants the next look in ``seconds`` (0: at once;
    None: not unless something changes)."""
    if seconds is None:
        return DONE
    return REQUEUE_NOW if seconds <= 0 else Result(requeue_after=seconds)
