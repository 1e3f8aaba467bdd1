"""The fault manager: each instance's fault level and the one recovery strategy it runs.

Level-triggered: :meth:`FaultManager.reconcile` (called by the instance reconcile, so after every
beat or engine event that changed something, and on every resync) looks at what the heartbeats
show now and decides which strategy the instance wants:

- the instance's level is the highest of its NodeManagers' reported faults (ReportFaults, L1-L6)
  and L2 for an engine that died (its endpoint ABNORMAL with no process);
- above L2 the instance is separated (INACTIVE, not routed) until the faults are cleared, and a
  running relaunch is stopped;
- L2 (a dead engine, or a restart request) → ``EngineRelaunch`` when ``enable_engine_relaunch``
  (off: nothing; the NodeManager's pod-restart fallback acts); a relaunch that succeeds has
  honoured the restart requests of its NodeManagers, which are cleared;
- the strategy that ran last failed → escalate: a failed ``EngineRelaunch`` → ``Terminate``.

At most one strategy runs per instance: a higher-ranked one stops the running one and starts;
an equal or lower one leaves it. A strategy that crashes (an exception other than
``StrategyFailed``: a bug) is logged with its traceback and run again after a backoff, up to
``STRATEGY_RESTARTS`` times; crashing once more counts as failed (and escalates). A finished
strategy is recorded in the instance's bounded history (with its outcome and duration) and its
instance is reconciled again. Reported faults and the history are stored first (they survive a
restart), then applied. A deleted instance's strategy is stopped and its record dropped.
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

from motor_mesh.common import enums, log, tasks
from motor_mesh.common.config import ControllerConfig
from motor_mesh.common.retry import Backoff
from motor_mesh.controller.faults.strategies import EngineRelaunch, Strategy, StrategyFailed, Terminate
from motor_mesh.controller.instances import InstanceTable
from motor_mesh.controller.model import Instance
from motor_mesh.controller.nodes.client import NodeManagerClients
from motor_mesh.controller.store.db import StateWriteError
from motor_mesh.controller.store.interface import StateStore
from motor_mesh.gen.motor.v1 import controller_pb2 as pb

HISTORY = 20  # finished strategies kept per instance
STRATEGY_RESTARTS = 3  # after a crash; one more crash and the strategy has failed
# Long enough for a crash caused by something passing (a peer mid-restart) to have passed.
RESTART_BACKOFF = (1.0, 5.0)
L1, L2 = pb.FAULT_LEVEL_L1, pb.FAULT_LEVEL_L2


@dataclass(frozen=True)
class ReportedFault:
    level: int
    reason: str


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
        store: StateStore,
    ) -> None:
        self.cfg = cfg
        self.table = table
        self.clients = clients
        self.enqueue = enqueue
        self.store = store
        self.relaunch = cfg.enable_engine_relaunch
        self._states: dict[int, FaultState] = {}
        # Reported faults by NodeManager address, then by code: they outlive the instance (a
        # rebuilt instance on a bad device is separated again) until cleared, and a restart.
        self._nodes: dict[str, dict[str, ReportedFault]] = {
            address: {code: ReportedFault(level, reason) for code, (level, reason) in faults.items()}
            for address, faults in store.load_node_faults().items()
        }
        # Strategy history from before a restart, until each instance's state is made.
        self._history = store.load_fault_history()
        # Strategies finished since the start, by (name, succeeded | failed | stopped): /metrics.
        self.finished: collections.Counter[tuple[str, str]] = collections.Counter()

    # --- reported faults -------------------------------------------------------------------

    async def report(self, faults: list[pb.NodeFault]) -> None:
        """Record or clear faults (already checked by the caller): stored first, in one
        transaction, then applied."""
        changed: dict[str, dict[str, ReportedFault]] = {}
        for f in faults:
            address = f"{f.host}:{f.nm_port}"
            node = changed.setdefault(address, dict(self._nodes.get(address, {})))
            if not f.cleared:
                node[f.code] = ReportedFault(f.level, f.reason)
            elif f.code:
                node.pop(f.code, None)
            else:
                node.clear()
        await self._replace(changed)
        for f in faults:
            log.event(
                "fault_cleared" if f.cleared else "fault_reported",
                node_manager=f"{f.host}:{f.nm_port}",
                level=pb.FaultLevel.Name(f.level),
                code=f.code,
                reason=f.reason,
            )

    async def _replace(self, changed: dict[str, dict[str, ReportedFault]]) -> None:
        await self.store.save_node_faults(
            {a: {c: (r.level, r.reason) for c, r in node.items()} for a, node in changed.items()}
        )
        for address, node in changed.items():
            if node:
                self._nodes[address] = node
            else:
                self._nodes.pop(address, None)

    def has_faults(self, address: str) -> bool:
        return address in self._nodes

    def node_level(self, address: str) -> int:
        return max((f.level for f in self._nodes.get(address, {}).values()), default=0)

    async def _clear_restart_requests(self, inst: Instance) -> None:
        changed = {
            address: {c: f for c, f in self._nodes[address].items() if f.level != L2}
            for address in inst.node_managers
            if any(f.level == L2 for f in self._nodes.get(address, {}).values())
        }
        if changed:
            try:
                await self._replace(changed)
            except StateWriteError:
                # Still recorded, so the next reconcile may relaunch once more: with the disk
                # failing, that is the safe side of forgetting a fault.
                log.warn("restart_requests_kept", instance_id=inst.id)

    # --- deciding --------------------------------------------------------------------------

    def reconcile(self, inst: Instance) -> bool:
        """Act on the instance's faults; True when its separation changed (the caller runs the
        state machine again)."""
        state = self._state(inst.id)
        reported = max((self.node_level(a) for a in inst.node_managers), default=0)
        level = max(reported, L2 if dead_engines(inst) else 0)
        if state.running is not None:
            level = max(level, state.running.level)
        if level != state.level:
            state.level, state.since = level, time.time()
        separated = level > L2
        changed = separated != inst.separated
        if changed:
            inst.separated = separated
            log.event(
                "instance_separated" if separated else "instance_reunited", instance_id=inst.id, level=level
            )
        running = state.running
        if running is not None:
            running.strategy.poke()  # something changed: let it look now
        if separated and running is not None and running.strategy.rank < level:
            self._preempt(inst, state, f"L{level} fault")
            running = None
        want = self._wanted(inst, state, level)
        if want is None or (running is not None and want.rank <= running.strategy.rank):
            return changed  # nothing wanted, or equal keeps the running one and lower is ignored
        self._preempt(inst, state, want.name)
        self._start(inst, state, want, level)
        return changed

    def _state(self, instance_id: int) -> FaultState:
        state = self._states.get(instance_id)
        if state is None:
            state = self._states[instance_id] = FaultState(since=time.time())
            state.history.extend(self._history.pop(instance_id, []))
        return state

    def _wanted(self, inst: Instance, state: FaultState, level: int) -> Strategy | None:
        if state.failed == EngineRelaunch.name:
            return Terminate(inst, self.clients, self.table, f"engine relaunch failed for instance {inst.id}")
        if level == L2 and self.relaunch:
            return EngineRelaunch(inst, self.clients, self.cfg)
        return None

    def _preempt(self, inst: Instance, state: FaultState, by: str) -> None:
        running = state.running
        if running is None:
            return
        log.event("strategy_preempted", instance_id=inst.id, strategy=running.strategy.name, by=by)
        state.running = None
        self._stop(running)

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
            # A transient bug must not escalate a relaunch to Terminate; one that keeps crashing
            # counts as failed instead of looping.
            await tasks.supervise(
                f"strategy-{strategy.name}-{inst.id}",
                strategy.run,
                Backoff(*RESTART_BACKOFF),
                restarts=STRATEGY_RESTARTS,
                expected=(StrategyFailed,),
            )
            log.event("strategy_succeeded", instance_id=inst.id, strategy=strategy.name)
            if strategy.name == EngineRelaunch.name:
                await self._clear_restart_requests(inst)
        except (StrategyFailed, tasks.GaveUp) as exc:
            outcome = f"failed: {exc}"
            log.error("strategy_failed", instance_id=inst.id, strategy=strategy.name, reason=str(exc))
        except asyncio.CancelledError:
            outcome = "stopped"
            raise
        finally:
            self.finished[strategy.name, outcome.split(":", 1)[0]] += 1
            elapsed = time.monotonic() - started
            stamp = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
            entry = f"{stamp} {strategy.name} {outcome} after {elapsed:.1f}s"
            # Its own task: this may be a cancelled task's last act, which must not wait on disk.
            tasks.start(f"fault-history-{inst.id}", self._record(inst, state, entry))
            if state.running is not None and state.running.strategy is strategy:
                state.running = None
                state.since = time.time()
                if outcome.startswith("failed"):
                    state.failed = strategy.name
                if inst.status != enums.DELETED:
                    self.enqueue(inst.id)  # look again: escalate, or clear the level

    async def _record(self, inst: Instance, state: FaultState, entry: str) -> None:
        """Stored, then kept in memory; an instance deleted meanwhile keeps no history. A failed
        write loses the entry (the store logged why): history is an operator's aid, not state."""
        if inst.id not in self._states:
            return
        try:
            await self.store.add_fault_history(inst.id, entry, HISTORY)
        except StateWriteError:
            return
        if inst.id in self._states:
            state.history.append(entry)

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
        self._history.pop(inst.id, None)  # on disk it went with the DELETED write
        if state is not None and state.running is not None:
            # Terminate deletes its own instance; it must finish, not be cancelled by that.
            if state.running.task is not asyncio.current_task():
                self._stop(state.running)

    def running(self) -> collections.Counter[str]:
        """How many of each strategy are running now."""
        return collections.Counter(s.running.strategy.name for s in self._states.values() if s.running)

    def status(self, instance_ids: list[int]) -> list[pb.FaultToleranceEntry]:
        out = []
        for iid in instance_ids:
            state = self._states.get(iid) or FaultState(history=collections.deque(self._history.get(iid, [])))
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
