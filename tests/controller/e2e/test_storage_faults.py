"""The Controller when its disk fails, its state file is damaged, or its loop stalls.

A failed write is made the way a full disk makes it: the database's writer raises the error
SQLite raises (``database or disk is full``). The chaos suite does the same for real with
RLIMIT_FSIZE on a running Controller.
"""

from __future__ import annotations

import asyncio
import json
import os
import sqlite3
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.rpc import error_details_pb2

from motor_mesh.common.errors import details_of
from motor_mesh.gen.motor.v1 import alarm_pb2, controller_pb2
from tests.controller.fakes import ABNORMAL, ACTIVE, DELETED, INACTIVE, NORMAL, running_controller
from tests.poll import until
from tests.procs import ROOT


class FullDisk:
    """Every write of the running Controller fails as on a full disk until ``lift()``."""

    def __init__(self, controller: Any, monkeypatch: pytest.MonkeyPatch) -> None:
        self._writer = controller.store._writer
        self._monkeypatch = monkeypatch
        self.failed = 0

        def full(fn: Any, args: Any) -> Any:
            self.failed += 1
            raise sqlite3.OperationalError("database or disk is full")

        monkeypatch.setattr(self._writer, "_transaction", full)

    def lift(self) -> None:
        self._monkeypatch.undo()


def _reason(err: grpc.aio.AioRpcError) -> str:
    infos = [d for d in details_of(err) if isinstance(d, error_details_pb2.ErrorInfo)]
    return infos[0].reason if infos else ""


async def test_a_registration_the_disk_refused_is_an_error_and_leaves_nothing(
    tmp_path: Path, node_managers, monkeypatch
) -> None:
    nm = await node_managers()
    async with running_controller(tmp_path) as h:
        disk = FullDisk(h.controller, monkeypatch)
        agent = h.agent(job="j", nm=nm)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await agent.register()
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert _reason(err.value) == "STATE_WRITE_FAILED"
        assert "database or disk is full" in (err.value.details() or "")
        assert disk.failed >= 1
        # Nothing half-done: no pending assembly, no session, no instance.
        assert h.controller.pending.jobs() == [] and len(h.controller.sessions) == 0
        assert await h.instances() == []

        disk.lift()
        await agent.register()
        await until(lambda: nm.starts)
        await agent.beat(NORMAL)
        [inst] = await until(lambda: h.instances(status=ACTIVE))
        assert inst.job_name == "j"


async def test_a_transition_the_disk_refused_is_not_shown_and_is_retried(
    tmp_path: Path, node_managers, monkeypatch
) -> None:
    nm = await node_managers()
    async with running_controller(tmp_path) as h:
        agent = await h.start_node(nm, job="j")
        [inst] = await until(lambda: h.instances(status=ACTIVE))
        disk = FullDisk(h.controller, monkeypatch)
        await agent.beat(ABNORMAL)
        await until(lambda: disk.failed >= 2)  # the reconcile tried, and tried again
        # What ListInstances shows is what is on disk: still ACTIVE.
        assert [i.status for i in await h.instances()] == [ACTIVE]
        disk.lift()
        # No new beat: the retry alone brings memory, disk and observers in step.
        [after] = await until(lambda: h.instances(status=INACTIVE))
        assert after.id == inst.id
    async with running_controller(tmp_path) as again:
        assert [i.status for i in await again.instances()] == [INACTIVE]


async def test_an_alarm_report_the_disk_refused_is_unavailable_and_can_be_sent_again(
    tmp_path: Path, monkeypatch
) -> None:
    async with running_controller(tmp_path) as h:
        disk = FullDisk(h.controller, monkeypatch)
        event = alarm_pb2.Alarm(alarm_id="0xFC001002", category=alarm_pb2.ALARM_CATEGORY_EVENT, moi="m")
        report = controller_pb2.ReportAlarmsRequest(alarms=[event])
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await h.stub.ReportAlarms(report, timeout=5)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert _reason(err.value) == "STATE_WRITE_FAILED"
        disk.lift()
        await h.stub.ReportAlarms(report, timeout=5)
        # The refused report stored nothing and used no sequence.
        assert [a.sequence for a in h.controller.alarms.history()] == [1]


# ---- bounds on Register ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "job",
    ["a b", "x" * 129, "job\r\x1b[31m", "-lead", "é", "a/b"],
)
async def test_a_job_name_outside_the_rules_is_invalid_argument(tmp_path: Path, job: str) -> None:
    async with running_controller(tmp_path) as h:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await h.agent(job=job, nm_port=7300).register()
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "job_name" in (err.value.details() or "")
        assert h.controller.pending.jobs() == []


@pytest.mark.parametrize("host", ["http://evil/", "a..b", "-x.example", "h" * 254, "10.0.0.1:80"])
async def test_a_host_that_is_not_an_address_is_invalid_argument(tmp_path: Path, host: str) -> None:
    async with running_controller(tmp_path) as h:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await h.agent(job="j", host=host, nm_port=7300).register()
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "host" in (err.value.details() or "")


async def test_pending_jobs_are_bounded(tmp_path: Path) -> None:
    async with running_controller(tmp_path) as h:
        h.controller.registrar.max_pending = 3
        for n in range(3):  # dp=2 with one port: each waits for a second NodeManager
            await h.agent(job=f"j{n}", nm_port=7300 + n, dp=2).register()
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await h.agent(job="one-too-many", nm_port=7399, dp=2).register()
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert sorted(h.controller.pending.jobs()) == ["j0", "j1", "j2"]
        # A job already waiting still takes its other members.
        await h.agent(job="j0", nm_port=7310, ports=(10002,), dp=2, node_rank=0).register()


# ---- a stalled loop --------------------------------------------------------------------------


async def test_a_stalled_loop_is_not_read_as_every_node_manager_going_silent(
    tmp_path: Path, node_managers
) -> None:
    kept, lost = await node_managers(), await node_managers()
    async with running_controller(tmp_path, instance_heartbeat_timeout_s=1.0, heartbeat_interval_s=0.2) as h:
        a = await h.start_node(kept, job="kept")
        b = await h.start_node(lost, job="lost", ports=(10002,))
        await until(lambda: len(h.controller.table.find(status=ACTIVE)) == 2)
        # The whole process stops for three heartbeat timeouts (a VM pause, a long GC).
        time.sleep(3.0)  # noqa: ASYNC251 - blocking the loop is the fault under test
        # The Controller's first tick after it sees the stall (and its sweep with it); then both
        # NodeManagers beat, and only "kept" keeps on.
        await until(lambda: h.controller.clock.stalls == 1)
        assert {i.job_name for i in h.controller.table.live.values()} == {"kept", "lost"}
        await a.beat(NORMAL)
        await b.beat(NORMAL)

        async def beating() -> None:
            while True:
                await a.beat(NORMAL)
                await asyncio.sleep(0.2)

        task = asyncio.create_task(beating())
        try:
            # The one that went quiet after the stall is still found, one timeout later...
            [gone] = await until(lambda: h.instances(status=DELETED), timeout=10)
            assert gone.job_name == "lost"
            # ...and the stall itself cost the one that kept beating nothing.
            assert h.controller.table.by_job["kept"].status == ACTIVE
            assert len(kept.starts) == 1
        finally:
            task.cancel()


# ---- a damaged state file ----------------------------------------------------------------------


def _controller(state_dir: Path) -> subprocess.CompletedProcess[str]:
    cfg = state_dir.parent / "controller.json"
    cfg.write_text(json.dumps({"controller": {"port": 0, "state_dir": str(state_dir), "coordinators": []}}))
    return subprocess.run(
        [sys.executable, "-m", "motor_mesh.cli", "controller", "--config", str(cfg)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )


def _one_line_about_the_move(result: subprocess.CompletedProcess[str], db: Path) -> Path:
    assert result.returncode == 1, result.stderr
    assert "Traceback" not in result.stderr
    [line] = [x for x in result.stderr.splitlines() if x.strip()]
    assert str(db) in line and "corrupt" in line
    [moved] = [p for p in db.parent.iterdir() if p.name.startswith("controller.db.corrupt-")]
    assert str(moved) in line
    assert not db.exists()
    return moved


def test_random_bytes_in_the_state_file_stop_the_controller_with_one_line(tmp_path: Path) -> None:
    state = tmp_path / "state"
    state.mkdir()
    db = state / "controller.db"
    junk = os.urandom(64 * 1024)
    db.write_bytes(junk)
    moved = _one_line_about_the_move(_controller(state), db)
    assert moved.read_bytes() == junk  # kept for the operator, as it was


def test_a_row_the_controller_cannot_read_is_a_corrupt_file_too(tmp_path: Path) -> None:
    state = tmp_path / "state"
    state.mkdir()
    db = state / "controller.db"
    with sqlite3.connect(db) as conn:
        conn.execute(
            "CREATE TABLE instances (id INTEGER PRIMARY KEY, job_name TEXT NOT NULL, "
            "status INTEGER NOT NULL, instance BLOB NOT NULL, members TEXT NOT NULL)"
        )
        conn.execute("INSERT INTO instances VALUES (1, 'j', 3, x'ffff', '{not json')")
    conn.close()
    _one_line_about_the_move(_controller(state), db)
