"""The Controller's embedded database: ``state_dir/controller.db`` (sqlite3, WAL).

Holds the instance-id counter, every assembled instance (DELETED ones too, so an id is never
handed out twice and operators can list what was removed), the pending assemblies, the node
faults reported with ReportFaults, the fault manager's strategy history, the alarms (the
active ones, and the bounded history with its sequence counter), and the desired instance count
of each role (SetDesiredInstances). Writes are small: one row
per registration, assembly or status transition, never one per heartbeat; one transaction per
alarm report. Every write is a coroutine that runs on the writer thread (store/db.py) and is on disk
when it returns; callers change memory only after it did, so a failed write (StateWriteError)
leaves both as they were. Loads run once, at start-up, before anything is served; a row that
cannot be decoded is a corrupt file like any other.
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TypeVar

from google.protobuf.message import DecodeError

from motor_mesh.common.enums import DELETED, InstanceStatus, Role
from motor_mesh.controller.convert import instance_from_row, instance_row, pending_from_row, pending_row
from motor_mesh.controller.model import Instance, Pending
from motor_mesh.controller.store.db import Writer, move_aside, open_checked
from motor_mesh.controller.store.interface import (
    KEEP_DELETED,
    DesiredCounts,
    NodeFaults,
    StoredSettings,
    settings_of,
)
from motor_mesh.gen.motor.v1 import alarm_pb2

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS instances (
    id INTEGER PRIMARY KEY, job_name TEXT NOT NULL, status INTEGER NOT NULL,
    instance BLOB NOT NULL, members TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS pending (
    id INTEGER PRIMARY KEY, job_name TEXT NOT NULL UNIQUE, data TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS node_faults (
    node_manager TEXT NOT NULL, code TEXT NOT NULL, level INTEGER NOT NULL, reason TEXT NOT NULL,
    PRIMARY KEY (node_manager, code)
);
CREATE TABLE IF NOT EXISTS fault_history (
    seq INTEGER PRIMARY KEY AUTOINCREMENT, instance_id INTEGER NOT NULL, entry TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS alarm_history (seq INTEGER PRIMARY KEY, alarm BLOB NOT NULL);
CREATE TABLE IF NOT EXISTS alarm_active (
    key TEXT PRIMARY KEY, seq INTEGER NOT NULL, alarm BLOB NOT NULL
);
CREATE TABLE IF NOT EXISTS desired_instances (
    role INTEGER PRIMARY KEY, replicas INTEGER NOT NULL, update_time_ns INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS settings (
    id INTEGER PRIMARY KEY CHECK (id = 1), revision INTEGER NOT NULL,
    coordinator TEXT NOT NULL, controller TEXT NOT NULL
);
"""

_T = TypeVar("_T")


class Store:
    def __init__(self, state_dir: str | Path) -> None:
        path = Path(state_dir)
        path.mkdir(parents=True, exist_ok=True)
        self.path = path / "controller.db"
        self._db = open_checked(self.path, _SCHEMA)
        self._writer = Writer(self._db)

    async def close(self) -> None:
        await self._writer.close()

    @property
    def write_failures(self) -> int:
        """Writes that failed (StateWriteError) since the start."""
        return self._writer.failures

    # ---- start-up reads --------------------------------------------------------------------

    def _load(self, what: Callable[[], _T]) -> _T:
        """A start-up read; a row this code cannot decode means the file is not what it wrote."""
        try:
            return what()
        except (sqlite3.DatabaseError, DecodeError, KeyError, TypeError, ValueError) as err:
            self._db.close()
            raise move_aside(self.path, f"unreadable row: {type(err).__name__}: {err}") from None

    def load_instances(self) -> list[Instance]:
        def load() -> list[Instance]:
            self._db.execute(
                "DELETE FROM instances WHERE status=? AND id NOT IN "
                "(SELECT id FROM instances WHERE status=? ORDER BY id DESC LIMIT ?)",
                (DELETED, DELETED, KEEP_DELETED),
            )
            rows = self._db.execute("SELECT id, instance, members FROM instances ORDER BY id").fetchall()
            return [instance_from_row(i, blob, members) for i, blob, members in rows]

        return self._load(load)

    def load_pending(self) -> list[Pending]:
        def load() -> list[Pending]:
            rows = self._db.execute("SELECT id, job_name, data FROM pending ORDER BY id").fetchall()
            return [pending_from_row(id_, job, data) for id_, job, data in rows]

        return self._load(load)

    def load_node_faults(self) -> dict[str, NodeFaults]:
        def load() -> dict[str, NodeFaults]:
            out: dict[str, NodeFaults] = {}
            for address, code, level, reason in self._db.execute(
                "SELECT node_manager, code, level, reason FROM node_faults ORDER BY node_manager, code"
            ):
                out.setdefault(str(address), {})[str(code)] = (int(level), str(reason))
            return out

        return self._load(load)

    def load_fault_history(self) -> dict[int, list[str]]:
        def load() -> dict[int, list[str]]:
            out: dict[int, list[str]] = {}
            for instance_id, entry in self._db.execute(
                "SELECT instance_id, entry FROM fault_history ORDER BY seq"
            ):
                out.setdefault(int(instance_id), []).append(str(entry))
            return out

        return self._load(load)

    def load_alarms(self) -> tuple[list[alarm_pb2.Alarm], list[alarm_pb2.Alarm], int]:
        """The history (oldest first), the active alarms (by sequence) and the last sequence
        handed out."""

        def load() -> tuple[list[alarm_pb2.Alarm], list[alarm_pb2.Alarm], int]:
            rows = self._db.execute("SELECT alarm FROM alarm_history ORDER BY seq")
            history = [alarm_pb2.Alarm.FromString(b) for (b,) in rows]
            rows = self._db.execute("SELECT alarm FROM alarm_active ORDER BY seq")
            active = [alarm_pb2.Alarm.FromString(b) for (b,) in rows]
            row = self._db.execute("SELECT value FROM meta WHERE key='last_alarm_sequence'").fetchone()
            top = self._db.execute(
                "SELECT MAX(m) FROM (SELECT MAX(seq) AS m FROM alarm_history "
                "UNION ALL SELECT MAX(seq) FROM alarm_active)"
            ).fetchone()[0]
            return history, active, max(row[0] if row else 0, top or 0)

        return self._load(load)

    def load_desired(self) -> DesiredCounts:
        def load() -> DesiredCounts:
            rows = self._db.execute(
                "SELECT role, replicas, update_time_ns FROM desired_instances ORDER BY role"
            )
            return {Role(int(role)): (int(replicas), int(at)) for role, replicas, at in rows}

        return self._load(load)

    def load_settings(self) -> StoredSettings | None:
        def load() -> StoredSettings | None:
            row = self._db.execute("SELECT revision, coordinator, controller FROM settings").fetchone()
            return None if row is None else settings_of(int(row[0]), json.loads(row[1]), json.loads(row[2]))

        return self._load(load)

    # ---- writes ----------------------------------------------------------------------------

    async def next_instance_id(self) -> int:
        """Reserve the next instance id (on disk before it is handed out)."""
        return await self._writer.run("instance id", _next_instance_id)

    async def save_instance(self, inst: Instance, status: InstanceStatus | None = None) -> None:
        """Write the instance (with ``status`` instead of its own, when given). A DELETED
        instance's strategy history goes in the same transaction."""
        blob, members = instance_row(inst, status)
        status = inst.status if status is None else status
        row = (inst.id, inst.job_name, int(status), blob, members)
        await self._writer.run(f"instance {inst.id}", _save_instance, row)

    async def assemble(self, inst: Instance) -> None:
        """The pending row becomes an instance row, atomically."""
        blob, members = instance_row(inst)
        row = (inst.id, inst.job_name, int(inst.status), blob, members)
        await self._writer.run(f"instance {inst.id}", _assemble, row)

    async def forget_instance(self, instance_id: int) -> None:
        """Drop a DELETED instance's row (history pruning; its id stays used)."""
        await self._writer.run(f"instance {instance_id}", _forget_instance, instance_id)

    async def save_pending(self, p: Pending) -> None:
        row = (p.id, p.job_name, pending_row(p))
        await self._writer.run(f"registration of job {p.job_name}", _save_pending, row)

    async def delete_pending(self, pending_id: int) -> None:
        await self._writer.run(f"pending assembly {pending_id}", _delete_pending, pending_id)

    async def save_node_faults(self, nodes: dict[str, NodeFaults]) -> None:
        """Replace the stored faults of each node in ``nodes`` (an empty dict clears it), in one
        transaction."""
        rows = {a: [(a, c, lvl, why) for c, (lvl, why) in f.items()] for a, f in nodes.items()}
        await self._writer.run("node faults", _save_node_faults, rows)

    async def add_fault_history(self, instance_id: int, entry: str, keep: int) -> None:
        """Append to an instance's strategy history, keeping its newest ``keep`` entries."""
        what = f"fault history of {instance_id}"
        await self._writer.run(what, _add_fault_history, instance_id, entry, keep)

    async def save_alarms(
        self,
        history: Sequence[tuple[int, bytes]],
        active: Mapping[str, tuple[int, bytes] | None],
        last_sequence: int,
        keep: int,
    ) -> None:
        """One alarm report in one transaction: new history rows ``(sequence, alarm)``, active
        rows by dedupe key (None: the key is no longer active), the sequence counter, and the
        history trimmed to the newest ``keep`` sequences (the sequences are contiguous)."""
        await self._writer.run("alarms", _save_alarms, list(history), dict(active), last_sequence, keep)

    async def save_desired(self, role: Role, replicas: int, update_time_ns: int) -> None:
        """The desired instance count of ``role``, replacing the one recorded before."""
        await self._writer.run("desired instances", _save_desired, (role, replicas, update_time_ns))

    async def save_settings(self, settings: StoredSettings) -> None:
        """The settings of a reload, replacing the ones stored before."""
        row = (settings.revision, _dumps(settings.coordinator), _dumps(settings.controller))
        await self._writer.run("settings", _save_settings, row)


def _dumps(values: object) -> str:
    return json.dumps(values, separators=(",", ":"), sort_keys=True)


# ---- statements, run on the writer thread inside one transaction each ------------------------


def _next_instance_id(db: sqlite3.Connection) -> int:
    row = db.execute("SELECT value FROM meta WHERE key='next_instance_id'").fetchone()
    floor = db.execute(
        "SELECT MAX(m) FROM (SELECT MAX(id) AS m FROM instances UNION ALL SELECT MAX(id) FROM pending)"
    ).fetchone()[0]
    value = max(row[0] if row else 1, (floor or 0) + 1)
    db.execute(
        "INSERT INTO meta(key, value) VALUES('next_instance_id', ?) "
        "ON CONFLICT(key) DO UPDATE SET value=excluded.value",
        (value + 1,),
    )
    return int(value)


def _save_instance(db: sqlite3.Connection, row: tuple[int, str, int, bytes, str]) -> None:
    db.execute(
        "INSERT INTO instances(id, job_name, status, instance, members) VALUES(?,?,?,?,?) "
        "ON CONFLICT(id) DO UPDATE SET status=excluded.status, instance=excluded.instance, "
        "members=excluded.members",
        row,
    )
    if row[2] == DELETED:
        db.execute("DELETE FROM fault_history WHERE instance_id=?", (row[0],))


def _assemble(db: sqlite3.Connection, row: tuple[int, str, int, bytes, str]) -> None:
    db.execute("DELETE FROM pending WHERE id=?", (row[0],))
    db.execute(
        "INSERT OR REPLACE INTO instances(id, job_name, status, instance, members) VALUES(?,?,?,?,?)", row
    )


def _forget_instance(db: sqlite3.Connection, instance_id: int) -> None:
    db.execute("DELETE FROM instances WHERE id=? AND status=?", (instance_id, DELETED))


def _save_pending(db: sqlite3.Connection, row: tuple[int, str, str]) -> None:
    db.execute(
        "INSERT INTO pending(id, job_name, data) VALUES(?,?,?) "
        "ON CONFLICT(id) DO UPDATE SET data=excluded.data",
        row,
    )


def _delete_pending(db: sqlite3.Connection, pending_id: int) -> None:
    db.execute("DELETE FROM pending WHERE id=?", (pending_id,))


def _save_node_faults(db: sqlite3.Connection, rows: dict[str, list[tuple[str, str, int, str]]]) -> None:
    for address, faults in rows.items():
        db.execute("DELETE FROM node_faults WHERE node_manager=?", (address,))
        db.executemany("INSERT INTO node_faults(node_manager, code, level, reason) VALUES(?,?,?,?)", faults)


def _add_fault_history(db: sqlite3.Connection, instance_id: int, entry: str, keep: int) -> None:
    db.execute("INSERT INTO fault_history(instance_id, entry) VALUES(?,?)", (instance_id, entry))
    db.execute(
        "DELETE FROM fault_history WHERE instance_id=? AND seq NOT IN "
        "(SELECT seq FROM fault_history WHERE instance_id=? ORDER BY seq DESC LIMIT ?)",
        (instance_id, instance_id, keep),
    )


def _save_alarms(
    db: sqlite3.Connection,
    history: list[tuple[int, bytes]],
    active: dict[str, tuple[int, bytes] | None],
    last_sequence: int,
    keep: int,
) -> None:
    db.executemany("INSERT INTO alarm_history(seq, alarm) VALUES(?,?)", history)
    for key, row in active.items():
        if row is None:
            db.execute("DELETE FROM alarm_active WHERE key=?", (key,))
        else:
            db.execute(
                "INSERT INTO alarm_active(key, seq, alarm) VALUES(?,?,?) "
                "ON CONFLICT(key) DO UPDATE SET seq=excluded.seq, alarm=excluded.alarm",
                (key, *row),
            )
    # The counter outlives the rows: trimming never lets a sequence come back.
    db.execute(
        "INSERT INTO meta(key, value) VALUES('last_alarm_sequence', ?) "
        "ON CONFLICT(key) DO UPDATE SET value=excluded.value",
        (last_sequence,),
    )
    db.execute("DELETE FROM alarm_history WHERE seq <= ?", (last_sequence - keep,))


def _save_desired(db: sqlite3.Connection, row: tuple[int, int, int]) -> None:
    db.execute(
        "INSERT INTO desired_instances(role, replicas, update_time_ns) VALUES(?,?,?) "
        "ON CONFLICT(role) DO UPDATE SET replicas=excluded.replicas, update_time_ns=excluded.update_time_ns",
        row,
    )


def _save_settings(db: sqlite3.Connection, row: tuple[int, str, str]) -> None:
    db.execute(
        "INSERT INTO settings(id, revision, coordinator, controller) VALUES(1,?,?,?) "
        "ON CONFLICT(id) DO UPDATE SET revision=excluded.revision, coordinator=excluded.coordinator, "
        "controller=excluded.controller",
        row,
    )
