"""``motor up``'s last resorts: killing everything it started at once, and removing its
temporary state directory."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
from pathlib import Path

from services.common import log
from services.common.procgroup import ProcInfo, all_procs


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
