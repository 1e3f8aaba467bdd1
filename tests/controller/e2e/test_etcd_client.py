"""The Controller's etcd client against a real etcd (tests/etcd.py; skipped without one): keys,
transactions, leases, watches across broken connections and restarts, endpoint failover, TLS."""

from __future__ import annotations

import asyncio
import json
import logging
import shutil
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from motor_mesh.common.config import ConfigError
from motor_mesh.controller.store.etcd_client import (
    EtcdClient,
    EtcdCompacted,
    EtcdUnavailable,
    cmp_create,
    cmp_mod,
    cmp_value,
    cmp_version,
    op_delete,
    op_get,
    op_put,
    prefix_end,
)
from motor_mesh.gen.etcd.mvccpb import kv_pb2
from tests.chaos.proxy import TcpProxy
from tests.etcd import EtcdServer, etcdctl
from tests.poll import until
from tests.ports import reserved_port

Seen = list[tuple[str, bytes, bytes]]  # (PUT or DELETE, key, value) in the order delivered


@pytest.fixture
async def client(etcd_server: EtcdServer) -> AsyncIterator[EtcdClient]:
    c = EtcdClient([etcd_server.endpoint])
    yield c
    await c.close()


async def watching(client: EtcdClient, prefix: bytes, seen: Seen) -> asyncio.Task[None]:
    """A task appending every event under ``prefix`` to ``seen``, from the current revision on."""
    _, revision = await client.get_prefix(prefix)

    async def run() -> None:
        async for events in client.watch(prefix, prefix=True, start_revision=revision + 1):
            seen.extend((kv_pb2.Event.EventType.Name(e.type), e.kv.key, e.kv.value) for e in events)

    return asyncio.create_task(run())


async def stop(task: asyncio.Task[None]) -> None:
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


def test_prefix_end() -> None:
    assert prefix_end(b"/motor/") == b"/motor0"
    assert prefix_end(b"a\xff") == b"b"
    assert prefix_end(b"\xff\xff") == b"\0"


async def test_put_get_and_prefix_agree_with_etcdctl(client: EtcdClient, etcd_server: EtcdServer) -> None:
    assert await client.get(b"/motor/a") is None
    rev_b = await client.put(b"/motor/b", b"2")
    rev_a = await client.put(b"/motor/a", b"1")
    await client.put(b"/motorz", b"outside the prefix")
    assert rev_a > rev_b > 0

    kv = await client.get(b"/motor/a")
    assert kv is not None and (kv.value, kv.create_revision, kv.mod_revision) == (b"1", rev_a, rev_a)
    kvs, revision = await client.get_prefix(b"/motor/")
    assert [(k.key, k.value) for k in kvs] == [(b"/motor/a", b"1"), (b"/motor/b", b"2")]
    assert revision == rev_a + 1

    # What etcd itself holds, seen without this client; and a write from outside it, read back.
    out = await asyncio.to_thread(etcdctl, etcd_server.endpoint, "get", "/motor/a", "--print-value-only")
    assert out.strip() == "1"
    await asyncio.to_thread(etcdctl, etcd_server.endpoint, "put", "/motor/c", "from etcdctl")
    kv = await client.get(b"/motor/c")
    assert kv is not None and kv.value == b"from etcdctl"


async def test_txn_applies_success_or_failure_by_its_compares(client: EtcdClient) -> None:
    key = b"/motor/leader"
    created = await client.txn([cmp_create(key, 0)], [op_put(key, b"one")], [op_get(key)])
    assert created.succeeded
    term = created.header.revision

    # Someone holds it: the failure branch runs and reads the holder.
    lost = await client.txn([cmp_create(key, 0)], [op_put(key, b"two")], [op_get(key)])
    assert not lost.succeeded
    assert [kv.value for kv in lost.responses[0].response_range.kvs] == [b"one"]

    # The creation revision fences a write: it holds while the key is the same incarnation.
    fenced = await client.txn([cmp_create(key, term), cmp_value(key, b"one")], [op_put(key, b"one'")])
    assert fenced.succeeded
    kv = await client.get(key)
    assert kv is not None and (kv.value, kv.create_revision, kv.version) == (b"one'", term, 2)
    assert (await client.txn([cmp_mod(key, kv.mod_revision), cmp_version(key, 2)], [])).succeeded
    assert not (await client.txn([cmp_mod(key, term)], [op_put(key, b"stale")])).succeeded

    # Deleted and created again: a new creation revision, so the old fence no longer holds.
    await client.txn([], [op_delete(key)])
    await client.put(key, b"three")
    assert not (await client.txn([cmp_create(key, term)], [op_put(key, b"old leader")])).succeeded
    kv = await client.get(key)
    assert kv is not None and kv.value == b"three"

    await client.put(b"/motor/x/1", b"")
    await client.put(b"/motor/x/2", b"")
    deleted = await client.txn([], [op_delete(b"/motor/x/", prefix=True)])
    assert deleted.responses[0].response_delete_range.deleted == 2
    assert (await client.get_prefix(b"/motor/x/"))[0] == []


async def test_lease_keeps_key_while_renewed_and_expiry_deletes_it(client: EtcdClient) -> None:
    lease = await client.grant(1)
    await client.put(b"/motor/leased", b"v", lease)
    assert await client.keepalive(lease) > 0
    assert await client.keepalive(lease) > 0  # the same stream, a second renewal
    kv = await client.get(b"/motor/leased")
    assert kv is not None and kv.lease == lease

    # No more renewals: etcd expires the lease and deletes the key.
    await until(lambda: _absent(client, b"/motor/leased"), 15, "the leased key to expire")
    assert await client.keepalive(lease) == 0


async def test_revoke_deletes_attached_keys(client: EtcdClient) -> None:
    lease = await client.grant(30)
    await client.put(b"/motor/leased", b"v", lease)
    assert await client.keepalive(lease) > 0
    await client.revoke(lease)
    assert await client.get(b"/motor/leased") is None
    assert await client.keepalive(lease) == 0
    await client.revoke(lease)  # already gone: nothing to do


async def test_keepalive_reopens_its_stream_after_etcd_restarts(
    client: EtcdClient, etcd_server: EtcdServer
) -> None:
    lease = await client.grant(30)
    assert await client.keepalive(lease) > 0
    await asyncio.to_thread(etcd_server.stop)
    with pytest.raises(EtcdUnavailable):
        await client.keepalive(lease)
    await asyncio.to_thread(etcd_server.start)
    # The channel may still be backing off from the refused reconnects: a call or two unanswered.
    renewed = await until(
        lambda: client.keepalive(lease), 15, "a renewal after the restart", retry=(EtcdUnavailable,)
    )
    assert renewed > 0


async def test_watch_reports_puts_and_deletes(client: EtcdClient) -> None:
    seen: Seen = []
    task = await watching(client, b"/motor/", seen)
    await client.put(b"/motor/a", b"1")
    await client.put(b"/elsewhere", b"x")
    await client.txn([], [op_put(b"/motor/b", b"2"), op_delete(b"/motor/a")])
    want = [("PUT", b"/motor/a", b"1"), ("PUT", b"/motor/b", b"2"), ("DELETE", b"/motor/a", b"")]
    await until(lambda: seen == want, 10, f"events {want}")
    await stop(task)


async def test_watch_resumes_from_the_last_revision_it_saw(
    etcd_server: EtcdServer, caplog: pytest.LogCaptureFixture
) -> None:
    proxy = TcpProxy("127.0.0.1", etcd_server.client_port).start()
    client = EtcdClient([proxy.address])
    seen: Seen = []
    task = await watching(client, b"/motor/", seen)
    try:
        rev_a = await client.put(b"/motor/a", b"1")
        await until(lambda: seen == [("PUT", b"/motor/a", b"1")], 10, "the first event")
        # Written while the watch's connection is black-holed and then cut: this stream never
        # delivers it, so only the resumed watch can.
        proxy.stall()
        await asyncio.to_thread(etcdctl, etcd_server.endpoint, "put", "/motor/b", "2")
        assert proxy.cut() >= 1
        proxy.resume()
        await client.put(b"/motor/c", b"3")
        want = [("PUT", b"/motor/a", b"1"), ("PUT", b"/motor/b", b"2"), ("PUT", b"/motor/c", b"3")]
        await until(lambda: seen == want, 15, f"each event once: {want}")
        broken = [r.fields for r in caplog.records if getattr(r, "event", "") == "etcd_watch_broken"]  # type: ignore[attr-defined]
        assert [f["resume_revision"] for f in broken] == [rev_a + 1]
    finally:
        await stop(task)
        await client.close()
        proxy.close()


async def test_watch_resumes_after_etcd_restarts(client: EtcdClient, etcd_server: EtcdServer) -> None:
    seen: Seen = []
    task = await watching(client, b"/motor/", seen)
    await client.put(b"/motor/a", b"1")
    await until(lambda: seen == [("PUT", b"/motor/a", b"1")], 10, "the first event")
    await asyncio.to_thread(etcd_server.stop)
    await asyncio.to_thread(etcd_server.start)
    await asyncio.to_thread(etcdctl, etcd_server.endpoint, "put", "/motor/b", "2")
    want = [("PUT", b"/motor/a", b"1"), ("PUT", b"/motor/b", b"2")]
    await until(lambda: seen == want, 20, f"each event once: {want}")
    await stop(task)


async def test_watch_of_a_compacted_revision_fails(client: EtcdClient, etcd_server: EtcdServer) -> None:
    first = await client.put(b"/motor/a", b"1")
    latest = await client.put(b"/motor/a", b"2")
    await asyncio.to_thread(etcdctl, etcd_server.endpoint, "compact", str(latest))
    with pytest.raises(EtcdCompacted):
        async for _ in client.watch(b"/motor/a", start_revision=first):
            pass


async def test_fails_over_to_an_endpoint_that_answers_and_stays_there(
    etcd_server: EtcdServer, caplog: pytest.LogCaptureFixture
) -> None:
    dead = f"127.0.0.1:{reserved_port()}"  # reserved, never bound: connections are refused
    client = EtcdClient([dead, etcd_server.endpoint], timeout_s=5)
    try:
        with caplog.at_level(logging.INFO, logger="motor"):
            await client.put(b"/motor/a", b"1")
            kv = await client.get(b"/motor/a")
            lease = await client.grant(30)
            assert await client.keepalive(lease) > 0
        assert kv is not None and kv.value == b"1"
        switches = [r.fields for r in caplog.records if getattr(r, "event", "") == "etcd_endpoint"]  # type: ignore[attr-defined]
        assert switches == [{"endpoint": etcd_server.endpoint, "previous": dead}]
    finally:
        await client.close()


async def test_unavailable_when_no_endpoint_answers() -> None:
    dead = [f"127.0.0.1:{reserved_port()}", f"127.0.0.1:{reserved_port()}"]
    client = EtcdClient(dead, timeout_s=5)
    try:
        calls = [lambda: client.get(b"/k"), lambda: client.put(b"/k", b"v"), lambda: client.keepalive(1)]
        for call in calls:
            with pytest.raises(EtcdUnavailable) as err:
                await call()
            assert dead[0] in str(err.value) and dead[1] in str(err.value)
    finally:
        await client.close()


def test_tls_key_readable_by_others_is_refused(tmp_path: Path) -> None:
    key, cert = tmp_path / "client.key", tmp_path / "client.pem"
    key.write_text("-----BEGIN PRIVATE KEY-----\n")
    cert.write_text("-----BEGIN CERTIFICATE-----\n")
    key.chmod(0o640)
    with pytest.raises(ConfigError, match="must not be readable by group or others"):
        EtcdClient(["127.0.0.1:2379"], cert_file=str(cert), key_file=str(key))
    key.chmod(0o600)
    with pytest.raises(ConfigError, match="go together"):
        EtcdClient(["127.0.0.1:2379"], key_file=str(key))


@pytest.mark.skipif(shutil.which("openssl") is None, reason="openssl CLI needed to make certificates")
async def test_mutual_tls(tmp_path: Path) -> None:
    from tests.e2e.test_tls import make_pki

    pki = make_pki(tmp_path)
    server = EtcdServer(tmp_path / "etcd", pki=pki)
    await asyncio.to_thread(server.start)
    tls = EtcdClient(
        [server.endpoint],
        ca_file=str(pki / "ca.pem"),
        cert_file=str(pki / "client.pem"),
        key_file=str(pki / "client.key"),
    )
    plain = EtcdClient([server.endpoint], timeout_s=1)
    try:
        await tls.put(b"/motor/a", json.dumps({"tls": True}).encode())
        kv = await tls.get(b"/motor/a")
        assert kv is not None and json.loads(kv.value) == {"tls": True}
        with pytest.raises(EtcdUnavailable):
            await plain.get(b"/motor/a")
    finally:
        await tls.close()
        await plain.close()
        await asyncio.to_thread(server.stop)


async def _absent(client: EtcdClient, key: bytes) -> bool:
    return await client.get(key) is None
