"""``motor up``'s last resorts: killing everything it started at once, having the kernel stop a
child that cannot watch for our exit itself, and removing its temporary state directory."""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import signal
import sys
from collections.abc import Callable
from pathlib import Path

from motor_mesh.common import log
from motor_mesh.common.procgroup import ProcInfo, all_procs


def descendants(root: int) -> list[ProcInfo]:
    """Every process below ``root``, parents before their children. Orphans re-parented to
    ``root`` (a subreaper) are its children now, so they are found too."""
    children: dict[int, list[ProcInfo]] = {}
    for p in all_procs():
        children.setdefault(p.ppid, []).append(p)
    found: list[ProcInfo] = []
    todo = [root]
    while todo:
        for p in children.get(todo.pop(0), []):
            found.append(p)
            todo.append(p.pid)
    return found


def kill_descendants(root: int) -> None:
    """SIGKILL every descendant of ``root`` and every process group one of them leads or is in
    (an engine's workers), ``root``'s own group excepted (it holds ``root`` and maybe a pipeline
    it runs in). Twice: a process may have started another just before it was killed."""
    own = os.getpgid(root)
    for _ in range(2):
        procs = descendants(root)
        for p in procs:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(p.pid, signal.SIGKILL)
        for pgid in {p.pgid for p in procs} - {own}:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pgid, signal.SIGKILL)


PR_SET_PDEATHSIG = 1


def die_with_parent() -> Callable[[], None]:
    """A ``preexec_fn`` after which the kernel sends the child SIGTERM when we are gone, however
    we go (even SIGKILL): for a child that ignores the stdin we stop the others by (etcd)."""
    if not sys.platform.startswith("linux"):
        return lambda: None
    prctl = ctypes.CDLL(None, use_errno=True).prctl  # looked up here: the child only calls it
    parent = os.getpid()

    def arm() -> None:
        prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
        if os.getppid() != parent:  # we were gone before it was armed
            os._exit(1)

    return arm


def remove_state_dir(state: Path, own: bool) -> None:
    """Remove ``state`` if it is our temporary directory; a directory the user gave is theirs."""
    if not own:
        return
    try:
        shutil.rmtree(state)
    except FileNotFoundError:
        return  # already gone: nothing to do
    except OSError as exc:
        log.warn("state_dir_not_removed", state_dir=str(state), reason=str(exc))
