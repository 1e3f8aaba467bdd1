"""GcGuard: the long-lived heap is frozen as it grows, reclaimed when it shrinks, and pauses are
measured (services/common/gcpolicy.py)."""

from __future__ import annotations

import gc
import time
import weakref
from collections.abc import Iterator

import pytest

from motor_mesh.common.gcpolicy import GcGuard


@pytest.fixture
def guard() -> Iterator[GcGuard]:
    gc.unfreeze()
    g = GcGuard()
    yield g
    g.close()
    gc.unfreeze()


class Node:
    """A cyclic record, like a Member and its Instance."""

    def __init__(self) -> None:
        self.me = self


def test_growth_freezes_what_is_alive(guard: GcGuard) -> None:
    guard.settle(10)  # too small a working set to bother
    assert gc.get_freeze_count() == 0
    kept = [Node() for _ in range(1000)]
    guard.settle(1000)
    frozen = gc.get_freeze_count()
    assert frozen >= len(kept)
    guard.settle(1100)  # under a quarter more: nothing to do
    assert gc.get_freeze_count() == frozen
    more = [Node() for _ in range(1000)]
    guard.settle(2000)
    assert gc.get_freeze_count() >= frozen + len(more)


def test_shrink_reclaims_frozen_garbage(guard: GcGuard) -> None:
    nodes = [Node() for _ in range(1000)]
    refs = [weakref.ref(n) for n in nodes]
    guard.settle(1000)
    del nodes  # cyclic garbage inside the permanent generation: no collection can see it
    gc.collect()
    assert all(r() is not None for r in refs)
    guard.settle(100)  # the working set shrank: a full reclaim
    assert all(r() is None for r in refs)


class SlowToFree:
    """Cyclic garbage whose finalizer takes ``ms``: only a collection frees it, and the
    collection's pause includes the finalizer."""

    def __init__(self, ms: float) -> None:
        self.me = self
        self.ms = ms

    def __del__(self) -> None:
        time.sleep(self.ms / 1000)


def test_collections_and_pauses_are_reported(guard: GcGuard) -> None:
    guard.take_stats()
    SlowToFree(20)
    gc.collect()
    collections, longest_ms = guard.take_stats()
    assert collections >= 1
    assert 20 <= longest_ms < 5000  # the collection that ran the 20 ms finalizer, measured
    assert guard.take_stats() == (0, 0.0)
