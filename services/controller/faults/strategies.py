"""Recovery strategies, as steps over a stored record (model.StrategyRecord).

The fault manager calls :meth:`advance` from the instance reconcile; each call does one step
(a round of calls to the NodeManagers) and returns the record as it is after it, which the
manager stores before anything else happens, and when to look again. A strategy holds no state
of its own, so a restarted Controller or a new leader continues from the stored record.
``advance`` raises :class:`StrategyFailed` when the strategy cannot recover the instance.
``rank`` orders strategies and fault levels: a higher one preempts a lower one.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass

import grpc

from motor_mesh.common import enums, errors, log, retry
from motor_mesh.common.config import ControllerConfig
from motor_mesh.controller.instances import InstanceTable
from motor_mesh.controller.model import Instance, Removal, StrategyRecord, observe_kv_ports
from motor_mesh.controller.nodes.client import NodeManagerClients
from motor_mesh.gen.motor.v1 import nodemanager_pb2

PROBE_RETRY_S = 0.5
# RestartEngines answers a retry cannot change.
RESTART_POLICY = retry.policy(
    {
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.FAILED_PRECONDITION,
        grpc.StatusCode.UNAUTHENTICATED,
        grpc.StatusCode.PERMISSION_DENIED,
        grpc.StatusCode.UNIMPLEMENTED,
    }
)


class StrategyFailed(Exception):
    """The strategy could not recover the instance; the message says why, and ``record`` is
    the strategy's record as the failing step left it (None: as it was before the step)."""

    def __init__(self, why: str, record: StrategyRecord | None = None) -> None:
        super().__init__(why)
        self.record = record


@dataclass(frozen=True)
class Step:
    record: StrategyRecord
    # Seconds until the next step; 0 = at once.
    after: float
    succeeded: bool = False


def _why(result: BaseException) -> str:
    if isinstance(result, grpc.RpcError):
        failure = errors.RpcFailure.of(result)
        return f"{failure.code.name}: {failure.message}"
    return f"{type(result).__name__}: {result}"


class EngineRelaunch:
    """Relaunch the instance's engines in place, on every NodeManager together (the ranks of a
    collective group restart together or not at all).

    - ``probe``: GetStatus of every NodeManager (each retried ``engine_relaunch_dispatch_retries``
      times), recording its incarnation and relaunch count;
    - ``restart``: ``RestartEngines(RESTART)`` to each, a retryable failure retried as many times;
      one whose answer was lost (a Controller restart) is recognised by its relaunch count;
    - ``wait_ready``: ``GetStatus(relaxed)`` until all are ready. It fails after the complete
      timeout, when one NodeManager misses the unreachable threshold of polls in a row, or when
      a relaunched engine dies again;
    - ``abort`` (after a failure, or when preempted): ``RestartEngines(ABORT)`` to the
      NodeManagers whose restart was not accepted, so their pod-restart fallback goes ahead. The
      accepted ones stay frozen while their engines come up: never stopped by the escalation.
    """

    name = "EngineRelaunch"
    rank = 2  # the fault level it answers: an L3+ fault (separation) stops it
    first_phase = "probe"

    def __init__(
        self,
        clients: NodeManagerClients,
        cfg: ControllerConfig,
        settings: Callable[[], ControllerConfig] | None = None,
    ) -> None:
        self.clients = clients
        # Read at each step: a reload replaces the running section (controller/settings.py); a
        # relaunch already waiting keeps the deadline it stored.
        self._cfg = settings or (lambda: cfg)

    @property
    def timeout_s(self) -> float:
        return self._cfg().engine_relaunch_complete_timeout_s

    @property
    def poll_s(self) -> float:
        return self._cfg().engine_relaunch_poll_interval_s

    @property
    def retries(self) -> int:
        return self._cfg().engine_relaunch_dispatch_retries

    @property
    def threshold(self) -> int:
        return self._cfg().engine_relaunch_nm_unreachable_threshold

    async def advance(self, inst: Instance, rec: StrategyRecord) -> Step:
        if rec.phase == "probe":
            return await self._probe(inst, rec)
        if rec.phase == "restart":
            return await self._restart(inst, rec)
        if rec.phase == "wait_ready":
            return await self._wait_ready(inst, rec)
        raise AssertionError(f"EngineRelaunch has no phase {rec.phase!r}")

    def _count_failures(self, rec: StrategyRecord, failed: dict[str, str], what: str) -> StrategyRecord:
        attempts = dict(rec.attempts)
        for a in failed:
            attempts[a] = attempts.get(a, 0) + 1
        gone = [f"{a} ({why})" for a, why in failed.items() if attempts[a] > self.retries]
        rec = dataclasses.replace(rec, attempts=attempts)
        if gone:
            raise StrategyFailed(f"{what}: {', '.join(gone)}", rec)
        return rec

    async def _probe(self, inst: Instance, rec: StrategyRecord) -> Step:
        todo = [a for a in inst.node_managers if a not in rec.base]
        answers = await asyncio.gather(*(self.clients.get_status(a) for a in todo), return_exceptions=True)
        base = dict(rec.base)
        failed: dict[str, str] = {}
        for a, answer in zip(todo, answers, strict=True):
            if isinstance(answer, BaseException):
                failed[a] = _why(answer)
            else:
                base[a] = (answer.incarnation, answer.relaunch_count)
        rec = self._count_failures(
            dataclasses.replace(rec, base=base), failed, "unreachable before the relaunch"
        )
        if failed:
            return Step(rec, PROBE_RETRY_S)
        return Step(dataclasses.replace(rec, phase="restart", attempts={}), 0)

    async def _restart(self, inst: Instance, rec: StrategyRecord) -> Step:
        todo = [a for a in inst.node_managers if a not in rec.accepted]
        accepted = list(rec.accepted)
        # Sent before the last Controller stopped, answer unknown: the relaunch count tells.
        unsure = [a for a in todo if a in rec.dispatched]
        if unsure:
            answers = await asyncio.gather(
                *(self.clients.get_status(a) for a in unsure), return_exceptions=True
            )
            for a, answer in zip(unsure, answers, strict=True):
                if not isinstance(answer, BaseException) and self._restarted(rec, a, answer):
                    accepted.append(a)
                    log.event("relaunch_found_accepted", instance_id=inst.id, node_manager=a)
            todo = [a for a in todo if a not in accepted]
        results = await asyncio.gather(
            *(self.clients.restart_engines(a, enums.RESTART, inst.id) for a in todo), return_exceptions=True
        )
        failed: dict[str, str] = {}
        refused: list[str] = []
        for a, result in zip(todo, results, strict=True):
            if not isinstance(result, BaseException):
                accepted.append(a)
                continue
            failure = errors.RpcFailure.of(result) if isinstance(result, grpc.RpcError) else None
            if failure is not None and failure.code == grpc.StatusCode.ABORTED:
                accepted.append(a)  # one is already running there, which is as good
            elif failure is not None and not RESTART_POLICY.retryable(failure.code):
                refused.append(f"{a} ({_why(result)})")
            else:
                failed[a] = _why(result)
                log.warn("relaunch_dispatch_failed", instance_id=inst.id, node_manager=a, reason=failed[a])
        # An answer came for each of these: none is left to be found out after a restart.
        dispatched = tuple(a for a in rec.dispatched if a not in todo)
        rec = dataclasses.replace(rec, accepted=tuple(accepted), dispatched=dispatched)
        if refused:
            raise StrategyFailed(f"restart refused by {', '.join(refused)}", rec)
        rec = self._count_failures(rec, failed, "restart refused by")
        if failed:
            return Step(rec, PROBE_RETRY_S)
        deadline = time.time() + self.timeout_s
        return Step(dataclasses.replace(rec, phase="wait_ready", attempts={}, deadline=deadline), 0)

    @staticmethod
    def _restarted(rec: StrategyRecord, address: str, answer: nodemanager_pb2.GetStatusResponse) -> bool:
        """The same NodeManager process relaunched since the probe, and that relaunch did not
        fail (a failed one leaves no engines and lifts the freeze)."""
        incarnation, count = rec.base.get(address, (0, 0))
        same = answer.incarnation == incarnation and answer.relaunch_count > count
        return same and not _relaunch_failed(answer)

    def before_restart(self, inst: Instance, rec: StrategyRecord) -> StrategyRecord | None:
        """The record to store before a ``restart`` step sends anything: which NodeManagers are
        about to get RESTART (None: nothing new to record)."""
        if rec.phase != "restart":
            return None
        todo = tuple(a for a in inst.node_managers if a not in rec.accepted and a not in rec.dispatched)
        if not todo:
            return None
        return dataclasses.replace(rec, dispatched=rec.dispatched + todo)

    async def _wait_ready(self, inst: Instance, rec: StrategyRecord) -> Step:
        addresses = inst.node_managers
        answers = await asyncio.gather(
            *(self.clients.get_status(a) for a in addresses), return_exceptions=True
        )
        misses = dict(rec.misses)
        ready = True
        for a, answer in zip(addresses, answers, strict=True):
            if isinstance(answer, BaseException):
                misses[a] = misses.get(a, 0) + 1
                ready = False
                if misses[a] >= self.threshold:
                    raise StrategyFailed(f"{a} unreachable for {misses[a]} polls in a row ({_why(answer)})")
                continue
            misses[a] = 0
            ready = ready and answer.ready
            died = [e.id for e in answer.endpoints if e.status == enums.EP_ABNORMAL and not e.pid]
            if died:
                # The relaunched engines died again: waiting out the timeout would not help.
                raise StrategyFailed(f"engine(s) {died} on {a} died again after the relaunch")
            if _relaunch_failed(answer):
                raise StrategyFailed(f"the relaunch on {a} failed: it runs no engines")
        rec = dataclasses.replace(rec, misses=misses)
        if ready:
            # What every NodeManager just said is newer than the last beats: recorded now, the
            # next look at the instance does not take the dead engines for still dead.
            for a, answer in zip(addresses, answers, strict=True):
                assert not isinstance(answer, BaseException)
                observe_status(inst, a, answer)
            return Step(rec, 0, succeeded=True)
        if time.time() >= rec.deadline:
            raise StrategyFailed(f"engines not ready {self.timeout_s:.0f}s after the relaunch")
        return Step(rec, min(self.poll_s, max(0.0, rec.deadline - time.time())))

    async def abort(self, inst: Instance, rec: StrategyRecord) -> None:
        """ABORT to every NodeManager whose restart was not accepted; an error line names each
        one it did not reach (its freeze, if any, expires on its own)."""
        targets = [a for a in inst.node_managers if a not in rec.accepted]
        if not targets:
            return
        results = await asyncio.gather(
            *(self.clients.restart_engines(a, enums.ABORT, inst.id) for a in targets),
            return_exceptions=True,
        )
        for a, result in zip(targets, results, strict=True):
            if isinstance(result, BaseException):
                log.error(
                    "relaunch_abort_unreached", instance_id=inst.id, node_manager=a, reason=_why(result)
                )


def _relaunch_failed(answer: nodemanager_pb2.GetStatusResponse) -> bool:
    """No engines and no freeze: a relaunch that could not launch (RELAUNCH_FAILED) leaves the
    NodeManager so; one still running holds the freeze."""
    return not answer.endpoints and not answer.HasField("frozen_until")


def observe_status(inst: Instance, address: str, answer: nodemanager_pb2.GetStatusResponse) -> None:
    """Record what a NodeManager's GetStatus answered (status, pid, KV event ports) on the
    instance's endpoints: newer than the last beats."""
    member = next((m for m in inst.members if m.address == address), None)
    if member is None:
        return
    for reported in answer.endpoints:
        ep = member.by_id.get(reported.id)
        if ep is not None:
            ep.status, ep.pid = reported.status, reported.pid
            observe_kv_ports(ep, reported)


class Terminate:
    """The last resort after a failed relaunch: the instance is doomed (reason RELAUNCH_FAILED)
    with Stop for the NodeManagers that had not accepted the relaunch (each stops its engines and
    exits, so its pod restarts and registers anew). The ones that accepted it are left to finish
    recovering or to let their freeze expire, when their own arbiter decides."""

    name = "Terminate"
    rank = 7  # above every fault level: once started it finishes
    first_phase = "stop"

    def __init__(self, table: InstanceTable) -> None:
        self.table = table

    async def advance(self, inst: Instance, rec: StrategyRecord) -> Step:
        stop = [a for a in inst.node_managers if a not in rec.failed_accepted]
        await self.table.doom(inst, Removal.RELAUNCH_FAILED, "engine relaunch failed", stop=stop)
        return Step(rec, 0, succeeded=True)

    async def abort(self, inst: Instance, rec: StrategyRecord) -> None:
        pass
