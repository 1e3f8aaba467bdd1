"""``state_dir/engines.json``: the engine process groups this node started.

A NodeManager killed with SIGKILL leaves its engines running and holding their ports; the next
one reads this file on start and kills every recorded group that is still alive.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import os
import signal
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from motor_mesh.common import log, procgroup

FILE_NAME = "engines.json"
_KILL_WAIT_S = 10.0
# Far more than any node's engines take (a record is about 200 bytes).
_MAX_BYTES = 1 << 20


@dataclass
class EngineRecord:
    endpoint_id: int
    port: int
    pid: int
    pgid: int
    start_ticks: int = 0  # the leader's start time in clock ticks: tells a reused pid apart
    markers: list[str] = field(default_factory=list)  # command-line fragments of this engine


class StateFile:
    def __init__(self, state_dir: str | Path) -> None:
        self.path = Path(state_dir) / FILE_NAME
        self._saving = asyncio.Lock()

    def read(self) -> list[EngineRecord]:
        """The records, or as many as can be read. A file that cannot be read whole is moved
        aside (``engines.json.corrupt-<UTC time>``, kept for a post-mortem) with one warning
        saying what was lost: start-up goes on, with the engines we can still name."""
        try:
            with self.path.open("rb") as f:
                raw = f.read(_MAX_BYTES + 1)
        except FileNotFoundError:
            return []
        except OSError as exc:
            self._set_aside(0, f"unreadable: {exc.strerror or exc}", "unknown")
            return []
        if len(raw) > _MAX_BYTES:
            self._set_aside(0, f"larger than {_MAX_BYTES} bytes", "unknown")
            return []
        try:
            data = json.loads(raw)
        # RecursionError: deeply nested brackets, which json reports no other way.
        except (ValueError, RecursionError) as exc:
            self._set_aside(0, f"not JSON: {str(exc)[:200]}", "unknown")
            return []
        items = data.get("engines") if isinstance(data, dict) else None
        if not isinstance(items, list):
            self._set_aside(0, 'not an object with an "engines" list', "unknown")
            return []
        out = [r for r in map(_record, items) if r is not None]
        if len(out) < len(items):
            self._set_aside(len(out), "some engine records are malformed", len(items) - len(out))
        return out

    def _set_aside(self, kept: int, reason: str, lost: int | str) -> None:
        moved_to = ""
        stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
        for n in range(100):
            target = self.path.with_name(f"{FILE_NAME}.corrupt-{stamp}" + (f"-{n}" if n else ""))
            if target.exists():
                continue
            try:
                os.replace(self.path, target)
            except OSError as exc:
                reason += f"; not moved aside: {exc.strerror or exc}"
            else:
                moved_to = str(target)
            break
        # lost: engine records we could not read, so engines of an earlier run that may be left
        # running (they are not killed); "unknown" when the file could not be parsed at all.
        log.warn(
            "engine_state_corrupt",
            path=str(self.path),
            moved_to=moved_to,
            reason=reason,
            records_kept=kept,
            records_lost=lost,
        )

    def write(self, records: list[EngineRecord]) -> None:
        """Atomically and durably (temp file, fsync, rename, fsync of the directory): a crash
        or power loss mid-write leaves the old list or the new one, never neither."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        body = json.dumps({"nm_pid": os.getpid(), "engines": [asdict(r) for r in records]}, indent=1)
        fd, tmp = tempfile.mkstemp(prefix=".engines.", suffix=".tmp", dir=self.path.parent)
        try:
            with os.fdopen(fd, "w") as f:
                f.write(body)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        _fsync_dir(self.path.parent)

    async def save(self, records: list[EngineRecord]) -> None:
        """:meth:`write` off the event loop (fsync may take a while on a busy disk); saves run
        in the order they were asked for."""
        async with self._saving:
            await asyncio.to_thread(self.write, records)


def _fsync_dir(path: Path) -> None:
    """Make a rename in ``path`` durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    except OSError as exc:
        # Some file systems cannot fsync a directory; the rename is as durable as they make it.
        if exc.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP):
            raise
    finally:
        os.close(fd)


def _int(value: object, low: int, high: int | None = None) -> int:
    # bool is an int to Python, and "12" or 1.5 would pass int(): none of them is what we wrote.
    if type(value) is not int or value < low or (high is not None and value > high):
        raise ValueError(value)
    return value


def _record(item: object) -> EngineRecord | None:
    """One record as written by :meth:`StateFile.write`, or None for anything else."""
    if not isinstance(item, dict):
        return None
    markers = item.get("markers", [])
    try:
        if not (isinstance(markers, list) and all(isinstance(m, str) for m in markers)):
            raise ValueError(markers)
        return EngineRecord(
            endpoint_id=_int(item["endpoint_id"], 0),
            port=_int(item["port"], 1, 65535),
            # 0 and 1 are no process group of ours, and a negative one is no process group at all.
            pid=_int(item["pid"], 2),
            pgid=_int(item["pgid"], 2),
            start_ticks=_int(item.get("start_ticks", 0), 0),
            markers=markers,
        )
    except (KeyError, ValueError):
        return None


def _is_ours(rec: EngineRecord) -> bool:
    """Whether the live group ``rec.pgid`` is still the engine we recorded, not a reused id."""
    if rec.pgid == os.getpgid(0) or rec.pgid <= 1:
        return False
    if not Path("/proc").is_dir():
        return True  # nothing to verify with; the pgid was ours
    leader = procgroup.proc_info(rec.pgid)
    if leader is not None and rec.start_ticks and leader.start_ticks == rec.start_ticks:
        return True
    members = procgroup.group_members(rec.pgid)
    # Our engines lead their own session, so every member's session id is the pgid.
    members = [m for m in members if m.sid == rec.pgid]
    return procgroup.looks_like_engine(members, rec.markers)


async def _kill_stale(rec: EngineRecord, reaper: procgroup.Reaper | None) -> None:
    if not procgroup.group_alive(rec.pgid):
        return
    # Reads /proc (a scan of every process to find the group's members): off the loop.
    if not await asyncio.to_thread(_is_ours, rec):
        log.warn("stale_engine_skipped", pgid=rec.pgid, reason="process group now belongs to something else")
        return
    log.event("stale_engine_kill", pgid=rec.pgid, endpoint_id=rec.endpoint_id, port=rec.port)
    procgroup.signal_group(rec.pgid, signal.SIGKILL)
    if not await procgroup.wait_group_gone(rec.pgid, _KILL_WAIT_S, reaper):
        log.error("stale_engine_stuck", pgid=rec.pgid)


async def kill_recorded_engines(state: StateFile, reaper: procgroup.Reaper | None = None) -> int:
    """SIGKILL every recorded engine group still alive, wait until each is gone, clear the file.

    Returns how many records there were."""
    records = await asyncio.to_thread(state.read)
    if records:
        await asyncio.gather(*(_kill_stale(r, reaper) for r in records))
    if records or state.path.exists():
        await state.save([])
    return len(records)
