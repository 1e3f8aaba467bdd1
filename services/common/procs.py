"""Process-group helpers shared by the NodeManager and ``motor up``."""

from __future__ import annotations

import asyncio
import ctypes
import errno
import json
import os
import signal
from pathlib import Path

from services.common import log

PR_SET_CHILD_SUBREAPER = 36


def become_subreaper() -> bool:
    """Orphaned descendants re-parent to us instead of init, so we can reap and stop them."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def reap(pid: int) -> None:
    """Collect ``pid`` if it is our (possibly adopted) child and has exited."""
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass


async def kill_group(pgid: int, grace_s: float, pids: tuple[int, ...] = ()) -> None:
    """SIGTERM the group, wait ``grace_s``, SIGKILL it; done only when ``killpg(pgid, 0)`` says ESRCH."""
    loop = asyncio.get_running_loop()
    for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            return
        except PermissionError as exc:
            log.warn("kill_denied", pgid=pgid, errno=errno.errorcode.get(exc.errno or 0, "?"))
            return
        deadline = loop.time() + wait
        while loop.time() < deadline:
            for pid in (pgid, *pids):
                reap(pid)
            if not group_alive(pgid):
                return
            await asyncio.sleep(0.02)
    log.error("group_survived_sigkill", pgid=pgid)


def recorded_pgids(record: Path) -> list[int]:
    """The engine process groups listed in a NodeManager's ``engines.json``."""
    try:
        data = json.loads(record.read_text())
    except (OSError, ValueError):
        return []
    entries = data.get("engines", []) if isinstance(data, dict) else data
    return [int(e["pgid"]) for e in entries if isinstance(e, dict) and isinstance(e.get("pgid"), int)]


async def kill_recorded_engines(record: Path, grace_s: float = 0.0) -> int:
    """SIGKILL every still-alive group recorded in ``record``; returns how many were alive."""
    alive = [g for g in recorded_pgids(record) if group_alive(g)]
    await asyncio.gather(*(kill_group(g, grace_s) for g in alive))
    if alive:
        log.event("killed_leftover_engines", record=str(record), pgids=",".join(map(str, alive)))
    return len(alive)
