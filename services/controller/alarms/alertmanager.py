"""Alarms to Alertmanager: the Controller's alarm store as firing and resolved alerts.

``AlertmanagerSink`` is one of the alarm store's sinks (``on_alarm`` after each stored alarm,
on the event loop). It posts to Alertmanager's ``/api/v2/alerts`` (a JSON list of
postableAlerts) from one supervised background task, so a slow or absent Alertmanager never
holds up the store or anything else on the loop:

- An ALARM is a firing alert: ``startsAt`` = its occur_time, ``endsAt`` = send time +
  ``ENDS_AFTER_RESENDS`` * ``resend_s``. Alertmanager expects clients to keep re-sending firing
  alerts; an explicit endsAt (as Prometheus sends) keeps the alert firing between resends
  whatever the receiving Alertmanager's ``resolve_timeout`` is, and lets it resolve on its own
  if the Controller goes away for good.
- Its CLEAR is the same label set with ``endsAt`` = the clear's time: Alertmanager identifies an
  alert by its labels, so the clear reuses the labels sent for the ALARM (a CLEAR need not repeat
  the ALARM's severity or p_instance_id). Nothing that changes per occurrence (reason, time) is a
  label.
- EVENTs are not sent. Alertmanager has no one-off alerts: an already-resolved alert is never
  notified, and a short-lived firing one notifies "firing" then "resolved" for something nobody
  has to act on. Events stay in the alarm store (``motor alarms``, WatchAlarms).
- Level-triggered: at start and every ``resend_s`` every alarm in ``active()`` is sent again, and
  an alert this sink had firing that is no longer active is resolved. So a restarted Controller,
  or an Alertmanager that lost its state, converges within one resend period.

What waits to be sent is kept per alert label set, latest state only (an ALARM followed by its
CLEAR is one CLEAR), bounded by ``max_pending``; an entry leaves it only once Alertmanager
accepted it, so a failed or cancelled post loses nothing. Connection errors, timeouts, 5xx and
429 are retried with backoff and jitter; any other answer drops the batch with one error line.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import ssl
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime

import aiohttp

from motor_mesh.common import log, tasks
from motor_mesh.common.retry import Backoff
from motor_mesh.controller.alarms.store import dedupe_key
from motor_mesh.gen.motor.v1 import alarm_pb2

# A stable alertname per alarm id, for Alertmanager routes; ids are compared case-insensitively.
ALERTNAMES = {
    "0xfc001002": "MotorInstanceFault",
    "0xfc001004": "MotorCoordinatorFault",
    "0xfc001005": "MotorCoordinatorCongestion",
    "0xfc001009": "MotorPrecisionIssue",
}
OTHER_ALERTNAME = "MotorAlarm"
SEVERITIES = {
    alarm_pb2.SEVERITY_CRITICAL: "critical",
    alarm_pb2.SEVERITY_MAJOR: "major",
    alarm_pb2.SEVERITY_MINOR: "minor",
    alarm_pb2.SEVERITY_WARNING: "warning",
}
# A reporter that set no severity still gets a label routes can match; the least one.
UNSET_SEVERITY = "warning"
# Prometheus's factor: a firing alert survives three lost resends before Alertmanager resolves it.
ENDS_AFTER_RESENDS = 4
MAX_BATCH = 256
# Alertmanager (classic validation) refuses a whole alert whose label or annotation name is not
# [a-zA-Z_][a-zA-Z0-9_]*; additional_info keys are free-form, so they are made to fit.
_NOT_NAME = re.compile(r"[^a-zA-Z0-9_]")

LabelSet = frozenset[tuple[str, str]]


@dataclass(frozen=True, slots=True)
class Alert:
    """One alert as it will be posted; ``ends_at`` None = firing (its endsAt is set when sent)."""

    labels: dict[str, str]
    annotations: dict[str, str]
    starts_at: float
    ends_at: float | None = None

    @property
    def label_set(self) -> LabelSet:
        return frozenset(self.labels.items())

    def postable(self, now: float, firing_for_s: float) -> dict[str, object]:
        ends = self.ends_at if self.ends_at is not None else now + firing_for_s
        # Alertmanager refuses endsAt before startsAt (reporters' clocks differ).
        ends = max(ends, self.starts_at)
        body: dict[str, object] = {"labels": self.labels, "startsAt": rfc3339(self.starts_at)}
        if self.annotations:
            body["annotations"] = self.annotations
        body["endsAt"] = rfc3339(ends)
        return body


def rfc3339(t: float) -> str:
    return datetime.fromtimestamp(t, UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def _when(alarm: alarm_pb2.Alarm, default: float) -> float:
    ts = alarm.occur_time
    return ts.seconds + ts.nanos / 1e9 if (ts.seconds or ts.nanos) else default


def _name(key: str) -> str:
    name = _NOT_NAME.sub("_", key)
    return name if name and not name[0].isdigit() else "_" + name


def labels_of(alarm: alarm_pb2.Alarm) -> dict[str, str]:
    labels = {
        "alertname": ALERTNAMES.get(alarm.alarm_id.lower(), OTHER_ALERTNAME),
        "alarm_id": alarm.alarm_id,
        "severity": SEVERITIES.get(alarm.severity, UNSET_SEVERITY),
        "service": "motor",
    }
    # Empty values are left out: to Alertmanager an empty label is the same as none.
    if alarm.instance_id:
        labels["instance_id"] = str(alarm.instance_id)
    if alarm.p_instance_id:
        labels["p_instance_id"] = str(alarm.p_instance_id)
    if alarm.moi:
        labels["moi"] = alarm.moi
    return labels


def annotations_of(alarm: alarm_pb2.Alarm) -> dict[str, str]:
    notes = {_name(k): v for k, v in sorted(alarm.additional_info.items()) if v}
    for name, value in (
        ("summary", alarm.alarm_name),
        ("description", alarm.reason),
        ("probable_cause", alarm.probable_cause),
    ):
        if value:
            notes[name] = value
    return notes


class AlertmanagerSink:
    """Alarms to the Alertmanager at ``url`` (the full ``…/api/v2/alerts`` URL).

    ``active`` returns the currently active ALARMs (the store's ``active()``). ``start()`` on the
    event loop, ``on_alarm`` for every stored alarm, ``await close()`` at shutdown. ``tls_ca_file``
    is trusted for an https URL, in addition to the system's roots."""

    def __init__(
        self,
        url: str,
        active: Callable[[], list[alarm_pb2.Alarm]],
        *,
        resend_s: float = 60.0,
        timeout_s: float = 5.0,
        tls_ca_file: str = "",
        max_pending: int = 1000,
        backoff: Backoff | None = None,
    ) -> None:
        if resend_s <= 0 or timeout_s <= 0 or max_pending < 1:
            raise ValueError("resend_s and timeout_s must be > 0, max_pending >= 1")
        self.url = url
        self._active = active
        self.resend_s = resend_s
        self.timeout_s = timeout_s
        self.max_pending = max_pending
        self._backoff = backoff or Backoff(0.5, 30.0)
        self._ssl: ssl.SSLContext | bool = True
        if tls_ca_file:  # read now: an unreadable CA file is a start-up error, not a send error
            self._ssl = ssl.create_default_context()
            self._ssl.load_verify_locations(cafile=tls_ca_file)
        self._pending: OrderedDict[LabelSet, Alert] = OrderedDict()
        self._firing: dict[str, Alert] = {}  # what this sink told Alertmanager is firing
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._session: aiohttp.ClientSession | None = None
        self._dropped_unlogged = 0
        # Counters, for tests and for whoever wants to expose them.
        self.sent = 0
        self.dropped = 0
        self.failures = 0

    # -- the store's side: never blocks, never raises for a bad alarm ---------------------------

    def on_alarm(self, alarm: alarm_pb2.Alarm) -> None:
        now = time.time()
        key = dedupe_key(alarm)
        if alarm.category == alarm_pb2.ALARM_CATEGORY_ALARM:
            self._fire(key, Alert(labels_of(alarm), annotations_of(alarm), _when(alarm, now)), now)
        elif alarm.category == alarm_pb2.ALARM_CATEGORY_CLEAR:
            firing = self._firing.pop(key, None)
            # The ALARM's labels, so Alertmanager resolves that very alert; the clear's own when
            # this sink never saw the ALARM. A clear dated in the future (clock skew) takes
            # effect now: Alertmanager would otherwise keep the alert firing until then.
            ended = min(_when(alarm, now), now)
            if firing is None:
                firing = Alert(labels_of(alarm), annotations_of(alarm), ended)
            notes = {**firing.annotations, **annotations_of(alarm)}
            self._put(Alert(firing.labels, notes, firing.starts_at, ended))
        # EVENTs: not sent (module docstring).

    def _fire(self, key: str, alert: Alert, now: float) -> None:
        old = self._firing.get(key)
        if old is not None and old.label_set != alert.label_set:
            # Same alarm, new labels (its severity changed): the old alert would otherwise
            # stay firing beside the new one until its endsAt.
            self._put(Alert(old.labels, old.annotations, old.starts_at, now))
        if old is not None and old.label_set == alert.label_set:
            alert = Alert(alert.labels, alert.annotations, min(old.starts_at, alert.starts_at))
        self._firing[key] = alert
        self._put(alert)

    def _put(self, alert: Alert, *, if_absent: bool = False) -> None:
        ls = alert.label_set
        if ls in self._pending:
            if if_absent:
                return  # what is pending is at least as recent as a resend
            self._pending[ls] = alert  # latest state wins: an ALARM then its CLEAR is the CLEAR
            self._pending.move_to_end(ls)
        else:
            if len(self._pending) >= self.max_pending:
                self._drop_one()
            self._pending[ls] = alert
        self._wake.set()

    def _drop_one(self) -> None:
        # The oldest firing alert goes first: the next resend brings it back if it is still
        # active, whereas a dropped resolve is only made good by the firing alert's endsAt.
        victim = next((ls for ls, a in self._pending.items() if a.ends_at is None), None)
        if victim is None:
            victim = next(iter(self._pending))
        del self._pending[victim]
        self.dropped += 1
        self._dropped_unlogged += 1

    def _resend_active(self) -> None:
        now = time.time()
        firing: dict[str, Alert] = {}
        for alarm in self._active():
            if alarm.category != alarm_pb2.ALARM_CATEGORY_ALARM:
                continue
            key = dedupe_key(alarm)
            alert = Alert(labels_of(alarm), annotations_of(alarm), _when(alarm, now))
            old = self._firing.get(key)
            if old is not None and old.label_set != alert.label_set:
                self._put(Alert(old.labels, old.annotations, old.starts_at, now))
            elif old is not None and old.starts_at < alert.starts_at:
                # The store moves an active alarm's occur_time to its latest report; the alert
                # started with the first.
                alert = Alert(alert.labels, alert.annotations, old.starts_at)
            firing[key] = alert
        # What this sink had firing and the store no longer has active was cleared without a
        # CLEAR reaching us (or the store forgot it): resolve it rather than let it linger.
        for key, old in self._firing.items():
            if key not in firing:
                self._put(Alert(old.labels, old.annotations, old.starts_at, now))
        self._firing = firing
        for alert in firing.values():
            self._put(alert, if_absent=True)

    # -- the sending task ------------------------------------------------------------------------

    def start(self) -> None:
        if self._task is None:
            # What is active now is queued at once: after a Controller restart, Alertmanager
            # hears about it again, and a CLEAR from now on finds the labels its ALARM was sent
            # with.
            self._resend_active()
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.timeout_s))
            self._task = tasks.spawn("alertmanager_sink", self._run)

    async def close(self, flush_timeout_s: float = 1.0) -> None:
        """Stop sending; one last short attempt at what is pending (resolves above all)."""
        await tasks.cancel_quietly(self._task)
        self._task = None
        if self._session is None:
            return
        if self._pending:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._send_once(), flush_timeout_s)
        await self._session.close()
        self._session = None

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        next_resend = loop.time() + self.resend_s  # start() queued what is active
        while True:
            if loop.time() >= next_resend:
                self._resend_active()
                next_resend = loop.time() + self.resend_s
            if not self._pending:
                self._wake.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), max(0.0, next_resend - loop.time()))
                continue
            retry_after = await self._send_once()
            if retry_after is not None:
                await asyncio.sleep(retry_after)

    async def _send_once(self) -> float | None:
        """Post one batch of what is pending. None when the loop may go on at once; otherwise
        how long to wait before the next attempt."""
        assert self._session is not None
        if self._dropped_unlogged:
            log.warn("alert_queue_full", dropped=self._dropped_unlogged, limit=self.max_pending)
            self._dropped_unlogged = 0
        batch = list(self._pending.items())[:MAX_BATCH]
        now = time.time()
        firing_for_s = ENDS_AFTER_RESENDS * self.resend_s
        payload = [alert.postable(now, firing_for_s) for _, alert in batch]
        try:
            async with self._session.post(self.url, json=payload, ssl=self._ssl) as resp:
                status, header = resp.status, resp.headers.get("Retry-After", "")
                # Alertmanager says what it refused; the payload itself is never logged.
                detail = (await resp.text(errors="replace"))[:200] if status >= 300 else ""
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            return self._failed(error=f"{type(exc).__name__}: {exc}"[:200])
        if status >= 500 or status == 429:
            return self._failed(status=status, retry_after=header)
        # Accepted, or refused for good: either way this batch leaves the queue (an entry that
        # was replaced meanwhile by a newer state stays, to be sent next).
        for ls, alert in batch:
            if self._pending.get(ls) is alert:
                del self._pending[ls]
        self._backoff.reset()
        if status >= 300:
            self.dropped += len(batch)
            log.error("alert_rejected", status=status, dropped=len(batch), detail=detail)
            return None
        self.sent += len(batch)
        resolved = sum(1 for _, a in batch if a.ends_at is not None)
        log.event("alert_sent", count=len(batch), firing=len(batch) - resolved, resolved=resolved)
        return None

    def _failed(self, *, status: int = 0, error: str = "", retry_after: str = "") -> float:
        self.failures += 1
        delay = self._backoff.next(float(retry_after) if retry_after.isdigit() else None)
        fields: dict[str, object] = {"status": status} if status else {"error": error}
        log.warn("alert_send_failed", **fields, pending=len(self._pending), retry_in_s=round(delay, 3))
        return delay
