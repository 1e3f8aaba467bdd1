"""Precision alarms: the ``Alarm`` messages and their delivery to the Controller (``ReportAlarms``).

Delivery is retried until the Controller accepts it: alarms wait in an in-memory queue, in the
order they were raised, and one supervised task sends them (exponential backoff with jitter
between failures). The queue outlives any Controller outage; it does not outlive this process:
an alarm not yet accepted when the Coordinator stops is lost (logged as
``precision_reports_lost``), and the group is sampled afresh by the next Coordinator.

:class:`AlarmReporter` carries any of the Coordinator's alarms: the congestion alarm
(``coordinator/congestion.py``) has one of its own, ``kind="congestion"``, which names its task
and log lines (``congestion_report_failed``…) so that each alarm's delivery reads on its own.

With several Controllers (``coordinator.controller`` lists them, or names them with
``dns:///``) every delivery goes to the leader: each attempt follows a standby's NOT_LEADER
answer and skips a Controller that is down before it counts as failed.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import socket
import time
from collections.abc import Callable, Mapping

import grpc
from google.protobuf import timestamp_pb2

from motor_mesh.common import errors, log, retry, tasks
from motor_mesh.common.config import CoordinatorConfig
from motor_mesh.common.leader_target import ControllerTarget, first_address
from motor_mesh.gen.motor.v1 import alarm_pb2, controller_pb2

ALARM_ID = "0xFC001009"
ALARM_NAME = "Precision issue"
PROBABLE_CAUSE = (
    "The engines of a prefill/decode group answer, but their output is garbled: usually a faulty "
    "accelerator (memory errors, a broken link between devices) or numerical errors in the engine "
    "(overflow, a wrong kernel or precision setting)."
)
# MAJOR, not CRITICAL: the alarm is about one group. The Coordinator keeps routing to it (it does
# not judge fast enough to take a group out safely), and the other groups keep answering
# correctly, so the service is degraded rather than lost; the Controller decides the recovery.
SEVERITY = alarm_pb2.SEVERITY_MAJOR
ALARM = alarm_pb2.ALARM_CATEGORY_ALARM
CLEAR = alarm_pb2.ALARM_CATEGORY_CLEAR

REPORT_TIMEOUT_S = 5.0
MAX_BATCH = 100
_WILDCARDS = frozenset({"", "0.0.0.0", "::", "[::]"})


def moi_of(ip: str, p: int, d: int) -> str:
    return f"service name=Coordinator, service ip={ip}, pId={p}, instanceId={d}"


def _split(hostport: str) -> tuple[str, str]:
    host, _, port = hostport.rpartition(":")
    return host.strip("[]"), port


async def service_ip(host: str, controller: str) -> str:
    """The Coordinator's address for its alarms' moi: ``host`` as it serves, unless that is a
    wildcard (0.0.0.0, ::), which names no one. Then the local address this machine uses to
    reach the Controller (the first one ``controller`` names): the address the Controller sees
    the Coordinator at, chosen by the kernel's routing (a UDP connect sends nothing). The host
    name when even that fails."""
    if host not in _WILDCARDS:
        return host
    try:
        chost, cport = _split(first_address(controller))
        infos = await asyncio.get_running_loop().getaddrinfo(chost, cport, type=socket.SOCK_DGRAM)
        family, _, _, _, addr = infos[0]
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect(addr)
            return str(s.getsockname()[0])
    except (OSError, IndexError, ValueError):
        return socket.gethostname()


def occurred_at(now_ns: int | None = None) -> timestamp_pb2.Timestamp:
    """An alarm's ``occur_time``: ``now_ns`` (tests), else now."""
    occur = timestamp_pb2.Timestamp()
    occur.FromNanoseconds(time.time_ns() if now_ns is None else now_ns)
    return occur


def precision_alarm(
    category: alarm_pb2.AlarmCategory.ValueType,
    moi: str,
    p: int,
    d: int,
    reason: str,
    info: Mapping[str, str],
    now_ns: int | None = None,
) -> alarm_pb2.Alarm:
    return alarm_pb2.Alarm(
        alarm_id=ALARM_ID,
        category=category,
        severity=SEVERITY,
        moi=moi,
        alarm_name=ALARM_NAME,
        probable_cause=PROBABLE_CAUSE,
        reason=reason,
        instance_id=d,
        p_instance_id=p,
        occur_time=occurred_at(now_ns),
        additional_info=dict(info),
    )


class AlarmReporter:
    """The queue of alarms not yet accepted by the Controller, and the task that sends them."""

    def __init__(
        self,
        cfg: CoordinatorConfig,
        key: str | None,
        on_pending: Callable[[int], None] = lambda n: None,
        backoff: retry.Backoff | None = None,
        *,
        kind: str = "precision",
    ) -> None:
        self.kind = kind
        self._target = ControllerTarget(
            cfg.controller,
            key=key,
            tls=cfg,
            max_message_bytes=cfg.max_message_bytes,
            service="coordinator",
        )
        self._queue: collections.deque[alarm_pb2.Alarm] = collections.deque()
        self._wake = asyncio.Event()
        self._on_pending = on_pending
        self._backoff = backoff or retry.Backoff(initial=0.2, maximum=30.0)
        self._task: asyncio.Task[None] | None = None
        self._empty = asyncio.Event()  # set while nothing waits for the Controller
        self._empty.set()

    @property
    def pending(self) -> int:
        return len(self._queue)

    def start(self) -> None:
        self._task = tasks.spawn(f"{self.kind}_alarm_reporter", self._run)

    def submit(self, alarm: alarm_pb2.Alarm) -> None:
        self._queue.append(alarm)
        self._empty.clear()
        self._on_pending(len(self._queue))
        self._wake.set()

    async def active(self, alarm_id: str, timeout_s: float) -> list[alarm_pb2.Alarm]:
        """The Controller's active alarms of ``alarm_id`` (ListAlarms, one page of up to 1000).
        Raises grpc.aio.AioRpcError."""
        request = controller_pb2.ListAlarmsRequest(active_only=True, alarm_id=alarm_id, page_size=1000)
        resp = await self._target.call("ListAlarms", request, timeout_s)
        return list(resp.alarms)

    async def flush(self, timeout_s: float) -> bool:
        """Wait until the Controller accepted everything submitted, at most ``timeout_s``;
        whether it did (before a stop: a last CLEAR is worth a short wait, not a hung stop)."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._empty.wait(), timeout_s)
        return not self._queue

    async def _run(self) -> None:
        while True:
            while not self._queue:
                self._wake.clear()
                await self._wake.wait()
            # The head of the queue, in order: an ALARM always reaches the Controller before
            # its CLEAR.
            batch = [self._queue[i] for i in range(min(MAX_BATCH, len(self._queue)))]
            try:
                resp = await self._target.call(
                    "ReportAlarms", controller_pb2.ReportAlarmsRequest(alarms=batch), REPORT_TIMEOUT_S
                )
            except grpc.aio.AioRpcError as err:
                failure = errors.RpcFailure.of(err)
                delay = self._backoff.next(failure.retry_after)
                # Every code is retried: the alarm must get through, and a Controller that is
                # down, restarting or not yet upgraded all heal on their own. A code that only
                # an operator can fix (a wrong key) is logged as an error.
                logger = log.error if failure.code in retry.TERMINAL_CODES else log.warn
                logger(
                    f"{self.kind}_report_failed",
                    controller=self._target.address,
                    code=failure.code.name,
                    message=failure.message,
                    pending=len(self._queue),
                    retry_in_s=round(delay, 3),
                )
                await asyncio.sleep(delay)
                continue
            for _ in batch:
                self._queue.popleft()
            if not self._queue:
                self._empty.set()
            self._on_pending(len(self._queue))
            self._backoff.reset()
            for a in batch:
                log.event(
                    f"{self.kind}_report_accepted",
                    alarm_id=a.alarm_id,
                    category=alarm_pb2.AlarmCategory.Name(a.category),
                    p=a.p_instance_id,
                    d=a.instance_id,
                    moi=a.moi,
                    # The Controller may recover the group and clear the alarm itself, after
                    # this answer (it then calls ClearPrecisionAlarm): nothing to do here but say so.
                    cleared=resp.precision_alarm_cleared,
                    recovery_pending=resp.precision_recovery_pending,
                )

    async def close(self) -> None:
        await tasks.cancel_quietly(self._task)
        self._task = None
        if self._queue:
            log.warn(f"{self.kind}_reports_lost", pending=len(self._queue), controller=self._target.target)
        await self._target.close()
