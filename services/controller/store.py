"""The Controller's embedded database: ``state_dir/controller.db`` (sqlite3, WAL).

Holds the instance-id counter, every assembled instance (DELETED ones too, so an id is never
handed out twice and operators can list what was removed), the pending assemblies, the node
faults reported with ReportFaults, the fault manager's strategy history, and the alarms (the
active ones, and the bounded history with its sequence counter). Writes are small and
synchronous: one row per registration, assembly or status transition, never one per heartbeat;
one transaction per alarm report.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Mapping, Sequence
from pathlib import Path

from services.common.enums import DELETED, InstanceStatus

from .convert import instance_from_row, instance_row, pending_from_row, pending_row
from .model import Instance, Pending

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
"""

# A node's reported faults by code: (level, reason).
NodeFaults = dict[str, tuple[int, str]]

# DELETED instances kept for ListInstances(status=DELETED), in memory and on disk; older ones are
# pruned as new ones are deleted and at start-up. The id counter lives in ``meta``, so pruning
# never lets an id come back.
KEEP_DELETED = 1000


class Store:
    def __init__(self, state_dir: str | Path) -> None:
        path = Path(state_dir)
        path.mkdir(parents=True, exist_ok=True)
        self.path = path / "controller.db"
        self._db = sqlite3.connect(self.path, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        # NORMAL in WAL mode: a power cut may lose the last transaction, never corrupt the file.
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.executescript(_SCHEMA)

    def close(self) -> None:
        self._db.close()

    def next_instance_id(self) -> int:
        """Reserve the next instance id (persisted before it is handed out)."""
        row = self._db.execute("SELECT value FROM meta WHERE key='next_instance_id'").fetchone()
        floor = self._db.execute(
            "SELECT MAX(m) FROM (SELECT MAX(id) AS m FROM instances UNION ALL SELECT MAX(id) FROM pending)"
        ).fetchone()[0]
        value = max(row[0] if row else 1, (floor or 0) + 1)
        self._db.execute(
            "INSERT INTO meta(key, value) VALUES('next_instance_id', ?) "
            "ON CONFLICT(key) DO UPDATE SET value=excluded.value",
            (value + 1,),
        )
        return value

    def save_instance(self, inst: Instance, status: InstanceStatus | None = None) -> None:
        """Write the instance (with ``status`` instead of its own, when given)."""
        blob, members = instance_row(inst, status)
        status = inst.status if status is None else status
        self._db.execute(
            "INSERT INTO instances(id, job_name, status, instance, members) VALUES(?,?,?,?,?) "
            "ON CONFLICT(id) DO UPDATE SET status=excluded.status, instance=excluded.instance, "
            "members=excluded.members",
            (inst.id, inst.job_name, int(status), blob, members),
        )

    def assemble(self, inst: Instance) -> None:
        """The pending row becomes an instance row, atomically."""
        blob, members = instance_row(inst)
        with self._db:
            self._db.execute("BEGIN")
            self._db.execute("DELETE FROM pending WHERE id=?", (inst.id,))
            self._db.execute(
                "INSERT OR REPLACE INTO instances(id, job_name, status, instance, members) VALUES(?,?,?,?,?)",
                (inst.id, inst.job_name, int(inst.status), blob, members),
            )

    def forget_instance(self, instance_id: int) -> None:
        """Drop a DELETED instance's row (history pruning; its id stays used)."""
        self._db.execute("DELETE FROM instances WHERE id=? AND status=?", (instance_id, DELETED))

    def save_pending(self, p: Pending) -> None:
        self._db.execute(
            "INSERT INTO pending(id, job_name, data) VALUES(?,?,?) "
            "ON CONFLICT(id) DO UPDATE SET data=excluded.data",
            (p.id, p.job_name, pending_row(p)),
        )

    def delete_pending(self, pending_id: int) -> None:
        self._db.execute("DELETE FROM pending WHERE id=?", (pending_id,))

    def load_instances(self) -> list[Instance]:
        self._db.execute(
            "DELETE FROM instances WHERE status=? AND id NOT IN "
            "(SELECT id FROM instances WHERE status=? ORDER BY id DESC LIMIT ?)",
            (DELETED, DELETED, KEEP_DELETED),
        )
        rows = self._db.execute("SELECT id, instance, members FROM instances ORDER BY id").fetchall()
        return [instance_from_row(i, blob, members) for i, blob, members in rows]

    def load_pending(self) -> list[Pending]:
        rows = self._db.execute("SELECT id, job_name, data FROM pending ORDER BY id").fetchall()
        return [pending_from_row(id_, job, data) for id_, job, data in rows]

    def save_node_faults(self, nodes: dict[str, NodeFaults]) -> None:
        """Replace the stored faults of each node in ``nodes`` (an empty dict clears it), in one
        transaction."""
        with self._db:
            self._db.execute("BEGIN")
            for address, faults in nodes.items():
                self._db.execute("DELETE FROM node_faults WHERE node_manager=?", (address,))
                self._db.executemany(
                    "INSERT INTO node_faults(node_manager, code, level, reason) VALUES(?,?,?,?)",
                    [(address, code, level, reason) for code, (level, reason) in faults.items()],
                )

    def load_node_faults(self) -> dict[str, NodeFaults]:
        out: dict[str, NodeFaults] = {}
        for address, code, level, reason in self._db.execute(
            "SELECT node_manager, code, level, reason FROM node_faults ORDER BY node_manager, code"
        ):
            out.setdefault(address, {})[code] = (level, reason)
        return out

    def add_fault_history(self, instance_id: int, entry: str, keep: int) -> None:
        """Append to an instance's strategy history, keeping its newest ``keep`` entries."""
        with self._db:
            self._db.execute("BEGIN")
            self._db.execute(
                "INSERT INTO fault_history(instance_id, entry) VALUES(?,?)", (instance_id, entry)
            )
            self._db.execute(
                "DELETE FROM fault_history WHERE instance_id=? AND seq NOT IN "
                "(SELECT seq FROM fault_history WHERE instance_id=? ORDER BY seq DESC LIMIT ?)",
                (instance_id, instance_id, keep),
            )

    def load_fault_history(self) -> dict[int, list[str]]:
        out: dict[int, list[str]] = {}
        for instance_id, entry in self._db.execute(
            "SELECT instance_id, entry FROM fault_history ORDER BY seq"
        ):
            out.setdefault(instance_id, []).append(entry)
        return out

    def forget_fault_history(self, instance_id: int) -> None:
        self._db.execute("DELETE FROM fault_history WHERE instance_id=?", (instance_id,))

    def save_alarms(
        self,
        history: Sequence[tuple[int, bytes]],
        active: Mapping[str, tuple[int, bytes] | None],
        last_sequence: int,
        keep: int,
    ) -> None:
        """One alarm report in one transaction: new history rows ``(sequence, alarm)``, active
        rows by dedupe key (None: the key is no longer active), the sequence counter, and the
        history trimmed to the newest ``keep`` sequences (the sequences are contiguous)."""
        with self._db:
            self._db.execute("BEGIN")
            self._db.executemany("INSERT INTO alarm_history(seq, alarm) VALUES(?,?)", history)
            for key, row in active.items():
                if row is None:
                    self._db.execute("DELETE FROM alarm_active WHERE key=?", (key,))
                else:
                    self._db.execute(
                        "INSERT INTO alarm_active(key, seq, alarm) VALUES(?,?,?) "
                        "ON CONFLICT(key) DO UPDATE SET seq=excluded.seq, alarm=excluded.alarm",
                        (key, *row),
                    )
            # The counter outlives the rows: trimming never lets a sequence come back.
            self._db.execute(
                "INSERT INTO meta(key, value) VALUES('last_alarm_sequence', ?) "
                "ON CONFLICT(key) DO UPDATE SET value=excluded.value",
                (last_sequence,),
            )
            self._db.execute("DELETE FROM alarm_history WHERE seq <= ?", (last_sequence - keep,))

    def load_alarms(self) -> tuple[list[bytes], list[bytes], int]:
        """The history (oldest first), the active alarms (by sequence) and the last sequence
        handed out."""
        history = [b for (b,) in self._db.execute("SELECT alarm FROM alarm_history ORDER BY seq")]
        active = [b for (b,) in self._db.execute("SELECT alarm FROM alarm_active ORDER BY seq")]
        row = self._db.execute("SELECT value FROM meta WHERE key='last_alarm_sequence'").fetchone()
        top = self._db.execute(
            "SELECT MAX(m) FROM (SELECT MAX(seq) AS m FROM alarm_history "
            "UNION ALL SELECT MAX(seq) FROM alarm_active)"
        ).fetchone()[0]
        return history, active, max(row[0] if row else 0, top or 0)
