"""What survives a Controller restart (in-process, same state_dir): ids, instances, pending
assemblies; heartbeat clocks start at load time."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from motor_mesh.controller.instances import InstanceTable
from motor_mesh.controller.model import Instance, JobSpec, Member, Pending
from motor_mesh.controller.store.sqlite import Store
from motor_mesh.gen.motor.v1 import common_pb2, controller_pb2
from tests.controller.fakes import ACTIVE, DELETED, NORMAL, delete, running_controller
from tests.poll import until


async def test_store_round_trip_and_ids_never_reused(tmp_path: Path) -> None:
    store = Store(tmp_path / "s")
    assert [await store.next_instance_id() for _ in range(3)] == [1, 2, 3]
    spec = JobSpec(role=1, model_name="m", engine_type=3, pd_protocol=1, dp=2)
    p = Pending(
        id=3, job_name="j", spec=spec, members=[Member(0, "h", 7300, [10000])], last_registration=12.5
    )
    await store.save_pending(p)
    ep = common_pb2.Endpoint(id=0, host="h", port=10000, status=common_pb2.ENDPOINT_STATUS_NORMAL, pid=7)
    member = Member(0, "h", 7301, [10000])
    member.attach([ep])
    inst = Instance(
        id=2,
        job_name="k",
        spec=spec,
        status=common_pb2.INSTANCE_STATUS_ACTIVE,
        endpoints=[ep],
        members=[member],
    )
    await store.assemble(inst)
    await store.close()

    again = Store(tmp_path / "s")
    assert await again.next_instance_id() == 4
    [loaded] = again.load_instances()
    assert (loaded.id, loaded.job_name, loaded.status, loaded.endpoints[0].pid) == (2, "k", ACTIVE, 7)
    assert loaded.members[0].by_id[0] is loaded.endpoints[0]
    [pending] = again.load_pending()
    assert (pending.id, pending.job_name, pending.spec, pending.last_registration) == (3, "j", spec, 12.5)
    assert pending.members[0].address == "h:7300"
    await again.close()


async def test_pending_assembly_survives_a_restart(tmp_path: Path, node_managers) -> None:
    a, b = await node_managers(), await node_managers()
    async with running_controller(tmp_path) as h:
        first = h.agent(job="j", nm=a, dp=2)
        await first.register()
        old_node, old_epoch = first.node_id, first.epoch
    async with running_controller(tmp_path) as h:
        back = h.agent(job="j", nm=a, dp=2)
        back.node_id, back.epoch = old_node, old_epoch
        assert (await back.beat()).directive == controller_pb2.DIRECTIVE_REREGISTER
        back.drop_stream()
        await back.register()  # takes its old slot back
        await h.agent(job="j", nm=b, ports=(10002,), dp=2).register()
        await until(lambda: a.starts and b.starts)
        assert a.starts[0].instance_id == 1  # the pending id from before the restart


async def test_clocks_start_at_load_time(tmp_path: Path, node_managers) -> None:
    kept, lost = await node_managers(), await node_managers()
    async with running_controller(tmp_path) as h:
        for nm, job, port in ((kept, "kept", 10000), (lost, "lost", 10002)):
            agent = h.agent(job=job, nm=nm, ports=(port,))
            await agent.register()
            await until(lambda nm=nm: nm.starts)  # type: ignore[misc]
            await agent.beat(NORMAL)
        await until(lambda: len(h.controller.table.find(status=ACTIVE)) == 2)
    timeout = 1.0
    before_load = time.monotonic()
    async with running_controller(tmp_path, instance_heartbeat_timeout_s=timeout) as h:
        agent = h.agent(job="kept", nm=kept, ports=(10000,))
        assert (await agent.register(instance_id=1)).instance_id == 1
        last_beat = time.monotonic()

        async def keep_beating() -> None:
            nonlocal last_beat
            while True:
                await agent.beat(NORMAL)
                last_beat = time.monotonic()
                await asyncio.sleep(0.05)

        beating = asyncio.create_task(keep_beating())
        try:
            # The silent one goes one timeout after the load, not at once (its saved clock is
            # from before the restart) ...
            [gone] = await until(lambda: h.instances(status=DELETED), timeout=10)
            assert gone.job_name == "lost" and time.monotonic() - before_load >= timeout
            # ... while the one that beats is still there past that same deadline.
            [inst] = await h.instances()
            assert (inst.id, inst.status) == (1, ACTIVE)
        finally:
            beating.cancel()
        # Once silent it goes too, a timeout after its last beat: the beats were what kept it.
        await until(lambda: len(h.controller.table.find(status=DELETED)) == 2, timeout=10)
        assert time.monotonic() - last_beat >= timeout
        assert len(kept.starts) == 1


async def test_deleted_history_is_bounded_in_memory_and_on_disk(tmp_path: Path) -> None:
    store = Store(tmp_path / "s")
    table = InstanceTable(store)
    table.keep_deleted = 2
    spec = JobSpec(role=1, model_name="m", engine_type=3, pd_protocol=1)
    made = []
    for n in range(4):
        member = Member(0, "h", 7300 + n, [10000])
        inst = Instance(
            id=await store.next_instance_id(),
            job_name=f"j{n}",
            spec=spec,
            status=common_pb2.INSTANCE_STATUS_INITIAL,
            endpoints=[],
            members=[member],
        )
        member.instance = inst
        await store.assemble(inst)
        table.add(inst)
        made.append(inst)
    for inst in made:
        await delete(table, inst)
    assert [i.id for i in table.find(status=DELETED)] == [3, 4]
    await store.close()
    again = Store(tmp_path / "s")
    assert sorted(i.id for i in again.load_instances()) == [3, 4]
    assert await again.next_instance_id() == 5
