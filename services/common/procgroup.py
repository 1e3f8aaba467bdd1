"""Process groups and reaping (docs/architecture.md, "The NodeManager").

Every engine runs in its own session, so its process group is the unit we signal. A stop is
complete only when ``killpg(pgid, 0)`` raises ESRCH: zombies count as members, so we also reap
every orphaned descendant (the NodeManager is a child subreaper) while we wait.

asyncio watches each engine leader by pid (its child watcher calls ``waitpid(pid)``); the reaper
below must never steal those statuses, so it reaps only zombies it was not told to leave alone.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import signal
import sys
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from services.common import log

PR_SET_CHILD_SUBREAPER = 36
_POLL_S = 0.05


def become_subreaper() -> bool:
    """Adopt every orphaned descendant (Linux), so engine workers are reaped by us."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))
    except (OSError, AttributeError) as exc:
        log.warn("subreaper_unavailable", reason=str(exc))
        return False
    return True


def group_alive(pgid: int) -> bool:
    if pgid <= 1:
        return False
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, but not ours to signal
    return True


def signal_group(pgid: int, sig: int) -> bool:
    """Send ``sig`` to the group; False when the group is gone."""
    if pgid <= 1:
        return False
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        return False
    except PermissionError:
        log.warn("group_signal_denied", pgid=pgid, signal=signal.Signals(sig).name)
        return False
    return True


@dataclass(frozen=True)
class ProcInfo:
    pid: int
    state: str
    ppid: int
    pgid: int
    sid: int
    start_ticks: int


def proc_info(pid: int) -> ProcInfo | None:
    """Fields of /proc/<pid>/stat (None when the process is gone or /proc is missing)."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # comm may contain spaces and parentheses: split after the last ')'.
    rest = raw[raw.rfind(")") + 2 :].split()
    try:
        return ProcInfo(pid, rest[0], int(rest[1]), int(rest[2]), int(rest[3]), int(rest[19]))
    except (IndexError, ValueError):
        return None


def cmdline(pid: int) -> list[str]:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return []
    return [part.decode(errors="replace") for part in raw.split(b"\0") if part]


def all_procs() -> list[ProcInfo]:
    out: list[ProcInfo] = []
    try:
        names = os.listdir("/proc")
    except OSError:
        return out
    for name in names:
        if name.isdigit():
            info = proc_info(int(name))
            if info is not None:
                out.append(info)
    return out


def group_members(pgid: int) -> list[ProcInfo]:
    return [p for p in all_procs() if p.pgid == pgid]


class Reaper:
    """Reaps zombie children that are not engine leaders watched by asyncio.

    A zombie that leads its own session may be a leader whose pid we have not been told yet (the
    spawn coroutine has not returned); such a zombie is reaped only on a later pass.
    """

    def __init__(self) -> None:
        self._leaders: set[int] = set()
        self._seen: set[int] = set()

    def watch(self, pid: int) -> None:
        self._leaders.add(pid)

    def unwatch(self, pid: int) -> None:
        self._leaders.discard(pid)

    def reap(self) -> int:
        """One pass; returns how many zombies were reaped."""
        me = os.getpid()
        reaped = 0
        seen: set[int] = set()
        for p in all_procs():
            if p.ppid != me or p.state != "Z" or p.pid in self._leaders:
                continue
            if p.pid == p.sid and p.pid not in self._seen:
                seen.add(p.pid)
                continue
            with contextlib.suppress(ChildProcessError, OSError):
                if os.waitpid(p.pid, os.WNOHANG)[0] == p.pid:
                    reaped += 1
        self._seen = seen
        return reaped

    async def run(self, interval_s: float = 1.0) -> None:
        while True:
            self.reap()
            await asyncio.sleep(interval_s)


def only_foreign_zombies(pgid: int) -> bool:
    """Whether every member left is a zombie that another process must reap.

    An engine left by a killed NodeManager was adopted by someone else (init, or ``motor up``
    as subreaper); once dead it holds no port, but it stays a group member until its new parent
    reaps it, which we cannot do."""
    me = os.getpid()
    members = group_members(pgid)
    return bool(members) and all(p.state == "Z" and p.ppid != me for p in members)


async def wait_group_gone(pgid: int, timeout_s: float, reaper: Reaper | None) -> bool:
    """Poll until the group has no member left (reaping as we go); False on timeout.

    Our own descendants are reaped here, so for them this means ``killpg(pgid, 0)`` raises
    ESRCH; zombies we are not the parent of are accepted as gone."""
    deadline = time.monotonic() + timeout_s
    while True:
        if reaper is not None:
            reaper.reap()
        if not group_alive(pgid) or only_foreign_zombies(pgid):
            return True
        if time.monotonic() >= deadline:
            return False
        await asyncio.sleep(_POLL_S)


async def stop_group(pgid: int, grace_s: float, reaper: Reaper | None, *, kill_wait_s: float = 10.0) -> bool:
    """SIGTERM the group, wait ``grace_s``, SIGKILL it, wait until it is gone (ESRCH)."""
    if grace_s > 0 and signal_group(pgid, signal.SIGTERM):
        if await wait_group_gone(pgid, grace_s, reaper):
            return True
    signal_group(pgid, signal.SIGKILL)
    if await wait_group_gone(pgid, kill_wait_s, reaper):
        return True
    left = [p.pid for p in group_members(pgid)]
    log.error("engine_group_stuck", pgid=pgid, pids=left)
    return False


def looks_like_engine(members: Iterable[ProcInfo], markers: Iterable[str]) -> bool:
    """Whether any member's command line mentions one of ``markers`` (an engine, its port)."""
    wanted = [m for m in markers if m]
    for p in members:
        text = " ".join(cmdline(p.pid))
        if any(m in text for m in wanted):
            return True
    return False
