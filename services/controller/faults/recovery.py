"""The recovery service: terminating an instance or a PD group, and clearing precision alarms.

- **Terminate** (TerminateInstance, or automatic precision recovery): the instance leaves
  routing at once (deleted, so every Coordinator drops it), then every NodeManager of it gets
  ``Stop`` (it stops its engines and exits, so its pod restarts and registers anew). A PD group
  goes decode first, so no decode is left waiting on a prefill that is gone, then prefill.
  ``terminated`` says whether every NodeManager took the Stop.
- **Clearing a precision alarm** of the group (p, d), only after a terminate that succeeded: the
  CLEAR (same alarm_id, moi and ids as the active ALARM) is stored, which passes it on to every
  sink (watchers, Alertmanager), then every configured Coordinator is told to drop its precision
  state for the group (``ClearPrecisionAlarm``). A Coordinator that cannot be reached answers
  ``scheduler_state_cleared = false`` and is called again in the background until it answers.
- **Reported alarms**: a precision CLEAR from a Coordinator (its samples are normal again) that
  clears an active alarm sets ``precision_alarm_cleared``; a precision ALARM with
  ``precision_auto_recovery_enabled`` terminates the group and clears the alarm at once.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import grpc

from motor_mesh.common import errors, log, tasks
from motor_mesh.common.channel import open_channel
from motor_mesh.common.config import ControllerConfig
from motor_mesh.common.enums import DELETED
from motor_mesh.common.retry import Backoff
from motor_mesh.controller.alarms.sources import ON_PURPOSE
from motor_mesh.controller.alarms.store import ALARM, PRECISION, AlarmStore, StoredAlarms, clear_of
from motor_mesh.controller.instances import InstanceTable
from motor_mesh.controller.model import Instance
from motor_mesh.controller.nodes.client import NodeManagerClients
from motor_mesh.gen.motor.v1 import alarm_pb2, coordinator_pb2, coordinator_pb2_grpc
from motor_mesh.gen.motor.v1 import controller_pb2 as pb

CLEAR_CALL_TIMEOUT_S = 5.0
CLEAR_RETRY = (1.0, 30.0)


@dataclass
class GroupRecovery:
    terminated: bool = False
    precision_alarm_cleared: bool = False
    scheduler_state_cleared: bool = False
    moi: str = ""


class Recovery:
    def __init__(
        self,
        cfg: ControllerConfig,
        table: InstanceTable,
        clients: NodeManagerClients,
        alarms: AlarmStore,
        coordinator_key: str | None,
    ) -> None:
        self._cfg = cfg
        self._table = table
        self._clients = clients
        self._alarms = alarms
        self._key = coordinator_key
        self._retries: set[asyncio.Task[None]] = set()
        # The Coordinators pushed to now (they can change: push/coordinator_set.py); set by the app.
        self.coordinators: Callable[[], Sequence[str]] = lambda: cfg.coordinators

    # ---- TerminateInstance -----------------------------------------------------------------

    async def terminate(self, req: pb.TerminateInstanceRequest) -> pb.TerminateInstanceResponse:
        d = self._live(req.instance_id, "instance_id")
        p = self._live(req.p_instance_id, "p_instance_id") if req.p_instance_id else None
        reason = req.reason or "TerminateInstance"
        result = await self.recover_group(p, d, reason, terminate=True, clear=req.precision_alarm_clear)
        return pb.TerminateInstanceResponse(
            terminated=result.terminated,
            precision_alarm_cleared=result.precision_alarm_cleared,
            scheduler_state_cleared=result.scheduler_state_cleared,
            moi=result.moi,
        )

    def _live(self, instance_id: int, field: str) -> Instance:
        inst = self._table.live.get(instance_id)
        if inst is None or inst.status == DELETED:
            raise errors.not_found("instance", str(instance_id), f"{field}: no live instance {instance_id}")
        return inst

    # ---- ReportAlarms ----------------------------------------------------------------------

    async def after_report(self, stored: StoredAlarms) -> pb.ReportAlarmsResponse:
        """What stored alarms lead to: a precision CLEAR that cleared an active alarm (the
        Coordinator's samples are normal again) resets the other Coordinators' state for the
        group; a precision ALARM with auto-recovery on recovers the group."""
        cleared = [a for a in stored.cleared if a.alarm_id == PRECISION]
        resp = pb.ReportAlarmsResponse(precision_alarm_cleared=bool(cleared))
        for a in cleared:
            resp.scheduler_state_cleared = await self._clear_coordinators(a.p_instance_id, a.instance_id)
        if self._cfg.precision_auto_recovery_enabled:
            for a in stored:
                if a.alarm_id == PRECISION and a.category == ALARM:
                    await self._auto_recover(a, resp)
        return resp

    async def _auto_recover(self, alarm: alarm_pb2.Alarm, resp: pb.ReportAlarmsResponse) -> None:
        d = self._table.live.get(alarm.instance_id)
        p = self._table.live.get(alarm.p_instance_id) if alarm.p_instance_id else None
        if d is None:
            log.warn("precision_recovery_skipped", d=alarm.instance_id, why="decode instance not live")
            return
        log.event("precision_recovery", p=alarm.p_instance_id, d=alarm.instance_id, moi=alarm.moi)
        result = await self.recover_group(p, d, "precision alarm", terminate=True, clear=True)
        resp.precision_alarm_cleared_by_auto_recovery = result.precision_alarm_cleared
        resp.precision_alarm_cleared = resp.precision_alarm_cleared or result.precision_alarm_cleared
        resp.scheduler_state_cleared = result.scheduler_state_cleared

    # ---- the group ---------------------------------------------------------------------------

    async def recover_group(
        self, p: Instance | None, d: Instance, reason: str, *, terminate: bool, clear: bool
    ) -> GroupRecovery:
        result = GroupRecovery(terminated=True)
        if terminate:
            ok_d = await self._terminate_one(d, reason)
            ok_p = await self._terminate_one(p, reason) if p is not None else True
            result.terminated = ok_d and ok_p
        if not clear:
            return result
        if not result.terminated:
            log.warn("precision_clear_skipped", p=p.id if p else 0, d=d.id, why="terminate failed")
            return result
        alarm = self._alarms.active_precision(p.id if p else 0, d.id)
        if alarm is None:
            return result  # nothing active for the group: nothing to clear
        await self._alarms.report([clear_of(alarm, f"cleared by recovery: {reason}")])
        result.precision_alarm_cleared, result.moi = True, alarm.moi
        result.scheduler_state_cleared = await self._clear_coordinators(
            alarm.p_instance_id, alarm.instance_id
        )
        log.event("precision_alarm_cleared", p=alarm.p_instance_id, d=alarm.instance_id, moi=alarm.moi)
        return result

    async def _terminate_one(self, inst: Instance, reason: str) -> bool:
        addresses = list(inst.node_managers)
        # Out of routing first: no request may reach engines that are being stopped.
        # A removal on purpose: it clears the instance's fault alarm instead of raising one.
        await self._table.delete(inst, f"{ON_PURPOSE} {reason}")
        # A NodeManager that is gone is known at once (a probe does not wait for it), so an
        # operator's call answers in seconds rather than after Stop's own deadline.
        reachable = await asyncio.gather(*(self._clients.reachable(a) for a in addresses))
        targets = [a for a, ok in zip(addresses, reachable, strict=True) if ok]
        unreached = [a for a in addresses if a not in targets]
        stops = await asyncio.gather(
            *(self._clients.stop(a, reason) for a in targets), return_exceptions=True
        )
        unreached += [a for a, r in zip(targets, stops, strict=True) if isinstance(r, BaseException)]
        if unreached:
            log.error("terminate_incomplete", instance_id=inst.id, unreached=",".join(unreached))
        else:
            log.event("instance_terminated", instance_id=inst.id, reason=reason)
        return not unreached

    # ---- Coordinators ----------------------------------------------------------------------

    async def _clear_coordinators(self, p: int, d: int) -> bool:
        """ClearPrecisionAlarm on every Coordinator pushed to; those that fail are retried in
        the background until they answer."""
        addresses = list(self.coordinators())
        results = await asyncio.gather(*(self._clear_one(a, p, d) for a in addresses))
        for address, ok in zip(addresses, results, strict=True):
            if not ok:
                task = tasks.start(f"precision-clear-{address}-{d}", self._retry_clear(address, p, d))
                self._retries.add(task)
                task.add_done_callback(self._retries.discard)
        return all(results)

    async def _clear_one(self, address: str, p: int, d: int) -> bool:
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

    async def _retry_clear(self, address: str, p: int, d: int) -> None:
        backoff = Backoff(*CLEAR_RETRY)
        while address in self.coordinators():
            await backoff.sleep()
            if await self._clear_one(address, p, d):
                log.event("precision_clear_call_retried", coordinator=address, d=d)
                return

    async def close(self) -> None:
        for task in list(self._retries):
            await tasks.cancel_quietly(task)
