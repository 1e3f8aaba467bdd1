"""AlertmanagerSink: the postableAlerts it posts (checked against the schema by a receiver in the
test), retry with backoff, never blocking the loop, coalescing, level-triggered resends; and the
same against a real Alertmanager when one is installed (`make system-deps` installs Debian's)."""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import AsyncIterator, Callable
from datetime import datetime
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from google.protobuf.timestamp_pb2 import Timestamp

from motor_mesh.common.retry import Backoff
from motor_mesh.controller.alarms.alertmanager import AlertmanagerSink
from motor_mesh.controller.alarms.store import dedupe_key
from motor_mesh.gen.motor.v1 import alarm_pb2
from tests.poll import until
from tests.ports import reserved_port
from tests.procs import Exited, Proc, system_binary

ALARM, CLEAR, EVENT = (
    alarm_pb2.ALARM_CATEGORY_ALARM,
    alarm_pb2.ALARM_CATEGORY_CLEAR,
    alarm_pb2.ALARM_CATEGORY_EVENT,
)
MOI = "service name=Coordinator, service ip=127.0.0.1, pId={p}, instanceId={d}"


def alarm(
    category: int = ALARM,
    d: int = 7,
    *,
    alarm_id: str = "0xFC001002",
    p: int = 6,
    severity: int = alarm_pb2.SEVERITY_MAJOR,
    reason: str = "engine died",
    info: dict[str, str] | None = None,
) -> alarm_pb2.Alarm:
    when = Timestamp()
    when.GetCurrentTime()
    return alarm_pb2.Alarm(
        alarm_id=alarm_id,
        category=category,  # type: ignore[arg-type]
        severity=severity,  # type: ignore[arg-type]
        moi=MOI.format(p=p, d=d),
        alarm_name="instance fault",
        probable_cause="an engine process exited",
        reason=reason,
        instance_id=d,
        p_instance_id=p,
        occur_time=when,
        additional_info=info or {},
    )


def clear(d: int = 7, **kw: Any) -> alarm_pb2.Alarm:
    # A CLEAR repeats the moi, alarm_id and instance_id, not necessarily severity or p_instance_id.
    a = alarm(CLEAR, d, severity=alarm_pb2.SEVERITY_UNSPECIFIED, reason="engine back", **kw)
    a.p_instance_id = 0
    return a


class Store:
    """The alarm store's contract as the sink sees it: ``active()``, and ``on_alarm`` after each
    stored alarm."""

    def __init__(self) -> None:
        self.alarms: dict[str, alarm_pb2.Alarm] = {}
        self.sinks: list[AlertmanagerSink] = []

    def active(self) -> list[alarm_pb2.Alarm]:
        return list(self.alarms.values())

    def report(self, a: alarm_pb2.Alarm) -> None:
        if a.category == ALARM:
            self.alarms[dedupe_key(a)] = a
        elif a.category == CLEAR:
            self.alarms.pop(dedupe_key(a), None)
        for s in self.sinks:
            s.on_alarm(a)


# ---- the postableAlerts schema, checked by hand ----------------------------------------------------

NAME = re.compile(r"^[a-zA-Z_][a-zA-Z0-9_]*$")
RFC3339 = re.compile(r"^\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}(\.\d+)?(Z|[+-]\d{2}:\d{2})$")
FIELDS = {"labels", "annotations", "startsAt", "endsAt", "generatorURL"}


def label_set_errors(where: str, value: Any, *, required: bool) -> list[str]:
    if not isinstance(value, dict):
        return [f"{where}: not an object"]
    if required and not value:
        return [f"{where}: empty"]
    errs = [f"{where}: bad name {k!r}" for k in value if not isinstance(k, str) or not NAME.match(k)]
    errs += [f"{where}[{k}]: not a string" for k, v in value.items() if not isinstance(v, str)]
    return errs


def schema_errors(body: Any) -> list[str]:
    """What in ``body`` Alertmanager's POST /api/v2/alerts (postableAlerts) would refuse."""
    if not isinstance(body, list) or not body:
        return ["body: not a non-empty list"]
    errs: list[str] = []
    for i, a in enumerate(body):
        if not isinstance(a, dict):
            errs.append(f"[{i}]: not an object")
            continue
        errs += [f"[{i}]: unknown field {k!r}" for k in set(a) - FIELDS]
        errs += label_set_errors(f"[{i}].labels", a.get("labels"), required=True)
        if "annotations" in a:
            errs += label_set_errors(f"[{i}].annotations", a["annotations"], required=False)
        times = {}
        for f in ("startsAt", "endsAt"):
            if f in a:
                if isinstance(a[f], str) and RFC3339.match(a[f]):
                    times[f] = datetime.fromisoformat(a[f])
                else:
                    errs.append(f"[{i}].{f}: not RFC3339: {a[f]!r}")
        if len(times) == 2 and times["endsAt"] < times["startsAt"]:
            errs.append(f"[{i}]: endsAt before startsAt")
        if "generatorURL" in a and not isinstance(a["generatorURL"], str):
            errs.append(f"[{i}].generatorURL: not a string")
    return errs


class Receiver:
    """An Alertmanager stand-in: records every POST, checks it against the schema, answers
    ``answers`` in turn (then 200), and with ``hang`` set waits for it before answering."""

    def __init__(self) -> None:
        self.posts: list[list[dict[str, Any]]] = []
        self.received: list[datetime] = []  # when each post arrived
        self.errors: list[str] = []
        self.answers: list[int] = []
        self.hang: asyncio.Event | None = None
        self.in_flight = 0
        self.runner: web.AppRunner | None = None
        self.url = ""

    async def handle(self, request: web.Request) -> web.Response:
        if request.content_type != "application/json":
            self.errors.append(f"content type {request.content_type}")
        body = await request.json()
        self.errors += schema_errors(body)
        self.posts.append(body)
        self.received.append(datetime.now().astimezone())
        if self.hang is not None:
            self.in_flight += 1
            await self.hang.wait()
            self.in_flight -= 1
        status = self.answers.pop(0) if self.answers else 200
        return web.Response(status=status, text="" if status == 200 else f"answer {status}")

    async def start(self, port: int = 0) -> Receiver:
        app = web.Application()
        app.router.add_post("/api/v2/alerts", self.handle)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", port)
        await site.start()
        port = self.runner.addresses[0][1]
        self.url = f"http://127.0.0.1:{port}/api/v2/alerts"
        return self

    async def stop(self) -> None:
        if self.hang is not None:
            self.hang.set()
        if self.runner is not None:
            await self.runner.cleanup()

    def alerts(self) -> list[dict[str, Any]]:
        return [a for post in self.posts for a in post]

    def states(self, d: int) -> list[str]:
        """For each alert received about instance ``d``, in order: 'firing' (its endsAt was
        ahead when it arrived) or 'resolved'."""
        return [
            "firing" if datetime.fromisoformat(a["endsAt"]) > at else "resolved"
            for post, at in zip(self.posts, self.received, strict=True)
            for a in post
            if a["labels"].get("instance_id") == str(d)
        ]


@pytest.fixture
async def receiver() -> AsyncIterator[Receiver]:
    r = await Receiver().start()
    yield r
    assert not r.errors, r.errors
    await r.stop()


@pytest.fixture
async def sinks() -> AsyncIterator[Callable[..., AlertmanagerSink]]:
    made: list[AlertmanagerSink] = []

    def make(url: str, store: Store, **kw: Any) -> AlertmanagerSink:
        kw.setdefault("backoff", Backoff(0.01, 0.05))
        kw.setdefault("resend_s", 3600.0)
        sink = AlertmanagerSink(url, store.active, **kw)
        store.sinks.append(sink)
        made.append(sink)
        return sink

    yield make
    for s in made:
        await s.close(flush_timeout_s=0.1)


def events(caplog: pytest.LogCaptureFixture, name: str) -> list[dict[str, Any]]:
    return [r.fields for r in caplog.records if getattr(r, "event", None) == name]  # type: ignore[attr-defined]


EXPECTED_LABELS = {
    "alertname": "MotorInstanceFault",
    "alarm_id": "0xFC001002",
    "severity": "major",
    "instance_id": "7",
    "p_instance_id": "6",
    "moi": MOI.format(p=6, d=7),
    "service": "motor",
}


# ---- always: against the receiver ------------------------------------------------------------------


async def test_alarm_fires_and_its_clear_resolves_the_same_labels(receiver: Receiver, sinks: Any) -> None:
    store = Store()
    sink = sinks(receiver.url, store)
    sink.start()
    store.report(alarm(info={"node-ip": "10.0.0.21", "2nd try": "yes"}))
    await until(lambda: receiver.states(7) == ["firing"])
    (fired,) = receiver.alerts()
    assert fired["labels"] == EXPECTED_LABELS
    assert fired["annotations"] == {
        "summary": "instance fault",
        "description": "engine died",
        "probable_cause": "an engine process exited",
        "node_ip": "10.0.0.21",  # additional_info keys made valid annotation names
        "_2nd_try": "yes",
    }

    store.report(clear())
    await until(lambda: receiver.states(7) == ["firing", "resolved"])
    resolved = receiver.alerts()[1]
    # Identical labels although the CLEAR carried no severity and no p_instance_id.
    assert resolved["labels"] == EXPECTED_LABELS
    assert resolved["startsAt"] == fired["startsAt"]
    assert resolved["annotations"]["description"] == "engine back"


async def test_events_are_not_sent(receiver: Receiver, sinks: Any) -> None:
    store = Store()
    sink = sinks(receiver.url, store)
    sink.start()
    store.report(alarm(EVENT, 3))
    store.report(alarm(ALARM, 4))
    await until(lambda: receiver.posts)
    assert [a["labels"]["instance_id"] for a in receiver.alerts()] == ["4"]


async def test_5xx_and_429_are_retried_with_growing_backoff(
    receiver: Receiver, sinks: Any, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="motor")
    receiver.answers = [500, 429, 503]
    store = Store()
    sink = sinks(receiver.url, store)
    sink.start()
    store.report(alarm())
    await until(lambda: sink.sent == 1)
    assert len(receiver.posts) == 4 and sink.failures == 3
    assert all([a["labels"] for a in post] == [EXPECTED_LABELS] for post in receiver.posts)
    failed = events(caplog, "alert_send_failed")
    assert [f["status"] for f in failed] == [500, 429, 503]
    delays = [f["retry_in_s"] for f in failed]
    assert delays[0] < delays[1] < delays[2]  # 0.01, 0.02, 0.04 (±20%)
    assert events(caplog, "alert_sent")[-1]["count"] == 1


async def test_a_refused_batch_is_dropped_with_one_error_line(
    receiver: Receiver, sinks: Any, caplog: pytest.LogCaptureFixture
) -> None:
    receiver.answers = [400]
    store = Store()
    sink = sinks(receiver.url, store)
    sink.start()
    store.report(alarm(d=1))
    await until(lambda: sink.dropped == 1)
    store.report(alarm(d=2))
    await until(lambda: sink.sent == 1)
    # Not retried: the second post carries only the new alarm.
    assert [[a["labels"]["instance_id"] for a in post] for post in receiver.posts] == [["1"], ["2"]]
    (line,) = events(caplog, "alert_rejected")
    assert line["status"] == 400 and line["dropped"] == 1 and "answer 400" in line["detail"]


async def test_an_unreachable_alertmanager_gets_the_alarm_once_it_is_up(sinks: Any) -> None:
    port = reserved_port()
    store = Store()
    sink = sinks(f"http://127.0.0.1:{port}/api/v2/alerts", store)
    sink.start()
    store.report(alarm())
    await until(lambda: sink.failures >= 2)  # connection refused, retried
    late = await Receiver().start(port)
    try:
        await until(lambda: late.states(7) == ["firing"])
        assert not late.errors
    finally:
        await late.stop()


async def test_a_hung_alertmanager_blocks_nothing(receiver: Receiver, sinks: Any) -> None:
    receiver.hang = asyncio.Event()
    store = Store()
    sink = sinks(receiver.url, store, timeout_s=60.0)
    sink.start()
    store.report(alarm(d=1))
    await until(lambda: receiver.in_flight == 1)

    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            ticks += 1
            await asyncio.sleep(0)

    other_work = asyncio.create_task(ticker())
    try:
        for d in range(2, 200):
            store.report(alarm(d=d))  # a plain call: it returns while the POST still hangs
        before = ticks
        await until(lambda: ticks > before + 100)
        assert receiver.in_flight == 1 and len(receiver.posts) == 1
    finally:
        other_work.cancel()
    await sink.close(flush_timeout_s=0.1)  # ends although the receiver still hangs
    receiver.hang.set()


async def test_coalescing_keeps_the_clear_and_a_full_queue_drops_firing_alerts_first(
    receiver: Receiver, sinks: Any, caplog: pytest.LogCaptureFixture
) -> None:
    store = Store()
    sink = sinks(receiver.url, store, max_pending=3, resend_s=0.2)
    # Before the sending task runs: everything waits in the queue.
    store.report(alarm(d=1))
    store.report(clear(d=1))  # the same label set: replaces the ALARM
    for d in (2, 3, 4):
        store.report(alarm(d=d))  # d=4 finds the queue full: the oldest firing alert goes
    assert sink.dropped == 1
    sink.start()  # its first resend finds the queue full again, and drops again
    await until(lambda: receiver.posts)
    assert len(receiver.posts[0]) == 3
    assert receiver.states(1) == ["resolved"]  # never sent firing, and its CLEAR was kept
    assert events(caplog, "alert_queue_full")[0]["dropped"] >= 1
    # Dropped firing alerts come back with the next resends: they are still active.
    await until(lambda: all("firing" in receiver.states(d) for d in (2, 3, 4)))


async def test_resends_keep_active_alarms_firing_and_stop_once_cleared(
    receiver: Receiver, sinks: Any
) -> None:
    store = Store()
    sink = sinks(receiver.url, store, resend_s=0.2)
    store.report(alarm(d=1))  # before start: level-triggered, as after a Controller restart
    store.report(alarm(d=2))
    sink.start()
    await until(lambda: receiver.states(1).count("firing") >= 3 and receiver.states(2).count("firing") >= 3)

    store.report(clear(d=1))
    await until(lambda: "resolved" in receiver.states(1))
    seen = len(receiver.states(2))
    await until(lambda: len(receiver.states(2)) >= seen + 3)  # three more resends of d=2
    after = receiver.states(1)
    assert after[after.index("resolved") :] == ["resolved"]  # d=1 is no longer re-announced


async def test_an_alarm_gone_from_the_store_without_a_clear_is_resolved(
    receiver: Receiver, sinks: Any
) -> None:
    store = Store()
    sink = sinks(receiver.url, store, resend_s=0.1)
    sink.start()
    store.report(alarm(d=1))
    await until(lambda: receiver.states(1) == ["firing"])
    store.alarms.clear()  # forgotten: no CLEAR reaches the sink
    await until(lambda: "resolved" in receiver.states(1))


async def test_a_new_severity_resolves_the_old_label_set(receiver: Receiver, sinks: Any) -> None:
    store = Store()
    sink = sinks(receiver.url, store)
    sink.start()
    store.report(alarm(severity=alarm_pb2.SEVERITY_MAJOR))
    await until(lambda: len(receiver.alerts()) == 1)
    store.report(alarm(severity=alarm_pb2.SEVERITY_CRITICAL))
    await until(lambda: len(receiver.alerts()) == 3)
    assert receiver.states(7) == ["firing", "resolved", "firing"]
    assert [a["labels"]["severity"] for a in receiver.alerts()] == ["major", "major", "critical"]


# ---- a real Alertmanager, when installed ---------------------------------------------------------

AM_CONFIG = 'route:\n  receiver: "null"\nreceivers:\n  - name: "null"\n'
LISTENING = 'msg="Listening on"'


def alertmanager_binary() -> str | None:
    return system_binary("prometheus-alertmanager", "alertmanager")


class RealAlertmanager:
    """An Alertmanager on loopback, no gossip, its state in ``tmp``. Port 0 (the default): where
    it bound, read from its ``msg="Listening on"`` line by ``started()`` / ``await_started()``."""

    def __init__(self, binary: str, tmp: Path, port: int = 0) -> None:
        tmp.mkdir(parents=True, exist_ok=True)
        (tmp / "alertmanager.yml").write_text(AM_CONFIG)
        self.proc = Proc(
            [
                binary,
                f"--config.file={tmp / 'alertmanager.yml'}",
                f"--storage.path={tmp / 'data'}",
                f"--web.listen-address=127.0.0.1:{port}",
                "--cluster.listen-address=",
            ],
            cwd=tmp,
        )
        self.port = port

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _bound(self, line: str) -> RealAlertmanager:
        m = re.search(r"address=\S+:(\d+)", line)
        assert m is not None, line
        self.port = int(m.group(1))
        return self

    def started(self) -> RealAlertmanager:
        return self._bound(self.proc.wait_line(LISTENING, 30))

    async def await_started(self) -> RealAlertmanager:
        return self._bound(await self.proc.await_line(LISTENING, 30))

    async def wait_ready(self, http: aiohttp.ClientSession) -> None:
        async def ready() -> bool:
            if not self.proc.alive():
                raise Exited(f"alertmanager exited:\n{self.proc.tail()}")
            async with http.get(f"{self.base}/-/ready") as resp:  # refused until it is up: not yet
                return resp.status == 200

        await until(ready, timeout=30.0, what="alertmanager /-/ready", retry=(aiohttp.ClientError,))

    async def active_alerts(self, http: aiohttp.ClientSession) -> list[dict[str, Any]]:
        async with http.get(f"{self.base}/api/v2/alerts", params={"active": "true"}) as resp:
            assert resp.status == 200
            return list(await resp.json())

    def stop(self) -> None:
        self.proc.stop(10)


def require_alertmanager() -> None:
    # Called from the tests themselves, not a fixture: pytest then reports every skip at this one
    # line, folded into one summary line.
    if alertmanager_binary() is None:
        pytest.skip(
            "no Alertmanager (prometheus-alertmanager or alertmanager on PATH or in /usr/bin; "
            "`make system-deps` installs Debian's as root): real-Alertmanager tests skipped"
        )


class Alertmanagers:
    """Starts real Alertmanagers (each with its own directory under ``tmp``); ``http`` queries
    them."""

    def __init__(self, tmp: Path, http: aiohttp.ClientSession) -> None:
        self.tmp, self.http = tmp, http
        self.started: list[RealAlertmanager] = []

    async def start(self, port: int = 0) -> RealAlertmanager:
        binary = alertmanager_binary()
        assert binary is not None, "call require_alertmanager() first"
        am = RealAlertmanager(binary, self.tmp / f"am-{len(self.started)}", port)
        self.started.append(am)
        await am.await_started()
        await am.wait_ready(self.http)
        return am


@pytest.fixture
async def alertmanagers(tmp_path: Path) -> AsyncIterator[Alertmanagers]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as http:
        ams = Alertmanagers(tmp_path, http)
        try:
            yield ams
        finally:
            for am in ams.started:
                am.stop()


async def firing_in(am: RealAlertmanager, http: aiohttp.ClientSession, d: int) -> dict[str, Any] | None:
    for a in await am.active_alerts(http):
        if a["labels"].get("instance_id") == str(d) and a["status"]["state"] == "active":
            return a
    return None


async def absent(am: RealAlertmanager, http: aiohttp.ClientSession, d: int) -> bool:
    """Nothing about instance ``d`` among the active alerts (v2 never lists resolved ones)."""
    return all(a["labels"].get("instance_id") != str(d) for a in await am.active_alerts(http))


async def test_real_alertmanager_fires_and_resolves(alertmanagers: Alertmanagers, sinks: Any) -> None:
    require_alertmanager()
    am, http = await alertmanagers.start(), alertmanagers.http
    store = Store()
    sink = sinks(f"{am.base}/api/v2/alerts", store)
    sink.start()
    store.report(alarm())
    got = await until(lambda: firing_in(am, http, 7), timeout=20.0)
    assert got["labels"] == EXPECTED_LABELS
    assert got["annotations"]["summary"] == "instance fault"

    store.report(clear())
    await until(lambda: absent(am, http, 7), timeout=20.0)


async def test_real_alertmanager_started_late_still_gets_the_alarm(
    alertmanagers: Alertmanagers, sinks: Any
) -> None:
    require_alertmanager()
    port = reserved_port()
    store = Store()
    sink = sinks(f"http://127.0.0.1:{port}/api/v2/alerts", store)
    sink.start()
    store.report(alarm())
    await until(lambda: sink.failures >= 1)
    am = await alertmanagers.start(port)
    await until(lambda: firing_in(am, alertmanagers.http, 7), timeout=20.0)


async def test_real_alertmanager_hears_active_alarms_again_after_it_restarts(
    alertmanagers: Alertmanagers, sinks: Any
) -> None:
    require_alertmanager()
    # A reserved port: the restarted Alertmanager binds it again.
    am, http = await alertmanagers.start(reserved_port()), alertmanagers.http
    store = Store()
    store.report(alarm())  # raised before the sink exists: the first resend announces it
    sink = sinks(f"{am.base}/api/v2/alerts", store, resend_s=0.3)
    sink.start()
    await until(lambda: firing_in(am, http, 7), timeout=20.0)
    am.stop()  # Alertmanager keeps alerts in memory only: the new one starts empty
    again = await alertmanagers.start(am.port)
    await until(lambda: firing_in(again, http, 7), timeout=20.0)
