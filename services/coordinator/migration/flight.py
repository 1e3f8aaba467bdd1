"""A leg answering a client that can be told to move off its instance (a drain's deadline, the
instance leaving the table) while it waits for or reads the engine's answer."""

from __future__ import annotations

import asyncio
import math
import time

from motor_mesh.common.httpclient import Interrupt, Response


class Moved(Exception):
    """The stream was taken off its instance; ``reason``: drain or left."""

    def __init__(self, reason: str) -> None:
        super().__init__(f"moved off its instance ({reason})")
        self.reason = reason


class Flight:
    """Registered with its target (``Target.joined``) for as long as the leg runs."""

    __slots__ = ("_loop", "_timer", "opening", "reason", "resp")

    def __init__(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._timer: asyncio.TimerHandle | None = None
        self.reason: str | None = None  # set once the leg must move
        # Stops the wait for the answer's head: a hung engine answering a non-streamed request
        # sends its head only with the whole body.
        self.opening = Interrupt()
        self.resp: Response | None = None  # the answer being read, once its head came

    def move_at(self, when: float, reason: str) -> None:
        """Move at wall time ``when`` (inf: never; a later call replaces an earlier one)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self.reason is not None or math.isinf(when):
            return
        delay = when - time.time()
        if delay <= 0:
            self._move(reason)
        else:
            self._timer = self._loop.call_later(delay, self._move, reason)

    def _move(self, reason: str) -> None:
        self._timer = None
        self.reason = reason
        if self.resp is not None:
            # Events already received still reach the client: the move is at a token boundary.
            self.resp.interrupt(Moved(reason))
        else:
            self.opening(Moved(reason))

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
