"""The alarms the Controller raises itself (docs/architecture.md, "Alarms").

**Instance fault** (``0xFC001002``, MAJOR, one per instance id): raised when an instance turns
INACTIVE, or is DELETED by a fault; cleared when it is ACTIVE (or PAUSED) again, or removed on
purpose. Whether a removal is on purpose is the stored reason of its teardown (model.Removal):
TERMINATED (an operator's TerminateInstance) and PRECISION_RECOVERY are; every other reason (a
heartbeat timeout, a failed start, a restarted NodeManager, a failed relaunch) is a fault.

A DELETED instance never comes back, so its alarm is cleared when its job is served again (a
later instance of the same job ACTIVE or PAUSED), when the instance leaves the Controller's
memory (pruned from the DELETED history), or by an operator's CLEAR.

**Coordinator fault** (``0xFC001004``, CRITICAL, instance_id 0, keyed by its moi): raised when a
configured Coordinator has been unreachable (its health Watch broken or not SERVING) for
``COORDINATOR_ALARM_AFTER_S``; cleared when the Watch sees it SERVING again.

Both are level-triggered as well as event-driven: at start-up and on every resync the alarms are
compared with what the Controller sees (an INACTIVE instance without its alarm gets one, an
ACTIVE one with an alarm gets its CLEAR, an alarm about an instance or a Coordinator the
Controller no longer has is cleared), so a lost event or a failed write is corrected.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable

from motor_mesh.common import log
from motor_mesh.common.enums import (
    ACTIVE,
    DELETED,
    INACTIVE,
    PAUSED,
    ROLE_NAMES,
    InstanceStatus,
    Role,
    status_name,
)
from motor_mesh.controller.alarms.store import (
    ALARM,
    COORDINATOR_FAULT,
    INSTANCE_FAULT,
    AlarmStore,
    clear_of,
    now_timestamp,
)
from motor_mesh.controller.instances import InstanceTable
from motor_mesh.controller.model import Instance
from motor_mesh.gen.motor.v1 import alarm_pb2

COORDINATOR_ALARM_AFTER_S = 10.0
_HEALTHY = (ACTIVE, PAUSED)


def on_purpose(inst: Instance) -> bool:
    return inst.teardown is not None and inst.teardown.reason.on_purpose


def instance_moi(inst: Instance) -> str:
    role = ROLE_NAMES.get(Role(inst.spec.role), "unspecified")
    return f"service name=Controller, instanceId={inst.id}, role={role}, job={inst.job_name}"


def instance_alarm(
    inst: Instance, category: alarm_pb2.AlarmCategory.ValueType, reason: str
) -> alarm_pb2.Alarm:
    return alarm_pb2.Alarm(
        alarm_id=INSTANCE_FAULT,
        category=category,
        severity=alarm_pb2.SEVERITY_MAJOR,
        moi=instance_moi(inst),
        alarm_name="Instance fault",
        probable_cause=(
            "an engine died or turned unhealthy, a NodeManager went silent, or a node fault was reported"
        ),
        reason=reason,
        instance_id=inst.id,
        occur_time=now_timestamp(),
        additional_info={
            "job": inst.job_name,
            "model": inst.spec.model_name,
            "status": status_name(inst.status),
        },
    )


def coordinator_moi(address: str) -> str:
    return f"service name=Coordinator, service ip={address}"


def coordinator_alarm(
    address: str, category: alarm_pb2.AlarmCategory.ValueType, reason: str
) -> alarm_pb2.Alarm:
    return alarm_pb2.Alarm(
        alarm_id=COORDINATOR_FAULT,
        category=category,
        severity=alarm_pb2.SEVERITY_CRITICAL,
        moi=coordinator_moi(address),
        alarm_name="Coordinator fault",
        probable_cause="the Coordinator process is down, restarting or unreachable over the network",
        reason=reason,
        occur_time=now_timestamp(),
        additional_info={"address": address},
    )


class InstanceAlarms:
    """An observer of the instance table."""

    def __init__(self, table: InstanceTable, alarms: AlarmStore) -> None:
        self._table = table
        self._alarms = alarms

    def on_transition(self, inst: Instance, old: InstanceStatus, new: InstanceStatus, reason: str) -> None:
        self._alarms.submit(lambda: self._after(inst, new, reason), "instances")

    def _after(self, inst: Instance, new: InstanceStatus, reason: str) -> list[alarm_pb2.Alarm]:
        """What a transition raises or clears, from the alarms as they are when it is reported."""
        batch: list[alarm_pb2.Alarm] = []
        what = f"instance {inst.id} ({inst.job_name}) {status_name(new)}: {reason}"
        if new == INACTIVE or (new == DELETED and not on_purpose(inst)):
            batch.append(instance_alarm(inst, ALARM, what))
        elif new == DELETED or new in _HEALTHY:
            active = self._alarms.find_active(instance_alarm(inst, ALARM, ""))
            if active is not None:
                batch.append(clear_of(active, what))
        if new in _HEALTHY:
            batch += self._clears_of_replaced(inst.job_name)
        return batch

    def _clears_of_replaced(self, job: str) -> list[alarm_pb2.Alarm]:
        """CLEARs of the alarms of DELETED instances of ``job``: the job is served again."""
        out = []
        for a in self._alarms.active(INSTANCE_FAULT):
            gone = self._table.deleted.get(a.instance_id)
            if gone is not None and gone.job_name == job:
                out.append(clear_of(a, f"instance {a.instance_id} ({job}): the job is served again"))
        return out

    def reconcile(self) -> None:
        self._alarms.submit(self._differences, "instances")

    def _differences(self) -> list[alarm_pb2.Alarm]:
        """The reports that make the active alarms match the instances."""
        batch: list[alarm_pb2.Alarm] = []
        alarmed = {a.instance_id: a for a in self._alarms.active(INSTANCE_FAULT)}
        served = {i.job_name for i in self._table.live.values() if i.status in _HEALTHY}
        for inst in self._table.live.values():
            a = alarmed.get(inst.id)
            if inst.status == INACTIVE and a is None:
                batch.append(instance_alarm(inst, ALARM, f"instance {inst.id} ({inst.job_name}) INACTIVE"))
            elif inst.status in _HEALTHY and a is not None:
                batch.append(clear_of(a, f"instance {inst.id} ({inst.job_name}) {status_name(inst.status)}"))
        for iid, a in alarmed.items():
            if iid in self._table.live:
                continue
            gone = self._table.deleted.get(iid)
            if gone is None:
                batch.append(clear_of(a, f"instance {iid} is no longer known to the Controller"))
            elif gone.job_name in served:
                batch.append(clear_of(a, f"instance {iid} ({gone.job_name}): the job is served again"))
        return batch


class CoordinatorAlarms:
    """Told by each Coordinator's health Watch whether it is reachable (``on_reachability``)."""

    def __init__(
        self, alarms: AlarmStore, addresses: Iterable[str], after_s: float = COORDINATOR_ALARM_AFTER_S
    ) -> None:
        self._alarms = alarms
        self._addresses = frozenset(addresses)
        self.after_s = after_s
        self._down_since: dict[str, tuple[float, str]] = {}  # address -> (monotonic, why)
        self._timers: dict[str, asyncio.TimerHandle] = {}

    def set_addresses(self, addresses: Iterable[str]) -> None:
        """The Coordinators now pushed to: one that left is no longer waited for, and the
        reconcile clears its alarm."""
        self._addresses = frozenset(addresses)
        for address in [a for a in self._down_since if a not in self._addresses]:
            self._down_since.pop(address)
            timer = self._timers.pop(address, None)
            if timer is not None:
                timer.cancel()
        self.reconcile()

    def on_reachability(self, address: str, reachable: bool, why: str = "") -> None:
        if address not in self._addresses:
            return  # a pusher being closed after its Coordinator left the set
        try:
            if reachable:
                self._down_since.pop(address, None)
                timer = self._timers.pop(address, None)
                if timer is not None:
                    timer.cancel()
                self._alarms.submit(lambda: self._clear(address), "coordinators")
            elif address not in self._down_since:
                self._down_since[address] = (time.monotonic(), why)
                self._schedule(address, self.after_s)
        except Exception:  # never into the health Watch that called
            log.exception("coordinator_alarm_failed", coordinator=address)

    def _clear(self, address: str) -> list[alarm_pb2.Alarm]:
        active = self._alarms.find_active(coordinator_alarm(address, ALARM, ""))
        return [] if active is None else [clear_of(active, f"Coordinator {address} is reachable")]

    def _schedule(self, address: str, delay: float) -> None:
        self._timers[address] = asyncio.get_running_loop().call_later(delay, self._due, address)

    def _due(self, address: str) -> None:
        self._timers.pop(address, None)
        self.check()

    def check(self) -> None:
        """Raise the alarm of every Coordinator down for the threshold without one (its timer,
        and the resync)."""
        now, batch = time.monotonic(), []
        for address, (since, why) in self._down_since.items():
            left = since + self.after_s - now
            if left > 0:
                if address not in self._timers:  # a timer may fire a hair early
                    self._schedule(address, left)
                continue
            probe = coordinator_alarm(address, ALARM, "")
            if self._alarms.find_active(probe) is None:
                reason = f"Coordinator {address} unreachable for {now - since:.1f}s ({why or 'no answer'})"
                batch.append(coordinator_alarm(address, ALARM, reason))
        if batch:  # a second ALARM of the same key before this one is stored only updates it
            self._alarms.submit(lambda: batch, "coordinators")

    def reconcile(self) -> None:
        configured = {coordinator_moi(a) for a in self._addresses}
        stale = [
            a for a in self._alarms.active(COORDINATOR_FAULT) if a.moi not in configured and not a.instance_id
        ]
        if stale:
            clears = [clear_of(a, "Coordinator no longer configured") for a in stale]
            self._alarms.submit(lambda: clears, "coordinators")
        self.check()

    def close(self) -> None:
        for timer in self._timers.values():
            timer.cancel()
        self._timers.clear()
