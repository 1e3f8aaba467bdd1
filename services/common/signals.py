"""Stop signals for every Motor process: the first SIGTERM/SIGINT starts a graceful stop, the
second forces the exit at once (after the hooks that kill what must not outlive the process),
and, under ``motor up``, stdin closing stops the process too.

No gRPC here: the Coordinator's inference workers and ``motor up`` use it as well.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
from collections.abc import Callable

from motor_mesh.common import log

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
# What a forced exit must not leave behind (on_forced_exit).
_FORCED_EXIT_HOOKS: list[Callable[[], None]] = []


def on_forced_exit(hook: Callable[[], None]) -> None:
    """Run ``hook`` if a second signal forces the exit: kill what must not outlive this process
    (a NodeManager's engines, a Coordinator's workers). It must not block."""
    _FORCED_EXIT_HOOKS.append(hook)


# Set by ``motor up`` for its children: stop when stdin closes (stop_when_stdin_closes).
STDIN_GUARD_ENV = "MOTOR_STOP_ON_STDIN_EOF"


def install_stop_signals(
    on_stop: Callable[[], None], *, before_forced_exit: Callable[[], None] | None = None
) -> None:
    """SIGTERM/SIGINT call ``on_stop`` (the graceful stop); the next one forces the exit at
    once: one log line, ``before_forced_exit()`` (kill what must not outlive us; it must not
    block), then exit code 128 + the signal's number, as a shell reports a process it killed.

    An operator who signals twice does not want to wait for a drain, and a supervisor's second
    signal (or Ctrl-C pressed again) is how a stuck stop is cut short without SIGKILL, which
    would leave no word in the log."""
    loop = asyncio.get_running_loop()
    received: list[int] = []

    def handle(sig: int) -> None:
        received.append(sig)
        if len(received) == 1:
            on_stop()
            return
        rc = 128 + sig
        log.warn("forced_exit", signal=signal.Signals(sig).name, rc=rc, reason="second stop signal")
        hooks = [*_FORCED_EXIT_HOOKS, *([before_forced_exit] if before_forced_exit else [])]
        for hook in hooks:
            try:
                hook()
            except Exception:
                log.exception("forced_exit_cleanup_failed", hook=getattr(hook, "__qualname__", "?"))
        # Whatever the graceful stop was waiting on stays unfinished: skip it (and every
        # finally block, atexit hook and thread join) on purpose.
        with contextlib.suppress(Exception):
            sys.stderr.flush()
        os._exit(rc)

    for sig in STOP_SIGNALS:
        loop.add_signal_handler(sig, handle, sig)


def stop_when_stdin_closes(on_stop: Callable[[], None]) -> None:
    """Call ``on_stop`` once stdin reaches EOF. ``motor up`` gives each child a pipe it never
    writes to and closes it to stop the child; the pipe also closes when ``motor up`` is gone,
    even killed with SIGKILL, so the child stops (engines included) instead of living on as an
    orphan holding its ports. Not a signal, so it does not count towards a forced exit."""
    loop = asyncio.get_running_loop()
    fd = 0

    def readable() -> None:
        try:
            data = os.read(fd, 4096)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            loop.remove_reader(fd)
            log.event("stdin_closed", action="stopping")
            on_stop()

    try:
        loop.add_reader(fd, readable)
    except (OSError, ValueError) as exc:  # not a pipe (a file, /dev/null): nothing to watch
        log.warn("stdin_watch_unavailable", reason=str(exc) or type(exc).__name__)
