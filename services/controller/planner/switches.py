"""Carrying out a role switch (prefill <-> decode) of one instance, one stored step at a time.

Whoever decides a switch (the planner) calls :meth:`RoleSwitches.begin`, which stores the wish
with the instance (model.RoleSwitch) and enqueues it; the instance reconcile then calls
:meth:`RoleSwitches.advance` until it is over. Every step's outcome is written before the next
one starts, so a Controller that dies halfway is followed by one that goes on from there:

1. ``drain``: every Coordinator drains the instance (DrainInstances: no new request goes to it;
   the ones on it finish there or, after the Coordinator's grace, continue on another instance
   of the role), until each reports none left or the drain's bound passes (as a teardown's
   drain, reconcile/teardown.py). A drain is cancelled when the instance stops being ACTIVE
   meanwhile (an engine died, a fault separated it): nothing was changed yet;
2. ``switch``: the instance is out of routing (INACTIVE, reason ``role_switch``); the
   NodeManagers about to be called are stored (``dispatched``), then every one gets
   ``SwitchRole`` at once (a multi-node instance's ranks switch together). A NodeManager that
   serves the role already answers without relaunching, so a call repeated by a new leader
   relaunches nothing twice. A refusal, or a NodeManager unreachable past
   ``engine_relaunch_dispatch_retries``, rolls the switch back: the ones that took it get
   ``SwitchRole`` to the old role. A rollback that fails too dooms the instance
   (``role_switch_failed``: its NodeManagers restart and register with their configured role);
3. ``wait_ready``: ``GetStatus`` until every NodeManager serves the new role and is ready (or an
   engine died again, or ``engine_relaunch_complete_timeout_s`` passed: the fault manager takes
   it from there). Then the role is written with the instance (its id stays), the record is
   cleared and ``switched_at`` set (the planner's cooldown), and the instance becomes ACTIVE
   again under its new role: every Coordinator gets it as a new instance of that role.

Each finished switch is one entry in the instance's history (GetFaultToleranceStatus).
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Awaitable, Callable

import grpc

from motor_mesh.common import enums, errors, log
from motor_mesh.common.config import ControllerConfig
from motor_mesh.common.enums import ACTIVE, ROLE_NAMES
from motor_mesh.controller.faults.strategies import RESTART_POLICY, observe_status
from motor_mesh.controller.instances import InstanceTable
from motor_mesh.controller.model import Instance, Removal, RoleSwitch
from motor_mesh.controller.nodes.client import NodeManagerClients
from motor_mesh.controller.reconcile.teardown import (
    DRAIN_MARGIN_S,
    DRAIN_POLL_S,
    DRAIN_UNANSWERED_S,
    Drainer,
)

RETRY_S = 0.5
# Outcomes counted for /metrics (motor_controller_role_switches_total{outcome}).
OUTCOMES = ("succeeded", "rolled_back", "cancelled", "failed")


def role_name(role: int) -> str:
    return ROLE_NAMES.get(role, str(role))  # type: ignore[call-overload]


class RoleSwitches:
    def __init__(
        self,
        table: InstanceTable,
        clients: NodeManagerClients,
        settings: Callable[[], ControllerConfig],
        history: Callable[[Instance, str], Awaitable[None]],
        wall: Callable[[], float] = time.time,
    ) -> None:
        self.table = table
        self.clients = clients
        self._cfg = settings
        self._history = history  # the instance's history (the fault manager keeps it)
        self.wall = wall
        self.drainer: Drainer | None = None  # set by the app: the Coordinators
        self.finished: dict[str, int] = dict.fromkeys(OUTCOMES, 0)
        # Called when a switch ends (the planner goes on with its decision).
        self.on_finished: Callable[[Instance, str], None] = lambda inst, outcome: None

    def running(self) -> list[Instance]:
        return [i for i in self.table.live.values() if i.switch is not None and i.teardown is None]

    async def begin(self, inst: Instance, to_role: int, reason: str) -> None:
        """Store the wish; the instance reconcile carries it out."""
        rec = RoleSwitch(from_role=inst.spec.role, to_role=to_role, reason=reason, started=self.wall())
        await self.table.update(inst, switch=rec)
        log.event(
            "role_switch_started",
            instance_id=inst.id,
            job=inst.job_name,
            from_role=role_name(rec.from_role),
            to_role=role_name(to_role),
            reason=reason,
        )
        self.table.enqueue(inst.id)

    async def advance(self, inst: Instance) -> float | None:
        """One step; seconds until the next look (0: at once), None when it is over."""
        rec = inst.switch
        assert rec is not None
        if rec.phase == "drain":
            return await self._drain(inst, rec)
        if rec.phase == "switch":
            return await self._switch(inst, rec)
        if rec.phase == "wait_ready":
            return await self._wait_ready(inst, rec)
        raise AssertionError(f"a role switch has no phase {rec.phase!r}")

    # ---- drain ----------------------------------------------------------------------------------

    async def _drain(self, inst: Instance, rec: RoleSwitch) -> float | None:
        if inst.status != ACTIVE or inst.separated or inst.strategy.name:
            # It left routing on its own (an engine died, a fault): nothing was changed yet.
            why = "separated" if inst.separated else inst.strategy.name or enums.status_name(inst.status)
            await self._finish(
                inst, rec, "cancelled", f"instance no longer ACTIVE ({why})", role=rec.from_role
            )
            return None
        reports = dict(await self.drainer.drain(inst.id)) if self.drainer is not None else {}
        now = self.wall()
        until = rec.drain_until
        moves = [r.move_at for r in reports.values() if r.move_at]
        if not until and moves:
            until = max(moves) + DRAIN_MARGIN_S  # set once: later answers do not push it back
        bound = until or rec.started + DRAIN_UNANSWERED_S
        drained = all(r.drained for r in reports.values())
        if not drained and now < bound:
            if until != rec.drain_until:
                await self.table.update(inst, switch=dataclasses.replace(rec, drain_until=until))
            return min(DRAIN_POLL_S, max(0.0, bound - now))
        log.event(
            "role_switch_drained",
            instance_id=inst.id,
            seconds=round(max(0.0, now - rec.started), 3),
            in_flight=sum(r.in_flight for r in reports.values()),
            timed_out=not drained,
        )
        await self.table.update(inst, switch=dataclasses.replace(rec, phase="switch", drain_until=until))
        return 0

    # ---- switch ---------------------------------------------------------------------------------

    async def _switch(self, inst: Instance, rec: RoleSwitch) -> float | None:
        todo = [a for a in inst.node_managers if a not in rec.accepted]
        new = tuple(a for a in todo if a not in rec.dispatched)
        if new:  # stored before anything is sent: a new leader knows they may have it
            rec = dataclasses.replace(rec, dispatched=rec.dispatched + new)
            await self.table.update(inst, switch=rec)
        results = await asyncio.gather(
            *(self.clients.switch_role(a, inst.id, rec.to_role) for a in todo), return_exceptions=True
        )
        accepted = list(rec.accepted)
        attempts = dict(rec.attempts)
        refused: dict[str, str] = {}  # said no: it did not switch
        gave_up: dict[str, str] = {}  # failed past the retries: it may have
        for a, result in zip(todo, results, strict=True):
            if not isinstance(result, BaseException):
                accepted.append(a)
                continue
            if not isinstance(result, grpc.RpcError):
                raise result
            failure = errors.RpcFailure.of(result)
            why = f"{a} ({failure.code.name}: {failure.message})"
            if not RESTART_POLICY.retryable(failure.code):  # the same answers as RestartEngines'
                refused[a] = why
                continue
            attempts[a] = attempts.get(a, 0) + 1
            log.warn("role_switch_call_failed", instance_id=inst.id, node_manager=a, reason=why)
            if attempts[a] > self._cfg().engine_relaunch_dispatch_retries:
                gave_up[a] = why
        rec = dataclasses.replace(rec, accepted=tuple(accepted), attempts=attempts)
        if refused or gave_up:
            why = "SwitchRole failed on " + ", ".join([*refused.values(), *gave_up.values()])
            return await self._roll_back(inst, rec, why, tuple(refused))
        if len(accepted) < len(inst.node_managers):
            await self.table.update(inst, switch=rec)
            return RETRY_S
        deadline = self.wall() + self._cfg().engine_relaunch_complete_timeout_s
        await self.table.update(inst, switch=dataclasses.replace(rec, phase="wait_ready", deadline=deadline))
        return 0

    async def _roll_back(
        self, inst: Instance, rec: RoleSwitch, why: str, untouched: tuple[str, ...]
    ) -> float | None:
        """Every NodeManager that may have switched goes back (``untouched`` refused outright:
        they serve the old role still)."""
        log.error("role_switch_refused", instance_id=inst.id, reason=why, rolled_back=bool(rec.rolled_back))
        if rec.rolled_back:
            # Not even the way back works: its NodeManagers restart and register anew.
            await self._finish(inst, rec, "failed", why, role=rec.from_role)
            await self.table.doom(inst, Removal.ROLE_SWITCH_FAILED, why, stop=inst.node_managers)
            return None
        # Swapped: from the role asked for back to the one it had (the history names both).
        back = dataclasses.replace(
            rec,
            from_role=rec.to_role,
            to_role=rec.from_role,
            phase="switch",
            dispatched=(),
            accepted=untouched,
            attempts={},
            rolled_back=why,
        )
        await self.table.update(inst, switch=back)
        return 0

    # ---- wait_ready -----------------------------------------------------------------------------

    async def _wait_ready(self, inst: Instance, rec: RoleSwitch) -> float | None:
        addresses = inst.node_managers
        answers = await asyncio.gather(
            *(self.clients.get_status(a) for a in addresses), return_exceptions=True
        )
        ready = True
        died = False
        for answer in answers:
            if isinstance(answer, BaseException):
                ready = False
                continue
            ready = ready and answer.ready and answer.role == rec.to_role
            died = died or any(e.status == enums.EP_ABNORMAL and not e.pid for e in answer.endpoints)
        if ready or died or self.wall() >= rec.deadline:
            for a, answer in zip(addresses, answers, strict=True):
                if not isinstance(answer, BaseException):
                    observe_status(inst, a, answer)  # newer than the beats: evaluated next
            if rec.rolled_back:
                outcome, detail = "rolled_back", rec.rolled_back
            elif ready:
                outcome, detail = "succeeded", ""
            else:
                outcome = "succeeded"
                detail = "an engine died after the switch" if died else "engines not ready by the deadline"
            await self._finish(inst, rec, outcome, detail, role=rec.to_role)
            return 0
        return min(self._cfg().engine_relaunch_poll_interval_s, max(0.0, rec.deadline - self.wall()))

    # ---- the end --------------------------------------------------------------------------------

    async def _finish(self, inst: Instance, rec: RoleSwitch, outcome: str, detail: str, *, role: int) -> None:
        """The role as it is now, written with the end of the switch; then history and log."""
        spec = dataclasses.replace(inst.spec, role=role)
        # A cancelled switch changed nothing: no cooldown.
        switched_at = inst.switched_at if outcome == "cancelled" else self.wall()
        await self.table.update(inst, spec=spec, switch=None, switched_at=switched_at)
        self.finished[outcome] += 1
        took = max(0.0, self.wall() - rec.started)
        original = role_name(rec.from_role if not rec.rolled_back else rec.to_role)
        wanted = role_name(rec.to_role if not rec.rolled_back else rec.from_role)
        stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        entry = f"{stamp} RoleSwitch {original}->{wanted} {outcome} after {took:.1f}s"
        await self._history(inst, entry + (f": {detail}" if detail else ""))
        log.event(
            "role_switch_finished",
            instance_id=inst.id,
            job=inst.job_name,
            outcome=outcome,
            role=role_name(role),
            seconds=round(took, 3),
            detail=detail,
            reason=rec.reason,
        )
        self.on_finished(inst, outcome)
