"""Process groups and reaping (docs/architecture.md, "The NodeManager").

Every engine runs in its own session, so its process group is the unit we signal. A stop is
complete only when ``killpg(pgid, 0)`` raises ESRCH: zombies count as members, so we also reap
every orphaned descendant (the NodeManager is a child subreaper) while we wait.

asyncio watches each engine leader by pid (its child watcher calls ``waitpid(pid)``); the reaper
below must never steal those statuses, so it reaps only zombies it was not told to leave alone.

Nothing here scans all of /proc on the event loop: the reaper wakes on SIGCHLD and looks at this
process's own children only, and a stop waits on pidfds of the group's members, looking the
members up (a full /proc scan) in a worker thread, once per exit it waited for.
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

from motor_mesh.common import log

PR_SET_CHILD_SUBREAPER = 36
_POLL_S = 0.05
# Without pidfds a stop looks at the group again at most this far apart (doubling from _POLL_S).
_MAX_PAUSE_S = 0.5
# With pidfds the group is looked at again on every exit, and at least this often: a pid reused
# between the look-up and pidfd_open would otherwise be waited on for nothing.
_RESCAN_S = 1.0
# A zombie the reaper must look at twice (see Reaper) gets its second pass this much later.
_DEFERRED_PASS_S = 1.0
# With SIGCHLD delivered, a pass this often anyway heals a missed one (it costs one read of our
# own children list).
_SAFETY_PASS_S = 30.0


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


def pin(pid: int, cores: Iterable[int]) -> bool:
    """Confine every thread of ``pid`` to ``cores`` (Linux); the threads and processes it starts
    later inherit that. Called right after a spawn, while the process is still starting, so no
    thread escapes. False where affinity cannot be set (not Linux, the process gone, cores not
    ours to give)."""
    setaffinity = getattr(os, "sched_setaffinity", None)
    if setaffinity is None:
        return False
    wanted = set(cores)
    try:
        tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        tids = [pid]
    try:
        for tid in tids:
            setaffinity(tid, wanted)
    except OSError:
        return False
    return True


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


def _child_pids() -> list[int] | None:
    """This process's children, every thread's (``/proc/self/task/*/children``); None where the
    kernel does not list them (built without CONFIG_PROC_CHILDREN)."""
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return None
    pids: list[int] = []
    listed = False
    for tid in tids:
        try:
            text = Path(f"/proc/self/task/{tid}/children").read_text()
        except OSError:
            continue  # a thread that just ended, or no such file on this kernel
        listed = True
        pids.extend(int(p) for p in text.split())
    return pids if listed else None


def _zombie_children() -> list[ProcInfo]:
    me = os.getpid()
    pids = _child_pids()
    if pids is None:
        candidates = [p for p in all_procs() if p.ppid == me]
    else:
        candidates = [p for p in map(proc_info, pids) if p is not None]
    return [p for p in candidates if p.state == "Z" and p.ppid == me]


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
        """One pass over our own children; returns how many zombies were reaped."""
        reaped = 0
        seen: set[int] = set()
        for p in _zombie_children():
            if p.pid in self._leaders:
                continue
            if p.pid == p.sid and p.pid not in self._seen:
                seen.add(p.pid)
                continue
            with contextlib.suppress(ChildProcessError, OSError):
                if os.waitpid(p.pid, os.WNOHANG)[0] == p.pid:
                    reaped += 1
        self._seen = seen
        return reaped

    async def run(self, interval_s: float = _SAFETY_PASS_S) -> None:
        """Reap on every SIGCHLD (an exited child, ours or adopted), and every ``interval_s``
        as a safety net; every second where SIGCHLD cannot be handled here.

        This takes over SIGCHLD for the loop (asyncio's default child watcher on Linux waits
        in threads and does not use it) and gives it back when cancelled."""
        loop = asyncio.get_running_loop()
        woken = asyncio.Event()
        try:
            loop.add_signal_handler(signal.SIGCHLD, woken.set)
            handled = True
        except (RuntimeError, ValueError, NotImplementedError) as exc:  # not the main thread
            log.warn("reaper_without_sigchld", reason=str(exc))
            handled, interval_s = False, min(interval_s, 1.0)
        try:
            while True:
                self.reap()
                wait = min(interval_s, _DEFERRED_PASS_S) if self._seen else interval_s
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(woken.wait(), wait)
                woken.clear()
        finally:
            if handled:
                loop.remove_signal_handler(signal.SIGCHLD)


def _only_foreign_zombies(members: list[ProcInfo]) -> bool:
    """Whether every member left is a zombie that another process must reap.

    An engine left by a killed NodeManager was adopted by someone else (init, or ``motor up``
    as subreaper); once dead it holds no port, but it stays a group member until its new parent
    reaps it, which we cannot do."""
    me = os.getpid()
    return bool(members) and all(p.state == "Z" and p.ppid != me for p in members)


_pidfds = hasattr(os, "pidfd_open")


async def _until_one_exits(pids: list[int], timeout_s: float) -> bool:
    """Wait until one of ``pids`` exits or ``timeout_s`` passes (pidfds on the loop: no
    polling); False at once when this system has no pidfds."""
    global _pidfds
    if not _pidfds:
        return False
    loop = asyncio.get_running_loop()
    exited = asyncio.Event()
    fds: list[int] = []
    try:
        for pid in pids:
            try:
                fd = os.pidfd_open(pid)
            except ProcessLookupError:
                return True  # gone already: worth a look now
            except OSError as exc:  # ENOSYS (kernel < 5.3) or refused by a sandbox
                log.warn("pidfd_unavailable", reason=str(exc))
                _pidfds = False
                return False
            fds.append(fd)
            loop.add_reader(fd, exited.set)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(exited.wait(), timeout_s)
        return True
    finally:
        for fd in fds:
            loop.remove_reader(fd)
            os.close(fd)


async def wait_group_gone(pgid: int, timeout_s: float, reaper: Reaper | None) -> bool:
    """Wait until the group has no member left (reaping as we go); False on timeout.

    Our own descendants are reaped here, so for them this means ``killpg(pgid, 0)`` raises
    ESRCH; zombies we are not the parent of are accepted as gone."""
    deadline = time.monotonic() + timeout_s
    pause = _POLL_S
    while True:
        if reaper is not None:
            reaper.reap()
        if not group_alive(pgid):
            return True
        # Who is left takes a scan of all of /proc: off the loop, and once per exit waited for.
        members = await asyncio.to_thread(group_members, pgid)
        if _only_foreign_zombies(members):
            return True
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        live = [p.pid for p in members if p.state != "Z"]
        # With no live member, what is left are zombies of ours that asyncio's child watcher or
        # the reaper is about to collect: look again shortly.
        if not (live and await _until_one_exits(live, min(left, _RESCAN_S))):
            await asyncio.sleep(min(left, pause))
            pause = min(pause * 2, _MAX_PAUSE_S)


async def stop_group(pgid: int, grace_s: float, reaper: Reaper | None, *, kill_wait_s: float = 10.0) -> bool:
    """SIGTERM the group, wait ``grace_s``, SIGKILL it, wait until it is gone (ESRCH)."""
    if grace_s > 0 and signal_group(pgid, signal.SIGTERM):
        if await wait_group_gone(pgid, grace_s, reaper):
            return True
    signal_group(pgid, signal.SIGKILL)
    if await wait_group_gone(pgid, kill_wait_s, reaper):
        return True
    left = [p.pid for p in await asyncio.to_thread(group_members, pgid)]
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
