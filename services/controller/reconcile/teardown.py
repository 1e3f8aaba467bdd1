"""Carrying out a doomed instance's teardown (instances.py ``doom``), one stored step at a time.

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

from motor_mesh.common import log
from motor_mesh.common.enums import DELETED
from motor_mesh.controller.alarms.store import AlarmStore, clear_of
from motor_mesh.controller.faults.recovery import CoordinatorClears, precision_alarms
from motor_mesh.controller.instances import InstanceTable
from motor_mesh.controller.model import Instance, Teardown
from motor_mesh.controller.nodes.client import NodeManagerClients
from motor_mesh.controller.reconcile.runner import Retry

# How soon the prefill of a PD group looks again whether its decode is gone.
AFTER_POLL_S = 0.2


class Teardowns:
    def __init__(
        self, table: InstanceTable, clients: NodeManagerClients, alarms: AlarmStore, clears: CoordinatorClears
    ) -> None:
        self.table = table
        self.clients = clients
        self.alarms = alarms
        self.clears = clears

    def pending(self) -> list[int]:
        """DELETED instances whose teardown is not done (after a restart): the reconcile's keys."""
        return [i for i, inst in self.table.deleted.items() if inst.teardown and not inst.teardown.done]

    async def advance(self, inst: Instance) -> float | None:
        """One pass; seconds until the next look, or None when done (or nothing to do)."""
        td = inst.teardown
        assert td is not None
        if inst.status != DELETED:
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
