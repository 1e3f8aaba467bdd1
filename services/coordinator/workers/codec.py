"""The bytes between the management process and its inference workers.

Every message is a ZeroMQ multipart message whose first frame names its kind (see the kinds
below); the frames after it are built here. The hub and its workers always run from the same
install, so the formats need no negotiation; a format byte on the snapshot still turns a mix-up
into a clear :class:`CodecError` instead of a garbled table.

A table snapshot (``encode_state``), little-endian::

    u8 format (2) | u64 revision | u32 n_paused | u32 n_instances
    n_paused x u64 paused id
    u32 n_draining | n_draining x (u64 id | f64 wall-clock time its requests move)
    n_instances x (u64 key | u32 size | size bytes of a serialized motor.v1.Instance)

The instance keeps its own key (normally equal to ``Instance.id``) so the round trip is exact.
Loads (``encode_loads``) are ``u32 n | n x (u64 instance id, i64 load)``; a worker's report
(``encode_report``) is its loads then its legs in flight in the same form, then ``u64`` the table
revision it routed by, then ``u64 running | u64 queued``, its admission (requests holding a
slot, requests waiting for one; a report that ends after the revision reads as 0, 0); the hub's
broadcast of
every worker's loads (``encode_worker_loads``) is ``u32 n | n x (u32 worker index, loads)``. A
precision sample is ``u64 p | u64 d`` then the :class:`Completed` as UTF-8 JSON (the request is
the client's parsed JSON body, so it serialises as it came).
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Mapping
from typing import NamedTuple

from motor_mesh.coordinator.precision.groups import Completed
from motor_mesh.coordinator.table import Drain, TableState, engines
from motor_mesh.gen.motor.v1 import common_pb2

# Message kinds: the first frame of every message.
HELLO = b"hello"  # worker -> hub (DEALER -> ROUTER): [HELLO, peer, u64 pid]; asks for a snapshot
STATE = b"state"  # hub -> worker (ROUTER reply and PUB): [STATE, incarnation, snapshot]
BEAT = b"beat"  # hub -> workers (PUB): [BEAT, incarnation, u64 revision, u64 settings generation]
LOADS = b"loads"  # PUB: [LOADS, incarnation, worker loads]; PUSH: [LOADS, peer, report]
ACK = b"ack"  # worker -> hub (PUSH): [ACK, peer, u64 revision]
SAMPLE = b"sample"  # worker -> hub (PUSH): [SAMPLE, peer, sample]
SERVING = b"serving"  # worker -> hub (PUSH): [SERVING, peer, b""]; it listens for clients
DEMAND = b"demand"  # worker -> hub (PUSH): [DEMAND, peer, JSON {bucket: amount asked}] (shares.py)
PARTS = b"parts"  # hub -> workers (PUB): [PARTS, incarnation, JSON {bucket: {worker: part}}]

STATE_FORMAT = 2

_STATE_HEAD = struct.Struct("<BQII")
_U64 = struct.Struct("<Q")
_U32 = struct.Struct("<I")
_ENTRY = struct.Struct("<QI")
_LOAD = struct.Struct("<Qq")
_PEER = struct.Struct("<IQ")
_PAIR = struct.Struct("<QQ")
_DRAIN = struct.Struct("<Qd")


class CodecError(ValueError):
    """Bytes that are not a message of the expected kind (truncated, wrong format)."""


class _Reader:
    """Reads fixed-size fields off a buffer, failing with :class:`CodecError` past its end."""

    def __init__(self, data: bytes, what: str) -> None:
        self.data = memoryview(data)
        self.pos = 0
        self.what = what

    def take(self, size: int) -> memoryview:
        end = self.pos + size
        if end > len(self.data):
            raise CodecError(f"{self.what}: truncated at byte {self.pos} (needs {size} more)")
        chunk = self.data[self.pos : end]
        self.pos = end
        return chunk

    def unpack(self, fmt: struct.Struct) -> tuple[int, ...]:
        return fmt.unpack(self.take(fmt.size))

    def done(self) -> None:
        if self.pos != len(self.data):
            raise CodecError(f"{self.what}: {len(self.data) - self.pos} trailing bytes")


def _fail(what: str, exc: Exception) -> CodecError:
    return CodecError(f"{what}: {exc}")


# ---- table snapshots ---------------------------------------------------------------------------


def encode_state(state: TableState) -> bytes:
    try:
        parts = [_STATE_HEAD.pack(STATE_FORMAT, state.revision, len(state.paused), len(state.instances))]
        parts.extend(_U64.pack(iid) for iid in sorted(state.paused))
        parts.append(_U32.pack(len(state.draining)))
        parts.extend(_DRAIN.pack(iid, d.move_at) for iid, d in sorted(state.draining.items()))
        for key, inst in state.instances.items():
            body = inst.SerializeToString(deterministic=True)
            parts.append(_ENTRY.pack(key, len(body)))
            parts.append(body)
    except struct.error as exc:  # an id or revision outside u64
        raise _fail("table snapshot", exc) from exc
    return b"".join(parts)


def decode_state(data: bytes) -> TableState:
    r = _Reader(data, "table snapshot")
    fmt, revision, n_paused, n_instances = r.unpack(_STATE_HEAD)
    if fmt != STATE_FORMAT:
        raise CodecError(f"table snapshot: format {fmt}, this build reads {STATE_FORMAT}")
    paused = frozenset(r.unpack(_U64)[0] for _ in range(n_paused))
    (n_draining,) = r.unpack(_U32)
    move_at: dict[int, float] = {}
    for _ in range(n_draining):
        iid, at = _DRAIN.unpack(r.take(_DRAIN.size))
        move_at[iid] = at
    instances: dict[int, common_pb2.Instance] = {}
    for _ in range(n_instances):
        key, size = r.unpack(_ENTRY)
        body = bytes(r.take(size))
        try:
            instances[key] = common_pb2.Instance.FromString(body)
        except Exception as exc:  # protobuf's DecodeError, and whatever else a bad buffer raises
            raise _fail(f"table snapshot: instance {key}", exc) from exc
    r.done()
    draining: dict[int, Drain] = {}
    for iid, at in move_at.items():
        inst = instances.get(iid)
        if inst is None:
            raise CodecError(f"table snapshot: draining instance {iid} is not in the table")
        draining[iid] = Drain(at, engines(inst))
    return TableState(instances, paused, revision, draining)


# ---- loads -------------------------------------------------------------------------------------


def _put_loads(parts: list[bytes], loads: Mapping[int, int]) -> None:
    parts.append(_U32.pack(len(loads)))
    parts.extend(_LOAD.pack(iid, load) for iid, load in loads.items())


def _get_loads(r: _Reader) -> dict[int, int]:
    (n,) = r.unpack(_U32)
    loads: dict[int, int] = {}
    for _ in range(n):
        iid, load = r.unpack(_LOAD)
        loads[iid] = load
    return loads


def encode_loads(loads: Mapping[int, int]) -> bytes:
    """One worker's in-flight requests per instance id."""
    parts: list[bytes] = []
    try:
        _put_loads(parts, loads)
    except struct.error as exc:
        raise _fail("loads", exc) from exc
    return b"".join(parts)


def decode_loads(data: bytes) -> dict[int, int]:
    r = _Reader(data, "loads")
    loads = _get_loads(r)
    r.done()
    return loads


class Report(NamedTuple):
    """One worker's report, decoded."""

    loads: dict[int, int]
    legs: dict[int, int]
    revision: int
    running: int = 0  # requests holding an admission slot
    queued: int = 0  # requests waiting for one


def encode_report(
    loads: Mapping[int, int], legs: Mapping[int, int], revision: int, running: int = 0, queued: int = 0
) -> bytes:
    """One worker's report: its loads, its legs in flight per instance id (a drain is over when
    no worker has one left on the instance), the table revision it routed by then, and its
    admission (for the management process's congestion alarm)."""
    parts: list[bytes] = []
    try:
        _put_loads(parts, loads)
        _put_loads(parts, legs)
        parts.append(_U64.pack(max(revision, 0)))
        parts.append(_PAIR.pack(running, queued))
    except struct.error as exc:
        raise _fail("loads", exc) from exc
    return b"".join(parts)


def decode_report(data: bytes) -> Report:
    r = _Reader(data, "loads")
    loads = _get_loads(r)
    legs = _get_loads(r)
    (revision,) = r.unpack(_U64)
    running = queued = 0
    if r.pos < len(r.data):  # a report without admission numbers (an older encoder) ends here
        running, queued = r.unpack(_PAIR)
    r.done()
    return Report(loads, legs, revision, running, queued)


def encode_worker_loads(per_worker: Mapping[int, Mapping[int, int]]) -> bytes:
    """Every live worker's loads, by worker index (the hub's broadcast)."""
    parts = [_U32.pack(len(per_worker))]
    try:
        for index, loads in per_worker.items():
            parts.append(_U32.pack(index))
            _put_loads(parts, loads)
    except struct.error as exc:
        raise _fail("worker loads", exc) from exc
    return b"".join(parts)


def decode_worker_loads(data: bytes) -> dict[int, dict[int, int]]:
    r = _Reader(data, "worker loads")
    (n,) = r.unpack(_U32)
    per_worker: dict[int, dict[int, int]] = {}
    for _ in range(n):
        (index,) = r.unpack(_U32)
        per_worker[index] = _get_loads(r)
    r.done()
    return per_worker


# ---- precision samples -------------------------------------------------------------------------


def encode_sample(p: int, d: int, completed: Completed) -> bytes:
    """Raises :class:`CodecError` for a request that is not JSON-serialisable."""
    try:
        # ASCII escapes: a lone surrogate (json.loads makes one of "\ud800") survives the trip.
        body = json.dumps(
            {"path": completed.path, "model": completed.model, "request": completed.request},
            separators=(",", ":"),
        ).encode()
        return _PAIR.pack(p, d) + body
    except (TypeError, ValueError, struct.error) as exc:
        raise _fail("precision sample", exc) from exc


def decode_sample(data: bytes) -> tuple[int, int, Completed]:
    r = _Reader(data, "precision sample")
    p, d = r.unpack(_PAIR)
    try:
        doc = json.loads(bytes(r.take(len(data) - r.pos)))
        completed = Completed(str(doc["path"]), str(doc["model"]), dict(doc["request"]))
    except (ValueError, KeyError, TypeError) as exc:
        raise _fail("precision sample", exc) from exc
    return p, d, completed


# ---- sockets and small frames ------------------------------------------------------------------------------


class Addresses(NamedTuple):
    """The hub's three ipc endpoints inside its private socket directory."""

    snapshot: str  # ROUTER (hub) <- DEALER (workers): hello, answered with a snapshot
    publish: str  # PUB (hub) -> SUB (workers): snapshots, beats, everyone's loads
    report: str  # PULL (hub) <- PUSH (workers): acks, loads, precision samples


# A Unix socket path is at most 107 bytes (sun_path); ZeroMQ would fail with a vaguer error.
MAX_IPC_PATH = 107


def addresses(sock_dir: str) -> Addresses:
    paths = [os.path.join(sock_dir, name) for name in ("snapshot.ipc", "publish.ipc", "report.ipc")]
    for path in paths:
        if len(os.fsencode(path)) > MAX_IPC_PATH:
            raise ValueError(f"socket path {path!r} is longer than {MAX_IPC_PATH} bytes")
    return Addresses(*(f"ipc://{path}" for path in paths))


def ipc_path(address: str) -> str:
    return address.removeprefix("ipc://")


def pack_peer(index: int, token: int) -> bytes:
    """Who sent a worker's message: its index and the token its link drew at start (a restarted
    worker, or a second link in the same process, is a different peer)."""
    return _PEER.pack(index, token)


def unpack_peer(data: bytes) -> tuple[int, int]:
    r = _Reader(data, "peer")
    index, token = r.unpack(_PEER)
    r.done()
    return index, token


def pack_u64(value: int) -> bytes:
    return _U64.pack(value)


def unpack_u64(data: bytes) -> int:
    r = _Reader(data, "u64")
    (value,) = r.unpack(_U64)
    r.done()
    return value
