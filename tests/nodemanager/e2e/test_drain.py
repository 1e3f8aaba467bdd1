"""SIGTERM on a registered NodeManager process (``motor nodemanager``) against a fake Controller:
it asks the Controller to terminate its instance (which drains it first) and keeps its engines
running until the Controller's Stop; a Controller that does not take the request, SIGINT, or a
second signal stop the engines at once."""

from __future__ import annotations

import signal
from pathlib import Path

from motor_mesh.gen.motor.v1 import nodemanager_pb2
from tests.nodemanager.conftest import nm_config
from tests.poll import until
from tests.ports import port_free, reserved_pair
from tests.procs import group_alive, group_gone


async def serving_node(tmp_path: Path, controller, start_nm, **overrides):
    """A registered NodeManager whose engine (instance 42) is ready; (the process, engine pid)."""
    port = reserved_pair()
    cfg = nm_config(tmp_path, [port], job_name="job-a", controller=controller.address, **overrides)
    nm = await start_nm(cfg)
    await until(lambda: controller.fake.beats(), 15, "a beat")
    pid = (await nm.start_engines(instance_id=42)).endpoints[0].pid
    await nm.wait_ready()
    return nm, pid


async def test_sigterm_has_the_controller_terminate_the_instance_before_the_engines_stop(
    tmp_path: Path, controller, start_nm
) -> None:
    fake = controller.fake
    fake.accept_terminate = True
    nm, pid = await serving_node(tmp_path, controller, start_nm)
    nm.proc.signal(signal.SIGTERM)
    (req,) = await until(lambda: fake.terminates, 10, "TerminateInstance")
    assert req.instance_id == 42 and "SIGTERM" in req.reason and nm.address in req.reason
    # While the Controller drains it the node goes on as before: engines up, beats flowing.
    beats = len(fake.beats())
    await until(lambda: len(fake.beats()) >= beats + 3, 10, "beats during the drain")
    assert group_alive(pid) and (await nm.status()).ready
    # Drained: the Controller stops the node, which then exits as SIGTERM asked (0).
    await nm.stub.Stop(nodemanager_pb2.StopRequest(reason="terminated: drained"), timeout=20)
    assert group_gone(pid)
    assert await nm.wait_exit() == 0
    assert "outcome=stopped_by_controller" in await nm.wait_line("event=drain_wait_over")
    assert len(fake.terminates) == 1


async def test_a_second_signal_during_the_drain_stops_at_once(tmp_path: Path, controller, start_nm) -> None:
    controller.fake.accept_terminate = True
    nm, pid = await serving_node(tmp_path, controller, start_nm)
    nm.proc.signal(signal.SIGTERM)
    await until(lambda: controller.fake.terminates, 10, "TerminateInstance")
    await nm.wait_line("event=drain_requested")
    nm.proc.signal(signal.SIGTERM)
    assert await nm.wait_exit() == 128 + signal.SIGTERM
    await nm.wait_line("event=forced_exit")
    await until(lambda: not group_alive(pid), 10, "the engine's process group to be gone")


async def test_a_controller_that_does_not_take_the_request_leaves_the_stop_as_before(
    tmp_path: Path, controller, start_nm
) -> None:
    nm, pid = await serving_node(tmp_path, controller, start_nm)  # TerminateInstance: UNIMPLEMENTED
    port = nm.cfg["nodemanager"]["ports"][0]
    nm.proc.signal(signal.SIGTERM)
    assert await nm.wait_exit() == 0
    assert group_gone(pid) and port_free(port)
    assert "code=UNIMPLEMENTED" in await nm.wait_line("event=drain_request_failed")
    assert [r.instance_id for r in controller.fake.terminates] == [42]


async def test_sigint_stops_at_once_without_a_drain(tmp_path: Path, controller, start_nm) -> None:
    controller.fake.accept_terminate = True
    nm, pid = await serving_node(tmp_path, controller, start_nm)
    nm.proc.signal(signal.SIGINT)
    assert await nm.wait_exit() == 0
    assert group_gone(pid)
    assert controller.fake.terminates == []


async def test_a_node_with_nothing_to_drain_stops_at_once(tmp_path: Path, controller, start_nm) -> None:
    controller.fake.accept_terminate = True
    cfg = nm_config(tmp_path, [reserved_pair()], job_name="job-a", controller=controller.address)
    nm = await start_nm(cfg)
    await until(lambda: controller.fake.beats(), 15, "a beat")
    nm.proc.signal(signal.SIGTERM)  # registered, but no engines (no instance) yet
    assert await nm.wait_exit() == 0
    assert "reason=" in await nm.wait_line("event=drain_skipped")
    assert controller.fake.terminates == []
