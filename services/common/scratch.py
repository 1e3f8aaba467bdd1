"""Private scratch directories named after the process that made them, and the sweep of those
a process killed outright (SIGKILL: no cleanup runs) left behind.

``<parent>/<prefix><pid>-<random>``: whoever makes the next one removes those whose process is
gone. A process that is alive, or that is another user's, keeps its own.
"""

from __future__ import annotations

import os
import shutil
import tempfile


def make(prefix: str, parent: str | None = None) -> str:
    """A new directory (mode 0700) in ``parent`` (the temporary directory by default), after
    removing what dead processes left there under ``prefix``."""
    parent = parent or tempfile.gettempdir()
    sweep(parent, prefix)
    return tempfile.mkdtemp(prefix=f"{prefix}{os.getpid()}-", dir=parent)


def sweep(parent: str, prefix: str) -> None:
    """Remove ``parent``'s directories under ``prefix`` named after a process that is gone."""
    try:
        names = os.listdir(parent)
    except OSError:
        return
    for name in names:
        pid = name[len(prefix) :].split("-", 1)[0]
        if not (name.startswith(prefix) and pid.isdigit()):
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            shutil.rmtree(os.path.join(parent, name), ignore_errors=True)
        except (PermissionError, OverflowError):
            continue  # alive and someone else's; or a number no pid can be: not ours to remove
