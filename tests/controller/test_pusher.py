"""The event pusher against a fake Coordinator: incremental calls, the coalesced full Set,
incarnation changes, NOT_FOUND deletes and a Coordinator that comes up late."""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from motor.v1 import common_pb2

from services.controller import state_machine as sm
from services.controller.instances import InstanceTable
from services.controller.model import Instance, JobSpec, Member
from services.controller.pusher import CoordinatorSync
from services.controller.store import Store
from tests.controller.fakes import FakeCoordinator, until


class World:
    """An instance table (with its database) and one pusher watching it."""

    def __init__(self, tmp: Path, address: str, sync_interval_s: float = 0.0, resync_s: float = 30.0) -> None:
        self.store = Store(tmp)
        self.table = InstanceTable(self.store)
        self.sync = CoordinatorSync([address], self.table, sync_interval_s=sync_interval_s, resync_s=resync_s)
        self.pusher = self.sync.pushers[address]
        self._next_port = 10000

    def instance(self, status: int = sm.ACTIVE) -> Instance:
        """A new instance, taken from INITIAL to ``status`` through the table."""
        iid = self.store.next_instance_id()
        port, self._next_port = self._next_port, self._next_port + 2
        ep = common_pb2.Endpoint(id=0, host="127.0.0.1", port=port, status=common_pb2.ENDPOINT_STATUS_NORMAL)
        spec = JobSpec(role=common_pb2.ROLE_PREFILL, model_name="m", engine_type=3, pd_protocol=1)
        m = Member(node_rank=0, host="127.0.0.1", nm_port=7300, ports=[port])
        inst = Instance(
            id=iid, job_name=f"job{iid}", spec=spec, status=sm.INITIAL, endpoints=[ep], members=[m]
        )
        self.store.assemble(inst)
        self.table.add(inst)
        if status != sm.INITIAL:
            self.table.transition(inst, sm.ACTIVE, "test")
        if status not in (sm.INITIAL, sm.ACTIVE):
            self.table.transition(inst, status, "test")  # type: ignore[arg-type]
        return inst


@pytest.fixture
async def world(tmp_path: Path, coordinator: FakeCoordinator) -> AsyncIterator[World]:
    w = World(tmp_path, coordinator.address)
    w.sync.start()
    await until(lambda: coordinator.count("Set", ok=True) == 1)  # the start-up sync
    yield w
    await w.sync.close()
    w.store.close()


async def test_transitions_become_incremental_calls(world: World, coordinator: FakeCoordinator) -> None:
    inst = world.instance(sm.ACTIVE)
    await until(lambda: inst.id in coordinator.table)
    [add] = coordinator.ok_calls("Add")
    assert add.instances[0].endpoints[0].port == inst.endpoints[0].port
    world.table.transition(inst, sm.PAUSED, "test")
    await until(lambda: inst.id in coordinator.paused)
    world.table.transition(inst, sm.ACTIVE, "test")
    await until(lambda: coordinator.count("Resume", ok=True) == 1)
    world.table.transition(inst, sm.INACTIVE, "test")
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
    a = world.instance(sm.ACTIVE)
    b = world.instance(sm.ACTIVE)
    world.table.transition(a, sm.PAUSED, "test")
    await until(lambda: coordinator.count("Set", ok=True) == 2)
    assert coordinator.table.keys() == {a.id, b.id}
    assert coordinator.paused == {a.id}
    # Barrier: one more change; everything queued before it has been sent once it arrives.
    c = world.instance(sm.ACTIVE)
    await until(lambda: c.id in coordinator.table)
    failed = [m for m, _, ok in coordinator.calls if not ok]
    assert failed == ["Add", "Set", "Set"]  # a failed Set never queues another Set
    assert coordinator.count("Set", ok=True) == 2  # start-up + exactly one resync
    assert [i.id for r in coordinator.ok_calls("Add") for i in r.instances] == [c.id]  # b rode in the Set
    assert world.pusher.synced_fingerprint


async def test_new_incarnation_triggers_a_set(world: World, coordinator: FakeCoordinator) -> None:
    a = world.instance(sm.ACTIVE)
    await until(lambda: a.id in coordinator.table)
    coordinator.restart_state()  # as if the Coordinator restarted with an empty table
    b = world.instance(sm.ACTIVE)
    await until(lambda: coordinator.table.keys() == {a.id, b.id})
    assert coordinator.count("Set", ok=True) == 2


async def test_delete_not_found_counts_as_done(world: World, coordinator: FakeCoordinator) -> None:
    a = world.instance(sm.ACTIVE)
    await until(lambda: a.id in coordinator.table)
    coordinator.table.clear()  # someone else removed it
    world.table.transition(a, sm.DELETED, "test")
    b = world.instance(sm.ACTIVE)  # barrier
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
        w.store.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def test_coordinator_down_then_up_gets_a_full_set(tmp_path: Path) -> None:
    port = _free_port()
    w = World(tmp_path, f"127.0.0.1:{port}")
    w.sync.start()
    late = FakeCoordinator()
    try:
        a = w.instance(sm.ACTIVE)
        await until(lambda: w.pusher.stats["set_failed"] >= 2)
        await late.start(port)
        await until(lambda: a.id in late.table, timeout=5)
        assert late.count("Set", ok=True) == 1 and late.count("Add") == 0
    finally:
        await w.sync.close()
        await late.stop()
        w.store.close()


async def test_watch_break_and_return_resyncs(tmp_path: Path, coordinator: FakeCoordinator) -> None:
    w = World(tmp_path, coordinator.address)
    w.sync.start()
    try:
        await until(lambda: coordinator.count("Set", ok=True) == 1)
        a = w.instance(sm.ACTIVE)
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
        w.store.close()


async def test_a_lost_event_is_corrected_by_the_resync(
    tmp_path: Path, coordinator: FakeCoordinator, monkeypatch: pytest.MonkeyPatch
) -> None:
    w = World(tmp_path, coordinator.address, resync_s=0.2)
    monkeypatch.setattr(w.pusher, "on_transition", lambda *args: None)  # every event is lost
    w.sync.start()
    try:
        await until(lambda: coordinator.count("Set", ok=True) == 1)
        a = w.instance(sm.ACTIVE)
        await until(lambda: a.id in coordinator.table, timeout=5)
        w.table.transition(a, sm.PAUSED, "test")
        await until(lambda: a.id in coordinator.paused, timeout=5)
        w.table.transition(a, sm.INACTIVE, "test")
        await until(lambda: a.id not in coordinator.table, timeout=5)
        # The resync sent the differences, not a full Set.
        assert [coordinator.count(m, ok=True) for m in ("Set", "Add", "Pause", "Delete")] == [1, 1, 1, 1]
    finally:
        await w.sync.close()
        w.store.close()


async def test_a_change_made_while_a_call_is_in_flight_follows_it(
    world: World, coordinator: FakeCoordinator
) -> None:
    a = world.instance(sm.INITIAL)

    def pause_during_add(method: str) -> None:
        if method == "Add":  # the Coordinator has taken the Add; its answer is not back yet
            world.table.transition(a, sm.PAUSED, "test")

    coordinator.on_answer = pause_during_add
    world.table.transition(a, sm.ACTIVE, "test")
    await until(lambda: a.id in coordinator.paused)
    [add] = coordinator.ok_calls("Add")
    assert add.instances[0].status == sm.ACTIVE and coordinator.count("Pause", ok=True) == 1
