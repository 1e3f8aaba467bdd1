"""A NodeManager process against a fake in-process Controller: registration retries and
refusals, beats, the DEAD event, DIRECTIVE_REREGISTER, hung engines, freeze and suicide."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import grpc
import pytest

from motor_mesh.common import errors
from motor_mesh.gen.motor.v1 import common_pb2, controller_pb2, nodemanager_pb2
from tests.nodemanager.conftest import ControllerServer, nm_config
from tests.poll import until
from tests.ports import port_free, reserved_pair, reserved_port
from tests.procs import group_gone

NORMAL = common_pb2.ENDPOINT_STATUS_NORMAL
ABNORMAL = common_pb2.ENDPOINT_STATUS_ABNORMAL
DEAD = controller_pb2.ENGINE_EVENT_TYPE_DEAD
UNHEALTHY = controller_pb2.ENGINE_EVENT_TYPE_UNHEALTHY


async def test_registration_retries_until_controller_is_up(tmp_path: Path, start_nm) -> None:
    cport = reserved_port()
    port = reserved_pair()
    nm = await start_nm(nm_config(tmp_path, [port], job_name="job-a", controller=f"127.0.0.1:{cport}"))
    await nm.wait_line("event=register_failed")
    assert "code=UNAVAILABLE" in await nm.wait_line("event=register_failed")

    ctl = await ControllerServer(cport).start()
    try:
        fake = ctl.fake
        await until(lambda: fake.beats(), 15, "a beat")
        (reg,) = fake.registers
        incarnation = (await nm.status()).incarnation  # this process, as GetStatus says
        assert incarnation > 0
        assert reg == controller_pb2.RegisterRequest(
            job_name="job-a",
            role=common_pb2.ROLE_PREFILL,
            model_name="served-1",
            engine_type=common_pb2.ENGINE_TYPE_SIM,
            host="127.0.0.1",
            nm_port=nm.port,
            ports=[port],
            device_count=0,
            parallel=common_pb2.ParallelConfig(dp=1, tp=1, pp=1, ep=1, nnodes=1),
            node_rank=0,
            instance_id=0,
            pd_protocol=common_pb2.PD_PROTOCOL_VLLM,
            incarnation=incarnation,
        )
        first = fake.beats()[0]
        assert (first.node_id, first.session_epoch, list(first.endpoints)) == (7, 1, [])
        # beats keep coming every heartbeat_interval_ms, with increasing seq
        await until(lambda: len(fake.beats()) >= 3, 10, "three beats")
        seqs = [b.seq for b in fake.beats()]
        assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)

        # The stream breaks: the NodeManager reconnects in the same session.
        fake.break_streams()
        await until(lambda: fake.streams_opened >= 2, 10, "a new stream")
        n = len(fake.beats())
        await until(lambda: len(fake.beats()) >= n + 2, 10, "beats on the new stream")
        assert len(fake.registers) == 1 and fake.beats()[-1].session_epoch == 1
    finally:
        nm.proc.kill()
        await ctl.stop()


REFUSALS = {
    "INVALID_ARGUMENT": errors.bad_request([("job_name", "required")]),
    "UNAUTHENTICATED": errors.MotorError(grpc.StatusCode.UNAUTHENTICATED, "missing management key"),
    "PERMISSION_DENIED": errors.MotorError(grpc.StatusCode.PERMISSION_DENIED, "wrong management key"),
}


@pytest.mark.parametrize("code", list(REFUSALS))
async def test_refused_registration_exits_1(tmp_path: Path, controller, start_nm, code: str) -> None:
    controller.fake.register_errors.append(REFUSALS[code])
    cfg = nm_config(tmp_path, [reserved_pair()], job_name="job-a", controller=controller.address)
    nm = await start_nm(cfg)
    assert await nm.wait_exit() == 1
    assert f"code={code}" in await nm.wait_line("event=register_refused")


async def test_registration_retries_through_already_exists_and_cancelled(
    tmp_path: Path, controller, start_nm
) -> None:
    fake = controller.fake
    fake.register_errors += [
        errors.already_exists("NODE_REGISTERED", "the previous session has not timed out"),
        errors.MotorError(grpc.StatusCode.CANCELLED, "controller shutting down"),
    ]
    cfg = nm_config(tmp_path, [reserved_pair()], job_name="job-a", controller=controller.address)
    nm = await start_nm(cfg)
    await until(lambda: fake.beats(), 15, "a beat after two failed registrations")
    assert len(fake.registers) == 3
    assert "code=ALREADY_EXISTS" in await nm.wait_line("event=register_failed")
    assert "event=register_failed" in await nm.wait_line("code=CANCELLED")
    assert nm.proc.popen.poll() is None


async def test_engines_beats_reregister_and_dead_event(tmp_path: Path, controller, start_nm) -> None:
    fake = controller.fake
    port = reserved_pair()
    cfg = nm_config(tmp_path, [port], job_name="job-a", controller=controller.address, suicide_threshold=1000)
    nm = await start_nm(cfg)
    await until(lambda: fake.beats(), 15, "first beat")

    pid = (await nm.start_engines(instance_id=42)).endpoints[0].pid
    await nm.wait_ready()
    beat = await until(
        lambda: next((b for b in fake.beats() if [e.status for e in b.endpoints] == [NORMAL]), None),
        10,
        "a beat with the endpoint NORMAL",
    )
    (ep,) = beat.endpoints
    assert (ep.id, ep.host, ep.port, ep.pid) == (0, "127.0.0.1", port, pid)

    # The Controller lost the session: register again with the instance id, engines untouched.
    fake.reregister()
    await until(lambda: len(fake.registers) >= 2, 10, "re-registration")
    assert fake.registers[1].instance_id == 42
    await until(lambda: any(b.session_epoch == 2 for b in fake.beats()), 10, "beats in the new session")
    status = await nm.status()
    assert status.ready and [e.pid for e in status.endpoints] == [pid]

    # The engine group dies: one DEAD event naming the pid, and a beat saying ABNORMAL.
    os.killpg(pid, signal.SIGKILL)
    ev = await until(lambda: next(iter(fake.events()), None), 10, "DEAD event")
    assert (ev.type, ev.endpoint_id, ev.pid, ev.node_id, ev.session_epoch) == (DEAD, 0, pid, 7, 2)
    assert "SIGKILL" in ev.detail
    await until(lambda: [e.status for e in fake.last_endpoints()] == [ABNORMAL], 10, "ABNORMAL beat")
    n = len(fake.beats())
    await until(lambda: len(fake.beats()) >= n + 2, 10, "later beats")
    assert len(fake.events()) == 1  # once per pid
    status = await nm.status()
    assert not status.ready
    assert [(e.status, e.pid) for e in status.endpoints] == [(ABNORMAL, 0)]
    await until(lambda: group_gone(pid), 10, "the dead engine's group reaped")
    assert port_free(port)


async def test_hung_engine_unhealthy_then_killed_and_reported_dead(
    tmp_path: Path, controller, start_nm
) -> None:
    fake = controller.fake
    port = reserved_pair()
    cfg = nm_config(
        tmp_path,
        [port],
        job_name="job-a",
        controller=controller.address,
        status_probe_timeout_s=0.3,
        suicide_threshold=1000,
    )
    nm = await start_nm(cfg)
    pid = (await nm.start_engines()).endpoints[0].pid
    await nm.wait_ready()
    # The whole engine stops answering, /health included (the simulated engine's `hang` fault
    # wedges inference only; the inference probe's tests cover that).
    os.killpg(pid, signal.SIGSTOP)
    unhealthy = await until(lambda: [e for e in fake.events() if e.type == UNHEALTHY], 10, "UNHEALTHY")
    assert unhealthy[0].pid == pid
    dead = await until(
        lambda: [e for e in fake.events() if e.type == DEAD], 15, "DEAD after the hang timeout"
    )
    assert dead[0].pid == pid and "hung" in dead[0].detail
    await until(lambda: group_gone(pid), 10, "hung group killed and reaped")


async def test_dead_engine_with_relaunch_enabled_freezes_then_restart_and_abort(
    tmp_path: Path, controller, start_nm
) -> None:
    fake = controller.fake
    fake.relaunch_enabled = True
    port = reserved_pair()
    cfg = nm_config(tmp_path, [port], job_name="job-a", controller=controller.address)
    nm = await start_nm(cfg)
    with pytest.raises(grpc.aio.AioRpcError) as exc:
        await nm.stub.RestartEngines(
            nodemanager_pb2.RestartEnginesRequest(action=nodemanager_pb2.RESTART_ACTION_RESTART), timeout=5
        )
    assert exc.value.code() == grpc.StatusCode.FAILED_PRECONDITION

    pid = (await nm.start_engines()).endpoints[0].pid
    await nm.wait_ready()
    os.killpg(pid, signal.SIGKILL)
    await until(lambda: fake.events(), 10, "DEAD event")
    # acked and relaunch enabled: frozen, so suicide arbitration holds off
    status = await nm.wait_status(lambda s: s.HasField("frozen_until"), "frozen")
    assert not status.ready

    start = len(nm.proc.lines)
    restart = nodemanager_pb2.RestartEnginesRequest(
        action=nodemanager_pb2.RESTART_ACTION_RESTART, instance_id=5
    )
    resp = await nm.stub.RestartEngines(restart, timeout=15)
    assert resp.relaunch_count == 1
    banner = await nm.wait_line("[ENGINE RELAUNCH #1 ", start=start)
    assert banner.startswith("[ENGINE RELAUNCH #1 ") and banner.endswith(" UTC]")
    status = await nm.wait_ready()
    (ep,) = status.endpoints
    nm.track(ep.pid)
    assert ep.pid != pid and status.relaunch_count == 1 and status.HasField("frozen_until")

    await nm.stub.RestartEngines(
        nodemanager_pb2.RestartEnginesRequest(action=nodemanager_pb2.RESTART_ACTION_ABORT), timeout=5
    )
    assert not (await nm.status()).HasField("frozen_until")
    assert nm.proc.popen.poll() is None


async def test_dead_engine_without_relaunch_leads_to_suicide(tmp_path: Path, controller, start_nm) -> None:
    port = reserved_pair()
    nm = await start_nm(nm_config(tmp_path, [port], job_name="job-a", controller=controller.address))
    pid = (await nm.start_engines()).endpoints[0].pid
    await nm.wait_ready()
    os.killpg(pid, signal.SIGKILL)
    assert await nm.wait_exit() != 0
    assert "suicide" in await nm.wait_line("event=exiting")
    assert port_free(port)


async def test_controller_down_when_the_engine_dies_means_no_freeze(
    tmp_path: Path, controller, start_nm
) -> None:
    # Relaunch is on, but nobody acknowledges the death report: nothing will relaunch the
    # engine, so the node must not hold its fallback; it restarts promptly.
    controller.fake.relaunch_enabled = True
    port = reserved_pair()
    nm = await start_nm(nm_config(tmp_path, [port], job_name="job-a", controller=controller.address))
    pid = (await nm.start_engines()).endpoints[0].pid
    await nm.wait_ready()
    await until(lambda: controller.fake.beats(), 10, "a beat")
    await controller.stop()
    os.killpg(pid, signal.SIGKILL)
    assert await nm.wait_exit() != 0
    assert "suicide" in await nm.wait_line("event=exiting")
    assert not any("event=frozen" in line for line in nm.proc.lines)


async def test_a_freeze_nobody_lifts_expires_and_the_node_restarts(
    tmp_path: Path, controller, start_nm
) -> None:
    # The death report is acked (relaunch on) but neither RESTART nor ABORT ever comes, as when
    # the Controller's ABORT is lost: the hold runs out on its own.
    controller.fake.relaunch_enabled = True
    port = reserved_pair()
    cfg = nm_config(
        tmp_path, [port], job_name="job-a", controller=controller.address, engine_restart_wait_timeout_s=1
    )
    nm = await start_nm(cfg)
    pid = (await nm.start_engines()).endpoints[0].pid
    await nm.wait_ready()
    os.killpg(pid, signal.SIGKILL)
    await nm.wait_line("event=frozen")
    assert await nm.wait_exit() != 0
    assert "suicide" in await nm.wait_line("event=exiting")


async def test_a_stopped_node_does_not_register_again_while_it_leaves(
    tmp_path: Path, controller, start_nm
) -> None:
    # The Controller deletes an instance before it sends Stop, so the leaving node's stream is
    # told to register again: it must not, or a new instance would be assembled around a node
    # that is about to exit.
    fake = controller.fake
    cfg = nm_config(tmp_path, [reserved_pair()], job_name="job-a", controller=controller.address)
    nm = await start_nm(cfg)
    await until(lambda: fake.beats(), 15, "first beat")
    await nm.start_engines()
    await nm.wait_ready()
    await nm.stub.Stop(nodemanager_pb2.StopRequest(reason="test"), timeout=10)
    fake.reregister()
    assert await nm.wait_exit(10) == 1
    assert len(fake.registers) == 1
