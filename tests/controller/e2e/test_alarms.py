"""The Controller's alarm store through its RPCs (ReportAlarms, ListAlarms, WatchAlarms), the
alarms the Controller raises itself (instance and Coordinator faults), and what survives a
restart of the real process."""

from __future__ import annotations

import asyncio
import json
import signal
import sqlite3
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.rpc import error_details_pb2

from motor_mesh.common import errors
from motor_mesh.controller.alarms.store import COORDINATOR_FAULT, INSTANCE_FAULT, PRECISION, precision_moi
from motor_mesh.controller.model import Removal
from motor_mesh.gen.motor.v1 import alarm_pb2, controller_pb2, controller_pb2_grpc
from tests.controller.fakes import (
    ABNORMAL,
    ACTIVE,
    INACTIVE,
    NORMAL,
    FakeCoordinator,
    Harness,
    delete,
    running_controller,
)
from tests.poll import until
from tests.ports import reserved_port
from tests.procs import Proc, motor_argv

# A reporter's own alarm: the Controller's instance alarms clear INSTANCE_FAULT alarms about
# instances it does not have.
OTHER = "0xFC00AAAA"
ALARM = alarm_pb2.ALARM_CATEGORY_ALARM
CLEAR = alarm_pb2.ALARM_CATEGORY_CLEAR
EVENT = alarm_pb2.ALARM_CATEGORY_EVENT


def alarm(
    category: int = ALARM, alarm_id: str = OTHER, instance_id: int = 0, moi: str = "", **kw: Any
) -> alarm_pb2.Alarm:
    return alarm_pb2.Alarm(
        alarm_id=alarm_id,
        category=category,  # type: ignore[arg-type]
        severity=alarm_pb2.SEVERITY_MAJOR,
        instance_id=instance_id,
        moi=moi or f"test, instanceId={instance_id}",
        **kw,
    )


def precision(p: int, d: int, category: int = ALARM, ip: str = "10.0.0.1") -> alarm_pb2.Alarm:
    return alarm(category, PRECISION, instance_id=d, moi=precision_moi(ip, p, d), p_instance_id=p)


async def report(stub: Any, *alarms: alarm_pb2.Alarm) -> controller_pb2.ReportAlarmsResponse:
    return await stub.ReportAlarms(controller_pb2.ReportAlarmsRequest(alarms=list(alarms)), timeout=5)


async def listed(stub: Any, active_only: bool = False, **kw: Any) -> list[alarm_pb2.Alarm]:
    """Every page, as the server orders them (newest first)."""
    out: list[alarm_pb2.Alarm] = []
    token = ""
    while True:
        req = controller_pb2.ListAlarmsRequest(active_only=active_only, page_token=token, **kw)
        resp = await stub.ListAlarms(req, timeout=5)
        out.extend(resp.alarms)
        token = resp.next_page_token
        if not token:
            return out


def keys(alarms: list[alarm_pb2.Alarm]) -> list[tuple[str, int, int, str]]:
    return [(a.alarm_id, a.category, a.instance_id, a.reason) for a in alarms]


def field_paths(err: grpc.aio.AioRpcError) -> set[str]:
    return {
        v.field
        for d in errors.details_of(err)
        if isinstance(d, error_details_pb2.BadRequest)
        for v in d.field_violations
    }


class Watch:
    """A WatchAlarms stream read by a task into ``got``."""

    def __init__(self, stub: Any, after: int = 0) -> None:
        self.call = stub.WatchAlarms(controller_pb2.WatchAlarmsRequest(after_sequence=after))
        self.got: list[alarm_pb2.Alarm] = []
        self.error: grpc.aio.AioRpcError | None = None
        self.task = asyncio.create_task(self._read())

    async def _read(self) -> None:
        try:
            async for item in self.call:
                self.got.append(item.alarm)
        except grpc.aio.AioRpcError as err:
            self.error = err

    @property
    def sequences(self) -> list[int]:
        return [a.sequence for a in self.got]

    def cancel(self) -> None:
        self.call.cancel()


# ---- ReportAlarms and ListAlarms -----------------------------------------------------------------


async def test_report_then_list_active_and_history_in_sequence_order(tmp_path: Path) -> None:
    async with running_controller(tmp_path) as h:
        await report(h.stub, alarm(instance_id=7, reason="down"), alarm(EVENT, "0xFC00CCCC", reason="hello"))
        await report(h.stub, precision(3, 4))
        history = await listed(h.stub)
        assert [a.sequence for a in history] == [3, 2, 1]
        assert keys(history) == [
            (PRECISION, ALARM, 4, ""),
            ("0xFC00CCCC", EVENT, 0, "hello"),
            (OTHER, ALARM, 7, "down"),
        ]
        active = await listed(h.stub, active_only=True)
        assert [(a.alarm_id, a.sequence) for a in active] == [(PRECISION, 3), (OTHER, 1)]
        assert [a.sequence for a in await listed(h.stub, alarm_id=PRECISION)] == [3]
        assert all(a.HasField("occur_time") for a in history)  # stamped when the reporter did not


async def test_dedupe_rules(tmp_path: Path) -> None:
    async with running_controller(tmp_path) as h:
        await report(h.stub, alarm(instance_id=1, reason="first"))
        # The same alarm_id + instance_id while active: the active one is updated, not stored again.
        await report(h.stub, alarm(instance_id=1, moi="other moi", reason="again"))
        # Another instance, or another alarm_id: another alarm.
        await report(h.stub, alarm(instance_id=2), alarm(alarm_id="0xFC00BBBB", instance_id=1))
        # instance_id 0: keyed by moi (Coordinator alarms).
        await report(
            h.stub,
            alarm(alarm_id=COORDINATOR_FAULT, moi="service name=Coordinator, service ip=a:1"),
            alarm(alarm_id=COORDINATOR_FAULT, moi="service name=Coordinator, service ip=b:1"),
            alarm(alarm_id=COORDINATOR_FAULT, moi="service name=Coordinator, service ip=a:1"),
        )
        # Precision alarms: keyed by moi, whatever their instance ids say.
        await report(h.stub, precision(3, 4), precision(3, 4), precision(5, 4))
        active = await listed(h.stub, active_only=True)
        by_id: dict[str, list[alarm_pb2.Alarm]] = {}
        for a in active:
            by_id.setdefault(a.alarm_id, []).append(a)
        [first, second] = sorted(by_id[OTHER], key=lambda a: a.instance_id)
        assert (first.sequence, first.reason) == (1, "again")
        assert second.instance_id == 2
        assert len(by_id["0xFC00BBBB"]) == 1
        assert len(by_id[COORDINATOR_FAULT]) == 2
        assert sorted(a.p_instance_id for a in by_id[PRECISION]) == [3, 5]
        history = await listed(h.stub)
        assert [a.sequence for a in history] == list(range(len(history), 0, -1))
        assert len(history) == 1 + 2 + 2 + 2  # no record for a repeat
        assert h.controller.alarms.active_precision(3, 4) is not None
        assert h.controller.alarms.active_precision(0, 4).p_instance_id == 5  # type: ignore[union-attr]
        assert h.controller.alarms.active_precision(9, 4) is None


async def test_clear_clears_only_its_own_key_and_a_clear_of_nothing_is_only_recorded(tmp_path: Path) -> None:
    async with running_controller(tmp_path) as h:
        await report(h.stub, alarm(instance_id=1), alarm(instance_id=2), precision(3, 4), precision(5, 6))
        await report(h.stub, alarm(CLEAR, instance_id=1), precision(3, 4, CLEAR))
        active = await listed(h.stub, active_only=True)
        assert sorted((a.alarm_id, a.instance_id) for a in active) == [(PRECISION, 6), (OTHER, 2)]
        assert h.controller.alarms.active_precision(3, 4) is None
        before = await listed(h.stub)
        assert keys(before[:2]) == [(PRECISION, CLEAR, 4, ""), (OTHER, CLEAR, 1, "")]

        # Nothing active with this key: recorded, clears nothing.
        await report(h.stub, alarm(CLEAR, instance_id=99), alarm(CLEAR, instance_id=1))
        assert [a.sequence for a in await listed(h.stub, active_only=True)] == [a.sequence for a in active]
        after = await listed(h.stub)
        assert len(after) == len(before) + 2
        assert [a.sequence for a in after[:3]] == [8, 7, 6]

        # A cleared key can be raised again, as a new alarm with a new sequence.
        await report(h.stub, alarm(instance_id=1, reason="back"))
        [again] = [a for a in await listed(h.stub, active_only=True) if a.instance_id == 1]
        assert (again.sequence, again.reason) == (9, "back")


async def test_paging(tmp_path: Path) -> None:
    async with running_controller(tmp_path) as h:
        await report(h.stub, *[alarm(EVENT, instance_id=i) for i in range(1, 26)])
        pages: list[list[int]] = []
        token = ""
        while True:
            resp = await h.stub.ListAlarms(
                controller_pb2.ListAlarmsRequest(page_size=10, page_token=token), timeout=5
            )
            pages.append([a.sequence for a in resp.alarms])
            token = resp.next_page_token
            if not token:
                break
            # Stored between pages: newer than anything listed, so the pages go on undisturbed.
            await report(h.stub, alarm(EVENT, instance_id=100 + len(pages)))
        assert pages == [list(range(25, 15, -1)), list(range(15, 5, -1)), list(range(5, 0, -1))]

        # The default page is 100 alarms; a larger page_size than 1000 is taken as 1000.
        await report(h.stub, *[alarm(EVENT, instance_id=i) for i in range(1000)])
        await report(h.stub, *[alarm(EVENT, instance_id=i) for i in range(200)])
        resp = await h.stub.ListAlarms(controller_pb2.ListAlarmsRequest(), timeout=5)
        assert len(resp.alarms) == 100 and resp.next_page_token
        resp = await h.stub.ListAlarms(controller_pb2.ListAlarmsRequest(page_size=5000), timeout=5)
        assert len(resp.alarms) == 1000 and resp.next_page_token

        # A token is only good for the filters it was made for, and only if this server made it.
        first = await h.stub.ListAlarms(controller_pb2.ListAlarmsRequest(page_size=1), timeout=5)
        for req in (
            controller_pb2.ListAlarmsRequest(page_token=first.next_page_token, active_only=True),
            controller_pb2.ListAlarmsRequest(page_token=first.next_page_token, alarm_id=PRECISION),
            controller_pb2.ListAlarmsRequest(page_token="not-a-token"),
            controller_pb2.ListAlarmsRequest(page_token="W10"),  # base64 of "[]"
        ):
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await h.stub.ListAlarms(req, timeout=5)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert field_paths(err.value) == {"page_token"}
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await h.stub.ListAlarms(controller_pb2.ListAlarmsRequest(page_size=-1), timeout=5)
        assert field_paths(err.value) == {"page_size"}


async def test_a_bad_alarm_refuses_the_whole_report_naming_each_field(tmp_path: Path) -> None:
    async with running_controller(tmp_path) as h:
        bad = [
            alarm(instance_id=1),
            alarm_pb2.Alarm(category=ALARM, instance_id=2),
            alarm_pb2.Alarm(alarm_id=OTHER, instance_id=3),
            alarm_pb2.Alarm(alarm_id=PRECISION, category=ALARM, instance_id=4),
            alarm_pb2.Alarm(alarm_id=OTHER, category=42, instance_id=5),  # type: ignore[arg-type]
        ]
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await report(h.stub, *bad)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert field_paths(err.value) == {
            "alarms[1].alarm_id",
            "alarms[2].category",
            "alarms[3].moi",
            "alarms[4].category",
        }
        assert await listed(h.stub) == []


async def test_a_failed_write_changes_nothing_and_answers_unavailable(tmp_path: Path, monkeypatch) -> None:
    async with running_controller(tmp_path) as h:
        await report(h.stub, alarm(instance_id=1), alarm(instance_id=2))
        watch = Watch(h.stub)
        await until(lambda: h.controller.alarm_watch.watchers == 1)
        before_active = await listed(h.stub, active_only=True)
        before_history = await listed(h.stub)

        def broken(*args: Any, **kw: Any) -> None:
            raise sqlite3.OperationalError("disk I/O error")

        monkeypatch.setattr(h.controller.store._writer, "_transaction", broken)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await report(h.stub, alarm(CLEAR, instance_id=1), alarm(instance_id=3), alarm(EVENT))
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert await listed(h.stub, active_only=True) == before_active
        assert await listed(h.stub) == before_history

        monkeypatch.undo()
        await report(h.stub, alarm(EVENT, reason="after"))
        await until(lambda: watch.got)
        # Nothing of the failed report reached the watcher, and no sequence was used up.
        assert [(a.sequence, a.reason) for a in watch.got] == [(3, "after")]
        watch.cancel()


# ---- WatchAlarms ---------------------------------------------------------------------------------


async def test_watch_follows_live(tmp_path: Path) -> None:
    async with running_controller(tmp_path) as h:
        await report(h.stub, alarm(instance_id=1))  # before the watch: not sent
        watch = Watch(h.stub)
        await until(lambda: h.controller.alarm_watch.watchers == 1)
        await report(h.stub, alarm(instance_id=1), alarm(instance_id=2), alarm(CLEAR, instance_id=1))
        await report(h.stub, alarm(EVENT, reason="e"))
        await until(lambda: len(watch.got) == 3)
        # The repeat of an active alarm is not passed on.
        assert [(a.sequence, a.category, a.instance_id) for a in watch.got] == [
            (2, ALARM, 2),
            (3, CLEAR, 1),
            (4, EVENT, 0),
        ]
        watch.cancel()
        await until(lambda: h.controller.alarm_watch.watchers == 0)


async def test_resume_replays_exactly_the_missed_ones_even_while_reports_arrive(tmp_path: Path) -> None:
    pad = {"pad": "x" * 2000}  # a replay much larger than the stream's flow-control window
    async with running_controller(tmp_path) as h:
        for start in range(0, 1500, 500):
            await report(
                h.stub, *[alarm(EVENT, instance_id=start + i, additional_info=pad) for i in range(500)]
            )
        call = h.stub.WatchAlarms(controller_pb2.WatchAlarmsRequest(after_sequence=200))
        got = [(await call.read()).alarm.sequence]
        # The replay is under way (1300 records cannot fit in the window): report during it.
        for i in range(30):
            await report(h.stub, alarm(EVENT, instance_id=10_000 + i))
        while len(got) < 1300 + 30:
            got.append((await asyncio.wait_for(call.read(), 10)).alarm.sequence)
        assert got == list(range(201, 1531))
        await report(h.stub, alarm(EVENT, reason="live"))
        assert (await asyncio.wait_for(call.read(), 10)).alarm.sequence == 1531
        call.cancel()


async def test_resume_after_the_last_sequence_replays_nothing_and_beyond_it_is_out_of_range(
    tmp_path: Path,
) -> None:
    async with running_controller(tmp_path) as h:
        await report(h.stub, alarm(EVENT), alarm(EVENT))
        watch = Watch(h.stub, after=2)
        await until(lambda: h.controller.alarm_watch.watchers == 1)
        await report(h.stub, alarm(EVENT))
        await until(lambda: watch.sequences == [3])
        watch.cancel()
        beyond = Watch(h.stub, after=9)
        await beyond.task
        assert beyond.error is not None and beyond.error.code() == grpc.StatusCode.OUT_OF_RANGE


async def test_a_slow_subscriber_is_ended_and_others_are_not_held_up(tmp_path: Path) -> None:
    big = {"pad": "x" * 65536}
    async with running_controller(tmp_path) as h:
        h.controller.alarm_watch.buffer = 4
        fast = Watch(h.stub)
        slow = h.stub.WatchAlarms(controller_pb2.WatchAlarmsRequest())  # never read for now
        await until(lambda: h.controller.alarm_watch.watchers == 2)
        n = 0
        while h.controller.alarm_watch.watchers == 2:
            assert n < 400, "the slow subscriber was never ended"
            n += 1
            await report(h.stub, alarm(EVENT, instance_id=n, additional_info=big))
            await until(lambda n=n: len(fast.got) == n)  # type: ignore[misc]
        assert fast.error is None
        # The slow one gets what was already on its way, then RESOURCE_EXHAUSTED.
        received: list[int] = []
        with pytest.raises(grpc.aio.AioRpcError) as err:
            while True:
                item = await asyncio.wait_for(slow.read(), 10)
                assert item is not grpc.aio.EOF
                received.append(item.alarm.sequence)
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert received == list(range(1, len(received) + 1))
        assert len(received) < n
        # It resumes from the last sequence it got and misses nothing.
        resumed = Watch(h.stub, after=received[-1] if received else 0)
        await until(lambda: h.controller.alarm_watch.watchers == 2)
        await report(h.stub, alarm(EVENT, instance_id=n + 1))
        await until(lambda: fast.sequences == list(range(1, n + 2)))
        start = received[-1] + 1 if received else n + 1
        await until(lambda: resumed.sequences == list(range(start, n + 2)))
        fast.cancel()
        resumed.cancel()


async def test_streams_end_with_unavailable_when_the_controller_stops(tmp_path: Path) -> None:
    async with running_controller(tmp_path) as h:
        watch = Watch(h.stub)
        await until(lambda: h.controller.alarm_watch.watchers == 1)
        await h.server.stop()
        await asyncio.wait_for(watch.task, 10)
        assert watch.error is not None and watch.error.code() == grpc.StatusCode.UNAVAILABLE


# ---- the Controller's own alarms -----------------------------------------------------------------


async def active_of(h: Harness, alarm_id: str) -> list[alarm_pb2.Alarm]:
    return await listed(h.stub, active_only=True, alarm_id=alarm_id)


async def test_instance_alarm_raised_when_inactive_and_cleared_when_active_again(
    tmp_path: Path, node_managers
) -> None:
    nm = await node_managers()
    async with running_controller(tmp_path) as h:
        agent = await h.start_node(nm, job="p")
        await until(lambda: h.instances(status=ACTIVE))
        assert await active_of(h, INSTANCE_FAULT) == []

        await agent.beat(ABNORMAL)
        await until(lambda: h.instances(status=INACTIVE))
        [raised] = await until(lambda: active_of(h, INSTANCE_FAULT))
        assert (raised.instance_id, raised.severity) == (1, alarm_pb2.SEVERITY_MAJOR)
        assert raised.moi == "service name=Controller, instanceId=1, role=prefill, job=p"
        assert "endpoint_abnormal" in raised.reason

        await agent.beat(NORMAL)
        await until(lambda: h.instances(status=ACTIVE))
        await until(lambda: not h.controller.alarms.active(INSTANCE_FAULT))
        history = await listed(h.stub, alarm_id=INSTANCE_FAULT)
        assert [(a.category, a.instance_id, a.moi) for a in history] == [
            (CLEAR, 1, raised.moi),
            (ALARM, 1, raised.moi),
        ]


async def test_instance_alarm_on_a_fault_deletion_but_not_on_a_purposeful_one(
    tmp_path: Path, node_managers
) -> None:
    a, b = await node_managers(), await node_managers()
    async with running_controller(tmp_path) as h:
        for nm, job, port in ((a, "a", 10000), (b, "b", 10002)):
            await h.start_node(nm, job=job, ports=(port,))
        await until(lambda: len(h.controller.table.find(status=ACTIVE)) == 2)
        table = h.controller.table
        await delete(table, table.by_job["a"], Removal.HEARTBEAT_TIMEOUT)
        await delete(table, table.by_job["b"], Removal.TERMINATED)
        await h.controller.alarms.drain()
        [raised] = await active_of(h, INSTANCE_FAULT)
        assert raised.instance_id == 1 and "heartbeat_timeout" in raised.reason
        assert all(x.instance_id == 1 for x in await listed(h.stub, alarm_id=INSTANCE_FAULT))

        # Cleared on purpose when it was alarmed: an INACTIVE instance terminated by the operator.
        c = await node_managers()
        await h.start_node(c, ABNORMAL, job="c", ports=(10004,))
        await until(lambda: h.controller.alarms.find_active(alarm(alarm_id=INSTANCE_FAULT, instance_id=3)))
        await delete(table, table.by_job["c"], Removal.TERMINATED)
        await h.controller.alarms.drain()
        assert [x.instance_id for x in h.controller.alarms.active(INSTANCE_FAULT)] == [1]


async def test_instance_alarms_are_level_triggered(tmp_path: Path, node_managers, monkeypatch) -> None:
    nm = await node_managers()
    async with running_controller(tmp_path) as h:
        agent = await h.start_node(nm, job="p")
        await until(lambda: h.instances(status=ACTIVE))

        # The transition's alarm is lost (a failed write): the next resync raises it.
        writer = h.controller.store._writer
        real = writer._transaction

        def broken(fn: Any, args: Any) -> Any:
            if fn.__name__ == "_save_alarms":
                raise sqlite3.OperationalError("disk I/O error")
            return real(fn, args)

        monkeypatch.setattr(writer, "_transaction", broken)
        await h.controller.alarms.drain()
        await agent.beat(ABNORMAL)
        await until(lambda: h.instances(status=INACTIVE))
        monkeypatch.undo()
        await h.controller.alarms.drain()
        assert h.controller.alarms.active(INSTANCE_FAULT) == []
        h.controller.instance_alarms.reconcile()
        await h.controller.alarms.drain()
        [raised] = h.controller.alarms.active(INSTANCE_FAULT)
        assert raised.instance_id == 1

        # An alarm about an instance the Controller does not have is cleared.
        await report(h.stub, alarm(alarm_id=INSTANCE_FAULT, instance_id=77))
        h.controller.instance_alarms.reconcile()
        await h.controller.alarms.drain()
        assert [x.instance_id for x in h.controller.alarms.active(INSTANCE_FAULT)] == [1]


async def test_instance_alarm_of_a_deleted_instance_clears_when_its_job_is_served_again(
    tmp_path: Path, node_managers
) -> None:
    nm = await node_managers()
    async with running_controller(tmp_path) as h:
        agent = await h.start_node(nm, job="p")
        await until(lambda: h.instances(status=ACTIVE))
        await delete(h.controller.table, h.controller.table.by_job["p"])
        await h.controller.alarms.drain()
        assert [x.instance_id for x in h.controller.alarms.active(INSTANCE_FAULT)] == [1]
        agent.drop_stream()
        await h.start_node(nm, job="p")
        await until(lambda: h.instances(status=ACTIVE))
        await until(lambda: not h.controller.alarms.active(INSTANCE_FAULT))


async def test_coordinator_alarm_after_the_threshold_and_its_clear(tmp_path: Path) -> None:
    coord = await FakeCoordinator().start()
    port = coord.port
    try:
        async with running_controller(
            tmp_path, coordinators=[coord.address], coordinator_alarm_after_s=0.3
        ) as h:
            await until(lambda: coord.count("Set", ok=True) >= 1)
            assert await active_of(h, COORDINATOR_FAULT) == []
            await coord.stop()
            [raised] = await until(lambda: active_of(h, COORDINATOR_FAULT), timeout=20)
            assert raised.moi == f"service name=Coordinator, service ip=127.0.0.1:{port}"
            assert (raised.instance_id, raised.severity) == (0, alarm_pb2.SEVERITY_CRITICAL)
            coord = await FakeCoordinator().start(port)
            await until(lambda: not h.controller.alarms.active(COORDINATOR_FAULT), timeout=20)
            history = await listed(h.stub, alarm_id=COORDINATOR_FAULT)
            assert [a.category for a in history] == [CLEAR, ALARM]
    finally:
        await coord.stop()


async def test_coordinator_alarms_left_from_before_a_restart_are_put_right(tmp_path: Path) -> None:
    coord = await FakeCoordinator().start()
    try:
        up = f"service name=Coordinator, service ip={coord.address}"
        gone = "service name=Coordinator, service ip=10.9.9.9:7200"
        async with running_controller(tmp_path, coordinators=["127.0.0.1:1"]) as h:
            await report(
                h.stub, alarm(alarm_id=COORDINATOR_FAULT, moi=up), alarm(alarm_id=COORDINATOR_FAULT, moi=gone)
            )
        async with running_controller(tmp_path, coordinators=[coord.address]) as h:
            # Reachable now, or no longer configured: both cleared.
            await until(lambda: not h.controller.alarms.active(COORDINATOR_FAULT))
            clears = [a.moi for a in await listed(h.stub, alarm_id=COORDINATOR_FAULT) if a.category == CLEAR]
            assert sorted(clears) == sorted([up, gone])
    finally:
        await coord.stop()


# ---- the real process: kill -9 and restart -------------------------------------------------------


async def start_controller(tmp_path: Path, port: int = 0) -> tuple[Proc, str]:
    cfg = tmp_path / "controller.json"
    cfg.write_text(json.dumps({"controller": {"state_dir": str(tmp_path / "state"), "coordinators": []}}))
    proc = Proc(motor_argv("controller", "--config", str(cfg), "--port", str(port)), cwd=tmp_path)
    target, _ = await proc.await_listening()
    return proc, target


async def test_alarms_survive_sigkill_and_a_resumed_watch_misses_nothing(tmp_path: Path) -> None:
    proc, target = await start_controller(tmp_path)
    try:
        async with grpc.aio.insecure_channel(target) as ch:
            stub = controller_pb2_grpc.ControllerStub(ch)
            await report(stub, alarm(instance_id=5, reason="kept"), alarm(EVENT), alarm(instance_id=6))
            await report(stub, alarm(CLEAR, instance_id=6))
            watch = Watch(stub, after=1)
            await until(lambda: watch.sequences == [2, 3, 4])
            await asyncio.to_thread(proc.kill)
            await asyncio.wait_for(watch.task, 10)
            assert watch.error is not None
        proc, target = await start_controller(tmp_path)
        async with grpc.aio.insecure_channel(target) as ch:
            stub = controller_pb2_grpc.ControllerStub(ch)
            [kept] = await listed(stub, active_only=True)
            assert (kept.instance_id, kept.reason, kept.sequence) == (5, "kept", 1)
            await report(stub, alarm(instance_id=7), alarm(EVENT))
            resumed = Watch(stub, after=watch.sequences[-1])
            await until(lambda: resumed.sequences == [5, 6])
            await report(stub, alarm(EVENT))
            await until(lambda: resumed.sequences == [5, 6, 7])
            assert [a.sequence for a in await listed(stub)] == list(range(7, 0, -1))
            resumed.cancel()
    finally:
        await asyncio.to_thread(proc.kill)


async def test_motor_alarms_watch_survives_a_controller_restart(tmp_path: Path) -> None:
    port = reserved_port()  # the restarted Controller binds it again
    proc, target = await start_controller(tmp_path, port)
    cli: Proc | None = None
    try:
        async with grpc.aio.insecure_channel(target) as ch:
            await report(controller_pb2_grpc.ControllerStub(ch), alarm(instance_id=1, reason="before"))
        # --after 1: whenever the CLI subscribes, what is stored after sequence 1 reaches it.
        cli = Proc(
            motor_argv("alarms", "--controller", target, "--watch", "--after", "1", "-o", "json"),
            cwd=tmp_path,
        )
        async with grpc.aio.insecure_channel(target) as ch:
            await report(controller_pb2_grpc.ControllerStub(ch), alarm(EVENT, reason="one"))
        await until(lambda: len(cli.stdout_lines) == 1)  # type: ignore[union-attr]

        await asyncio.to_thread(proc.kill)
        proc, target = await start_controller(tmp_path, port)
        async with grpc.aio.insecure_channel(target) as ch:
            # Stored before the CLI is back: it is replayed when it resumes.
            await report(controller_pb2_grpc.ControllerStub(ch), alarm(EVENT, reason="two"))
            await until(lambda: "resuming after sequence 2" in cli.output(), timeout=20)  # type: ignore[union-attr]
            await report(controller_pb2_grpc.ControllerStub(ch), alarm(EVENT, reason="three"))
        await until(lambda: len(cli.stdout_lines) >= 3, timeout=20)  # type: ignore[union-attr]
        printed = [json.loads(line) for line in cli.stdout_lines]
        assert [(int(a["sequence"]), a["reason"]) for a in printed] == [(2, "one"), (3, "two"), (4, "three")]

        cli.signal(signal.SIGINT)
        assert await cli.await_exit(10) == 130
        assert "Traceback" not in cli.output()
    finally:
        if cli is not None:
            await asyncio.to_thread(cli.kill)
        await asyncio.to_thread(proc.kill)
