"""``engines.json`` that cannot be read: start-up goes on, the file is moved aside with one
warning saying what was lost, and every record that can be read is still acted on. Writes are
durable (the directory is fsynced after the rename)."""

from __future__ import annotations

import json
import logging
import os
import random
import stat
from pathlib import Path

import pytest

from motor_mesh.nodemanager import statefile
from motor_mesh.nodemanager.statefile import EngineRecord, StateFile, kill_recorded_engines
from tests.nodemanager.conftest import nm_config
from tests.nodemanager.test_procgroup import spawn_group
from tests.ports import reserved_pair
from tests.procs import group_alive

GOOD = {"endpoint_id": 0, "port": 10000, "pid": 999_999_990, "pgid": 999_999_990, "markers": ["vllm"]}

CORRUPT = {
    "random bytes": random.Random(7).randbytes(2048),
    "truncated JSON": json.dumps({"nm_pid": 1, "engines": [GOOD]}).encode()[:-9],
    "empty": b"",
    "a list": b"[1, 2]",
    "engines null": b'{"engines": null}',
    "engines a number": b'{"engines": 5}',
    "nested to death": b"[" * 100_000,
}


def corrupt_warnings(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if getattr(r, "event", "") == "engine_state_corrupt"]


def aside(state: StateFile) -> list[Path]:
    return sorted(state.path.parent.glob("engines.json.corrupt-*"))


@pytest.mark.parametrize("content", CORRUPT.values(), ids=CORRUPT.keys())
async def test_unreadable_state_is_moved_aside_and_start_up_goes_on(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, content: bytes
) -> None:
    state = StateFile(tmp_path)
    state.path.write_bytes(content)
    assert await kill_recorded_engines(state) == 0
    (moved,) = aside(state)
    assert moved.read_bytes() == content  # kept for a post-mortem
    assert not state.path.exists()
    (warning,) = corrupt_warnings(caplog)
    fields = warning.fields  # type: ignore[attr-defined]
    assert fields["path"] == str(state.path) and fields["moved_to"] == str(moved)
    assert fields["records_lost"] == "unknown" and fields["records_kept"] == 0
    # and the next write starts afresh
    await state.save([EngineRecord(0, 10000, 123, 123)])
    assert state.read() == [EngineRecord(0, 10000, 123, 123)]


async def test_records_that_can_be_read_are_still_killed(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    engine = await spawn_group("import time; print('ready', flush=True); time.sleep(60)", "engine-sim")
    state = StateFile(tmp_path)
    good = {"endpoint_id": 0, "port": 10000, "pid": engine.pid, "pgid": engine.pid, "markers": ["engine-sim"]}
    bad = [
        {**good, "pgid": -engine.pid},  # killpg() of a negative id is an error, not a group
        {**good, "pid": str(engine.pid)},
        {**good, "markers": "engine-sim"},
        {"endpoint_id": 1, "port": 10002},
        "not a record",
    ]
    state.path.write_text(json.dumps({"nm_pid": 1, "engines": [good, *bad]}))
    try:
        assert await kill_recorded_engines(state) == 1
        assert await engine.wait() == -9
        assert not group_alive(engine.pid)
    finally:
        if engine.returncode is None:
            engine.kill()
            await engine.wait()
    (warning,) = corrupt_warnings(caplog)
    fields = warning.fields  # type: ignore[attr-defined]
    assert (fields["records_kept"], fields["records_lost"]) == (1, 5)
    (moved,) = aside(state)
    assert fields["moved_to"] == str(moved)
    assert state.read() == []


async def test_each_corrupt_file_is_kept(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    state = StateFile(tmp_path)
    for content in (b"one", b"two"):
        state.path.write_bytes(content)
        assert state.read() == []
    assert sorted(p.read_bytes() for p in aside(state)) == [b"one", b"two"]
    assert len(corrupt_warnings(caplog)) == 2


def test_write_fsyncs_the_file_then_the_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    synced: list[str] = []
    real = os.fsync

    def spy(fd: int) -> None:
        synced.append("dir" if stat.S_ISDIR(os.fstat(fd).st_mode) else "file")
        real(fd)

    monkeypatch.setattr(statefile.os, "fsync", spy)
    StateFile(tmp_path).write([EngineRecord(0, 10000, 123, 123)])
    assert synced == ["file", "dir"]


async def test_nodemanager_starts_over_a_corrupt_state_file(tmp_path: Path, start_nm) -> None:
    cfg = nm_config(tmp_path, [reserved_pair()])
    state = Path(cfg["nodemanager"]["state_dir"]) / "engines.json"
    state.parent.mkdir(parents=True)
    state.write_bytes(random.Random(3).randbytes(4096))
    nm = await start_nm(cfg)
    line = await nm.wait_line("event=engine_state_corrupt")
    (moved,) = state.parent.glob("engines.json.corrupt-*")
    assert f"moved_to={moved}" in line and "records_lost=unknown" in line
    assert "Traceback" not in "\n".join(nm.proc.lines)
    pid = (await nm.start_engines()).endpoints[0].pid
    await nm.wait_ready()
    assert nm.recorded_pgids() == [pid]
