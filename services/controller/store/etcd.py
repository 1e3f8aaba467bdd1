"""The Controller's state in etcd (``controller.store = "etcd"``): what store/sqlite.py keeps in SQLite,
shared by a leader and the standbys that take over from it. The keys and values are described
in store/etcd_layout.py.

Reads: :meth:`EtcdStore.open` reads the whole prefix once (at one revision); ``load_*`` decode
that read, synchronously, as the Controller calls them at start-up. They do not see later writes.

Writes: one at a time, like SQLite's writer thread. Each is ONE transaction whose compares start
with the fence's (this Controller's leadership): when those fail, the fence is told, nothing was
written and :class:`NotLeader` is raised; when etcd does not answer, StateWriteError. Either way
memory is unchanged (as with any remote store, a write whose answer was lost may still have
landed; each one can be repeated, and the id counter is compared, so an id is skipped, never
reused).

etcd refuses a transaction of more than 128 operations or 1.5 MiB, which one alarm report (up to
1000 alarms) or one ReportFaults can need: such a write goes through a journal. Its operations
are put as ``journal/<id>/<n>`` values, then ``meta/journal`` naming them: that put is the
commit. Then the operations are applied in batches and the journal deleted. A start-up read that
finds ``meta/journal`` applies it first, and deletes a journal without it, so a write is all
there or not at all. A committed journal still unapplied (etcd went away meanwhile) is applied
before the next write.
"""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import Mapping, Sequence
from typing import NoReturn

import grpc

from motor_mesh.common import log
from motor_mesh.common.enums import DELETED, InstanceStatus, Role
from motor_mesh.controller.model import Instance, Pending
from motor_mesh.controller.store import etcd_layout as lay
from motor_mesh.controller.store.db import StateWriteError
from motor_mesh.controller.store.etcd_client import (
    EtcdClient,
    EtcdUnavailable,
    cmp_mod,
    op_delete,
    op_get,
    op_put,
    prefix_end,
)
from motor_mesh.controller.store.etcd_layout import Op
from motor_mesh.controller.store.interface import (
    KEEP_DELETED,
    DesiredCounts,
    Fence,
    NodeFaults,
    NotLeader,
    StoredSettings,
)
from motor_mesh.gen.etcd.etcdserverpb import rpc_pb2
from motor_mesh.gen.motor.v1 import alarm_pb2

# Times next_instance_id reads the counter again after it moved under this process.
MAX_ID_RACES = 5

_WRITE_FAILED = (EtcdUnavailable, grpc.aio.AioRpcError)
_DROP_JOURNALS: list[Op] = [("del", lay.JOURNAL, b""), ("range", lay.JOURNALS, prefix_end(lay.JOURNALS))]


class EtcdStore:
    """Use :meth:`open`. ``close`` leaves the client open: it belongs to the caller."""

    def __init__(self, client: EtcdClient, prefix: str, fence: Fence) -> None:
        self._client = client
        self._fence = fence
        self._root = prefix.rstrip("/").encode() + b"/"
        self._snap = lay.Snapshot(prefix, {})
        self._lock = asyncio.Lock()
        self._failures = 0
        self._revision = 0  # the highest etcd revision seen
        self._next_id, self._next_id_rev = 1, 0  # the counter and its mod_revision
        self._top_id = 0  # the highest instance or pending id stored
        self._deleted: set[int] = set()  # ids stored with status DELETED
        self._pending_job: dict[int, str] = {}  # pending id -> its job (a job has one)
        self._pending_id: dict[str, int] = {}
        self._fault_history: dict[int, list[tuple[int, str]]] = {}  # id -> [(order, entry)]
        self._journal: list[Op] | None = None  # committed, not applied yet

    @classmethod
    async def open(cls, client: EtcdClient, prefix: str, fence: Fence) -> EtcdStore:
        """Read the state under ``prefix``, finish (or drop) a journal the last leader left, and
        prune DELETED instances beyond KEEP_DELETED (fenced writes). EtcdUnavailable when etcd
        cannot be read, StateCorrupt when a value cannot be decoded."""
        self = cls(client, prefix, fence)
        kvs, self._revision = await client.get_prefix(self._root)
        snap = self._snap = lay.Snapshot(prefix, {kv.key[len(self._root) :]: kv.value for kv in kvs})
        self._next_id = snap.counter(lay.COUNTER, 1)
        self._next_id_rev = next((kv.mod_revision for kv in kvs if kv.key == self._root + lay.COUNTER), 0)
        self._journal = snap.journal()
        if self._journal is not None:
            snap.apply(self._journal)
            async with self._lock:
                await self._settle("state recovery")
            snap.apply(_DROP_JOURNALS)
        instances, pendings = snap.instances(), snap.pending()
        self._top_id = max([0, *(i.id for i in instances), *(p.id for p in pendings)])
        self._deleted = {i.id for i in instances if i.status == DELETED}
        for p in pendings:
            self._pending_job[p.id], self._pending_id[p.job_name] = p.job_name, p.id
        self._fault_history = snap.fault_histories()
        await self._prune()
        return self

    async def _prune(self) -> None:
        """The DELETED instances beyond the newest KEEP_DELETED go, in batches: each deletion
        stands alone, and what a failure left is pruned at the next start."""
        old = sorted(self._deleted)[: max(0, len(self._deleted) - KEEP_DELETED)]
        async with self._lock:
            for batch in lay.batches(("del", lay.num(lay.INSTANCES, i), b"") for i in old):
                await self._txn("pruning of deleted instances", batch)
                self._snap.apply(batch)
        self._deleted.difference_update(old)

    async def close(self) -> None:
        async with self._lock:  # the write in flight
            self._snap = lay.Snapshot(self._snap.prefix, {})

    @property
    def write_failures(self) -> int:
        """Writes that failed (StateWriteError, NotLeader included) since the start."""
        return self._failures

    # ---- start-up reads ----------------------------------------------------------------------

    def load_instances(self) -> list[Instance]:
        return self._snap.instances()

    def load_pending(self) -> list[Pending]:
        return self._snap.pending()

    def load_node_faults(self) -> dict[str, NodeFaults]:
        return self._snap.node_faults()

    def load_fault_history(self) -> dict[int, list[str]]:
        return {i: [text for _, text in entries] for i, entries in self._snap.fault_histories().items()}

    def load_alarms(self) -> tuple[list[alarm_pb2.Alarm], list[alarm_pb2.Alarm], int]:
        """The history (oldest first), the active alarms (by sequence) and the last sequence
        handed out."""
        return self._snap.alarms()

    def load_desired(self) -> DesiredCounts:
        return self._snap.desired()

    def load_settings(self) -> StoredSettings | None:
        return self._snap.settings()

    # ---- writes ------------------------------------------------------------------------------

    async def next_instance_id(self) -> int:
        """Reserve the next instance id: the counter moves only from where this process last saw
        it, so an id is never handed out twice, whoever wrote last."""
        key = self._root + lay.COUNTER
        async with self._lock:
            for _ in range(MAX_ID_RACES):
                value = max(self._next_id, self._top_id + 1)
                resp = await self._txn(
                    "instance id",
                    [("put", lay.COUNTER, b"%d" % (value + 1))],
                    own=[cmp_mod(key, self._next_id_rev)],
                    failure=[op_get(key)],
                )
                if resp.succeeded:
                    self._next_id, self._next_id_rev = value + 1, resp.header.revision
                    return value
                kvs = resp.responses[0].response_range.kvs
                seen = kvs[0].mod_revision if kvs else 0
                if seen == self._next_id_rev:  # the counter is as this process left it
                    self._lose("instance id")
                # A try that landed although its answer was lost, or another writer.
                log.warn("instance_id_counter_moved", expected_revision=self._next_id_rev, revision=seen)
                self._next_id, self._next_id_rev = (int(kvs[0].value) if kvs else 1), seen
            self._failures += 1
            raise StateWriteError("instance id", RuntimeError("the id counter kept moving"))

    async def save_instance(self, inst: Instance, status: InstanceStatus | None = None) -> None:
        status = inst.status if status is None else status
        ops: list[Op] = [("put", lay.num(lay.INSTANCES, inst.id), lay.instance_value(inst, status))]
        if status == DELETED:
            ops.append(("del", lay.num(lay.FAULT_HISTORY, inst.id), b""))
        await self._write(f"instance {inst.id}", ops)
        self._stored_instance(inst.id, status)
        if status == DELETED:
            self._fault_history.pop(inst.id, None)

    async def assemble(self, inst: Instance) -> None:
        ops: list[Op] = [
            ("del", lay.num(lay.PENDING, inst.id), b""),
            ("put", lay.num(lay.INSTANCES, inst.id), lay.instance_value(inst)),
        ]
        await self._write(f"instance {inst.id}", ops)
        self._forget_pending(inst.id)
        self._stored_instance(inst.id, inst.status)

    async def forget_instance(self, instance_id: int) -> None:
        if instance_id in self._deleted:  # only a DELETED one, as in SQLite
            await self._write(f"instance {instance_id}", [("del", lay.num(lay.INSTANCES, instance_id), b"")])
            self._deleted.discard(instance_id)

    async def save_pending(self, p: Pending) -> None:
        what = f"registration of job {p.job_name}"
        # SQLite's table rules: a job has one pending assembly, and an id keeps its job.
        job = self._pending_job.get(p.id, p.job_name)
        other = self._pending_id.get(job, p.id)
        if other != p.id:
            self._failures += 1
            log.error("state_write_failed", operation=what, error=f"job already pending as {other}")
            raise StateWriteError(what, ValueError(f"job {job} already has pending assembly {other}"))
        await self._write(what, [("put", lay.num(lay.PENDING, p.id), lay.pending_value(job, p))])
        self._pending_job[p.id], self._pending_id[job] = job, p.id
        self._top_id = max(self._top_id, p.id)

    async def delete_pending(self, pending_id: int) -> None:
        await self._write(f"pending assembly {pending_id}", [("del", lay.num(lay.PENDING, pending_id), b"")])
        self._forget_pending(pending_id)

    async def save_node_faults(self, nodes: dict[str, NodeFaults]) -> None:
        ops: list[Op] = []
        for address, faults in nodes.items():
            key = lay.NODE_FAULTS + address.encode()
            value = {code: [level, reason] for code, (level, reason) in sorted(faults.items())}
            ops.append(("put", key, lay.dumps(value)) if faults else ("del", key, b""))
        await self._write("node faults", ops)

    async def add_fault_history(self, instance_id: int, entry: str, keep: int) -> None:
        entries = [*self._fault_history.get(instance_id, []), (self._revision + 1, entry)]
        entries = entries[max(0, len(entries) - keep) :]
        key = lay.num(lay.FAULT_HISTORY, instance_id)
        op: Op = ("put", key, lay.dumps(entries)) if entries else ("del", key, b"")
        await self._write(f"fault history of {instance_id}", [op])
        if entries:
            self._fault_history[instance_id] = entries
        else:
            self._fault_history.pop(instance_id, None)

    async def save_alarms(
        self,
        history: Sequence[tuple[int, bytes]],
        active: Mapping[str, tuple[int, bytes] | None],
        last_sequence: int,
        keep: int,
    ) -> None:
        cut = last_sequence - keep  # sequences up to this one are trimmed
        # A record trimmed at once is not written: etcd refuses a put inside a deleted range.
        ops: list[Op] = [("put", lay.num(lay.ALARM_HISTORY, seq), raw) for seq, raw in history if seq > cut]
        for dedupe, row in active.items():
            key = lay.ALARM_ACTIVE + dedupe.encode()
            value = None if row is None else lay.dumps({"seq": row[0], "alarm": lay.b64(row[1])})
            ops.append(("del", key, b"") if value is None else ("put", key, value))
        # The counter outlives the records: trimming never lets a sequence come back.
        ops.append(("put", lay.ALARM_SEQUENCE, b"%d" % last_sequence))
        if cut > 0:
            ops.append(("range", lay.ALARM_HISTORY, lay.num(lay.ALARM_HISTORY, cut + 1)))
        await self._write("alarms", ops)

    async def save_desired(self, role: Role, replicas: int, update_time_ns: int) -> None:
        op: Op = ("put", lay.desired_key(role), lay.desired_value(replicas, update_time_ns))
        await self._write("desired instances", [op])

    async def save_settings(self, settings: StoredSettings) -> None:
        await self._write("settings", [("put", lay.SETTINGS, lay.settings_value(settings))])

    # ---- transactions ------------------------------------------------------------------------

    def _stored_instance(self, instance_id: int, status: InstanceStatus) -> None:
        self._top_id = max(self._top_id, instance_id)
        if status == DELETED:
            self._deleted.add(instance_id)
        else:
            self._deleted.discard(instance_id)

    def _forget_pending(self, pending_id: int) -> None:
        job = self._pending_job.pop(pending_id, None)
        if job is not None:
            del self._pending_id[job]

    async def _write(self, what: str, ops: list[Op]) -> None:
        async with self._lock:
            await self._settle(what)
            if lay.fits(ops):
                await self._txn(what, ops)
                return
            # Too large for one transaction: through a journal (see the module's docstring).
            jid = secrets.token_hex(8)
            chunks = lay.pack(ops)
            await self._txn(what, _DROP_JOURNALS)  # what a journal that never committed left
            for n, chunk in enumerate(chunks):
                await self._txn(what, [("put", lay.journal_key(jid, n), chunk)])
            await self._txn(what, [("put", lay.JOURNAL, lay.journal_marker(jid, len(chunks)))])
            self._journal = ops
            try:
                await self._settle(what)
            except StateWriteError:  # committed all the same: applied before the next write
                log.warn("state_journal_pending", operation=what, operations=len(ops))

    async def _settle(self, what: str) -> None:
        """Apply the committed journal, then delete it."""
        if self._journal is None:
            return
        for batch in lay.batches(self._journal):
            await self._txn(what, batch)
        await self._txn(what, _DROP_JOURNALS)
        self._journal = None

    async def _txn(
        self,
        what: str,
        ops: Sequence[Op],
        *,
        own: Sequence[rpc_pb2.Compare] = (),
        failure: Sequence[rpc_pb2.RequestOp] = (),
    ) -> rpc_pb2.TxnResponse:
        """One fenced transaction. Refused without ``own`` compares: the fence failed
        (NotLeader); with them the caller tells which failed."""
        try:
            compares = [*self._fence.compares(), *own]
        except NotLeader:
            self._failures += 1
            raise
        try:
            resp = await self._client.txn(compares, [self._request(op) for op in ops], failure)
        except _WRITE_FAILED as err:
            self._failures += 1
            log.error("state_write_failed", operation=what, error=_describe(err))
            raise StateWriteError(what, RuntimeError(_describe(err))) from err
        self._revision = max(self._revision, resp.header.revision)
        if not resp.succeeded and not own:
            self._lose(what)
        return resp

    def _lose(self, what: str) -> NoReturn:
        self._fence.lost()
        self._failures += 1
        log.error("state_write_refused", operation=what, reason="another Controller leads")
        raise NotLeader(what, "another Controller holds the leader key in etcd")

    def _request(self, op: Op) -> rpc_pb2.RequestOp:
        kind, key, arg = op
        if kind == "put":
            return op_put(self._root + key, arg)
        if kind == "del":
            return op_delete(self._root + key)
        return op_delete(self._root + key, range_end=self._root + arg)


def _describe(err: BaseException) -> str:
    if isinstance(err, grpc.aio.AioRpcError):  # refused by etcd: too large, too many operations
        return f"etcd {err.code().name}: {err.details()}"
    return str(err)
