"""The etcd store against a real etcd: what it loads after a failover (a new EtcdStore.open) is
what SQLite's Store loads after a restart, for the same writes; ids are never handed out twice;
a write without the leadership changes nothing; a write while etcd is down fails cleanly."""

from __future__ import annotations

import math
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from motor_mesh.common.enums import DELETED, InstanceStatus
from motor_mesh.controller.convert import instance_row, pending_row
from motor_mesh.controller.model import Instance, JobSpec, Member, Pending
from motor_mesh.controller.store.db import StateCorrupt, StateWriteError
from motor_mesh.controller.store.etcd import EtcdStore
from motor_mesh.controller.store.etcd_client import EtcdClient, cmp_create, op_delete, op_put
from motor_mesh.controller.store.interface import NotLeader, StateStore
from motor_mesh.controller.store.sqlite import Store
from motor_mesh.gen.motor.v1 import alarm_pb2, common_pb2
from tests.etcd import EtcdServer
from tests.poll import until

PREFIX = "/motor-test"
SPEC = JobSpec(role=1, model_name="m", engine_type=3, pd_protocol=1, dp=2)
ACTIVE, INACTIVE = common_pb2.INSTANCE_STATUS_ACTIVE, common_pb2.INSTANCE_STATUS_INACTIVE


class TestFence:
    """A leader key on a lease, as a Controller holds it: writes compare its create revision."""

    __test__ = False

    def __init__(self, client: EtcdClient) -> None:
        self.client = client
        self.key = f"{PREFIX}/leader".encode()
        self.term = 0
        self.writes_left = math.inf  # then the lease deadline has passed
        self.lost_calls = 0

    async def take(self) -> TestFence:
        """Become the leader: whoever held the key loses it."""
        await self.client.txn([], [op_delete(self.key)])
        lease = await self.client.grant(60)
        resp = await self.client.txn([cmp_create(self.key, 0)], [op_put(self.key, b"test", lease)])
        assert resp.succeeded
        self.term = resp.header.revision
        return self

    def compares(self) -> list[Any]:
        if self.writes_left <= 0:
            raise NotLeader("etcd write", "the lease deadline has passed")
        self.writes_left -= 1
        return [cmp_create(self.key, self.term)]

    def lost(self) -> None:
        self.lost_calls += 1


@pytest.fixture
async def client(etcd_server: EtcdServer) -> AsyncIterator[EtcdClient]:
    c = EtcdClient([etcd_server.endpoint], timeout_s=2.0)
    yield c
    await c.close()


async def open_etcd(client: EtcdClient) -> tuple[EtcdStore, TestFence]:
    """A Controller that just won the election, reading the state."""
    fence = await TestFence(client).take()
    return await EtcdStore.open(client, PREFIX, fence), fence


def instance(id_: int, job: str, status: InstanceStatus, port: int = 10000) -> Instance:
    ep = common_pb2.Endpoint(id=0, host="h", port=port, status=common_pb2.ENDPOINT_STATUS_NORMAL, pid=id_)
    member = Member(0, "h", 7300 + id_, [port], device_count=2, incarnation=5)
    member.attach([ep])
    return Instance(id=id_, job_name=job, spec=SPEC, status=status, endpoints=[ep], members=[member])


def pending(id_: int, job: str, *ranks: int) -> Pending:
    members = [Member(r, "h", 7400 + r, [11000 + r]) for r in ranks]
    return Pending(id=id_, job_name=job, spec=SPEC, members=members, last_registration=12.5 + id_)


def alarm(seq: int, key: str, reason: str = "r") -> tuple[int, bytes]:
    a = alarm_pb2.Alarm(alarm_id=key, category=alarm_pb2.ALARM_CATEGORY_ALARM, sequence=seq, reason=reason)
    return seq, a.SerializeToString()


async def write_everything(store: StateStore) -> list[int]:
    """Every kind of write, the oversize ones (more than etcd's 128 operations) included; the ids
    handed out."""
    ids = [await store.next_instance_id() for _ in range(6)]
    await store.save_pending(pending(1, "a", 0))
    await store.save_pending(pending(2, "b", 0))
    await store.save_pending(pending(1, "a", 0, 1))
    await store.assemble(instance(1, "a", ACTIVE))
    await store.delete_pending(2)
    await store.save_pending(pending(6, "f", 0))
    await store.save_instance(instance(1, "a", ACTIVE), INACTIVE)
    # History order: instance 7's oldest entry is older than instance 1's oldest kept one.
    for instance_id, entry in [(1, "e1"), (7, "x1"), (1, "e2"), (1, "e3"), (4, "gone")]:
        await store.add_fault_history(instance_id, entry, 2)
    for i in (2, 3, 4, 5):  # DELETED ones beyond the number kept are pruned at the next start
        await store.save_instance(instance(i, f"d{i}", ACTIVE))
        await store.save_instance(instance(i, f"d{i}", ACTIVE), DELETED)
    await store.forget_instance(2)
    await store.forget_instance(1)  # not DELETED: stays
    await store.save_node_faults({"h:1": {"b": (2, "r"), "a": (1, "q")}, "h:0": {"c": (1, "z")}})
    await store.save_node_faults({"h:0": {}})
    await store.save_node_faults({f"n{i:03d}:7300": {"x": (1, f"{i}")} for i in range(200)})
    await store.save_alarms([alarm(1, "k1"), alarm(2, "k2")], {"k1": alarm(1, "k1")}, 2, 5)
    await store.save_alarms([alarm(3, "k3")], {"k1": None, "k3": alarm(3, "k3")}, 3, 5)
    await store.save_alarms([], {"k3": alarm(3, "k3", "updated")}, 3, 5)
    big = [alarm(s, f"b{s}") for s in range(4, 304)]
    await store.save_alarms(big, {f"b{s}": alarm(s, f"b{s}") for s in range(250, 304)}, 303, 100)
    return ids


def view(store: StateStore) -> dict[str, Any]:
    """Everything the store loads, comparable (order included)."""
    history, active, last = store.load_alarms()
    return {
        "instances": [(i.id, i.status, *instance_row(i)) for i in store.load_instances()],
        "pending": [(p.id, p.job_name, pending_row(p)) for p in store.load_pending()],
        "node_faults": [(a, list(f.items())) for a, f in store.load_node_faults().items()],
        "fault_history": list(store.load_fault_history().items()),
        "alarms": ([a.SerializeToString() for a in history], [a.SerializeToString() for a in active], last),
    }


async def test_etcd_loads_what_sqlite_loads_after_the_same_writes(
    client: EtcdClient, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for module in ("sqlite", "etcd"):
        monkeypatch.setattr(f"motor_mesh.controller.store.{module}.KEEP_DELETED", 2)
    sqlite = Store(tmp_path / "s")
    etcd, _ = await open_etcd(client)
    assert await write_everything(sqlite) == await write_everything(etcd) == [1, 2, 3, 4, 5, 6]
    await sqlite.close()
    await etcd.close()

    sqlite = Store(tmp_path / "s")
    etcd, _ = await open_etcd(client)  # a failover
    expected = view(sqlite)
    assert view(etcd) == expected
    assert [(i, s) for i, s, *_ in expected["instances"]] == [(1, INACTIVE), (4, DELETED), (5, DELETED)]
    assert [(i, job) for i, job, _ in expected["pending"]] == [(6, "f")]
    assert expected["node_faults"][0] == ("h:1", [("a", (1, "q")), ("b", (2, "r"))])
    assert len(expected["node_faults"]) == 201
    assert expected["fault_history"] == [(7, ["x1"]), (1, ["e2", "e3"])]
    history, active, last = expected["alarms"]
    assert (len(history), len(active), last) == (100, 55, 303)
    loaded = etcd.load_instances()[0]
    assert loaded.members[0].by_id[0] is loaded.endpoints[0]
    assert await sqlite.next_instance_id() == await etcd.next_instance_id() == 7
    await sqlite.close()
    await etcd.close()


async def test_ids_are_never_reused_across_leaders(client: EtcdClient) -> None:
    first, _ = await open_etcd(client)
    assert [await first.next_instance_id() for _ in range(3)] == [1, 2, 3]
    await first.save_instance(instance(3, "c", ACTIVE), DELETED)
    await first.forget_instance(3)  # no row holds id 3 any more
    # Another writer moved the counter while this one still leads: read again, not reused.
    await client.put(f"{PREFIX}/meta/next_instance_id".encode(), b"10")
    assert await first.next_instance_id() == 10

    second, _ = await open_etcd(client)  # a failover
    assert second.load_instances() == []
    assert await second.next_instance_id() == 11
    with pytest.raises(NotLeader):
        await first.next_instance_id()
    third, _ = await open_etcd(client)
    assert await third.next_instance_id() == 12


async def test_a_write_without_the_leadership_changes_nothing(client: EtcdClient) -> None:
    store, fence = await open_etcd(client)
    await store.save_pending(pending(1, "a", 0))
    await TestFence(client).take()  # another Controller won the election
    before = await client.get_prefix(PREFIX.encode())
    for write in (
        store.save_pending(pending(1, "a", 0, 1)),
        store.save_alarms([alarm(s, f"k{s}") for s in range(1, 201)], {}, 200, 1000),  # a journal
        store.next_instance_id(),
    ):
        with pytest.raises(NotLeader, match="not the leader"):
            await write
    assert fence.lost_calls == 3
    assert await client.get_prefix(PREFIX.encode()) == before  # the revision did not move either

    # A fence that knows its lease is over sends nothing at all.
    fence.writes_left = 0
    with pytest.raises(NotLeader):
        await store.delete_pending(1)
    assert fence.lost_calls == 3
    assert store.write_failures == 4
    assert await client.get_prefix(PREFIX.encode()) == before


async def test_etcd_down_fails_the_write_and_it_works_once_etcd_is_back(
    client: EtcdClient,
    etcd_server: EtcdServer,
) -> None:
    store, _ = await open_etcd(client)
    await store.save_pending(pending(1, "a", 0))
    etcd_server.stop()
    with pytest.raises(StateWriteError) as failed:
        await store.save_pending(pending(1, "a", 0, 1))
    assert not isinstance(failed.value, NotLeader)
    assert store.write_failures == 1
    etcd_server.start()

    async def saved() -> bool:
        try:
            await store.save_pending(pending(2, "b", 0))
        except StateWriteError:
            return False
        return True

    await until(saved, what="a write once etcd is back")
    assert store.write_failures >= 1
    again, _ = await open_etcd(client)
    assert [(p.id, len(p.members)) for p in again.load_pending()] == [(1, 1), (2, 1)]


async def test_an_oversize_write_is_all_there_or_not_at_all(client: EtcdClient) -> None:
    """Cut off after each of the transactions of a write too large for one: the next leader
    loads all of it or none of it, and the caller was told which."""
    report = [alarm(s, f"k{s}") for s in range(1, 201)]
    full = (200, 200, 200)
    seen = set()
    for allowed in range(10):
        await client.txn([], [op_delete(f"{PREFIX}/".encode(), prefix=True)])
        store, fence = await open_etcd(client)
        fence.writes_left = allowed
        try:
            await store.save_alarms(report, {f"k{seq}": (seq, raw) for seq, raw in report}, 200, 1000)
        except NotLeader:
            stored = False
        else:
            stored = True
        history, active, last = (await open_etcd(client))[0].load_alarms()
        assert (len(history), len(active), last) == (full if stored else (0, 0, 0))
        seen.add(stored)
    assert seen == {False, True}


async def test_an_unreadable_value_stops_the_start_with_one_line(client: EtcdClient) -> None:
    await client.put(f"{PREFIX}/instances/{7:020d}".encode(), b"not json")
    with pytest.raises(StateCorrupt, match=f"^etcd key {PREFIX}/instances/0+7 is unreadable"):
        await open_etcd(client)
