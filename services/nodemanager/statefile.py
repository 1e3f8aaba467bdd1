"""``state_dir/engines.json``: the engine process groups this node started.

A NodeManager killed with SIGKILL leaves its engines running and holding their ports; the next
one reads this file on start and kills every recorded group that is still alive.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

from services.common import log, procgroup

FILE_NAME = "engines.json"
_KILL_WAIT_S = 10.0


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

    def read(self) -> list[EngineRecord]:
        try:
            data = json.loads(self.path.read_text())
        except FileNotFoundError:
            return []
        except (OSError, ValueError) as exc:
            log.warn("engine_state_unreadable", path=str(self.path), reason=str(exc))
            return []
        out = []
        for item in data.get("engines", []) if isinstance(data, dict) else []:
            try:
                out.append(
                    EngineRecord(
                        endpoint_id=int(item["endpoint_id"]),
                        port=int(item["port"]),
                        pid=int(item["pid"]),
                        pgid=int(item["pgid"]),
                        start_ticks=int(item.get("start_ticks", 0)),
                        markers=[str(m) for m in item.get("markers", [])],
                    )
                )
            except (KeyError, TypeError, ValueError):
                log.warn("engine_state_bad_record", path=str(self.path))
        return out

    def write(self, records: list[EngineRecord]) -> None:
        """Atomically (temp file + rename): a crash mid-write never loses the old list."""
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
    if not _is_ours(rec):
        log.warn("stale_engine_skipped", pgid=rec.pgid, reason="process group now belongs to something else")
        return
    log.event("stale_engine_kill", pgid=rec.pgid, endpoint_id=rec.endpoint_id, port=rec.port)
    procgroup.signal_group(rec.pgid, signal.SIGKILL)
    if not await procgroup.wait_group_gone(rec.pgid, _KILL_WAIT_S, reaper):
        log.error("stale_engine_stuck", pgid=rec.pgid)


async def kill_recorded_engines(state: StateFile, reaper: procgroup.Reaper | None = None) -> int:
    """SIGKILL every recorded engine group still alive, wait until each is gone, clear the file.

    Returns how many records there were."""
    records = state.read()
    if records:
        await asyncio.gather(*(_kill_stale(r, reaper) for r in records))
    if records or state.path.exists():
        state.write([])
    return len(records)
