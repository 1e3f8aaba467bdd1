"""The Controller's alarm store (docs/architecture.md, "Alarms").

Alarms, clears and events arrive from ReportAlarms and from the Controller's own sources
(alarms/sources.py). Rules:

- **Dedupe key** of an alarm: ``alarm_id`` plus, for precision alarms (``PRECISION``), its
  ``moi``; for every other alarm its ``instance_id``, or its ``moi`` when ``instance_id`` is 0
  (a Coordinator alarm is about an address, not an instance).
- **ALARM**: a key not active yet becomes active and goes into the history with a new sequence.
  A key already active only has its ``reason`` and ``occur_time`` updated: it keeps its sequence
  and is not stored in the history again, so watchers and sinks are not told twice about one
  fault.
- **CLEAR**: removes the active ALARM of its key, and goes into the history either way (a CLEAR
  that matched nothing clears nothing, but it was said).
- **EVENT**: history only.
- **Sequence**: every history record gets the next one; strictly increasing, never reused
  (the counter is stored with the records, so a restart continues it). The history keeps the
  newest ``KEEP_HISTORY`` records.

A report is all or nothing: it is worked out on the side, written in one transaction, and only
then applied in memory and handed to the sinks, in sequence order. A failed write raises
StateWriteError and changes nothing. Reports are serialized (each is worked out from what the
one before it stored), and the write runs on the database's writer thread, off the event loop.
Sources that cannot wait (table observers, health watches) :meth:`AlarmStore.submit` a function
that builds their batch when its turn comes, so it is built from what the reports before it
stored; what a failed background report missed, the sources' periodic resync puts right.
"""

from __future__ import annotations

import asyncio
import collections
from bisect import bisect_left, bisect_right
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Protocol

from google.protobuf import timestamp_pb2

from motor_mesh.common import log, tasks
from motor_mesh.controller.store.db import StateWriteError
from motor_mesh.controller.store.interface import StateStore
from motor_mesh.gen.motor.v1 import alarm_pb2

INSTANCE_FAULT = "0xFC001002"
COORDINATOR_FAULT = "0xFC001004"
CONGESTION = "0xFC001005"  # reported by a Coordinator, about itself (by its moi)
PRECISION = "0xFC001009"

ALARM = alarm_pb2.ALARM_CATEGORY_ALARM
CLEAR = alarm_pb2.ALARM_CATEGORY_CLEAR
EVENT = alarm_pb2.ALARM_CATEGORY_EVENT

# Records kept for ListAlarms and for WatchAlarms to resume from, in memory and on disk.
KEEP_HISTORY = 10_000


def precision_moi(coordinator_ip: str, p: int, d: int) -> str:
    return f"service name=Coordinator, service ip={coordinator_ip}, pId={p}, instanceId={d}"


def dedupe_key(alarm: alarm_pb2.Alarm) -> str:
    if alarm.alarm_id != PRECISION and alarm.instance_id:
        return f"{alarm.alarm_id}|instance={alarm.instance_id}"
    return f"{alarm.alarm_id}|moi={alarm.moi}"


def now_timestamp() -> timestamp_pb2.Timestamp:
    ts = timestamp_pb2.Timestamp()
    ts.GetCurrentTime()
    return ts


def clear_of(active: alarm_pb2.Alarm, reason: str) -> alarm_pb2.Alarm:
    """The CLEAR of ``active``: same key, alarm name and severity."""
    out = alarm_pb2.Alarm()
    out.CopyFrom(active)
    out.category = CLEAR
    out.reason = reason
    out.sequence = 0
    out.occur_time.CopyFrom(now_timestamp())
    return out


class AlarmSink(Protocol):
    """Told of every record the store puts in its history (ALARM, CLEAR, EVENT), after the write,
    with ``sequence`` set, in sequence order, synchronously on the event loop: it must not block
    and must not modify ``alarm``."""

    def on_alarm(self, alarm: alarm_pb2.Alarm) -> None: ...


class StoredAlarms(list[alarm_pb2.Alarm]):
    """What ``report`` stored, one per reported alarm and in the same order: a copy of the
    record with its sequence, or for a repeated ALARM the (updated) active alarm, which keeps
    its earlier sequence. ``cleared``: the active alarms this report's CLEARs removed."""

    def __init__(self, stored: Iterable[alarm_pb2.Alarm] = (), cleared: Iterable[alarm_pb2.Alarm] = ()):
        super().__init__(stored)
        self.cleared = list(cleared)


class AlarmStore:
    def __init__(self, store: StateStore, keep: int = KEEP_HISTORY) -> None:
        self._store = store
        self.keep = keep
        history, active, self._last = store.load_alarms()
        self._history = history  # oldest first
        self._active: dict[str, alarm_pb2.Alarm] = {}
        # Active precision alarms by decode instance, then by key.
        self._precision: dict[int, dict[str, alarm_pb2.Alarm]] = {}
        for a in active:
            self._set_active(dedupe_key(a), a)
        self._sinks: list[AlarmSink] = []
        self._lock = asyncio.Lock()
        self._submitted: set[asyncio.Task[None]] = set()

    @property
    def last_sequence(self) -> int:
        return self._last

    # ---- writing -------------------------------------------------------------------------------

    async def report(self, alarms: Sequence[alarm_pb2.Alarm]) -> StoredAlarms:
        """Store ``alarms`` (all or none); raises on a failed write, nothing changed then."""
        async with self._lock:
            return await self._report(alarms)

    def submit(self, build: Callable[[], list[alarm_pb2.Alarm]], source: str) -> None:
        """Report what ``build()`` returns when this report's turn comes, in the background."""
        task = tasks.start(f"alarm-report-{source}", self._report_built(build, source))
        self._submitted.add(task)
        task.add_done_callback(self._submitted.discard)

    async def _report_built(self, build: Callable[[], list[alarm_pb2.Alarm]], source: str) -> None:
        async with self._lock:
            batch = build()
            if not batch:
                return
            try:
                await self._report(batch)
            except StateWriteError:  # logged by the store; the source's resync reports it again
                log.warn("alarm_report_deferred", source=source, alarms=len(batch))

    async def drain(self) -> None:
        """Wait for the submitted reports (on stop, before the database closes)."""
        while self._submitted:
            await asyncio.gather(*self._submitted, return_exceptions=True)

    async def _report(self, alarms: Sequence[alarm_pb2.Alarm]) -> StoredAlarms:
        changes: dict[str, alarm_pb2.Alarm | None] = {}  # key -> active after the report
        records: list[alarm_pb2.Alarm] = []
        out: list[alarm_pb2.Alarm] = []
        cleared: list[alarm_pb2.Alarm] = []
        seq = self._last
        for reported in alarms:
            a = alarm_pb2.Alarm()
            a.CopyFrom(reported)
            if not a.HasField("occur_time"):
                a.occur_time.CopyFrom(now_timestamp())
            key = dedupe_key(a)
            current = changes[key] if key in changes else self._active.get(key)
            if a.category == ALARM and current is not None:
                updated = alarm_pb2.Alarm()
                updated.CopyFrom(current)
                updated.reason = a.reason
                updated.occur_time.CopyFrom(a.occur_time)
                changes[key] = updated
                out.append(updated)
                continue
            seq += 1
            a.sequence = seq
            records.append(a)
            out.append(a)
            if a.category == ALARM:
                changes[key] = a
            elif a.category == CLEAR and current is not None:
                changes[key] = None
                cleared.append(current)
        if not out:
            return StoredAlarms()
        await self._store.save_alarms(
            [(r.sequence, r.SerializeToString()) for r in records],
            {k: None if v is None else (v.sequence, v.SerializeToString()) for k, v in changes.items()},
            seq,
            self.keep,
        )
        self._last = seq
        self._history.extend(records)
        if len(self._history) > self.keep:
            del self._history[: len(self._history) - self.keep]
        for key, value in changes.items():
            if value is None:
                self._drop_active(key)
            else:
                self._set_active(key, value)
        for r in records:
            self._notify(r)
        # Callers get copies: what the store holds is shared with the sinks and the watchers.
        return StoredAlarms((_copy(a) for a in out), (_copy(a) for a in cleared))

    def _set_active(self, key: str, alarm: alarm_pb2.Alarm) -> None:
        self._active[key] = alarm
        if alarm.alarm_id == PRECISION:
            self._precision.setdefault(alarm.instance_id, {})[key] = alarm

    def _drop_active(self, key: str) -> None:
        gone = self._active.pop(key, None)
        if gone is not None and gone.alarm_id == PRECISION:
            group = self._precision.get(gone.instance_id, {})
            group.pop(key, None)
            if not group:
                self._precision.pop(gone.instance_id, None)

    def _notify(self, alarm: alarm_pb2.Alarm) -> None:
        for sink in self._sinks:
            try:
                sink.on_alarm(alarm)
            except Exception:  # one broken sink must not keep the others uninformed
                log.exception("alarm_sink_failed", sink=type(sink).__name__, sequence=alarm.sequence)

    def subscribe(self, sink: AlarmSink) -> None:
        self._sinks.append(sink)

    def unsubscribe(self, sink: AlarmSink) -> None:
        if sink in self._sinks:
            self._sinks.remove(sink)

    # ---- reading (copies) ----------------------------------------------------------------------

    def active(self, alarm_id: str = "") -> list[alarm_pb2.Alarm]:
        """The active alarms, oldest first, optionally of one alarm_id."""
        return [_copy(a) for a in self._sorted_active() if not alarm_id or a.alarm_id == alarm_id]

    def active_counts(self) -> collections.Counter[tuple[str, int]]:
        """Active alarms by (alarm_id, severity), without copying any."""
        return collections.Counter((a.alarm_id, a.severity) for a in self._active.values())

    def find_active(self, alarm: alarm_pb2.Alarm) -> alarm_pb2.Alarm | None:
        """The active alarm with ``alarm``'s dedupe key."""
        found = self._active.get(dedupe_key(alarm))
        return None if found is None else _copy(found)

    def active_precision(self, p_instance_id: int, d_instance_id: int) -> alarm_pb2.Alarm | None:
        """The active precision alarm of the PD group (p, d), the newest if several Coordinators
        reported one; p=0 matches any p for that d."""
        group = self._precision.get(d_instance_id, {})
        found = [a for a in group.values() if not p_instance_id or a.p_instance_id == p_instance_id]
        return _copy(max(found, key=lambda a: a.sequence)) if found else None

    def history(self, after_sequence: int = 0, limit: int | None = None) -> list[alarm_pb2.Alarm]:
        """The kept history after ``after_sequence``, oldest first, at most ``limit`` records."""
        start = bisect_right(self._history, after_sequence, key=lambda a: a.sequence)
        end = len(self._history) if limit is None else min(len(self._history), start + limit)
        return [_copy(a) for a in self._history[start:end]]

    def newest_first(
        self, *, active_only: bool, alarm_id: str, before_sequence: int = 0
    ) -> Iterator[alarm_pb2.Alarm]:
        """The active alarms or the history, newest first, below ``before_sequence`` (0: from
        the newest), without copying: for building a response, consumed before the next
        ``await`` (a report in between would shift the history under it)."""
        if active_only:
            pool: Sequence[alarm_pb2.Alarm] = self._sorted_active()
        else:
            pool = self._history
        end = len(pool)
        if before_sequence:
            end = bisect_left(pool, before_sequence, key=lambda a: a.sequence)
        for i in range(end - 1, -1, -1):
            if not alarm_id or pool[i].alarm_id == alarm_id:
                yield pool[i]

    def _sorted_active(self) -> list[alarm_pb2.Alarm]:
        return sorted(self._active.values(), key=lambda a: a.sequence)


def _copy(alarm: alarm_pb2.Alarm) -> alarm_pb2.Alarm:
    out = alarm_pb2.Alarm()
    out.CopyFrom(alarm)
    return out
