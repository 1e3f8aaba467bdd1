"""Recovery strategies the fault manager runs for one instance, each as a cancellable task.

A strategy's ``run()`` returns when it succeeded and raises :class:`StrategyFailed` when it did
not; after any other exception (a bug) the fault manager calls it again, so it starts over from
its first phase. ``phase`` says where it is (GetFaultToleranceStatus shows it). ``rank`` orders
strategies and fault levels: a higher one preempts a lower one. When a strategy is stopped from
outside (preempted, or its instance deleted) its task is cancelled and :meth:`stopped` does what
must still be done without waiting for anyone.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Protocol

import grpc

from motor_mesh.common import enums, errors, log, tasks
from motor_mesh.common.config import ControllerConfig
from motor_mesh.controller.instances import InstanceTable
from motor_mesh.controller.model import Instance, observe_kv_ports
from motor_mesh.controller.nodes.client import NodeManagerClients
from motor_mesh.gen.motor.v1 import nodemanager_pb2

PROBE_RETRY_S = 0.5


class StrategyFailed(Exception):
    """The strategy could not recover the instance; the message says why."""


class Strategy(Protocol):
    name: str
    rank: int
    phase: str

    async def run(self) -> None: ...

    def stopped(self) -> None: ...

    def poke(self) -> None: ...


def _accepted(result: object) -> bool:
    """RestartEngines went through, or one is already running there (ABORTED), which is as good."""
    if isinstance(result, grpc.RpcError):
        return errors.RpcFailure.of(result).code == grpc.StatusCode.ABORTED
    return not isinstance(result, BaseException)


def _why(result: BaseException) -> str:
    if isinstance(result, grpc.RpcError):
        failure = errors.RpcFailure.of(result)
        return f"{failure.code.name}: {failure.message}"
    return f"{type(result).__name__}: {result}"


class EngineRelaunch:
    """Relaunch the instance's engines in place, on every NodeManager together (the ranks of a
    collective group restart together or not at all).

    Phase 1: probe every NodeManager (any unreachable → phase 2 for all), ``RestartEngines
    (RESTART)`` to all, then poll ``GetStatus(relaxed)`` until all are ready. It fails after the
    complete timeout, or when one NodeManager misses the unreachable threshold of polls in a
    row. Phase 2: ``RestartEngines(ABORT)`` to the NodeManagers whose restart was not accepted,
    so their pod-restart fallback goes ahead; the accepted ones stay held while their engines
    come up."""

    name = "EngineRelaunch"
    rank = 2  # the fault level it answers: an L3+ fault (separation) stops it

    def __init__(self, inst: Instance, clients: NodeManagerClients, cfg: ControllerConfig) -> None:
        self.inst = inst
        self.clients = clients
        self.addresses = list(inst.node_managers)
        self.timeout_s = cfg.engine_relaunch_complete_timeout_s
        self.poll_s = cfg.engine_relaunch_poll_interval_s
        self.retries = cfg.engine_relaunch_dispatch_retries
        self.threshold = cfg.engine_relaunch_nm_unreachable_threshold
        self.accepted: set[str] = set()
        self.phase = "probe"
        self._wake = asyncio.Event()

    async def run(self) -> None:
        try:
            await self._relaunch()
        except StrategyFailed:
            self.phase = "abort"
            await self._abort()
            raise

    async def _relaunch(self) -> None:
        self.phase = "probe"
        reachable = await asyncio.gather(*(self._probe(a) for a in self.addresses))
        gone = [a for a, ok in zip(self.addresses, reachable, strict=True) if not ok]
        if gone:
            raise StrategyFailed(f"unreachable before the relaunch: {', '.join(gone)}")
        self.phase = "restart"
        results = await asyncio.gather(
            *(self.clients.restart_engines(a, enums.RESTART, self.inst.id) for a in self.addresses),
            return_exceptions=True,
        )
        refused = []
        for a, result in zip(self.addresses, results, strict=True):
            if _accepted(result):
                self.accepted.add(a)
            else:
                assert isinstance(result, BaseException)
                refused.append(f"{a} ({_why(result)})")
        if refused:
            raise StrategyFailed(f"restart refused by {', '.join(refused)}")
        self.phase = "wait_ready"
        await self._wait_ready()

    async def _probe(self, address: str) -> bool:
        for attempt in range(self.retries + 1):
            if await self.clients.reachable(address):
                return True
            if attempt < self.retries:
                await asyncio.sleep(PROBE_RETRY_S)
        return False

    async def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.timeout_s
        misses = dict.fromkeys(self.addresses, 0)
        while True:
            answers = await asyncio.gather(
                *(self.clients.get_status(a) for a in self.addresses), return_exceptions=True
            )
            ready = True
            for a, answer in zip(self.addresses, answers, strict=True):
                if isinstance(answer, BaseException):
                    misses[a] += 1
                    ready = False
                    if misses[a] >= self.threshold:
                        raise StrategyFailed(
                            f"{a} unreachable for {misses[a]} polls in a row ({_why(answer)})"
                        )
                else:
                    misses[a] = 0
                    ready = ready and answer.ready
                    died = [e.id for e in answer.endpoints if e.status == enums.EP_ABNORMAL and not e.pid]
                    if died:
                        # The relaunched engines died again: waiting out the timeout would not help.
                        raise StrategyFailed(f"engine(s) {died} on {a} died again after the relaunch")
            if ready:
                # What every NodeManager just said is newer than the last beats: recorded now,
                # the next look at the instance does not take the dead engines for still dead.
                for a, answer in zip(self.addresses, answers, strict=True):
                    assert not isinstance(answer, BaseException)
                    self._observe(a, answer)
                return
            if time.monotonic() >= deadline:
                raise StrategyFailed(f"engines not ready {self.timeout_s:.0f}s after the relaunch")
            self._wake.clear()
            # asyncio.timeout, not wait_for: on 3.11 wait_for can swallow a cancellation that
            # arrives as the event is set, and a preempted strategy must stop.
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.poll_s):
                    await self._wake.wait()

    def poke(self) -> None:
        """The instance changed (a beat): poll now rather than at the next interval, so the
        strategy ends as soon as the engines are up and a later fault starts a new one."""
        self._wake.set()

    def _observe(self, address: str, answer: nodemanager_pb2.GetStatusResponse) -> None:
        member = next((m for m in self.inst.members if m.address == address), None)
        if member is None:
            return
        for reported in answer.endpoints:
            ep = member.by_id.get(reported.id)
            if ep is not None:
                ep.status, ep.pid = reported.status, reported.pid
                observe_kv_ports(ep, reported)

    async def _abort(self) -> None:
        """ABORT to every NodeManager whose restart was not accepted; an error line names each
        one it did not reach. Nothing is left to abort once the instance is deleted."""
        targets = [a for a in self.addresses if a not in self.accepted]
        if not targets or self.inst.status == enums.DELETED:
            return
        results = await asyncio.gather(
            *(self.clients.restart_engines(a, enums.ABORT, self.inst.id) for a in targets),
            return_exceptions=True,
        )
        for a, result in zip(targets, results, strict=True):
            if isinstance(result, BaseException):
                log.error(
                    "relaunch_abort_unreached", instance_id=self.inst.id, node_manager=a, reason=_why(result)
                )

    def stopped(self) -> None:
        tasks.start(f"relaunch-abort-{self.inst.id}", self._abort())


class Terminate:
    """The last resort: ``Stop`` every NodeManager of the instance (each stops its engines and
    exits, so its pod restarts and registers anew) and delete the instance."""

    name = "Terminate"
    rank = 7  # above every fault level: once started it finishes

    def __init__(
        self, inst: Instance, clients: NodeManagerClients, table: InstanceTable, reason: str
    ) -> None:
        self.inst = inst
        self.clients = clients
        self.table = table
        self.reason = reason
        self.phase = "stop"

    async def run(self) -> None:
        addresses = list(self.inst.node_managers)
        results = await asyncio.gather(
            *(self.clients.stop(a, self.reason) for a in addresses), return_exceptions=True
        )
        unreached = [
            f"{a} ({_why(r)})"
            for a, r in zip(addresses, results, strict=True)
            if isinstance(r, BaseException)
        ]
        self.phase = "delete"
        await self.table.delete(self.inst, "terminated")
        if unreached:
            # Deleted all the same: those NodeManagers are told to register again on their next beat.
            raise StrategyFailed(f"Stop did not reach {', '.join(unreached)}")

    def stopped(self) -> None:
        pass

    def poke(self) -> None:
        pass
