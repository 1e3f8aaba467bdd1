"""Carrying out a doomed instance's teardown (instances.py ``doom``), one stored step at a time.

0. **Drain** it, for a planned removal (``Teardown.drain``: TerminateInstance): every
   Coordinator is asked to ``DrainInstances`` (no new request goes to it; the ones on it finish
   there or, after the Coordinator's grace, continue on another instance), once per pass, until
   each reports nothing in flight on it (one answering NOT_FOUND or UNIMPLEMENTED has nothing to
   drain) or the deadline passes: the latest move time the Coordinators first answered plus
   ``DRAIN_MARGIN_S``, or, while none has answered, ``DRAIN_UNANSWERED_S`` after the drain began.
   Fault-driven removals skip this: their engines are broken already, and a Coordinator
   continues their requests elsewhere the moment the instance leaves its table.
1. **Delete** it (out of routing: every Coordinator drops it), once the instance it must follow
   (``after``: a PD group goes decode first) is deleted and its NodeManagers were sent Stop, so
   no decode is left pulling KV from a prefill that is gone.
2. **Stop** the NodeManagers named (each stops its engines and exits, so its pod restarts and
   registers anew): one round, the unreachable ones are known at once by a probe; those it did
   not reach are told to register again on their next beat.
3. **Precision**: clear the group's precision alarms (same moi), then call every Coordinator's
   ``ClearPrecisionAlarm``, retried with the reconcile's backoff until each answered.

Every step's outcome is written before the next one starts, so a Controller that dies halfway
is followed by one that goes on from there (the reconcile also runs for a DELETED instance whose
teardown is not done).
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Callable, Mapping
from typing import Protocol

from motor_mesh.common import log
from motor_mesh.common.enums import DELETED
from motor_mesh.controller.alarms.store import AlarmStore, clear_of
from motor_mesh.controller.faults.recovery import CoordinatorClears, precision_alarms
from motor_mesh.controller.instances import InstanceTable
from motor_mesh.controller.model import DrainReport, Instance, Teardown
from motor_mesh.controller.nodes.client import NodeManagerClients
from motor_mesh.controller.reconcile.runner import Retry

# How soon the prefill of a PD group looks again whether its decode is gone.
AFTER_POLL_S = 0.2
# How often a draining instance's Coordinators are asked again.
DRAIN_POLL_S = 0.5
# After the Coordinators' move time the requests still on the instance continue elsewhere at
# their next token boundary: this long is left for that before it is deleted all the same.
DRAIN_MARGIN_S = 5.0
# The drain's bound while no Coordinator has answered with a move time (every one unreachable):
# the Coordinators' default grace (coordinator.drain_grace_s) plus the margin.
DRAIN_UNANSWERED_S = 30.0 + DRAIN_MARGIN_S


class Drainer(Protocol):
    """DrainInstances on every Coordinator (push/pusher.py ``CoordinatorSync``)."""

    async def drain(self, instance_id: int) -> Mapping[str, DrainReport]: ...


class Teardowns:
    def __init__(
        self,
        table: InstanceTable,
        clients: NodeManagerClients,
        alarms: AlarmStore,
        clears: CoordinatorClears,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self.table = table
        self.clients = clients
        self.alarms = alarms
        self.clears = clears
        # The Coordinators drains are asked of; set by the app (None: there are none).
        self.drainer: Drainer | None = None
        self.wall = wall  # drain deadlines are stored, so they are wall-clock times
        # (instance, Coordinator, code) of failed drain calls already logged: one line each.
        self._drain_failures: set[tuple[int, str, str]] = set()

    def pending(self) -> list[int]:
        """DELETED instances whose teardown is not done (after a restart): the reconcile's keys."""
        return [i for i, inst in self.table.deleted.items() if inst.teardown and not inst.teardown.done]

    async def advance(self, inst: Instance) -> float | None:
        """One pass; seconds until the next look, or None when done (or nothing to do)."""
        td = inst.teardown
        assert td is not None
        if inst.status != DELETED:
            if td.draining:
                wait = await self._drain(inst, td)
                if wait is not None:
                    return wait
                td = inst.teardown
                assert td is not None
            if td.after and not self._finished_stopping(td.after):
                return AFTER_POLL_S
            await self.table.remove(inst)
        if not td.stopped:
            unreached = await self._stop(inst, td)
            td = dataclasses.replace(td, unreached=tuple(unreached), stopped=True)
            await self.table.update(inst, teardown=td)
        if td.precision is not None and not td.precision_cleared:
            found = precision_alarms(self.alarms, td.precision)
            if found:
                await self.alarms.report([clear_of(a, f"cleared by recovery: {td.reason}") for a in found])
                log.event("precision_alarm_cleared", p=td.precision[0], d=td.precision[1], moi=found[-1].moi)
            moi = found[-1].moi if found else ""
            # Nothing was active: the Coordinators hold no state for the group to reset.
            td = dataclasses.replace(
                td, precision_cleared=True, precision_moi=moi, coordinators_told=not found
            )
            await self.table.update(inst, teardown=td)
        if td.precision is not None and not td.coordinators_told:
            missed = await self.clears.clear(td.precision)
            if missed:
                raise Retry(f"instance {inst.id}: ClearPrecisionAlarm not answered by {', '.join(missed)}")
            td = dataclasses.replace(td, coordinators_told=True)
            await self.table.update(inst, teardown=td)
        log.event(
            "instance_torn_down",
            instance_id=inst.id,
            reason=str(td.reason),
            stopped=",".join(a for a in td.stop if a not in td.unreached),
            unreached=",".join(td.unreached),
        )
        return None

    async def _drain(self, inst: Instance, td: Teardown) -> float | None:
        """One round of DrainInstances on every Coordinator; seconds until the next, or None
        once the drain is over (stored). The start, the deadline and which Coordinators
        reported drained are written before the next step, so a restarted Controller or a new
        leader goes on with the same deadline."""
        now = self.wall()
        if not td.drain_started:
            td = dataclasses.replace(td, drain_started=now)
            await self.table.update(inst, teardown=td)
            log.event("instance_drain_started", instance_id=inst.id, reason=str(td.reason), detail=td.detail)
        reports = dict(await self.drainer.drain(inst.id)) if self.drainer is not None else {}
        now = self.wall()
        drained = tuple(sorted(a for a, r in reports.items() if r.drained))
        until = td.drain_until
        moves = [r.move_at for r in reports.values() if r.move_at]
        if not until and moves:
            until = max(moves) + DRAIN_MARGIN_S  # set once: later answers do not push it back
        bound = until or td.drain_started + DRAIN_UNANSWERED_S
        self._log_failures(inst.id, reports)
        done = len(drained) == len(reports) or now >= bound
        if done or (drained, until) != (td.drained, td.drain_until):
            td = dataclasses.replace(td, drained=drained, drain_until=until, drain_done=done)
            await self.table.update(inst, teardown=td)
        if not done:
            return min(DRAIN_POLL_S, max(0.0, bound - now))
        self._drain_failures = {f for f in self._drain_failures if f[0] != inst.id}
        log.event(
            "instance_drained",
            instance_id=inst.id,
            seconds=round(max(0.0, now - td.drain_started), 3),
            drained=",".join(drained),
            undrained=",".join(sorted(a for a in reports if a not in drained)),
            in_flight=sum(r.in_flight for r in reports.values()),
            timed_out=len(drained) != len(reports),
        )
        return None

    def _log_failures(self, instance_id: int, reports: Mapping[str, DrainReport]) -> None:
        """One warning per Coordinator and kind of failure for the whole drain."""
        for address, r in reports.items():
            if r.drained or not r.code or (instance_id, address, r.code) in self._drain_failures:
                continue
            self._drain_failures.add((instance_id, address, r.code))
            log.warn("instance_drain_call_failed", instance_id=instance_id, coordinator=address, code=r.code)

    def _finished_stopping(self, instance_id: int) -> bool:
        """The instance is deleted and its Stop round is over (or it is gone without one)."""
        if instance_id in self.table.live:
            return False
        gone = self.table.deleted.get(instance_id)
        return gone is None or gone.teardown is None or gone.teardown.stopped

    async def _stop(self, inst: Instance, td: Teardown) -> list[str]:
        """Stop to every NodeManager named; the ones it did not reach."""
        addresses = list(td.stop)
        if not addresses:
            return []
        # A NodeManager that is gone is known at once (a probe does not wait for it), so an
        # operator's call answers in seconds rather than after Stop's own deadline.
        reachable = await asyncio.gather(*(self.clients.reachable(a) for a in addresses))
        targets = [a for a, ok in zip(addresses, reachable, strict=True) if ok]
        unreached = [a for a in addresses if a not in targets]
        why = f"{td.reason}: {td.detail}" if td.detail else str(td.reason)
        stops = await asyncio.gather(*(self.clients.stop(a, why) for a in targets), return_exceptions=True)
        unreached += [a for a, r in zip(targets, stops, strict=True) if isinstance(r, BaseException)]
        if unreached:
            log.error("teardown_stop_incomplete", instance_id=inst.id, unreached=",".join(unreached))
        else:
            log.event(
                "instance_nodes_stopped", instance_id=inst.id, reason=why, node_managers=",".join(addresses)
            )
        return unreached
