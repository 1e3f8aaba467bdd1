"""The database file under ``state_dir``: opened with an integrity check, written on one thread.

Three promises rest on it: an acknowledged change survives a power cut (``synchronous=FULL``:
every commit is on disk before the call returns, which is what makes "instance ids are never
reused" true); a damaged file stops the Controller with one line instead of a traceback or,
worse, a start on half a history (it is moved aside, so the operator can look at it and the
next start begins clean on purpose); and no commit runs on the event loop (a commit with an
fsync takes milliseconds, and a full or failing disk much longer, while ten thousand heartbeat
streams wait on the same loop).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sqlite3
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

import grpc
from google.rpc import error_details_pb2

from motor_mesh.common import errors, log

T = TypeVar("T")

# The files SQLite keeps beside the database in WAL mode; moved aside with it.
_SIDECARS = ("-wal", "-shm")


class StateCorrupt(OSError):
    """The state file cannot be trusted. An OSError, so a service's start-up prints it as the
    one line it is and exits 1."""


class StateWriteError(errors.MotorError):
    """A write that did not happen (disk full, I/O error, read-only file): memory was not
    changed either, and the caller is told to retry."""

    def __init__(self, what: str, cause: BaseException) -> None:
        message = f"state write failed ({cause}): {what} was not changed; retry later"
        super().__init__(
            grpc.StatusCode.UNAVAILABLE,
            message,
            [
                error_details_pb2.ErrorInfo(
                    reason="STATE_WRITE_FAILED", domain=errors.DOMAIN, metadata={"operation": what}
                ),
                error_details_pb2.RetryInfo(retry_delay={"seconds": 2}),
            ],
        )


def move_aside(path: Path, why: str) -> StateCorrupt:
    """Rename the damaged file (and its WAL files) out of the way, durably, and say where."""
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    target = path.with_name(f"{path.name}.corrupt-{stamp}")
    for suffix in ("", *_SIDECARS):
        src = Path(f"{path}{suffix}")
        if src.exists():
            os.replace(src, f"{target}{suffix}")
    fsync_dir(path.parent)
    return StateCorrupt(
        f"state file {path} is corrupt ({why}); moved it to {target}. Restore a backup there, or "
        "start again to begin with an empty state (instance ids start over)"
    )


def fsync_dir(path: Path) -> None:
    """Make a rename or a new file in ``path`` survive a power cut."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def open_checked(path: Path, schema: str) -> sqlite3.Connection:
    """The database at ``path`` with ``schema`` applied, after SQLite's own integrity check.
    A file that is not a database, or fails the check, raises StateCorrupt after moving it."""
    db: sqlite3.Connection | None = None
    try:
        # The connection is used from the writer thread afterwards, one statement at a time.
        db = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
        verdict = db.execute("PRAGMA quick_check").fetchone()[0]
        if verdict != "ok":
            raise sqlite3.DatabaseError(f"integrity check: {verdict}")
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("PRAGMA synchronous=FULL")
        db.executescript(schema)
    except sqlite3.DatabaseError as err:
        if db is not None:
            db.close()
        raise move_aside(path, str(err)) from None
    fsync_dir(path.parent)
    return db


class Writer:
    """One thread that runs every statement, each call in one transaction."""

    def __init__(self, db: sqlite3.Connection) -> None:
        self._db = db
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="controller-db")
        self.failures = 0  # writes that raised StateWriteError, since the start

    async def run(self, what: str, fn: Callable[..., T], *args: Any) -> T:
        """``fn(db, *args)`` in a transaction on the writer thread. A failure rolls back and
        raises StateWriteError naming ``what``."""
        loop = asyncio.get_running_loop()
        try:
            return await loop.run_in_executor(self._pool, self._transaction, fn, args)
        except sqlite3.Error as err:
            self.failures += 1
            log.error("state_write_failed", operation=what, error=str(err))
            raise StateWriteError(what, err) from err

    def _transaction(self, fn: Callable[..., T], args: tuple[Any, ...]) -> T:
        db = self._db
        db.execute("BEGIN IMMEDIATE")
        try:
            out = fn(db, *args)
            db.execute("COMMIT")
        except BaseException:
            # When the file itself failed, SQLite may have rolled back already.
            with contextlib.suppress(sqlite3.Error):
                if db.in_transaction:
                    db.execute("ROLLBACK")
            raise
        return out

    async def close(self) -> None:
        """Wait for the writes in flight, then close the file."""
        await asyncio.to_thread(self._pool.shutdown, wait=True)
        self._db.close()
