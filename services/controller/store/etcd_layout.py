"""How the Controller's state is laid out in etcd (store/etcd.py writes it), and the reading of
it back at start-up.

Keys, under ``<etcd_prefix>/`` (ids and sequences as 20 digits, so key order is number order):

    meta/next_instance_id        the next id to hand out (decimal)
    meta/last_alarm_sequence     the last alarm sequence handed out (decimal)
    instances/<id>               {"instance": <motor.v1.Instance, base64>, "members": <JSON text>}
    pending/<id>                 {"job_name": ..., "data": <JSON text>}
    node_faults/<address>        {code: [level, reason]}
    fault_history/<instance id>  [[order, entry], ...] (oldest first, the newest ``keep``)
    alarm_history/<sequence>     the motor.v1.Alarm message
    alarm_active/<dedupe key>    {"seq": sequence, "alarm": <motor.v1.Alarm, base64>}
    desired_instances/<role>     {"replicas": n, "update_time_ns": ...}: the desired instance
                                 count of the role (prefill, decode or union)
    meta/settings                {"revision": n, "coordinator": {...}, "controller": {...}}: the
                                 settings of the last reload that changed something
    meta/journal                 {"id": ..., "chunks": n}: the journal below is committed
    journal/<id>/<n>             [[kind, key, value or range end (base64)], ...]: operations of
                                 a write too large for one transaction

The JSON texts are convert.py's, as SQLite stores them. A fault history entry's ``order`` is a
number above every etcd revision seen when it was written, so the start-up read lists the
instances in the order SQLite does (by each one's oldest entry).
"""

from __future__ import annotations

import base64
import json
from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeVar

from google.protobuf.message import DecodeError

from motor_mesh.common.enums import ROLE_NAMES, ROLES_BY_NAME, InstanceStatus, Role
from motor_mesh.controller.convert import instance_from_row, instance_row, pending_from_row, pending_row
from motor_mesh.controller.model import Instance, Pending
from motor_mesh.controller.store.db import StateCorrupt
from motor_mesh.controller.store.interface import DesiredCounts, NodeFaults, StoredSettings, settings_of
from motor_mesh.gen.motor.v1 import alarm_pb2

# etcd's defaults (--max-txn-ops 128, --max-request-bytes 1.5 MiB), with room for the compares.
MAX_TXN_OPS = 128
MAX_TXN_BYTES = 1 << 20

COUNTER = b"meta/next_instance_id"
ALARM_SEQUENCE = b"meta/last_alarm_sequence"
JOURNAL = b"meta/journal"
JOURNALS = b"journal/"
INSTANCES, PENDING, NODE_FAULTS = b"instances/", b"pending/", b"node_faults/"
FAULT_HISTORY, ALARM_HISTORY, ALARM_ACTIVE = b"fault_history/", b"alarm_history/", b"alarm_active/"
DESIRED = b"desired_instances/"
SETTINGS = b"meta/settings"

# One operation, on keys relative to the prefix: ("put", key, value), ("del", key, b"") or
# ("range", start, end): delete every key in [start, end).
Op = tuple[str, bytes, bytes]
T = TypeVar("T")


def num(ns: bytes, n: int) -> bytes:
    return ns + b"%020d" % n


def dumps(value: Any) -> bytes:
    return json.dumps(value, separators=(",", ":")).encode()


def b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode()


def instance_value(inst: Instance, status: InstanceStatus | None = None) -> bytes:
    blob, members = instance_row(inst, status)
    return dumps({"instance": b64(blob), "members": members})


def pending_value(job: str, p: Pending) -> bytes:
    return dumps({"job_name": job, "data": pending_row(p)})


def desired_key(role: Role) -> bytes:
    return DESIRED + ROLE_NAMES[role].encode()


def desired_value(replicas: int, update_time_ns: int) -> bytes:
    return dumps({"replicas": replicas, "update_time_ns": update_time_ns})


def settings_value(s: StoredSettings) -> bytes:
    values = {"revision": s.revision, "coordinator": dict(s.coordinator), "controller": dict(s.controller)}
    return dumps(values)


def journal_marker(jid: str, chunks: int) -> bytes:
    return dumps({"id": jid, "chunks": chunks})


def journal_key(jid: str, n: int) -> bytes:
    return JOURNALS + f"{jid}/{n:06d}".encode()


class Snapshot:
    """The keys under the prefix as one read returned them (relative to the prefix), decoded on
    demand: the ``load_*`` of the store. Anything that cannot be decoded is StateCorrupt."""

    def __init__(self, prefix: str, kvs: dict[bytes, bytes]) -> None:
        self.prefix = prefix
        self.kvs = kvs

    def decode(self, key: bytes, how: Callable[..., T], *args: Any) -> T:
        """``how(*args)``; a failure is a corrupt state, said in one line."""
        try:
            return how(*args)
        except (DecodeError, KeyError, TypeError, ValueError, IndexError) as err:
            where = f"{self.prefix.rstrip('/')}/{key.decode(errors='replace')}"
            raise StateCorrupt(
                f"etcd key {where} is unreadable ({type(err).__name__}: {err}); the state under "
                f"{self.prefix} was not written by this version of Motor, or was damaged"
            ) from None

    def entries(self, ns: bytes) -> list[tuple[bytes, bytes]]:
        return sorted((k, v) for k, v in self.kvs.items() if k.startswith(ns))

    def counter(self, key: bytes, default: int) -> int:
        raw = self.kvs.get(key)
        return default if raw is None else self.decode(key, int, raw)

    def journal(self) -> list[Op] | None:
        """The operations of the committed journal; [] when only an uncommitted one is there
        (to be deleted); None when there is none."""
        marker = self.kvs.get(JOURNAL)
        if marker is None:
            return [] if any(k.startswith(JOURNALS) for k in self.kvs) else None

        def read() -> list[Op]:
            head = json.loads(marker)
            ops: list[Op] = []
            for n in range(int(head["chunks"])):
                chunk = self.kvs[journal_key(str(head["id"]), n)]
                ops.extend(
                    (str(k), base64.b64decode(a), base64.b64decode(b)) for k, a, b in json.loads(chunk)
                )
            return ops

        return self.decode(JOURNAL, read)

    def apply(self, ops: Iterable[Op]) -> None:
        for kind, key, arg in ops:
            if kind == "put":
                self.kvs[key] = arg
            elif kind == "del":
                self.kvs.pop(key, None)
            else:
                for k in [k for k in self.kvs if key <= k < arg]:
                    del self.kvs[k]

    # ---- what the store's load_* return ----------------------------------------------------------

    def instances(self) -> list[Instance]:
        def decode(key: bytes, raw: bytes) -> Instance:
            d = json.loads(raw)
            return instance_from_row(
                int(key[len(INSTANCES) :]), base64.b64decode(d["instance"]), d["members"]
            )

        return [self.decode(key, decode, key, raw) for key, raw in self.entries(INSTANCES)]

    def pending(self) -> list[Pending]:
        def decode(key: bytes, raw: bytes) -> Pending:
            d = json.loads(raw)
            return pending_from_row(int(key[len(PENDING) :]), str(d["job_name"]), str(d["data"]))

        return [self.decode(key, decode, key, raw) for key, raw in self.entries(PENDING)]

    def node_faults(self) -> dict[str, NodeFaults]:
        def decode(key: bytes, raw: bytes) -> tuple[str, NodeFaults]:
            d = json.loads(raw)
            faults = {str(code): (int(d[code][0]), str(d[code][1])) for code in sorted(d)}
            return key[len(NODE_FAULTS) :].decode(), faults

        return dict(self.decode(key, decode, key, raw) for key, raw in self.entries(NODE_FAULTS))

    def fault_histories(self) -> dict[int, list[tuple[int, str]]]:
        """By instance id, each instance's entries with their order, instances as SQLite lists
        them: by their oldest entry."""
        found = [self.decode(k, _history, k, v) for k, v in self.entries(FAULT_HISTORY)]
        found.sort(key=lambda item: item[1][0][0])
        return dict(found)

    def alarms(self) -> tuple[list[alarm_pb2.Alarm], list[alarm_pb2.Alarm], int]:
        stored = self.entries(ALARM_HISTORY)
        history = [self.decode(k, alarm_pb2.Alarm.FromString, v) for k, v in stored]

        def active_of(raw: bytes) -> tuple[int, alarm_pb2.Alarm]:
            d = json.loads(raw)
            return int(d["seq"]), alarm_pb2.Alarm.FromString(base64.b64decode(d["alarm"]))

        active = sorted(
            (self.decode(k, active_of, v) for k, v in self.entries(ALARM_ACTIVE)), key=lambda a: a[0]
        )
        tops = [int(k[len(ALARM_HISTORY) :]) for k, _ in stored[-1:]]
        last = max([self.counter(ALARM_SEQUENCE, 0), *tops, *(seq for seq, _ in active)])
        return history, [a for _, a in active], last

    def desired(self) -> DesiredCounts:
        def decode(key: bytes, raw: bytes) -> tuple[Role, tuple[int, int]]:
            d = json.loads(raw)
            role = ROLES_BY_NAME[key[len(DESIRED) :].decode()]
            return role, (int(d["replicas"]), int(d["update_time_ns"]))

        return dict(sorted(self.decode(k, decode, k, v) for k, v in self.entries(DESIRED)))

    def settings(self) -> StoredSettings | None:
        raw = self.kvs.get(SETTINGS)
        if raw is None:
            return None

        def decode() -> StoredSettings:
            d = json.loads(raw)
            return settings_of(int(d["revision"]), d["coordinator"], d["controller"])

        return self.decode(SETTINGS, decode)


def _history(key: bytes, raw: bytes) -> tuple[int, list[tuple[int, str]]]:
    entries = [(int(order), str(text)) for order, text in json.loads(raw)]
    if not entries:
        raise ValueError("an empty history is never stored")
    return int(key[len(FAULT_HISTORY) :]), entries


# ---- transactions etcd takes -----------------------------------------------------------------


def size(op: Op) -> int:
    return len(op[1]) + len(op[2]) + 16


def fits(ops: Sequence[Op]) -> bool:
    return len(ops) <= MAX_TXN_OPS and sum(map(size, ops)) <= MAX_TXN_BYTES


def batches(ops: Iterable[Op]) -> list[list[Op]]:
    """``ops`` in order, cut into transactions etcd takes (an operation too large for one goes
    alone, and etcd refuses it)."""
    out: list[list[Op]] = []
    total = 0
    for op in ops:
        if not out or len(out[-1]) == MAX_TXN_OPS or total + size(op) > MAX_TXN_BYTES:
            out.append([])
            total = 0
        out[-1].append(op)
        total += size(op)
    return out


def pack(ops: Sequence[Op]) -> list[bytes]:
    """``ops`` as journal values of about MAX_TXN_BYTES at most (base64 grows them by a third)."""
    chunks: list[bytes] = []
    part: list[list[str]] = []
    total = 0
    for kind, a, b in ops:
        grown = size((kind, a, b)) * 4 // 3 + 8
        if part and total + grown > MAX_TXN_BYTES:
            chunks.append(dumps(part))
            part, total = [], 0
        part.append([kind, b64(a), b64(b)])
        total += grown
    chunks.append(dumps(part))
    return chunks
