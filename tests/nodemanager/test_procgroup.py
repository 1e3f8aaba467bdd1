"""Process-group stop, the start-up kill of recorded engines, and the zombie reaper."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

from motor_mesh.common import procgroup
from motor_mesh.nodemanager.statefile import EngineRecord, StateFile, kill_recorded_engines
from tests.poll import wait_until
from tests.procs import group_alive

# A leader that ignores SIGTERM, with a child in its group that ignores it too.
STUBBORN = (
    "import signal, subprocess, sys, time\n"
    "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
    "subprocess.Popen([sys.executable, '-c', "
    "'import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(60)'])\n"
    "print('ready', flush=True)\n"
    "time.sleep(60)\n"
)


async def spawn_group(code: str, *extra: str) -> asyncio.subprocess.Process:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", code, *extra, stdout=asyncio.subprocess.PIPE, start_new_session=True
    )
    assert proc.stdout is not None
    assert await asyncio.wait_for(proc.stdout.readline(), 10) == b"ready\n"
    return proc


async def test_stop_group_escalates_to_sigkill_and_waits_for_every_member() -> None:
    proc = await spawn_group(STUBBORN)
    assert len(procgroup.group_members(proc.pid)) == 2
    reaper = procgroup.Reaper()
    reaper.watch(proc.pid)  # asyncio waits for the leader; the reaper must not take its status
    assert await procgroup.stop_group(proc.pid, 0.2, reaper)
    # Nothing runs any more: the child, orphaned to init (this test process is no subreaper),
    # may stay a zombie until init reaps it.
    assert all(p.state == "Z" for p in procgroup.group_members(proc.pid))
    assert await asyncio.wait_for(proc.wait(), 5) == -9


async def test_stop_group_of_a_gone_group_is_immediate() -> None:
    proc = await spawn_group("print('ready', flush=True)")
    await proc.wait()
    assert await procgroup.stop_group(proc.pid, 5, None)


async def test_recorded_engines_are_killed_and_a_reused_pgid_is_left_alone(tmp_path: Path) -> None:
    state = StateFile(tmp_path)
    engine = await spawn_group("import time; print('ready', flush=True); time.sleep(60)", "engine-sim")
    stranger = await spawn_group("import time; print('ready', flush=True); time.sleep(60)")
    try:
        state.write(
            [
                # markers only: the leader's start time is not known
                EngineRecord(0, 10000, engine.pid, engine.pid, 0, ["engine-sim"]),
                # a pgid now held by an unrelated process (wrong start time, no marker)
                EngineRecord(1, 10002, stranger.pid, stranger.pid, 1, ["engine-sim", "--port 10002"]),
                EngineRecord(2, 10004, 999_999_999, 999_999_999, 0, []),  # long gone
            ]
        )
        assert await kill_recorded_engines(state) == 3
        assert await asyncio.wait_for(engine.wait(), 5) == -9
        assert not group_alive(engine.pid)
        assert stranger.returncode is None and group_alive(stranger.pid)
        assert state.read() == []
    finally:
        for p in (engine, stranger):
            if p.returncode is None:
                p.kill()
                await p.wait()


def test_state_file_round_trip_and_bad_content(tmp_path: Path) -> None:
    state = StateFile(tmp_path / "deep" / "dir")
    assert state.read() == []
    recs = [EngineRecord(0, 10000, 123, 123, 456, ["vllm"])]
    state.write(recs)
    assert state.read() == recs
    assert [p.name for p in state.path.parent.iterdir()] == ["engines.json"]  # no temp file left
    state.path.write_text("{not json")
    assert state.read() == []


def test_reaper_reaps_unwatched_zombies_only() -> None:
    # Plain (not asyncio) children that exit stay zombies until someone waits for them.
    watched = subprocess.Popen([sys.executable, "-c", "pass"])
    stray = subprocess.Popen([sys.executable, "-c", "pass"])

    def zombie(pid: int) -> bool:
        info = procgroup.proc_info(pid)
        return info is not None and info.state == "Z"

    wait_until(lambda: zombie(watched.pid) and zombie(stray.pid), 10, "both children to exit")
    reaper = procgroup.Reaper()
    reaper.watch(watched.pid)
    assert reaper.reap() >= 1
    assert procgroup.proc_info(stray.pid) is None
    assert zombie(watched.pid)  # its status is left for its owner
    assert watched.wait(5) == 0
    stray.returncode = 0  # its status went to the reaper, as intended
