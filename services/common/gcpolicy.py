"""Keeping CPython's cyclic garbage collector off a hot event loop.

A Controller serving 10,000 NodeManagers holds about a million GC-tracked objects (sessions,
instances, streams, their gRPC calls), nearly all of them long-lived. A full collection walks
every one of them, stalling every stream for up to a second on a busy core. Objects alive when
the working set has grown are moved to the permanent generation (``gc.freeze``), so later full
collections walk only what is newer. Everything the loop allocates per message is still freed
by reference counting or by the young generations as before.

Frozen objects that later become cyclic garbage are not collected until the next full reclaim;
freezing happens only on growth (each time the working set grew by a quarter), so what can be
held that way is bounded by a small multiple of the peak working set, and a shrink of the working
set by a quarter triggers a full reclaim (unfreeze, collect, freeze).
"""

from __future__ import annotations

import gc
import time
from typing import Any

from motor_mesh.common import log

GROWTH = 1.25
MIN_STEP = 64


class GcGuard:
    """Freezes the long-lived heap as it grows, and records collection pauses."""

    def __init__(self) -> None:
        self._frozen_size = 0
        self._started = 0.0
        self._max_pause_s = 0.0
        self._collections = 0
        gc.callbacks.append(self._on_gc)

    def close(self) -> None:
        if self._on_gc in gc.callbacks:
            gc.callbacks.remove(self._on_gc)

    def _on_gc(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        else:
            self._collections += 1
            self._max_pause_s = max(self._max_pause_s, time.perf_counter() - self._started)

    def settle(self, size: int) -> None:
        """Call with the size of the working set (any count that grows with it, e.g. sessions)."""
        if size >= self._frozen_size * GROWTH + MIN_STEP:
            self._freeze(size, full=False)
        elif size * GROWTH + MIN_STEP <= self._frozen_size:
            self._freeze(size, full=True)

    def _freeze(self, size: int, full: bool) -> None:
        t0 = time.perf_counter()
        if full:
            gc.unfreeze()
        gc.collect(2 if full else 1)
        gc.freeze()
        self._frozen_size = size
        log.event(
            "gc_frozen",
            size=size,
            full=full,
            objects=gc.get_freeze_count(),
            ms=round((time.perf_counter() - t0) * 1000, 1),
        )

    def take_stats(self) -> tuple[int, float]:
        """(collections, longest pause in ms) since the last call."""
        stats = self._collections, round(self._max_pause_s * 1000, 1)
        self._collections, self._max_pause_s = 0, 0.0
        return stats
