"""The fault manager: each instance's fault level and the one recovery strategy it runs.

Level-triggered: :meth:`FaultManager.step` (called by the instance reconcile, so after every
beat or engine event that changed something, on every resync and when the strategy asked to be
looked at again) looks at what the heartbeats show now and at the strategy record stored with
the instance (model.StrategyRecord), and does one step:

- the instance's level is the highest of its NodeManagers' reported faults (ReportFaults, L1-L6)
  and L2 for an engine that died (its endpoint ABNORMAL with no process);
- above L2 the instance is separated (INACTIVE, not routed) until the faults are cleared, and a
  running relaunch is stopped (its unaccepted NodeManagers get ABORT);
- L2 (a dead engine, or a restart request) → ``EngineRelaunch`` when ``enable_engine_relaunch``
  (off: nothing; the NodeManager's pod-restart fallback acts); a relaunch that succeeds has
  honoured the restart requests of its NodeManagers, which are cleared;
- the strategy that ran last failed (``failed`` in the record: prev_strategy_failed) →
  escalate: a failed ``EngineRelaunch`` → ``Terminate``.

At most one strategy runs per instance: a higher-ranked one stops the running one and starts;
an equal or lower one leaves it. Every step's record is stored before it takes effect, and the
next step reads only the stored record, so a Controller restart or a new leader continues (or
escalates) exactly where the last one stopped, and a relaunch that had failed is escalated, not
retried as new. A step that raises something unexpected (a bug) is logged with its traceback
and tried again after a backoff, up to ``STRATEGY_RESTARTS`` times; once more and the strategy
has failed (and escalates). A finished strategy is recorded in the instance's bounded history
(with its outcome and duration). Reported faults are stored first (they survive a restart),
then applied.
"""

from __future__ import annotations

import collections
import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime

from google.protobuf import timestamp_pb2

from motor_mesh.common import enums, log
from motor_mesh.common.config import ControllerConfig
from motor_mesh.controller.faults.strategies import EngineRelaunch, Step, StrategyFailed, Terminate
from motor_mesh.controller.instances import InstanceTable
from motor_mesh.controller.model import Instance, StrategyRecord
from motor_mesh.controller.nodes.client import NodeManagerClients
from motor_mesh.controller.store.db import StateWriteError
from motor_mesh.controller.store.interface import StateStore
from motor_mesh.gen.motor.v1 import controller_pb2 as pb

HISTORY = 20  # finished strategies kept per instance
STRATEGY_RESTARTS = 3  # steps that crashed; one more crash and the strategy has failed
# Long enough for a crash caused by something passing (a peer mid-restart) to have passed.
RESTART_BACKOFF = (1.0, 5.0)
L1, L2 = pb.FAULT_LEVEL_L1, pb.FAULT_LEVEL_L2
NONE = StrategyRecord()


@dataclass(frozen=True)
class ReportedFault:
    level: int
    reason: str


@dataclass(eq=False)
class FaultState:
    """What is kept in memory only: derived from the stored state at every step."""

    level: int = 0
    since: float = 0.0  # wall clock: when the level or the strategy last changed
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
        store: StateStore,
        *,
        settings: Callable[[], ControllerConfig] | None = None,
    ) -> None:
        self.table = table
        self.store = store
        self.relaunch = cfg.enable_engine_relaunch
        relaunch = EngineRelaunch(clients, cfg, settings)
        self.strategies = {s.name: s for s in (relaunch, Terminate(table))}
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

    def separate(self, inst: Instance) -> bool:
        """Set the instance's level and separation from what is observed now; True when its
        separation changed (the caller runs the state machine again)."""
        state = self._state(inst.id)
        level = self._level(inst)
        if level != state.level:
            state.level, state.since = level, time.time()
        separated = level > L2
        changed = separated != inst.separated
        if changed:
            inst.separated = separated
            log.event(
                "instance_separated" if separated else "instance_reunited", instance_id=inst.id, level=level
            )
        return changed

    def _level(self, inst: Instance) -> int:
        reported = max((self.node_level(a) for a in inst.node_managers), default=0)
        level = max(reported, L2 if dead_engines(inst) else 0)
        return max(level, inst.strategy.level) if inst.strategy.name else level

    async def step(self, inst: Instance) -> float | None:
        """One step of the instance's recovery; seconds until it wants the next one (0: at
        once), None when nothing runs."""
        level = self._level(inst)
        rec = inst.strategy
        running = self.strategies.get(rec.name)
        if running is not None and level > L2 and running.rank < level:
            await self._finish(inst, "stopped", f"L{level} fault", abort=True)
            rec, running = inst.strategy, None
        want = self._wanted(rec, level)
        if want is not None and (running is None or want.rank > running.rank):
            if running is not None:
                await self._finish(inst, "stopped", want.name, abort=True)
            fresh = StrategyRecord(
                name=want.name,
                phase=want.first_phase,
                level=level,
                started=time.time(),
                failed_accepted=inst.strategy.failed_accepted if want.name == Terminate.name else (),
            )
            await self.table.update(inst, strategy=fresh)
            self._state(inst.id).since = time.time()
            log.event("strategy_started", instance_id=inst.id, strategy=want.name)
            rec, running = fresh, want
        if running is None:
            return None
        return await self._advance(inst, running, rec)

    def _wanted(self, rec: StrategyRecord, level: int) -> EngineRelaunch | Terminate | None:
        if rec.failed == EngineRelaunch.name:
            return self.strategies[Terminate.name]
        if level == L2 and self.relaunch and not rec.name:
            return self.strategies[EngineRelaunch.name]
        return None

    async def _advance(
        self, inst: Instance, strategy: EngineRelaunch | Terminate, rec: StrategyRecord
    ) -> float | None:
        if isinstance(strategy, EngineRelaunch):
            ahead = strategy.before_restart(inst, rec)
            if ahead is not None:
                await self.table.update(inst, strategy=ahead)
                rec = ahead
        try:
            step: Step = await strategy.advance(inst, rec)
        except StrategyFailed as exc:
            log.error("strategy_failed", instance_id=inst.id, strategy=rec.name, reason=str(exc))
            await self._finish(inst, f"failed: {exc}", "", abort=True, record=exc.record or rec)
            return 0
        except StateWriteError:
            raise
        except Exception as exc:  # a bug: tried again, then counted as a failure
            crashes = rec.crashes + 1
            log.exception("strategy_crashed", instance_id=inst.id, strategy=rec.name, crashes=crashes)
            if crashes > STRATEGY_RESTARTS:
                why = f"failed {crashes} times, last: {type(exc).__name__}: {exc}"
                log.error("strategy_failed", instance_id=inst.id, strategy=rec.name, reason=why)
                await self._finish(inst, f"failed: {why}", "", abort=True, record=rec)
                return 0
            await self.table.update(inst, strategy=dataclasses.replace(rec, crashes=crashes))
            return min(RESTART_BACKOFF[0] * 2 ** (crashes - 1), RESTART_BACKOFF[1])
        if step.succeeded:
            log.event("strategy_succeeded", instance_id=inst.id, strategy=rec.name)
            if rec.name == EngineRelaunch.name:
                await self._clear_restart_requests(inst)
            await self._finish(inst, "succeeded", "", record=step.record)
            return 0
        if step.record != rec:
            await self.table.update(inst, strategy=step.record)
        return step.after

    async def _finish(
        self,
        inst: Instance,
        outcome: str,
        by: str,
        *,
        abort: bool = False,
        record: StrategyRecord | None = None,
    ) -> None:
        """The running strategy ends: ABORT where needed, the record cleared (keeping ``failed``
        for the escalation), history and counters."""
        rec = record or inst.strategy
        strategy = self.strategies[rec.name]
        if abort:
            await strategy.abort(inst, rec)
        if by:
            log.event("strategy_preempted", instance_id=inst.id, strategy=rec.name, by=by)
        failed = outcome.startswith("failed")
        after = NONE
        if failed:
            after = StrategyRecord(failed=rec.name, failed_accepted=rec.accepted)
        await self.table.update(inst, strategy=after)
        state = self._state(inst.id)
        state.since = time.time()
        self.finished[rec.name, outcome.split(":", 1)[0]] += 1
        elapsed = time.time() - rec.started if rec.started else 0.0
        stamp = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        await self._record(inst, state, f"{stamp} {rec.name} {outcome} after {elapsed:.1f}s")

    async def note(self, inst: Instance, entry: str) -> None:
        """One more entry in the instance's history (a role switch, planner/switches.py)."""
        await self._record(inst, self._state(inst.id), entry)

    def _state(self, instance_id: int) -> FaultState:
        state = self._states.get(instance_id)
        if state is None:
            state = self._states[instance_id] = FaultState(since=time.time())
            state.history.extend(self._history.pop(instance_id, []))
        return state

    async def _record(self, inst: Instance, state: FaultState, entry: str) -> None:
        """Stored, then kept in memory. A failed write loses the entry (the store logged why):
        history is an operator's aid, not state."""
        try:
            await self.store.add_fault_history(inst.id, entry, HISTORY)
        except StateWriteError:
            return
        state.history.append(entry)

    # --- observers and status --------------------------------------------------------------

    def on_transition(
        self, inst: Instance, old: enums.InstanceStatus, new: enums.InstanceStatus, reason: str
    ) -> None:
        if new == enums.DELETED:
            self._states.pop(inst.id, None)
            self._history.pop(inst.id, None)  # on disk it went with the DELETED write

    def running(self) -> collections.Counter[str]:
        """How many of each strategy are running now."""
        return collections.Counter(i.strategy.name for i in self.table.live.values() if i.strategy.name)

    def status(self, instances: list[Instance]) -> list[pb.FaultToleranceEntry]:
        out = []
        for inst in instances:
            state = self._states.get(inst.id) or FaultState(
                history=collections.deque(self._history.get(inst.id, []))
            )
            since = timestamp_pb2.Timestamp()
            if state.since:
                since.FromNanoseconds(int(state.since * 1e9))
            rec = inst.strategy
            out.append(
                pb.FaultToleranceEntry(
                    instance_id=inst.id,
                    fault_level=max(state.level, self._level(inst)),
                    strategy=rec.name,
                    phase=rec.phase,
                    history=list(state.history),
                    since=since if state.since else None,
                    prev_strategy_failed=rec.failed,
                )
            )
        return out
