"""The fault manager: each instance's fault level and the one recovery strategy it runs.

Level-triggered: :meth:`FaultManager.reconcile` (called by the instance reconcile, so after every
beat or engine event that changed something, and on every resync) looks at what the heartbeats
show now and decides which strategy the instance wants:

- an engine dead (its endpoint ABNORMAL with no process) is an L2 fault → ``EngineRelaunch``
  when ``enable_engine_relaunch`` (off: nothing; the NodeManager's pod-restart fallback acts);
- the strategy that ran last failed → escalate: a failed ``EngineRelaunch`` → ``Terminate``.

At most one strategy runs per instance: a higher-ranked one stops the running one and starts;
an equal or lower one leaves it. A finished strategy is recorded in the instance's bounded
history (with its outcome and duration) and its instance is reconciled again. A deleted
instance's strategy is stopped and its record dropped.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime

from google.protobuf import timestamp_pb2
from motor.v1 import controller_pb2 as pb

from services.common import enums, log, tasks
from services.common.config import ControllerConfig

from .instances import InstanceTable
from .model import Instance
from .nm_client import NodeManagerClients
from .strategies import EngineRelaunch, Strategy, StrategyFailed, Terminate

HISTORY = 20  # finished strategies kept per instance
L2 = 2


@dataclass(eq=False)
class Running:
    strategy: Strategy
    task: asyncio.Task[None]
    level: int


@dataclass(eq=False)
class FaultState:
    level: int = 0
    since: float = 0.0  # wall clock: when the level or the strategy last changed
    running: Running | None = None
    failed: str = ""  # the strategy that ran last, when it failed (prev_strategy_failed)
    history: collections.deque[str] = field(default_factory=lambda: collections.deque(maxlen=HISTORY))


def dead_engines(inst: Instance) -> list[int]:
    """Endpoint ids whose engine died: ABNORMAL and no process (pid 0)."""
    return [ep.id for ep in inst.endpoints if ep.status == enums.EP_ABNORMAL and not ep.pid]


class FaultManager:
    def __init__(
        self,
        cfg: ControllerConfig,
        table: InstanceTable,
        clients: NodeManagerClients,
        enqueue: Callable[[int], None],
    ) -> None:
        self.cfg = cfg
        self.table = table
        self.clients = clients
        self.enqueue = enqueue
        self.relaunch = cfg.enable_engine_relaunch
        self._states: dict[int, FaultState] = {}

    # --- deciding --------------------------------------------------------------------------

    def reconcile(self, inst: Instance) -> None:
        state = self._states.setdefault(inst.id, FaultState(since=time.time()))
        dead = dead_engines(inst)
        level = L2 if dead else 0
        if state.running is not None:
            level = max(level, state.running.level)
        if level != state.level:
            state.level, state.since = level, time.time()
        want = self._wanted(inst, state, dead)
        if want is None:
            return
        running = state.running
        if running is not None and want.rank <= running.strategy.rank:
            return  # equal keeps the running one; lower is ignored
        if running is not None:
            log.event("strategy_preempted", instance_id=inst.id, strategy=running.strategy.name, by=want.name)
            self._stop(running)
        self._start(inst, state, want, level)

    def _wanted(self, inst: Instance, state: FaultState, dead: list[int]) -> Strategy | None:
        if state.failed == EngineRelaunch.name:
            return Terminate(inst, self.clients, self.table, f"engine relaunch failed for instance {inst.id}")
        if dead and self.relaunch:
            return EngineRelaunch(inst, self.clients, self.cfg)
        return None

    # --- running ---------------------------------------------------------------------------

    def _start(self, inst: Instance, state: FaultState, strategy: Strategy, level: int) -> None:
        state.failed = ""
        state.since = time.time()
        task = tasks.start(f"strategy-{strategy.name}-{inst.id}", self._run(inst, state, strategy))
        state.running = Running(strategy, task, level)

    async def _run(self, inst: Instance, state: FaultState, strategy: Strategy) -> None:
        started = time.monotonic()
        log.event("strategy_started", instance_id=inst.id, strategy=strategy.name)
        outcome = "succeeded"
        try:
            await strategy.run()
            log.event("strategy_succeeded", instance_id=inst.id, strategy=strategy.name)
        except StrategyFailed as exc:
            outcome = f"failed: {exc}"
            log.error("strategy_failed", instance_id=inst.id, strategy=strategy.name, reason=str(exc))
        except asyncio.CancelledError:
            outcome = "stopped"
            raise
        except Exception as exc:
            outcome = f"failed: {type(exc).__name__}: {exc}"
            log.exception("strategy_failed", instance_id=inst.id, strategy=strategy.name)
        finally:
            elapsed = time.monotonic() - started
            stamp = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
            state.history.append(f"{stamp} {strategy.name} {outcome} after {elapsed:.1f}s")
            if state.running is not None and state.running.strategy is strategy:
                state.running = None
                state.since = time.time()
                if outcome.startswith("failed"):
                    state.failed = strategy.name
                if inst.status != enums.DELETED:
                    self.enqueue(inst.id)  # look again: escalate, or clear the level

    def _stop(self, running: Running) -> None:
        running.task.cancel()
        running.strategy.stopped()

    # --- observers and status --------------------------------------------------------------

    def on_transition(
        self, inst: Instance, old: enums.InstanceStatus, new: enums.InstanceStatus, reason: str
    ) -> None:
        if new != enums.DELETED:
            return
        state = self._states.pop(inst.id, None)
        if state is not None and state.running is not None:
            # Terminate deletes its own instance; it must finish, not be cancelled by that.
            if state.running.task is not asyncio.current_task():
                self._stop(state.running)

    def status(self, instance_ids: list[int]) -> list[pb.FaultToleranceEntry]:
        out = []
        for iid in instance_ids:
            state = self._states.get(iid) or FaultState()
            since = timestamp_pb2.Timestamp()
            if state.since:
                since.FromNanoseconds(int(state.since * 1e9))
            running = state.running
            out.append(
                pb.FaultToleranceEntry(
                    instance_id=iid,
                    fault_level=state.level,
                    strategy=running.strategy.name if running else "",
                    phase=running.strategy.phase if running else "",
                    history=list(state.history),
                    since=since if state.since else None,
                )
            )
        return out

    async def close(self) -> None:
        running = [s.running.task for s in self._states.values() if s.running is not None]
        for task in running:
            task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.gather(*running, return_exceptions=True)
