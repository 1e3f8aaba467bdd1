"""The congestion alarm 0xFC001005 (services/coordinator/congestion.py): the raise/clear rule on a
fake clock, the monitor's reports and gauges, the inference workers' admission summed by the
management process, and a real in-process Coordinator under overload reporting to a real
in-process Controller (and to one that is unreachable at first)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import re
import shutil
import tempfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from motor_mesh.common.config import CoordinatorConfig, load
from motor_mesh.common.enums import UNION
from motor_mesh.controller.alarms.alertmanager import labels_of
from motor_mesh.controller.alarms.store import CONGESTION, dedupe_key
from motor_mesh.controller.validation import report_alarms
from motor_mesh.coordinator import congestion
from motor_mesh.coordinator.congestion import CLEAR_BELOW, RAISE_AT, Change, Congestion, CongestionMonitor
from motor_mesh.coordinator.metrics import Metrics, use_own_process
from motor_mesh.coordinator.workers import codec
from motor_mesh.coordinator.workers.hub import WorkerHub
from motor_mesh.coordinator.workers.link import WorkerLink
from motor_mesh.gen.motor.v1 import alarm_pb2, controller_pb2
from tests.controller.fakes import running_controller
from tests.coordinator.conftest import (
    MODEL,
    FakeController,
    Running,
    SpawnEngines,
    StartCoordinator,
    get_text,
    instance,
    set_table,
)
from tests.poll import until

pytestmark = pytest.mark.timeout(60)

ALARM = alarm_pb2.ALARM_CATEGORY_ALARM
CLEAR = alarm_pb2.ALARM_CATEGORY_CLEAR
ADDRESS = "10.0.0.11:7200"


# ---- the rule, on a fake clock -------------------------------------------------------------------


def run(state: Congestion, samples: list[tuple[float, float]], raise_after_s: float = 10.0) -> list[Any]:
    """Feed (time, use) samples; the changes, as (time, change)."""
    out = []
    for t, use in samples:
        change = state.sample(use, t, raise_after_s)
        if change is not None:
            out.append((t, change))
    return out


def every(start: float, end: float, use: float, step: float = 0.5) -> list[tuple[float, float]]:
    n = round((end - start) / step)
    return [(start + i * step, use) for i in range(n + 1)]


def test_raised_once_only_after_the_whole_window() -> None:
    state = Congestion()
    assert run(state, every(0, 9.5, 0.9)) == []
    assert run(state, [(10.0, 0.9)]) == [(10.0, Change.RAISE)]
    assert state.raised
    assert run(state, every(10.5, 60, 1.2)) == []  # raised once, not again while it lasts


def test_exactly_85_percent_counts_as_congested() -> None:
    state = Congestion()
    assert run(state, [(0, 17 / 20), (10, 17 / 20)]) == [(10, Change.RAISE)]
    assert run(Congestion(), [(0, RAISE_AT - 1e-9), (10, RAISE_AT - 1e-9)]) == []


def test_a_dip_below_85_percent_before_the_raise_starts_the_window_again() -> None:
    state = Congestion()
    assert run(state, [*every(0, 6, 0.95), (6.5, 0.84), *every(7, 16.5, 0.95)]) == []
    assert run(state, [(17, 0.95)]) == [(17, Change.RAISE)]


def test_cleared_below_75_percent_and_not_between() -> None:
    state = Congestion()
    run(state, every(0, 10, 1.0))
    assert state.raised
    # A dip to 80 % neither clears nor makes a second raise; 75 % itself is not below.
    assert run(state, [(11, 0.80), (12, 0.95), (13, CLEAR_BELOW), (14, 0.99)]) == []
    assert run(state, [(15, 0.7499)]) == [(15, Change.CLEAR)]
    assert not state.raised
    # Congested again: a whole new window.
    assert run(state, [*every(16, 25.5, 0.9)]) == []
    assert run(state, [(26, 0.9)]) == [(26, Change.RAISE)]


def test_load_hovering_between_the_thresholds_never_flaps() -> None:
    below, raised = Congestion(), Congestion()
    # Before a raise: swinging between 74 % and 84 % never raises.
    swing = [(t * 0.5, 0.74 if t % 2 else 0.84) for t in range(200)]
    assert run(below, swing) == []
    # After it: swinging between 76 % and 100 % never clears.
    run(raised, every(0, 10, 0.9))
    assert run(raised, [(10 + t * 0.5, 0.76 if t % 2 else 1.0) for t in range(200)]) == []
    assert raised.raised


def test_zero_seconds_raises_at_the_first_congested_sample() -> None:
    state = Congestion()
    assert run(state, [(0, 0.5), (1, 0.86)], raise_after_s=0) == [(1, Change.RAISE)]


# ---- the monitor: reports, gauges, settings, stop -------------------------------------------------


class Reporter:
    """What the monitor hands its AlarmReporter."""

    def __init__(self) -> None:
        self.sent: list[alarm_pb2.Alarm] = []
        self.started = self.closed = False
        self.flushes = 0
        self.held: list[alarm_pb2.Alarm] = []  # the Controller's active congestion alarms

    def start(self) -> None:
        self.started = True

    def submit(self, alarm: alarm_pb2.Alarm) -> None:
        self.sent.append(alarm)

    async def flush(self, timeout_s: float) -> bool:
        self.flushes += 1
        return True

    async def active(self, alarm_id: str, timeout_s: float) -> list[alarm_pb2.Alarm]:
        assert alarm_id == congestion.ALARM_ID
        return self.held

    async def close(self) -> None:
        self.closed = True


def settings(**kw: Any) -> CoordinatorConfig:
    base = {"max_concurrent_requests": 6, "max_queued_requests": 4, "congestion_raise_s": 10}
    return load(None, env={}, overrides={"coordinator": {**base, **kw}}).coordinator


@pytest.fixture
def metrics() -> Metrics:
    use_own_process()
    return Metrics()


def gauge(m: Metrics, name: str) -> float | None:
    return m.registry.get_sample_value(name)


class Rig:
    def __init__(self, metrics: Metrics, **cfg: Any) -> None:
        self.cfg = settings(**cfg)
        self.load = (0, 0)
        self.now = 0.0
        self.reporter = Reporter()
        self.monitor = CongestionMonitor(
            lambda: self.cfg,
            lambda: self.load,
            self.reporter,  # type: ignore[arg-type]
            metrics,
            ADDRESS,
            clock=lambda: self.now,
        )

    def at(self, t: float, running: int, queued: int) -> Change | None:
        self.now, self.load = t, (running, queued)
        return self.monitor.sample()


def test_the_alarm_and_its_clear_name_the_coordinator(metrics: Metrics) -> None:
    rig = Rig(metrics)
    assert rig.at(0, 6, 3) is None  # 9 of 10
    assert gauge(metrics, "motor_coordinator_admission_use") == pytest.approx(0.9)
    assert gauge(metrics, "motor_coordinator_congestion_alarm") == 0
    assert rig.at(10, 6, 4) is Change.RAISE
    assert gauge(metrics, "motor_coordinator_congestion_alarm") == 1
    (raised,) = rig.reporter.sent
    assert raised.alarm_id == CONGESTION == congestion.ALARM_ID == "0xFC001005"
    assert raised.category == ALARM and raised.severity == alarm_pb2.SEVERITY_MAJOR
    assert raised.moi == f"service name=Coordinator, service ip={ADDRESS}"
    assert raised.instance_id == 0 and raised.p_instance_id == 0
    assert raised.alarm_name == "Coordinator congestion" and raised.probable_cause
    assert "100% (6 running + 4 queued of 10)" in raised.reason and "for 10.0s" in raised.reason
    assert dict(raised.additional_info) == {
        "address": ADDRESS,
        "use": "1.000",
        "running": "6",
        "queued": "4",
        "capacity": "10",
        "congestion_raise_s": "10",
    }
    assert raised.HasField("occur_time")

    assert rig.at(11, 5, 3) is None  # 80 %: still raised
    assert rig.at(12, 5, 2) is Change.CLEAR  # 70 %
    (_, cleared) = rig.reporter.sent
    assert cleared.category == CLEAR and cleared.moi == raised.moi
    assert "70%" in cleared.reason
    assert gauge(metrics, "motor_coordinator_congestion_alarm") == 0
    # The Controller takes both, and its store pairs the CLEAR with the ALARM.
    assert report_alarms(controller_pb2.ReportAlarmsRequest(alarms=[raised, cleared])) == []
    assert dedupe_key(raised) == dedupe_key(cleared)
    # Alertmanager: a stable name, and the same labels for both (so the clear resolves it).
    assert labels_of(raised)["alertname"] == "MotorCoordinatorCongestion"
    assert labels_of(raised) == labels_of(cleared)


def test_two_coordinators_raise_two_alarms(metrics: Metrics) -> None:
    a = congestion.congestion_alarm(ALARM, "10.0.0.11:7200", "r", congestion.Sample(1, 1, 2), 10)
    b = congestion.congestion_alarm(ALARM, "10.0.0.11:7201", "r", congestion.Sample(1, 1, 2), 10)
    assert dedupe_key(a) != dedupe_key(b)


def test_the_controller_refuses_a_congestion_alarm_without_moi() -> None:
    bad = alarm_pb2.Alarm(alarm_id=CONGESTION, category=ALARM, severity=alarm_pb2.SEVERITY_MAJOR)
    assert [f for f, _ in report_alarms(controller_pb2.ReportAlarmsRequest(alarms=[bad]))] == [
        "alarms[0].moi"
    ]


def test_settings_are_read_at_every_sample(metrics: Metrics) -> None:
    rig = Rig(metrics, congestion_raise_s=5)
    assert rig.at(0, 4, 0) is None  # 4 of 10
    assert gauge(metrics, "motor_coordinator_admission_use") == pytest.approx(0.4)
    # A reload lowers the limits: the same requests now fill 4 of 4, and the new wait applies.
    rig.cfg = dataclasses.replace(
        rig.cfg, max_concurrent_requests=2, max_queued_requests=2, congestion_raise_s=1
    )
    assert rig.at(1, 4, 0) is None
    assert gauge(metrics, "motor_coordinator_admission_use") == pytest.approx(1.0)
    assert rig.at(2, 4, 0) is Change.RAISE
    # Use above 1: shares rounded up per worker, or limits lowered under admitted requests.
    rig.at(3, 5, 1)
    assert gauge(metrics, "motor_coordinator_admission_use") == pytest.approx(1.5)


async def test_a_raised_alarm_is_cleared_when_the_coordinator_stops(metrics: Metrics) -> None:
    rig = Rig(metrics, congestion_raise_s=0)
    rig.monitor.start()
    try:
        assert rig.reporter.started
        rig.at(0, 6, 4)
    finally:
        await rig.monitor.close()
    assert [a.category for a in rig.reporter.sent] == [ALARM, CLEAR]
    assert rig.reporter.sent[1].reason == "the Coordinator is stopping"
    assert rig.reporter.sent[1].moi == rig.reporter.sent[0].moi
    assert rig.reporter.flushes == 1 and rig.reporter.closed


async def test_a_restarted_coordinator_takes_over_the_alarm_it_left_and_clears_it(metrics: Metrics) -> None:
    rig = Rig(metrics)
    left = congestion.congestion_alarm(ALARM, ADDRESS, "before the kill", congestion.Sample(6, 4, 10), 10)
    other = congestion.congestion_alarm(ALARM, "10.0.0.99:7200", "another's", congestion.Sample(6, 4, 10), 10)
    rig.reporter.held = [other, left]
    rig.monitor.interval_s = 0.01
    rig.monitor.start()
    try:
        await until(lambda: rig.reporter.sent, timeout=5, what="the clear of the alarm left behind")
    finally:
        await rig.monitor.close()
    [clear] = rig.reporter.sent
    assert clear.category == CLEAR and clear.moi == left.moi


async def test_a_quiet_coordinator_reports_nothing_when_it_stops(metrics: Metrics) -> None:
    rig = Rig(metrics, congestion_raise_s=0)
    rig.monitor.start()
    rig.at(0, 8, 0)  # 80 %: not congested
    await rig.monitor.close()
    assert rig.reporter.sent == [] and rig.reporter.flushes == 0 and rig.reporter.closed


async def test_the_loop_works_out_the_address_then_samples_on_its_own(metrics: Metrics) -> None:
    rig = Rig(metrics, congestion_raise_s=0)
    asked, looked_up = asyncio.Event(), asyncio.Event()

    async def address() -> str:  # a name lookup that takes a while: the start does not wait
        asked.set()
        await looked_up.wait()
        return "10.0.0.12:7200"

    rig.monitor = CongestionMonitor(
        lambda: rig.cfg,
        lambda: rig.load,
        rig.reporter,  # type: ignore[arg-type]
        metrics,
        address,
        interval_s=0.01,
    )
    rig.load = (10, 0)
    rig.monitor.start()
    try:
        await until(asked.is_set, timeout=5, what="the lookup")
        assert rig.monitor.last == congestion.Sample()  # nothing sampled before the address is known
        looked_up.set()
        await until(lambda: rig.reporter.sent, timeout=5, what="a raise from the loop")
        assert rig.reporter.sent[0].moi.endswith("service ip=10.0.0.12:7200")
        rig.load = (0, 0)
        await until(lambda: len(rig.reporter.sent) == 2, timeout=5, what="its clear")
    finally:
        await rig.monitor.close()
    assert [a.category for a in rig.reporter.sent] == [ALARM, CLEAR]


# ---- inference workers: their admission, summed ---------------------------------------------------


def test_a_report_carries_the_workers_admission_and_an_older_one_reads_as_none() -> None:
    report = codec.decode_report(codec.encode_report({1: 2}, {1: 1}, 7, 3, 5))
    assert report == codec.Report({1: 2}, {1: 1}, 7, 3, 5)
    # A report as encoded before admission numbers were added (loads, legs, revision).
    older = codec.encode_loads({1: 2}) + codec.encode_loads({1: 1}) + codec.pack_u64(7)
    assert codec.decode_report(older) == codec.Report({1: 2}, {1: 1}, 7, 0, 0)
    with pytest.raises(codec.CodecError):
        codec.decode_report(codec.encode_report({}, {}, 1, 1, 1)[:-1])


@pytest.fixture
def sock_dir() -> Iterator[str]:
    # Not tmp_path: a Unix socket path is at most 107 bytes. mkdtemp makes it mode 0700.
    path = tempfile.mkdtemp(prefix="motor-c-")
    yield path
    shutil.rmtree(path, ignore_errors=True)


async def test_two_workers_admission_is_summed_and_raises_the_alarm(sock_dir: str, metrics: Metrics) -> None:
    hub = WorkerHub(sock_dir)
    await hub.start()
    links: list[WorkerLink] = []
    try:
        admission = {0: (3, 1), 1: (2, 3)}
        for i in (0, 1):
            link = WorkerLink(sock_dir, i, lambda s: None, lambda loads: None)
            await link.start(timeout_s=5)
            link.report_loads(dict, dict, lambda i=i: admission[i])  # type: ignore[misc]
            links.append(link)
        await until(lambda: hub.admission() == (5, 4), timeout=5, what="both workers' admission")

        rig = Rig(metrics, congestion_raise_s=0)
        rig.monitor = CongestionMonitor(
            lambda: rig.cfg,
            hub.admission,
            rig.reporter,  # type: ignore[arg-type]
            metrics,
            ADDRESS,
            clock=lambda: rig.now,
        )
        assert rig.monitor.sample() is Change.RAISE  # 9 of 10, across both workers
        assert rig.reporter.sent[0].additional_info["running"] == "5"
        assert rig.reporter.sent[0].additional_info["queued"] == "4"

        admission[1] = (0, 0)  # a change is reported within a tick
        await until(lambda: hub.admission() == (3, 1), timeout=5, what="worker 1 idle")
        await links[0].close()
        hub.forget(0)  # a forgotten worker's requests leave the sum
        assert hub.admission() == (0, 0)
        assert rig.monitor.sample() is Change.CLEAR
    finally:
        for link in links:
            await link.close()
        await hub.close()


# ---- a real Coordinator under overload --------------------------------------------------------------


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    connector = aiohttp.TCPConnector(limit=0, force_close=True)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=30)) as s:
        yield s


class Overload:
    """``clients`` loops of completions, each sending its next request as soon as one is
    answered (a 429 included, after a short pause): the Coordinator stays full while it runs."""

    def __init__(self, http: aiohttp.ClientSession, coord: Running, clients: int) -> None:
        self.url = f"http://{coord.http}/v1/completions"
        self.http = http
        self.statuses: dict[int, int] = {}
        self.tasks = [asyncio.create_task(self._client()) for _ in range(clients)]

    async def _client(self) -> None:
        body = {"model": MODEL, "prompt": "congested", "max_tokens": 1}
        while True:
            with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                async with self.http.post(self.url, json=body) as resp:
                    await resp.read()
                    self.statuses[resp.status] = self.statuses.get(resp.status, 0) + 1
                    if resp.status == 429:
                        await asyncio.sleep(0.01)

    async def stop(self) -> None:
        for t in self.tasks:
            t.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)


async def metric(http: aiohttp.ClientSession, coord: Running, name: str) -> float:
    m = re.search(rf"^{name} (\S+)$", await get_text(http, f"http://{coord.http}/metrics"), re.M)
    assert m is not None, name
    return float(m.group(1))


OVERLOADABLE = {"max_concurrent_requests": 2, "max_queued_requests": 2, "congestion_raise_s": 0.5}


async def test_overload_raises_the_alarm_at_the_controller_and_quiet_clears_it(
    tmp_path: Path,
    start_coordinator: StartCoordinator,
    spawn_engines: SpawnEngines,
    http: aiohttp.ClientSession,
) -> None:
    engine = spawn_engines(u=["--ttft-ms", "300"])["u"]
    async with running_controller(tmp_path) as h:
        coord = await start_coordinator(controller=h.target, **OVERLOADABLE)
        await set_table(coord, instance(1, UNION, engine.port))
        assert coord.co.congestion is not None
        moi = f"service name=Coordinator, service ip=127.0.0.1:{coord.co.server.port}"

        async def active() -> list[alarm_pb2.Alarm]:
            req = controller_pb2.ListAlarmsRequest(active_only=True, alarm_id=CONGESTION)
            return list((await h.stub.ListAlarms(req, timeout=5)).alarms)

        load = Overload(http, coord, clients=8)
        try:
            (raised,) = await until(active, timeout=20, what="the congestion alarm at the Controller")
            assert raised.moi == moi and raised.severity == alarm_pb2.SEVERITY_MAJOR
            assert await metric(http, coord, "motor_coordinator_congestion_alarm") == 1
            assert await metric(http, coord, "motor_coordinator_admission_use") >= RAISE_AT
        finally:
            await load.stop()
        assert load.statuses.get(429)  # it was full indeed
        await until(lambda: _not(active), timeout=20, what="the clear once the load stopped")
        history = (
            await h.stub.ListAlarms(controller_pb2.ListAlarmsRequest(alarm_id=CONGESTION), timeout=5)
        ).alarms
        assert [a.category for a in sorted(history, key=lambda a: a.sequence)] == [ALARM, CLEAR]
        assert await metric(http, coord, "motor_coordinator_congestion_alarm") == 0


async def _not(probe: Any) -> bool:
    return not await probe()


async def test_a_controller_that_refuses_at_first_gets_the_alarm_later(
    start_coordinator: StartCoordinator,
    spawn_engines: SpawnEngines,
    fake_controller: FakeController,
    http: aiohttp.ClientSession,
) -> None:
    engine = spawn_engines(u=["--ttft-ms", "300"])["u"]
    fake_controller.refuse = True
    coord = await start_coordinator(controller=fake_controller.address, **OVERLOADABLE)
    await set_table(coord, instance(1, UNION, engine.port))
    load = Overload(http, coord, clients=8)
    try:
        await until(lambda: fake_controller.refused >= 2, timeout=20, what="refused reports, retried")
        fake_controller.refuse = False
        await until(lambda: fake_controller.of(ALARM), timeout=20, what="the alarm, once accepted")
    finally:
        await load.stop()
    await until(lambda: fake_controller.of(CLEAR), timeout=20, what="the clear")
    assert [a.alarm_id for a in fake_controller.alarms] == [CONGESTION, CONGESTION]
