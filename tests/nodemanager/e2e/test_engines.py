"""A NodeManager process on its own (registration disabled): StartEngines, readiness, Pause,
Resume, bad commands, Stop, SIGTERM, and a SIGKILLed NodeManager's engines cleaned up."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import grpc
import pytest
from google.rpc import error_details_pb2

from motor_mesh.common import errors
from motor_mesh.gen.motor.v1 import common_pb2, nodemanager_pb2
from motor_mesh.nodemanager import devices
from tests.nodemanager.conftest import nm_config
from tests.poll import until
from tests.ports import port_free, reserved_pair
from tests.procs import group_alive, group_gone

NORMAL = common_pb2.ENDPOINT_STATUS_NORMAL
PAUSED = common_pb2.ENDPOINT_STATUS_PAUSED
ABNORMAL = common_pb2.ENDPOINT_STATUS_ABNORMAL


async def test_start_engines_ready_pause_resume_and_idempotent(tmp_path: Path, start_nm) -> None:
    ports = [reserved_pair(), reserved_pair()]
    nm = await start_nm(nm_config(tmp_path, ports))
    await nm.wait_line("event=registration_disabled")

    resp = await nm.start_engines()
    assert [(e.id, e.port) for e in resp.endpoints] == [(0, ports[0]), (1, ports[1])]
    pids = [e.pid for e in resp.endpoints]
    assert all(p > 0 for p in pids) and len(set(pids)) == 2
    for e in resp.endpoints:
        assert e.status in (common_pb2.ENDPOINT_STATUS_INITIAL, common_pb2.ENDPOINT_STATUS_WAIT_TO_START)

    status = await nm.wait_ready()
    assert [(e.status, e.pid) for e in status.endpoints] == [(NORMAL, pids[0]), (NORMAL, pids[1])]
    assert status.instance_id == 5
    # each engine leads its own process group, recorded in state_dir/engines.json
    for pid in pids:
        assert os.getpgid(pid) == pid
    assert sorted(nm.recorded_pgids()) == sorted(pids)

    again = await nm.start_engines()
    assert [e.pid for e in again.endpoints] == pids

    await nm.stub.Pause(nodemanager_pb2.PauseRequest(), timeout=5)
    paused = await nm.status()
    assert not paused.ready
    assert [e.status for e in paused.endpoints] == [PAUSED, PAUSED]
    assert [e.pid for e in paused.endpoints] == pids  # engines keep running
    await nm.stub.Resume(nodemanager_pb2.ResumeRequest(), timeout=5)
    assert (await nm.status()).ready

    # A different start command (a new instance) replaces the engines.
    replaced = await nm.start_engines(instance_id=6)
    assert not {e.pid for e in replaced.endpoints} & set(pids)
    assert all(group_gone(p) for p in pids)
    assert (await nm.wait_ready()).instance_id == 6


async def test_bad_start_commands(tmp_path: Path, start_nm) -> None:
    port = reserved_pair()
    nm = await start_nm(nm_config(tmp_path, [port], job_name="job-a", controller="127.0.0.1:9"))
    subject = f"node/{nm.address}"
    wrong = [
        {"job_name": "job-b"},
        {"endpoints": [common_pb2.Endpoint(id=0, host="127.0.0.1", port=port + 7)]},
        {"endpoints": [common_pb2.Endpoint(id=0, host="10.1.2.3", port=port)]},
        {
            "endpoints": [
                common_pb2.Endpoint(id=0, host="127.0.0.1", port=port),
                common_pb2.Endpoint(id=1, host="127.0.0.1", port=port + 2),
            ]
        },
        # dp 1: node_rank 0 holds id 0 only, node_rank 1 id 1 only
        {"endpoints": [common_pb2.Endpoint(id=1, host="127.0.0.1", port=port)]},
        {"node_rank": 1},
    ]
    for overrides in wrong:
        with pytest.raises(grpc.aio.AioRpcError) as exc:
            await nm.start_engines(**overrides)
        assert exc.value.code() == grpc.StatusCode.FAILED_PRECONDITION, overrides
        (detail,) = errors.details_of(exc.value)
        assert isinstance(detail, error_details_pb2.PreconditionFailure)
        assert [(v.type, v.subject) for v in detail.violations] == [("NODE_MISMATCH", subject)]

    with pytest.raises(grpc.aio.AioRpcError) as exc:
        await nm.stub.StartEngines(nodemanager_pb2.StartEnginesRequest(job_name="job-a"), timeout=5)
    assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    (bad,) = errors.details_of(exc.value)
    assert {v.field for v in bad.field_violations} >= {"instance_id", "role", "endpoints"}

    status = await nm.status()
    assert not status.ready and not status.endpoints
    assert port_free(port)


async def test_stop_rpc_stops_engines_then_exits_nonzero(tmp_path: Path, start_nm) -> None:
    port = reserved_pair()
    nm = await start_nm(nm_config(tmp_path, [port], engine={"args": {"workers": 1}}))
    pid = (await nm.start_engines()).endpoints[0].pid
    await nm.wait_ready()
    await nm.stub.Stop(nodemanager_pb2.StopRequest(reason="test"), timeout=10)
    assert group_gone(pid)  # gone, zombies included, before the answer
    assert await nm.wait_exit() != 0
    assert port_free(port)


async def test_sigterm_stops_engines(tmp_path: Path, start_nm) -> None:
    port = reserved_pair()
    nm = await start_nm(nm_config(tmp_path, [port], engine={"args": {"workers": 1}}))
    pid = (await nm.start_engines()).endpoints[0].pid
    await nm.wait_ready()
    nm.proc.signal(signal.SIGTERM)
    assert await nm.wait_exit() == 0
    assert group_gone(pid)
    assert port_free(port)


async def test_sigkilled_nodemanager_restarted_kills_old_engines(tmp_path: Path, start_nm) -> None:
    port = reserved_pair()
    cfg = nm_config(tmp_path, [port], engine={"args": {"workers": 1}})
    nm = await start_nm(cfg)
    pid = (await nm.start_engines()).endpoints[0].pid
    await nm.wait_ready()
    os.kill(nm.proc.popen.pid, signal.SIGKILL)
    await nm.wait_exit()
    assert group_alive(pid) and not port_free(port)  # the orphaned engine still holds its port

    nm2 = await start_nm(cfg)
    await nm2.wait_line("event=stale_engine_kill")
    assert not group_alive(pid)
    assert port_free(port)
    assert nm2.recorded_pgids() == []
    # and the port is usable again by the new NodeManager's engine
    new_pid = (await nm2.start_engines()).endpoints[0].pid
    assert new_pid != pid
    await nm2.wait_ready()


async def test_headless_endpoint_is_normal_while_alive(tmp_path: Path, start_nm) -> None:
    port = reserved_pair()
    cfg = nm_config(tmp_path, [port], node_rank=1, parallel={"nnodes": 2, "tp": 2})
    # Under `motor up` the NodeManager prefixes its engines' output with [engine-<k>].
    nm = await start_nm(cfg, env={"MOTOR_UP_ENGINE_INDEX": "3"})
    # Rank 0's part on node_rank 1: id node_rank * dp + rank = 1; its head serves elsewhere.
    endpoint = common_pb2.Endpoint(id=1, host="127.0.0.1", port=port, headless=True)
    head = common_pb2.Endpoint(id=0, host="127.0.0.1", port=reserved_pair())
    req = {"endpoints": [endpoint], "master_host": "127.0.0.1", "node_rank": 1, "heads": [head]}
    (ep,) = (await nm.start_engines(**req)).endpoints
    assert ep.headless and ep.status == NORMAL  # no HTTP server to probe
    strict, relaxed = await nm.status(), await nm.status(relaxed=True)
    assert strict.ready and relaxed.ready
    line = await nm.wait_line("service=engine-sim event=headless")  # the engine was told --headless
    assert line.startswith("[engine-3] ts=")
    # No accelerator here: device_env "auto" chose the CPU platform, and said so once, with the
    # cores its engines share (all this process may run on: nothing configured).
    await nm.wait_line("event=device_env variable=cpu configured=auto")
    cores = devices.cpuset(devices.available_cores())
    await nm.wait_line(f"event=cpu_cores cores={cores} configured=false engines={cores}")


async def test_leader_death_seen_while_a_group_member_holds_the_log_pipe(tmp_path: Path, start_nm) -> None:
    # An engine whose worker outlives the leader and keeps the (prefixed, piped) output open.
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    vllm = bin_dir / "vllm"
    vllm.write_text(
        f"#!{sys.executable}\n"
        "import os, subprocess, sys\n"
        "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
        "os.execv(sys.executable, [sys.executable, '-m', 'motor_mesh.cli', 'engine-sim', *sys.argv[1:]])\n"
    )
    vllm.chmod(0o755)
    port = reserved_pair()
    env = {"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "MOTOR_UP_ENGINE_INDEX": "0"}
    nm = await start_nm(nm_config(tmp_path, [port], engine_type="vllm", suicide_threshold=1000), env=env)
    pid = (await nm.start_engines()).endpoints[0].pid
    await nm.wait_ready()
    assert len([p for p in os.listdir("/proc") if p.isdigit() and _pgid(int(p)) == pid]) == 2
    os.kill(pid, signal.SIGKILL)  # the leader only
    status = await nm.wait_status(lambda s: [e.status for e in s.endpoints] == [ABNORMAL], "ABNORMAL", 10)
    assert [e.pid for e in status.endpoints] == [0]
    await until(lambda: group_gone(pid), 10, "the rest of the group killed and reaped")


def _pgid(pid: int) -> int:
    try:
        return os.getpgid(pid)
    except ProcessLookupError:
        return -1


# Runs the NodeManager as a child subreaper that never reaps what it adopts, as `motor up` may.
NEGLECTFUL_SUBREAPER = (
    "import ctypes, subprocess, sys, time\n"
    "ctypes.CDLL(None).prctl(36, 1, 0, 0, 0)\n"
    "subprocess.Popen(sys.argv[1:]).wait()\n"
    "time.sleep(120)\n"
)


async def test_stale_engine_adopted_by_another_subreaper_does_not_stall_start_up(
    tmp_path: Path, start_nm
) -> None:
    port = reserved_pair()
    cfg = nm_config(tmp_path, [port])
    nm = await start_nm(cfg, wrapper=[sys.executable, "-c", NEGLECTFUL_SUBREAPER])
    pid = (await nm.start_engines()).endpoints[0].pid
    await nm.wait_ready()
    wrapper = nm.proc.popen.pid
    (nm_pid,) = _children(wrapper)
    os.kill(nm_pid, signal.SIGKILL)
    await until(lambda: _ppid(pid) == wrapper, 10, "the engine adopted by the wrapper")

    nm2 = await start_nm(cfg)
    await nm2.wait_line("event=stale_engine_kill")
    assert port_free(port)
    await nm2.start_engines()
    await nm2.wait_ready()
    assert "stale_engine_stuck" not in "\n".join(nm2.proc.lines)
    nm.proc.kill()  # the wrapper: its zombies go with it


def _children(pid: int) -> list[int]:
    return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def _ppid(pid: int) -> int:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return -1
