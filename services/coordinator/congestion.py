"""The congestion alarm ``0xFC001005``: this Coordinator has been close to full for a while.

**Use** is the requests running plus the requests queued in every process that serves HTTP
(this process with ``workers = 1``; with inference workers, the sum of what each last reported,
at most ``LOADS_S`` old), over the Coordinator-wide capacity ``max_concurrent_requests +
max_queued_requests``. It can pass 1: each worker's share of the limits is rounded up, and
limits lowered by a settings reload leave the requests already admitted where they are.

**Raise and clear** (:class:`Congestion`, pure, on the clock it is given): raised once every
sample has been at or above ``RAISE_AT`` for ``congestion_raise_s`` (0: at the first such
sample); one sample below ``RAISE_AT`` before that starts the wait again. Cleared by the first
sample below ``CLEAR_BELOW``; between the two a raised alarm stays raised, so load hovering at
the threshold does not flap it. Raise and clear are each reported once.

**The loop** (:class:`CongestionMonitor`) samples every ``SAMPLE_S`` and reads the settings
afresh each time (a reload may change the limits or the wait). Its state lives on the monitor,
so a loop restarted after a failure carries on from it. Raises and clears go to the Controller
through an :class:`AlarmReporter` of its own: queued in order and retried until the leading
Controller accepts them, so an unreachable Controller delays the report, never the sampling.

**Stopping**: a Coordinator that stops with its alarm raised reports the CLEAR and waits at
most ``STOP_FLUSH_S`` for the Controller to take it. A stopped Coordinator admits nothing, and
its absence is the Coordinator fault alarm's (``0xFC001004``) to tell. One killed outright
(SIGKILL, out of memory) cannot: its alarm stays active at the Controller, and the Coordinator
restarted at the same address takes it over. Before its first sample the loop asks the
Controller for the active congestion alarms; one with its own moi makes its state raised, so
the next sample under 75 % clears it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from enum import Enum

import grpc

from motor_mesh.common import log, tasks
from motor_mesh.common.config import CoordinatorConfig
from motor_mesh.coordinator.metrics import Metrics
from motor_mesh.coordinator.precision.reporter import AlarmReporter, occurred_at
from motor_mesh.gen.motor.v1 import alarm_pb2

ALARM_ID = "0xFC001005"
ADOPT_TIMEOUT_S = 2.0  # asking the Controller for a raised alarm left by an earlier process
ALARM_NAME = "Coordinator congestion"
PROBABLE_CAUSE = (
    "More requests arrive than the Coordinator admits: too few or too slow engines for the "
    "traffic, engines that stopped answering so requests hold their slots, or "
    "max_concurrent_requests and max_queued_requests set too low."
)
# MAJOR: admitted requests are still served, but new ones are about to be refused (429) or
# are waiting; the service is degraded, not lost.
SEVERITY = alarm_pb2.SEVERITY_MAJOR

RAISE_AT = 0.85
CLEAR_BELOW = 0.75
SAMPLE_S = 0.5
STOP_FLUSH_S = 2.0

Load = Callable[[], tuple[int, int]]  # requests running, requests queued


def moi_of(address: str) -> str:
    """The Coordinator as the Controller's own Coordinator alarm (0xFC001004) names one: by its
    gRPC ``host:port``, so two Coordinators on one host are two alarms."""
    return f"service name=Coordinator, service ip={address}"


class Change(Enum):
    RAISE = "raise"
    CLEAR = "clear"


class Congestion:
    """The alarm's state; ``sample`` advances it and says when to raise or clear."""

    def __init__(self) -> None:
        self.raised = False
        self.high_since: float | None = None  # since when every sample was >= RAISE_AT

    def sample(self, use: float, now: float, raise_after_s: float) -> Change | None:
        if self.raised:
            if use < CLEAR_BELOW:
                self.raised = False
                self.high_since = None
                return Change.CLEAR
            return None
        if use < RAISE_AT:
            self.high_since = None
            return None
        if self.high_since is None:
            self.high_since = now
        if now - self.high_since >= raise_after_s:
            self.raised = True
            return Change.RAISE
        return None

    def held_s(self, now: float) -> float:
        return 0.0 if self.high_since is None else now - self.high_since


@dataclass(frozen=True, slots=True)
class Sample:
    running: int = 0
    queued: int = 0
    capacity: int = 0

    @property
    def use(self) -> float:
        return (self.running + self.queued) / self.capacity if self.capacity > 0 else 0.0

    def describe(self) -> str:
        return f"{self.use:.0%} ({self.running} running + {self.queued} queued of {self.capacity})"


def congestion_alarm(
    category: alarm_pb2.AlarmCategory.ValueType,
    address: str,
    reason: str,
    sample: Sample,
    raise_after_s: float,
    now_ns: int | None = None,
) -> alarm_pb2.Alarm:
    return alarm_pb2.Alarm(
        alarm_id=ALARM_ID,
        category=category,
        severity=SEVERITY,
        moi=moi_of(address),
        alarm_name=ALARM_NAME,
        probable_cause=PROBABLE_CAUSE,
        reason=reason,
        occur_time=occurred_at(now_ns),
        additional_info={
            "address": address,
            "use": f"{sample.use:.3f}",
            "running": str(sample.running),
            "queued": str(sample.queued),
            "capacity": str(sample.capacity),
            "congestion_raise_s": f"{raise_after_s:g}",
        },
    )


class CongestionMonitor:
    """``settings``: the Coordinator's current settings; ``load``: requests running and queued
    in every process serving HTTP; ``address``: this Coordinator's gRPC ``host:port`` as others
    reach it (the alarm's identity), or how to work it out: the loop does so before its first
    sample, so a slow name lookup (the Controller's, for a wildcard host) never holds up the
    Coordinator's start. Owns ``reporter``: ``start()`` starts it, ``close()`` closes it."""

    def __init__(
        self,
        settings: Callable[[], CoordinatorConfig],
        load: Load,
        reporter: AlarmReporter,
        metrics: Metrics,
        address: str | Callable[[], Awaitable[str]],
        *,
        interval_s: float = SAMPLE_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._settings = settings
        self._load = load
        self._reporter = reporter
        self._metrics = metrics
        self.address = address if isinstance(address, str) else ""
        self._identify = None if isinstance(address, str) else address
        self.interval_s = interval_s
        self._clock = clock
        self.state = Congestion()
        self.last = Sample()
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._reporter.start()
        self._task = tasks.spawn("congestion_monitor", self._run)

    async def _run(self) -> None:
        if self._identify is not None:
            self.address = await self._identify()
            self._identify = None
        adopted = False
        while True:
            if not adopted:
                adopted = await self._adopt()
            self.sample()
            await asyncio.sleep(self.interval_s)

    async def _adopt(self) -> bool:
        """Whether the Controller answered. An alarm of this Coordinator's it still holds (this
        process restarted, or was killed, while congested) is this monitor's to clear: the
        raised state is the Controller's stored one, and the next sample under 75 % clears it."""
        try:
            alarms = await self._reporter.active(ALARM_ID, ADOPT_TIMEOUT_S)
        except grpc.aio.AioRpcError:
            return False  # tried again at the next sample
        moi = moi_of(self.address)
        if not self.state.raised and any(a.moi == moi for a in alarms):
            self.state.raised = True
            self._metrics.congestion_alarm.set(1)
            log.event("congestion_alarm_adopted", moi=moi)
        return True

    def sample(self) -> Change | None:
        """Take one sample: gauges, state, and the report of a raise or a clear."""
        cfg = self._settings()
        running, queued = self._load()
        s = Sample(running, queued, cfg.max_concurrent_requests + cfg.max_queued_requests)
        self.last = s
        self._metrics.admission_use.set(s.use)
        now = self._clock()
        change = self.state.sample(s.use, now, cfg.congestion_raise_s)
        if change is Change.RAISE:
            held = self.state.held_s(now)
            reason = f"admission use {s.describe()} at or above {RAISE_AT:.0%} for {held:.1f}s"
            self._report(alarm_pb2.ALARM_CATEGORY_ALARM, reason, s, cfg.congestion_raise_s)
            log.warn("congestion_alarm", **self._fields(s), held_s=round(held, 3))
        elif change is Change.CLEAR:
            reason = f"admission use {s.describe()} below {CLEAR_BELOW:.0%}"
            self._report(alarm_pb2.ALARM_CATEGORY_CLEAR, reason, s, cfg.congestion_raise_s)
            log.event("congestion_clear", **self._fields(s))
        return change

    def _fields(self, s: Sample) -> dict[str, object]:
        return {
            "use": round(s.use, 3),
            "running": s.running,
            "queued": s.queued,
            "capacity": s.capacity,
            "moi": moi_of(self.address),
        }

    def _report(
        self, category: alarm_pb2.AlarmCategory.ValueType, reason: str, s: Sample, raise_after_s: float
    ) -> None:
        self._metrics.congestion_alarm.set(1 if category == alarm_pb2.ALARM_CATEGORY_ALARM else 0)
        self._reporter.submit(congestion_alarm(category, self.address, reason, s, raise_after_s))

    async def close(self) -> None:
        """Stop sampling; a raised alarm is cleared (module docstring, "Stopping")."""
        await tasks.cancel_quietly(self._task)
        self._task = None
        if self.state.raised:
            self.state = Congestion()
            reason = "the Coordinator is stopping"
            self._report(
                alarm_pb2.ALARM_CATEGORY_CLEAR, reason, self.last, self._settings().congestion_raise_s
            )
            log.event("congestion_clear", reason="stopping", moi=moi_of(self.address))
            await self._reporter.flush(STOP_FLUSH_S)
        await self._reporter.close()
