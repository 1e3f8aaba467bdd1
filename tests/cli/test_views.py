"""What ``motor instances`` and ``motor alarms`` print: one row per instance or alarm, enum values
without their prefixes; ``motor alarms`` pages through everything the Controller holds; what
``motor instances --watch`` reports between two snapshots."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from google.protobuf import timestamp_pb2

from motor_mesh.cli import alarms, instances, views
from motor_mesh.common import server
from motor_mesh.gen.motor.v1 import alarm_pb2, common_pb2, controller_pb2
from tests.controller.fakes import running_controller


def test_instance_rows_spell_roles_and_statuses_short() -> None:
    instance = common_pb2.Instance(
        id=3,
        role=common_pb2.ROLE_PREFILL,
        status=common_pb2.INSTANCE_STATUS_ACTIVE,
        model_name="motor-sim",
        job_name="motor-sim-prefill-0",
        endpoints=[
            common_pb2.Endpoint(
                host="127.0.0.1", port=9000, status=common_pb2.ENDPOINT_STATUS_NORMAL, pid=41
            ),
            common_pb2.Endpoint(
                host="127.0.0.1", port=9002, status=common_pb2.ENDPOINT_STATUS_WAIT_TO_START, headless=True
            ),
        ],
    )
    assert views.instance_rows([instance]) == [
        ["ID", "ROLE", "STATUS", "MODEL", "JOB", "ENDPOINTS"],
        [
            "3",
            "PREFILL",
            "ACTIVE",
            "motor-sim",
            "motor-sim-prefill-0",
            "127.0.0.1:9000(NORMAL,pid=41) 127.0.0.1:9002(WAIT_TO_START,headless)",
        ],
    ]


def test_table_columns_are_aligned(capsys: pytest.CaptureFixture[str]) -> None:
    views.print_table([["ID", "ROLE"], ["12", "DECODE"], ["3", "PREFILL"]])
    assert capsys.readouterr().out == "ID  ROLE\n12  DECODE\n3   PREFILL\n"


def test_a_row_shorter_than_the_header_runs_on_without_widening_the_columns() -> None:
    rows = [
        ["ADDRESS", "HEALTH", "REV"],
        ["127.0.0.1:7200", "SERVING", "4"],
        ["coordinator-1:7200", "UNREACHABLE (UNAVAILABLE)"],
    ]
    assert views.table_lines(rows) == [
        "ADDRESS             HEALTH   REV",
        "127.0.0.1:7200      SERVING  4",
        "coordinator-1:7200  UNREACHABLE (UNAVAILABLE)",
    ]


def _inst(iid: int, status: int, pid: int) -> common_pb2.Instance:
    ep = common_pb2.Endpoint(
        host="127.0.0.1", port=9000 + iid, status=common_pb2.ENDPOINT_STATUS_NORMAL, pid=pid
    )
    return common_pb2.Instance(id=iid, role=common_pb2.ROLE_DECODE, status=status, endpoints=[ep])


def test_watch_reports_what_differs_between_two_snapshots() -> None:
    active = common_pb2.INSTANCE_STATUS_ACTIVE
    before = {1: _inst(1, active, 10), 2: _inst(2, active, 20), 3: _inst(3, active, 30)}
    after = {
        1: _inst(1, active, 10),  # unchanged: no line
        2: _inst(2, active, 21),  # relaunched: a new pid
        4: _inst(4, common_pb2.INSTANCE_STATUS_INITIAL, 40),
    }
    assert [(c, i.id) for c, i in instances.changes(before, after)] == [
        ("MODIFIED", 2),
        ("DELETED", 3),
        ("ADDED", 4),
    ]
    assert list(instances.changes(after, after)) == []


# ---- motor alarms --------------------------------------------------------------------------------


def test_alarm_rows_spell_enums_short_and_time_in_utc() -> None:
    a = alarm_pb2.Alarm(
        sequence=12,
        alarm_id="0xFC001002",
        category=alarm_pb2.ALARM_CATEGORY_ALARM,
        severity=alarm_pb2.SEVERITY_MAJOR,
        instance_id=3,
        moi="service name=Controller, instanceId=3, role=prefill, job=p",
        reason="instance 3 (p) INACTIVE: endpoint_abnormal",
        occur_time=timestamp_pb2.Timestamp(seconds=1_700_000_000),
    )
    assert alarms.alarm_row(a) == [
        "12",
        "2023-11-14T22:13:20+00:00",
        "ALARM",
        "MAJOR",
        "0xFC001002",
        "3",
        "service name=Controller, instanceId=3, role=prefill, job=p",
        "instance 3 (p) INACTIVE: endpoint_abnormal",
    ]
    assert alarms.alarm_line(alarm_pb2.Alarm(sequence=1, category=alarm_pb2.ALARM_CATEGORY_EVENT)) == (
        "1  -  EVENT  UNSPECIFIED  -  0  -  -"
    )


def test_after_needs_watch(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as done:
        alarms.main(["--after", "3"])
    assert done.value.code == 2
    assert "--after needs --watch" in capsys.readouterr().err


async def test_motor_alarms_pages_through_active_and_history(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(server, "SHUTDOWN_DRAIN_S", 0.0)
    monkeypatch.setattr(alarms, "PAGE_SIZE", 3)  # several pages from a few alarms
    raised = [
        alarm_pb2.Alarm(alarm_id="0xFC00AAAA", category=alarm_pb2.ALARM_CATEGORY_ALARM, instance_id=i)
        for i in range(1, 8)
    ]
    cleared = alarm_pb2.Alarm(alarm_id="0xFC00AAAA", category=alarm_pb2.ALARM_CATEGORY_CLEAR, instance_id=2)
    async with running_controller(tmp_path) as h:
        await h.stub.ReportAlarms(controller_pb2.ReportAlarmsRequest(alarms=[*raised, cleared]), timeout=5)

        def run(*flags: str) -> str:
            assert alarms.main(["--controller", h.target, *flags]) == 0
            return capsys.readouterr().out

        history = json.loads(await asyncio.to_thread(run, "--all", "-o", "json"))
        assert [int(a["sequence"]) for a in history] == list(range(1, 9))  # oldest first
        active = json.loads(await asyncio.to_thread(run, "-o", "json"))
        assert [a["instance_id"] for a in active] == ["1", "3", "4", "5", "6", "7"]
        assert json.loads(await asyncio.to_thread(run, "--active", "-o", "json")) == active
        table = (await asyncio.to_thread(run)).splitlines()
        assert table[0].split() == alarms.ALARM_HEADER
        assert [line.split()[0] for line in table[1:]] == ["1", "3", "4", "5", "6", "7"]
