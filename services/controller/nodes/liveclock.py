"""The clock heartbeat silence is measured on: monotonic time with the Controller's own stalls
taken out.

A NodeManager is silent when the Controller has not heard it for the heartbeat timeout. If the
Controller itself was not running (a VM pause, SIGSTOP, a long collection, a swapped-out heap),
it heard nobody, and on the plain monotonic clock every NodeManager would look silent at once:
the first sweep after the stall would delete the whole cluster. This clock does not advance
over a stall: :meth:`LiveClock.now` is read at least every ``tick_s`` while the loop runs (the
Controller's timer reads it), so a gap longer than ``stall_s`` between two reads is time the
loop was not running, and everyone's silence restarts from the end of it. A NodeManager that
really died is still found one timeout after the stall.
"""

from __future__ import annotations

import time

from motor_mesh.common import log


class LiveClock:
    def __init__(self, stall_s: float) -> None:
        self.stall_s = stall_s
        self._skipped = 0.0
        self._last = time.monotonic()
        self.stalls = 0

    def now(self) -> float:
        t = time.monotonic()
        gap = t - self._last
        self._last = t
        if gap > self.stall_s:
            self._skipped += gap
            self.stalls += 1
            log.warn("loop_stalled", stalled_s=round(gap, 3), note="heartbeat silence restarts now")
        return t - self._skipped
