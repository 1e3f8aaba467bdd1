"""The event pusher against a fake Coordinator: incremental calls, the coalesced full Set,
incarnation changes, NOT_FOUND deletes and a Coordinator that comes up late; then the failures
it must survive, each ending with the Coordinator's table equal to the Controller's: its channel
closed under a call, a Coordinator that hangs, refuses, restarts in the middle of a Set (a fake,
and a real process SIGKILLed), or takes a Set on its way out."""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2

from motor_mesh.common.server import MotorServer
from motor_mesh.controller import state_machine as sm
from motor_mesh.controller.convert import instance_pb
from motor_mesh.controller.instances import InstanceTable
from motor_mesh.controller.model import Instance, JobSpec, Member
from motor_mesh.controller.push.pusher import CoordinatorSync
from motor_mesh.controller.push.watch import UNKNOWN, CoordinatorWatch
from motor_mesh.controller.store.sqlite import Store
from motor_mesh.gen.motor.v1 import common_pb2
from tests.controller.fakes import (
    ACTIVE,
    NORMAL,
    FakeCoordinator,
    FakeNodeManager,
    controller_side,
    coordinator_side,
    delete,
    running_controller,
)
from tests.poll import until
from tests.ports import reserved_port
from tests.procs import Proc, motor_argv


class World:
    """An instance table (with its database) and one pusher watching it."""

    def __init__(
        self,
        tmp: Path,
        address: str,
        sync_interval_s: float = 0.0,
        resync_s: float = 30.0,
        call_timeout_s: float = 3.0,
    ) -> None:
        self.store = Store(tmp)
        self.table = InstanceTable(self.store)
        self.sync = CoordinatorSync(
            [address],
            self.table,
            sync_interval_s=sync_interval_s,
            resync_s=resync_s,
            call_timeout_s=call_timeout_s,
        )
        self.address = address
        self.pusher = self.sync.pushers[address]
        self._next_port = 10000

    async def in_step(self) -> bool:
        """The Coordinator holds exactly what the Controller's ListInstances would call routable."""
        listed = [instance_pb(i) for i in self.table.find()]  # what Controller.ListInstances answers
        return await coordinator_side(self.address) == controller_side(listed)

    async def instance(self, status: int = sm.ACTIVE) -> Instance:
        """A new instance, taken from INITIAL to ``status`` through the table."""
        iid = await self.store.next_instance_id()
        port, self._next_port = self._next_port, self._next_port + 2
        ep = common_pb2.Endpoint(id=0, host="127.0.0.1", port=port, status=common_pb2.ENDPOINT_STATUS_NORMAL)
        spec = JobSpec(role=common_pb2.ROLE_PREFILL, model_name="m", engine_type=3, pd_protocol=1)
        m = Member(node_rank=0, host="127.0.0.1", nm_port=7300, ports=[port])
        inst = Instance(
            id=iid, job_name=f"job{iid}", spec=spec, status=sm.INITIAL, endpoints=[ep], members=[m]
        )
        await self.store.assemble(inst)
        self.table.add(inst)
        if status != sm.INITIAL:
            await self.table.transition(inst, sm.ACTIVE, "test")
        if status == sm.DELETED:
            await delete(self.table, inst)
        elif status not in (sm.INITIAL, sm.ACTIVE):
            await self.table.transition(inst, status, "test")  # type: ignore[arg-type]
        return inst


@pytest.fixture
async def world(tmp_path: Path, coordinator: FakeCoordinator) -> AsyncIterator[World]:
    w = World(tmp_path, coordinator.address)
    w.sync.start()
    await until(lambda: coordinator.count("Set", ok=True) == 1)  # the start-up sync
    yield w
    await w.sync.close()
    await w.store.close()


async def test_transitions_become_incremental_calls(world: World, coordinator: FakeCoordinator) -> None:
    inst = await world.instance(sm.ACTIVE)
    await until(lambda: inst.id in coordinator.table)
    [add] = coordinator.ok_calls("Add")
    assert add.instances[0].endpoints[0].port == inst.endpoints[0].port
    await world.table.transition(inst, sm.PAUSED, "test")
    await until(lambda: inst.id in coordinator.paused)
    await world.table.transition(inst, sm.ACTIVE, "test")
    await until(lambda: coordinator.count("Resume", ok=True) == 1)
    await world.table.transition(inst, sm.INACTIVE, "test")
    await until(lambda: inst.id not in coordinator.table)
    [delete] = coordinator.ok_calls("Delete")
    # Delete names the identity: id, role, job name, endpoints.
    assert (delete.instances[0].id, delete.instances[0].job_name) == (inst.id, inst.job_name)
    assert [(e.host, e.port) for e in delete.instances[0].endpoints] == [
        ("127.0.0.1", inst.endpoints[0].port)
    ]
    assert coordinator.count("Set") == 1  # nothing failed: no extra full sync


async def test_failures_coalesce_into_exactly_one_set(world: World, coordinator: FakeCoordinator) -> None:
    coordinator.fail_next = 3  # the Add, then two Set attempts fail
    a = await world.instance(sm.ACTIVE)
    b = await world.instance(sm.ACTIVE)
    await world.table.transition(a, sm.PAUSED, "test")
    await until(lambda: coordinator.count("Set", ok=True) == 2)
    assert coordinator.table.keys() == {a.id, b.id}
    assert coordinator.paused == {a.id}
    # Barrier: one more change; everything queued before it has been sent once it arrives.
    c = await world.instance(sm.ACTIVE)
    await until(lambda: c.id in coordinator.table)
    failed = [m for m, _, ok in coordinator.calls if not ok]
    assert failed == ["Add", "Set", "Set"]  # a failed Set never queues another Set
    assert coordinator.count("Set", ok=True) == 2  # start-up + exactly one resync
    assert [i.id for r in coordinator.ok_calls("Add") for i in r.instances] == [c.id]  # b rode in the Set
    assert world.pusher.synced_fingerprint


async def test_new_incarnation_triggers_a_set(world: World, coordinator: FakeCoordinator) -> None:
    a = await world.instance(sm.ACTIVE)
    await until(lambda: a.id in coordinator.table)
    coordinator.restart_state()  # as if the Coordinator restarted with an empty table
    b = await world.instance(sm.ACTIVE)
    await until(lambda: coordinator.table.keys() == {a.id, b.id})
    assert coordinator.count("Set", ok=True) == 2


async def test_delete_not_found_counts_as_done(world: World, coordinator: FakeCoordinator) -> None:
    a = await world.instance(sm.ACTIVE)
    await until(lambda: a.id in coordinator.table)
    coordinator.table.clear()  # someone else removed it
    await delete(world.table, a)
    b = await world.instance(sm.ACTIVE)  # barrier
    await until(lambda: b.id in coordinator.table)
    assert coordinator.count("Delete", ok=False) == 1
    assert coordinator.count("Set") == 1  # NOT_FOUND did not force a full sync


async def test_periodic_set(tmp_path: Path, coordinator: FakeCoordinator) -> None:
    w = World(tmp_path, coordinator.address, sync_interval_s=0.1)
    w.sync.start()
    try:
        await until(lambda: coordinator.count("Set", ok=True) >= 3)
    finally:
        await w.sync.close()
        await w.store.close()


async def test_coordinator_down_then_up_gets_a_full_set(tmp_path: Path) -> None:
    port = reserved_port()
    w = World(tmp_path, f"127.0.0.1:{port}")
    w.sync.start()
    late = FakeCoordinator()
    try:
        a = await w.instance(sm.ACTIVE)
        await until(lambda: w.pusher.stats["set_failed"] >= 2)
        await late.start(port)
        await until(lambda: a.id in late.table, timeout=5)
        assert late.count("Set", ok=True) == 1 and late.count("Add") == 0
    finally:
        await w.sync.close()
        await late.stop()
        await w.store.close()


async def test_watch_break_and_return_resyncs(tmp_path: Path, coordinator: FakeCoordinator) -> None:
    w = World(tmp_path, coordinator.address)
    w.sync.start()
    try:
        await until(lambda: coordinator.count("Set", ok=True) == 1)
        a = await w.instance(sm.ACTIVE)
        await until(lambda: a.id in coordinator.table)
        # Same servicer (same incarnation) behind a new server: only the Watch sees the break.
        port = coordinator.port
        await coordinator.stop()
        coordinator.table.clear()
        await coordinator.start(port)
        await until(lambda: a.id in coordinator.table, timeout=5)
        assert coordinator.count("Set", ok=True) == 2
    finally:
        await w.sync.close()
        await w.store.close()


async def test_a_lost_event_is_corrected_by_the_resync(
    tmp_path: Path, coordinator: FakeCoordinator, monkeypatch: pytest.MonkeyPatch
) -> None:
    w = World(tmp_path, coordinator.address, resync_s=0.2)
    monkeypatch.setattr(w.pusher, "on_transition", lambda *args: None)  # every event is lost
    w.sync.start()
    try:
        await until(lambda: coordinator.count("Set", ok=True) == 1)
        a = await w.instance(sm.ACTIVE)
        await until(lambda: a.id in coordinator.table, timeout=5)
        await w.table.transition(a, sm.PAUSED, "test")
        await until(lambda: a.id in coordinator.paused, timeout=5)
        await w.table.transition(a, sm.INACTIVE, "test")
        await until(lambda: a.id not in coordinator.table, timeout=5)
        # The resync sent the differences, not a full Set.
        assert [coordinator.count(m, ok=True) for m in ("Set", "Add", "Pause", "Delete")] == [1, 1, 1, 1]
    finally:
        await w.sync.close()
        await w.store.close()


async def test_a_change_made_while_a_call_is_in_flight_follows_it(
    world: World, coordinator: FakeCoordinator
) -> None:
    a = await world.instance(sm.INITIAL)

    pausing: list[asyncio.Task[None]] = []

    def pause_during_add(method: str) -> None:
        if method == "Add":  # the Coordinator has taken the Add; its answer is not back yet
            pausing.append(
                asyncio.get_running_loop().create_task(world.table.transition(a, sm.PAUSED, "test"))
            )

    coordinator.on_answer = pause_during_add
    await world.table.transition(a, sm.ACTIVE, "test")
    await until(lambda: a.id in coordinator.paused)
    [add] = coordinator.ok_calls("Add")
    assert add.instances[0].status == sm.ACTIVE and coordinator.count("Pause", ok=True) == 1


# ---- failures the pusher survives -----------------------------------------------------------------


def logged(caplog: pytest.LogCaptureFixture, event: str = "coordinator_push_failed") -> list[dict]:
    return [r.fields for r in caplog.records if r.getMessage() == event]


def bugs(caplog: pytest.LogCaptureFixture) -> list[str]:
    """Lines that say something broke rather than failed as expected."""
    return [r.getMessage() for r in caplog.records if r.getMessage() in ("reconcile_failed", "task_failed")]


async def started(w: World) -> World:
    w.sync.start()
    await until(lambda: w.pusher.stats["set_ok"] == 1)  # the start-up sync
    return w


async def test_a_channel_closed_under_an_in_flight_call(
    tmp_path: Path, coordinator: FakeCoordinator, caplog: pytest.LogCaptureFixture
) -> None:
    w = await started(World(tmp_path, coordinator.address))
    try:
        a = await w.instance(sm.ACTIVE)
        await until(lambda: a.id in coordinator.table)
        coordinator.hang = True
        b = await w.instance(sm.ACTIVE)
        await until(lambda: coordinator.hung == ["Add"])
        # grpc.aio raises CancelledError inside the awaiting Add: the bug that once ended the
        # pusher for good.
        assert w.pusher._channel is not None
        await w.pusher._channel.close()
        coordinator.hang = False
        await until(w.in_step)
        assert b.id in coordinator.table
        c = await w.instance(sm.ACTIVE)  # and it keeps going
        await until(lambda: c.id in coordinator.table)
        first = logged(caplog)[0]
        assert (first["call"], first["code"], first["detail"]) == ("add", "CHANNEL_CLOSED", "CancelledError")
        assert bugs(caplog) == []
    finally:
        await w.sync.close()
        await w.store.close()


async def test_without_health_a_closed_channel_is_replaced_by_the_pusher(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    coordinator = await FakeCoordinator(health=False).start()
    w = await started(World(tmp_path, coordinator.address))
    try:
        await until(lambda: logged(caplog, "coordinator_health_unavailable"))
        # Nobody else would open a new channel: the Watch ended for good on UNIMPLEMENTED.
        assert w.pusher._channel is not None
        await w.pusher._channel.close()
        a = await w.instance(sm.ACTIVE)  # its Add finds the channel closed (UsageError)
        await until(lambda: a.id in coordinator.table)
        assert await w.in_step()
        assert [(f["call"], f["detail"]) for f in logged(caplog)] == [("add", "UsageError")]
        assert coordinator.count("Add") == 0 and coordinator.count("Set", ok=True) == 2
        assert bugs(caplog) == [] and len(logged(caplog, "coordinator_health_unavailable")) == 1
    finally:
        await w.sync.close()
        await w.store.close()
        await coordinator.stop()


async def test_a_hanging_coordinator(
    tmp_path: Path, coordinator: FakeCoordinator, caplog: pytest.LogCaptureFixture
) -> None:
    w = await started(World(tmp_path, coordinator.address, call_timeout_s=0.3))
    try:
        a = await w.instance(sm.ACTIVE)
        await until(lambda: a.id in coordinator.table)
        coordinator.hang = True
        b = await w.instance(sm.ACTIVE)
        await w.table.transition(a, sm.PAUSED, "test")
        # Each call ends at its deadline and is tried again, as a full Set.
        await until(lambda: len(coordinator.hung) >= 4)
        assert coordinator.hung[:2] == ["Add", "Set"] and set(coordinator.hung[1:]) == {"Set"}
        coordinator.hang = False
        await until(w.in_step)
        assert coordinator.paused == {a.id} and b.id in coordinator.table
        # One warning per kind of failure, however often it happened.
        assert [(f["call"], f["code"]) for f in logged(caplog)] == [
            ("add", "DEADLINE_EXCEEDED"),
            ("set", "DEADLINE_EXCEEDED"),
        ]
        assert bugs(caplog) == []
    finally:
        await w.sync.close()
        await w.store.close()


@pytest.mark.parametrize(
    "code",
    [grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.INTERNAL, grpc.StatusCode.RESOURCE_EXHAUSTED],
)
async def test_a_refusing_coordinator(
    tmp_path: Path, coordinator: FakeCoordinator, caplog: pytest.LogCaptureFixture, code: grpc.StatusCode
) -> None:
    w = await started(World(tmp_path, coordinator.address))
    try:
        a = await w.instance(sm.ACTIVE)
        await until(lambda: a.id in coordinator.table)
        coordinator.refuse = code
        b = await w.instance(sm.ACTIVE)
        await w.table.transition(a, sm.PAUSED, "test")
        await until(lambda: w.pusher.stats["set_failed"] >= 3)
        assert not await w.in_step()
        coordinator.refuse = None
        await until(w.in_step)
        assert coordinator.paused == {a.id} and b.id in coordinator.table
        assert [(f["call"], f["code"]) for f in logged(caplog)] == [("add", code.name), ("set", code.name)]
        assert bugs(caplog) == []
    finally:
        await w.sync.close()
        await w.store.close()


async def test_a_coordinator_restarted_during_a_set(tmp_path: Path, coordinator: FakeCoordinator) -> None:
    w = await started(World(tmp_path, coordinator.address))
    try:
        a, b = await w.instance(sm.ACTIVE), await w.instance(sm.PAUSED)
        await until(w.in_step)
        coordinator.hang = True
        w.pusher.request_full_sync("test")
        await until(lambda: coordinator.hung == ["Set"])
        port, old = coordinator.port, coordinator.incarnation
        await coordinator.stop()  # the Set in flight dies with the server
        coordinator.restart_state()
        coordinator.hang = False
        await coordinator.start(port)
        await until(w.in_step)
        assert coordinator.table.keys() == {a.id, b.id} and coordinator.paused == {b.id}
        # The server holds the table as soon as it applies the Set; the pusher reads the new
        # incarnation from the response, a moment later.
        await until(lambda: w.pusher.incarnation == coordinator.incarnation)
        assert coordinator.incarnation != old
    finally:
        await w.sync.close()
        await w.store.close()


async def test_a_set_taken_by_a_coordinator_on_its_way_out_is_sent_again(
    tmp_path: Path, coordinator: FakeCoordinator, caplog: pytest.LogCaptureFixture
) -> None:
    w = await started(World(tmp_path, coordinator.address))
    try:
        a = await w.instance(sm.ACTIVE)
        await until(w.in_step)
        # A graceful stop: NOT_SERVING first, and calls are still taken while it drains.
        assert isinstance(coordinator.server, MotorServer)
        await coordinator.server.health.enter_graceful_shutdown()
        await until(lambda: logged(caplog, "coordinator_unreachable"))
        w.pusher.request_full_sync("test")
        await until(lambda: coordinator.count("Set", ok=True) == 2)
        port = coordinator.port
        await coordinator.stop()
        coordinator.restart_state()
        await coordinator.start(port)
        # That Set reached the old process, not the one answering now: the table comes back.
        await until(w.in_step)
        assert a.id in coordinator.table and coordinator.count("Set", ok=True) == 3
    finally:
        await w.sync.close()
        await w.store.close()


class ScriptedHealth:
    """A health stub whose Watch streams follow a script: each item is a status to send or an
    exception to raise; a stream that runs out of items stays open."""

    def __init__(self, *streams: list[Any]) -> None:
        self.streams = list(streams)

    def Watch(self, req: health_pb2.HealthCheckRequest, wait_for_ready: bool = False) -> AsyncIterator[Any]:
        return self._stream(self.streams.pop(0))

    async def _stream(self, items: list[Any]) -> AsyncIterator[Any]:
        for item in items:
            if isinstance(item, BaseException):
                raise item
            yield health_pb2.HealthCheckResponse(status=item)
        await asyncio.Event().wait()


class WatchedPusher:
    address = "127.0.0.1:1"

    def __init__(self, health: ScriptedHealth) -> None:
        self.health = health
        self.channel_gen = 1
        self.restored_after: list[int] = []

    def health_stub(self) -> Any:
        return self.health

    def reopen(self) -> None:
        self.channel_gen += 1

    def restored(self, broken_gen: int) -> None:
        self.restored_after.append(broken_gen)


SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING


def rpc_error(code: grpc.StatusCode) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), "test")


async def test_a_watch_that_fails_is_restarted_and_resyncs(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    pusher = WatchedPusher(ScriptedHealth([SERVING, RuntimeError("test: a bug")], [SERVING]))
    watch = CoordinatorWatch(pusher)
    watch.start()
    try:
        # Nobody watched while it was restarting: whatever Set went before, a full one follows.
        await until(lambda: pusher.restored_after == [UNKNOWN])
        assert bugs(caplog) == ["task_failed"] and len(logged(caplog, "task_restarting")) == 1
        assert watch._task is not None and not watch._task.done()
    finally:
        await watch.close()


async def test_only_a_coordinator_without_health_ends_the_watch(caplog: pytest.LogCaptureFixture) -> None:
    pusher = WatchedPusher(
        ScriptedHealth(
            [SERVING, rpc_error(grpc.StatusCode.UNAVAILABLE)],  # breaks on channel 1
            [asyncio.CancelledError()],  # grpc.aio: the channel was closed under the stream
            [NOT_SERVING, rpc_error(grpc.StatusCode.CANCELLED)],
            [SERVING, rpc_error(grpc.StatusCode.UNAVAILABLE)],  # back, then breaks on channel 4
            [rpc_error(grpc.StatusCode.UNIMPLEMENTED)],
        )
    )
    watch = CoordinatorWatch(pusher)
    watch.start()
    assert watch._task is not None
    await asyncio.wait_for(watch._task, 10)
    assert pusher.restored_after == [1] and pusher.channel_gen == 5
    assert [f["why"] for f in logged(caplog, "coordinator_unreachable")] == ["UNAVAILABLE", "UNAVAILABLE"]
    assert len(logged(caplog, "coordinator_health_unavailable")) == 1
    assert bugs(caplog) == [] and logged(caplog, "task_restarting") == []


def _unread_bytes(port: int) -> int:
    """Bytes that arrived for the listener on ``port`` and sit unread in its sockets (a stopped
    process cannot read them): the request is on the wire."""
    total = 0
    for name in ("tcp", "tcp6"):
        for line in Path(f"/proc/net/{name}").read_text().splitlines()[1:]:
            fields = line.split()
            if int(fields[1].rsplit(":", 1)[1], 16) == port:
                total += int(fields[4].split(":")[1], 16)
    return total


async def test_a_real_coordinator_killed_during_a_set(
    tmp_path: Path, node_managers: Callable[..., Awaitable[FakeNodeManager]]
) -> None:
    # The same ports after the restart: reserved, not port 0.
    grpc_port, http_port = reserved_port(), reserved_port()
    argv = motor_argv("coordinator", "--port", str(grpc_port), "--http-port", str(http_port))

    async def coordinator_process() -> tuple[Proc, str]:
        proc = Proc(argv, cwd=tmp_path)
        address, _ = await proc.await_listening()
        return proc, address

    proc, address = await coordinator_process()
    try:
        async with running_controller(tmp_path / "controller", coordinators=[address]) as h:

            async def in_step() -> bool:
                return await coordinator_side(address) == controller_side(await h.instances())

            nm = await node_managers()
            agent = h.agent(job="p", nm=nm)
            await agent.register()
            await until(lambda: nm.starts)
            await agent.beat(NORMAL)
            await until(lambda: h.instances(status=ACTIVE))
            await until(in_step)
            sync = h.controller.coordinators
            pusher, old = sync.pushers[address], sync.pushers[address].incarnation
            proc.signal(signal.SIGSTOP)  # takes the Set, never answers it
            pusher.request_full_sync("test")
            await until(lambda: sync.reconciler.queue.processing == 1)
            await until(lambda: _unread_bytes(grpc_port) > 0)
            assert sync.reconciler.queue.processing == 1 and pusher.stats["set_ok"] == 1
            await asyncio.to_thread(proc.kill)
            proc, _ = await coordinator_process()
            await until(in_step, timeout=15)
            # The new process holds the table; the pusher learns its incarnation from the Set's
            # answer, which can reach it a moment after the table is visible.
            await until(lambda: pusher.incarnation != old)
            assert len(controller_side(await h.instances())[0]) == 1
    finally:
        await asyncio.to_thread(proc.kill)
