"""WatchAlarms: every record the alarm store accepts, to each subscriber in sequence order.

The hub is one of the store's sinks. Each stream has its own bounded queue: the store hands a
record to every queue and goes on, so a subscriber that does not read never holds up the store
or the others. A queue that is full ends its stream with RESOURCE_EXHAUSTED; the client resumes
with ``after_sequence`` = the last sequence it received and the replay fills the gap.

Resuming without a gap or a repeat: the stream subscribes first, then replays the stored history
after N, then follows its queue, dropping what the replay already sent (sequence ≤ the last
replayed). Records the store accepts during the replay wait in the queue.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator

import grpc

from motor_mesh.common import errors
from motor_mesh.controller.alarms.store import KEEP_HISTORY, AlarmStore
from motor_mesh.gen.motor.v1 import alarm_pb2

# Records one stream may have waiting. As large as the kept history: a burst the history holds
# (a resync raising many alarms at once) never ends a stream that keeps up; a stream further
# behind than this could not be resumed from the history anyway.
WATCH_BUFFER = KEEP_HISTORY


class _Subscriber:
    __slots__ = ("ended", "items", "wake")

    def __init__(self) -> None:
        self.items: deque[alarm_pb2.Alarm] = deque()
        self.wake = asyncio.Event()
        self.ended: errors.MotorError | None = None


class AlarmWatchHub:
    def __init__(self, store: AlarmStore, buffer: int = WATCH_BUFFER) -> None:
        self._store = store
        self.buffer = buffer
        self._subscribers: set[_Subscriber] = set()
        self._closed = False
        store.subscribe(self)

    @property
    def watchers(self) -> int:
        return len(self._subscribers)

    def on_alarm(self, alarm: alarm_pb2.Alarm) -> None:
        for sub in list(self._subscribers):
            if len(sub.items) >= self.buffer:
                sub.ended = errors.resource_exhausted(
                    f"alarm watch fell more than {self.buffer} records behind; "
                    "resume with after_sequence = the last sequence received"
                )
                self._subscribers.discard(sub)
            else:
                sub.items.append(alarm)
            sub.wake.set()

    def close(self) -> None:
        """The Controller is stopping: end every stream (the clients resume elsewhere or later)."""
        self._closed = True
        for sub in self._subscribers:
            sub.ended = _stopping()
            sub.wake.set()
        self._subscribers.clear()

    async def stream(self, after_sequence: int) -> AsyncIterator[alarm_pb2.Alarm]:
        if self._closed:
            raise _stopping()
        if after_sequence > self._store.last_sequence:
            raise errors.MotorError(
                grpc.StatusCode.OUT_OF_RANGE,
                f"after_sequence {after_sequence} is beyond the last stored sequence "
                f"{self._store.last_sequence}",
            )
        sub = _Subscriber()
        self._subscribers.add(sub)
        try:
            last = after_sequence
            if after_sequence:
                for alarm in self._store.history(after_sequence=after_sequence):
                    if sub.ended is not None:
                        raise sub.ended
                    yield alarm
                    last = alarm.sequence
            while True:
                if sub.ended is not None:
                    raise sub.ended
                if not sub.items:
                    sub.wake.clear()
                    await sub.wake.wait()
                    continue
                alarm = sub.items.popleft()
                if alarm.sequence > last:
                    yield alarm
                    last = alarm.sequence
        finally:
            self._subscribers.discard(sub)


def _stopping() -> errors.MotorError:
    return errors.unavailable("the Controller is stopping; resume with after_sequence", retry_after_s=1.0)
