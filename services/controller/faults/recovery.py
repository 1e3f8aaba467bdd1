"""Terminating an instance or a PD group, and recovering from precision alarms, as desired state.

Nothing here stops an engine inline: every path records what it wants (a doomed instance, with
a typed reason, stored: instances.py) and the instance reconcile carries it out
(reconcile/teardown.py), so a Controller restart or a new leader finishes what was started.

- **TerminateInstance** dooms the instance (with ``p_instance_id``, the PD group: the prefill's
  teardown waits for the decode's, so no decode is left waiting on a prefill that is gone) with
  Stop for every NodeManager, then waits for the teardown within the call's deadline.
  ``terminated`` says whether every NodeManager took the Stop. A plain terminate is a planned
  stop: the teardown first drains the instance on every Coordinator (reconcile/teardown.py), so
  the answer may come, with ``terminated`` false, before the drain is over; the teardown goes
  on. With ``precision_alarm_clear`` (the operator's side of a precision recovery: its engines
  answer garbage) nothing is drained, and the decode's teardown also clears the group's
  precision alarms and tells every Coordinator.
- **ReportAlarms** stores the report and answers at once. A precision CLEAR from a Coordinator
  (its samples are normal again) that cleared an active alarm has the other Coordinators reset
  their state for the group, in the background.
- **The precision reconcile** (key: the group (p, d), for every active precision alarm): with
  ``precision_auto_recovery_enabled`` a live instance of the group is doomed (reason
  PRECISION_RECOVERY, Stop everywhere); the decode's teardown then clears the alarm with the same
  moi and tells every Coordinator, retrying with backoff. An alarm of a group whose instances no
  longer exist (deleted for any other reason) is cleared with reason ``instance_gone``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence

import grpc

from motor_mesh.common import errors, log, tasks
from motor_mesh.common.channel import open_channel
from motor_mesh.common.config import ControllerConfig
from motor_mesh.common.enums import DELETED, InstanceStatus
from motor_mesh.common.retry import Backoff
from motor_mesh.controller.alarms.store import ALARM, PRECISION, AlarmStore, StoredAlarms, clear_of
from motor_mesh.controller.instances import InstanceTable
from motor_mesh.controller.model import Instance, Removal, Teardown
from motor_mesh.controller.reconcile.runner import DONE, Result
from motor_mesh.gen.motor.v1 import alarm_pb2, coordinator_pb2, coordinator_pb2_grpc
from motor_mesh.gen.motor.v1 import controller_pb2 as pb

CLEAR_CALL_TIMEOUT_S = 5.0
CLEAR_RETRY = (1.0, 30.0)
INSTANCE_GONE = "instance_gone"
# What TerminateInstance leaves of its deadline for answering.
ANSWER_MARGIN_S = 0.2

Group = tuple[int, int]  # (p_instance_id, d_instance_id)


def precision_alarms(alarms: AlarmStore, group: Group) -> list[alarm_pb2.Alarm]:
    """The group's active precision alarms (one per Coordinator that reported it)."""
    p, d = group
    return [a for a in alarms.active(PRECISION) if a.instance_id == d and a.p_instance_id == p]


class CoordinatorClears:
    """``ClearPrecisionAlarm`` on every Coordinator pushed to."""

    def __init__(self, cfg: ControllerConfig, key: str | None) -> None:
        self._cfg = cfg
        self._key = key
        self._retries: set[asyncio.Task[None]] = set()
        # The Coordinators pushed to now (they can change: push/coordinator_set.py); set by the app.
        self.coordinators: Callable[[], Sequence[str]] = lambda: cfg.coordinators

    async def clear(self, group: Group) -> list[str]:
        """Every Coordinator told; the ones that did not answer."""
        addresses = list(self.coordinators())
        results = await asyncio.gather(*(self._clear_one(a, group) for a in addresses))
        return [a for a, ok in zip(addresses, results, strict=True) if not ok]

    def clear_in_background(self, group: Group) -> None:
        """Each Coordinator called until it answers (or leaves the set)."""
        for address in self.coordinators():
            task = tasks.start(f"precision-clear-{address}-{group[1]}", self._until_cleared(address, group))
            self._retries.add(task)
            task.add_done_callback(self._retries.discard)

    async def _until_cleared(self, address: str, group: Group) -> None:
        backoff = Backoff(*CLEAR_RETRY)
        while address in self.coordinators():
            if await self._clear_one(address, group):
                return
            await backoff.sleep()

    async def _clear_one(self, address: str, group: Group) -> bool:
        p, d = group
        req = coordinator_pb2.ClearPrecisionAlarmRequest(d_instance_id=d, p_instance_id=p)
        try:
            async with open_channel(address, key=self._key, tls=self._cfg, service="controller") as ch:
                await coordinator_pb2_grpc.CoordinatorStub(ch).ClearPrecisionAlarm(
                    req, timeout=CLEAR_CALL_TIMEOUT_S
                )
            return True
        except grpc.aio.AioRpcError as err:
            log.warn("precision_clear_call_failed", coordinator=address, d=d, code=err.code().name)
            return False

    async def close(self) -> None:
        for task in list(self._retries):
            await tasks.cancel_quietly(task)


class Recovery:
    def __init__(
        self,
        cfg: ControllerConfig,
        table: InstanceTable,
        alarms: AlarmStore,
        clears: CoordinatorClears,
        enqueue_group: Callable[[Group], None] = lambda _: None,
    ) -> None:
        self._cfg = cfg
        self._table = table
        self._alarms = alarms
        self._clears = clears
        self.enqueue_group = enqueue_group  # the precision reconcile's; set by the app

    # ---- TerminateInstance -----------------------------------------------------------------

    async def terminate(
        self, req: pb.TerminateInstanceRequest, time_left: float | None
    ) -> pb.TerminateInstanceResponse:
        d = self._live(req.instance_id, "instance_id")
        p = self._live(req.p_instance_id, "p_instance_id") if req.p_instance_id else None
        detail = req.reason or "TerminateInstance"
        group = (p.id if p else 0, d.id) if req.precision_alarm_clear else None
        # Planned, unless it recovers from a precision fault.
        drain = not req.precision_alarm_clear
        await self._table.doom(
            d, Removal.TERMINATED, detail, stop=d.node_managers, precision=group, drain=drain
        )
        if p is not None:
            await self._table.doom(
                p, Removal.TERMINATED, detail, stop=p.node_managers, after=d.id, drain=drain
            )
        waits = [self._table.wait_torn_down(i) for i in (d, p) if i is not None]
        budget = None if time_left is None else max(0.0, time_left - ANSWER_MARGIN_S)
        try:
            done = await asyncio.wait_for(asyncio.gather(*waits), budget)
        except TimeoutError:
            # The teardown goes on without us: the answer says what is known now.
            done = [i.teardown for i in (d, p) if i is not None and i.teardown is not None]
        return self._answer(done, d, group)

    def _answer(
        self, done: Sequence[Teardown | None], d: Instance, group: Group | None
    ) -> pb.TerminateInstanceResponse:
        terminated = all(t is not None and t.stopped and not t.unreached for t in done)
        resp = pb.TerminateInstanceResponse(terminated=terminated)
        td = d.teardown
        if group is not None and td is not None and td.precision_moi:
            resp.precision_alarm_cleared = True
            resp.scheduler_state_cleared = td.coordinators_told
            resp.moi = td.precision_moi
        return resp

    def _live(self, instance_id: int, field: str) -> Instance:
        inst = self._table.live.get(instance_id)
        if inst is None or inst.status == DELETED:
            raise errors.not_found("instance", str(instance_id), f"{field}: no live instance {instance_id}")
        return inst  # one being torn down already: the call waits for that teardown

    # ---- ReportAlarms ----------------------------------------------------------------------

    def after_report(self, stored: StoredAlarms) -> pb.ReportAlarmsResponse:
        """What stored alarms lead to, none of it waited for: a precision CLEAR that cleared an
        active alarm resets the other Coordinators' state for the group; a precision ALARM with
        auto-recovery on is handed to the precision reconcile."""
        resp = pb.ReportAlarmsResponse()
        for a in stored.cleared:
            if a.alarm_id == PRECISION:
                resp.precision_alarm_cleared = True
                self._clears.clear_in_background((a.p_instance_id, a.instance_id))
        for a in stored:
            if a.alarm_id == PRECISION and a.category == ALARM:
                self.enqueue_group((a.p_instance_id, a.instance_id))
                resp.precision_recovery_pending = self._cfg.precision_auto_recovery_enabled
        return resp

    # ---- the precision reconcile -------------------------------------------------------------

    def groups(self) -> list[Group]:
        return sorted({(a.p_instance_id, a.instance_id) for a in self._alarms.active(PRECISION)})

    def on_transition(self, inst: Instance, old: InstanceStatus, new: InstanceStatus, reason: str) -> None:
        """A deleted instance: its groups' alarms may now be cleared."""
        if new == DELETED:
            for group in self.groups():
                if inst.id in group:
                    self.enqueue_group(group)

    async def reconcile(self, group: Group) -> Result:
        alarms = precision_alarms(self._alarms, group)
        if not alarms:
            return DONE
        p_id, d_id = group
        live = [i for i in (self._table.live.get(d_id), self._table.live.get(p_id)) if i is not None]
        if live and self._cfg.precision_auto_recovery_enabled:
            d = self._table.live.get(d_id)
            if d is not None and d.teardown is None:
                log.event("precision_recovery", p=p_id, d=d_id, moi=alarms[-1].moi)
                await self._table.doom(
                    d, Removal.PRECISION_RECOVERY, "precision alarm", stop=d.node_managers, precision=group
                )
            p = self._table.live.get(p_id) if p_id else None
            if p is not None:
                after = d_id if d is not None else 0
                await self._table.doom(
                    p, Removal.PRECISION_RECOVERY, "precision alarm", stop=p.node_managers, after=after
                )
            return DONE  # the decode's teardown clears the alarm
        if not any(self._table.gone(i) for i in (p_id, d_id) if i):
            return DONE  # the group is served: the alarm stands until a Coordinator clears it
        td = self._table.deleted[d_id].teardown if d_id in self._table.deleted else None
        if td is not None and td.precision == group and not td.precision_cleared:
            return DONE  # its teardown clears the alarm itself
        await self._alarms.report([clear_of(a, INSTANCE_GONE) for a in alarms])
        log.event("precision_alarm_cleared", p=p_id, d=d_id, reason=INSTANCE_GONE)
        return DONE
