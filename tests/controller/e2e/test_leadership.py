"""Leader election on a real etcd: one leader, standbys that name it, a term that grows with
every election, a leader that stops acting before its lease can be granted to another, and
fenced writes that an old leader can no longer land."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import pytest

from motor_mesh.controller.leader.election import Leadership, leader_key
from motor_mesh.controller.store.etcd_client import EtcdClient, op_put
from motor_mesh.controller.store.interface import NotLeader
from tests.chaos.proxy import TcpProxy
from tests.etcd import EtcdServer, etcdctl
from tests.poll import until

PREFIX = "/motor-test"
KEY = leader_key(PREFIX)
pytestmark = pytest.mark.timeout(60)


@pytest.fixture
async def clients(etcd_server: EtcdServer) -> AsyncIterator[list[EtcdClient]]:
    made: list[EtcdClient] = []
    yield made
    for c in made:
        await c.close()


def _client(clients: list[EtcdClient], endpoint: str) -> EtcdClient:
    c = EtcdClient([endpoint], timeout_s=1.0)
    clients.append(c)
    return c


async def _leader_at(client: EtcdClient) -> tuple[str, int]:
    kv = await client.get(KEY)
    assert kv is not None
    return kv.value.decode(), kv.create_revision


async def test_one_leader_a_standby_that_names_it_and_a_new_term_after_resigning(
    etcd_server: EtcdServer, clients: list[EtcdClient]
) -> None:
    a = Leadership(_client(clients, etcd_server.endpoint), PREFIX, "127.0.0.1:7100", 2)
    b = Leadership(_client(clients, etcd_server.endpoint), PREFIX, "127.0.0.1:7101", 2)
    await asyncio.wait_for(a.campaign(), 10)
    assert a.valid() and (a.term, a.leader_address) == (a.term, "127.0.0.1:7100")
    assert await _leader_at(clients[0]) == ("127.0.0.1:7100", a.term)

    standing = asyncio.create_task(b.campaign())
    await until(lambda: b.leader_address == "127.0.0.1:7100")
    assert not standing.done() and not b.valid() and b.term == 0
    keeping = asyncio.create_task(a.keep())
    try:
        await a.resign()
        await asyncio.wait_for(standing, 10)  # taken over as soon as the lease is given back
    finally:
        keeping.cancel()
    assert b.valid() and b.term > a.term
    assert await _leader_at(clients[0]) == ("127.0.0.1:7101", b.term)
    assert not a.valid() and a.ended.is_set()
    with pytest.raises(NotLeader):
        a.compares()
    with pytest.raises(NotLeader):
        a.push_metadata()
    assert b.push_metadata() == (("x-motor-leader-term", str(b.term)),)
    # etcdctl, independent of Motor's client, sees the same holder.
    assert "127.0.0.1:7101" in etcdctl(etcd_server.endpoint, "get", KEY.decode())


async def test_a_leader_that_cannot_renew_stops_acting_before_its_lease_can_be_taken(
    etcd_server: EtcdServer, clients: list[EtcdClient]
) -> None:
    """etcd is cut off from the leader (a stalled proxy): it stops acting on its own deadline,
    and at that moment its key still exists in etcd, so no one else can lead yet. The standby
    takes over after the lease expires, with a larger term, and a write fenced on the old term
    no longer lands."""
    proxy = TcpProxy("127.0.0.1", etcd_server.client_port).start()
    try:
        a = Leadership(_client(clients, proxy.address), PREFIX, "127.0.0.1:7100", 2)
        b = Leadership(_client(clients, etcd_server.endpoint), PREFIX, "127.0.0.1:7101", 2)
        await asyncio.wait_for(a.campaign(), 10)
        old_term = a.term
        fenced = a.compares()
        keeping = asyncio.create_task(a.keep())
        standing = asyncio.create_task(b.campaign())
        await until(lambda: b.leader_address == "127.0.0.1:7100")
        proxy.stall()
        await asyncio.wait_for(a.ended.wait(), 10)
        stopped_at = time.monotonic()
        holder = await clients[1].get(KEY)
        assert holder is not None and holder.create_revision == old_term, (
            "the lease ran out before the leader stopped"
        )
        assert not a.valid()
        await asyncio.wait_for(standing, 10)
        assert b.term > old_term and time.monotonic() > stopped_at
        await asyncio.wait_for(keeping, 5)  # the renewal loop ends once leadership is lost
        resp = await clients[1].txn(fenced, [op_put(f"{PREFIX}/probe".encode(), b"old leader")])
        assert not resp.succeeded
        assert await clients[1].get(f"{PREFIX}/probe".encode()) is None
    finally:
        proxy.close()


async def test_a_standby_campaigns_through_an_etcd_restart(
    etcd_server: EtcdServer, clients: list[EtcdClient]
) -> None:
    """etcd down while a standby waits: it keeps trying and wins once etcd is back and the old
    leader's lease has run out."""
    a = Leadership(_client(clients, etcd_server.endpoint), PREFIX, "127.0.0.1:7100", 1)
    await asyncio.wait_for(a.campaign(), 10)
    b = Leadership(_client(clients, etcd_server.endpoint), PREFIX, "127.0.0.1:7101", 1)
    standing = asyncio.create_task(b.campaign())
    await until(lambda: b.leader_address == "127.0.0.1:7100")
    etcd_server.stop()
    etcd_server.start()
    await asyncio.wait_for(standing, 30)
    assert b.term > a.term
    assert not a.valid()
