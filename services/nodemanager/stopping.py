"""How a NodeManager stops: SIGTERM is a planned stop whose instance is drained first, SIGINT
(Ctrl-C) and the end of stdin (``motor up``) stop at once, and a second SIGTERM or SIGINT forces
the exit.

The first SIGTERM of a registered NodeManager whose instance runs engines asks the Controller to
``TerminateInstance`` it: the Controller drains it on every Coordinator (no new request goes
there; the ones on it finish or move to another instance), deletes it and sends this node
``Stop``, which stops the engines. The NodeManager waits for that Stop at most
``nodemanager.drain_wait_s`` (45 s: the Coordinators' default drain grace, the Controller's
margin after it, and its Stop round), then stops as before; a Coordinator configured with a
longer grace moves its requests when the instance leaves its table. Nothing to drain (not
registered, no engines), a Controller that refuses or cannot be reached, stdin closing, or the
bound: the engines stop at once.

These handlers take over the ones every service gets (services/common/signals.py), which do not
say which signal came; the forced exit is the same: one ``forced_exit`` line, the engines'
process groups SIGKILLed, exit 128 + the signal.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
from collections.abc import Callable

from motor_mesh.common import log

# Deadline of the TerminateInstance call: it is answered once the termination is recorded (the
# Controller waits for the teardown only within the call's deadline).
TERMINATE_TIMEOUT_S = 5.0


class StopSignals:
    """SIGTERM sets ``planned``, SIGINT sets ``stop``; the next of either calls ``kill_now`` and
    exits at once."""

    def __init__(self, stop: asyncio.Event, kill_now: Callable[[], None]) -> None:
        self.stop = stop
        self.planned = asyncio.Event()
        self._kill_now = kill_now
        self._received: list[int] = []

    def install(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._handle, sig)

    def _handle(self, sig: int) -> None:
        self._received.append(sig)
        if len(self._received) == 1:
            (self.planned if sig == signal.SIGTERM else self.stop).set()
            return
        rc = 128 + sig
        log.warn("forced_exit", signal=signal.Signals(sig).name, rc=rc, reason="second stop signal")
        try:
            self._kill_now()
        except Exception:
            log.exception("forced_exit_cleanup_failed", hook="kill_now")
        with contextlib.suppress(Exception):
            sys.stderr.flush()
        os._exit(rc)
