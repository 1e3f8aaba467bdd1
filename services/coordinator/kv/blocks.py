"""kv_aware's request path and the index's per-block work in C, where it was built, else the
Python it mirrors.

Tokenizing a chat, hashing its blocks and looking them up in the shared index are a few
microseconds each in a tight loop, and several times that in a Coordinator between two
requests, when the machine's other processes have evicted its CPU caches: Python's objects and
bytecode are then fetched from memory again, per request. ``_speedups.c`` does the same work
over flat memory. Following the events, an engine's batch holds and releases a hundred blocks
when its cache churns: the per-block loops (:func:`hold`, :func:`release`, the shared tables'
writes) run there too, without the interpreter's dispatch per block. It is built by ``pip
install`` where a C compiler is present (an optional extension); without one, these functions
run the Python references, which define what the C computes and which the tests compare it with.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from typing import TypeVar

from motor_mesh.coordinator.kv.hashing import ROOT
from motor_mesh.coordinator.kv.hashing import chain as py_chain

K = TypeVar("K", bound=Hashable)  # an engine's block hash

try:
    from motor_mesh.coordinator.kv import _speedups as native
except ImportError:  # no C compiler at install time
    native = None  # type: ignore[assignment]


def chain(ids: Sequence[int], block_size: int, parent: int = ROOT) -> Sequence[int]:
    """:func:`~.hashing.chain`; in C for ids that fit 64 bits (all an engine has)."""
    if native is not None:
        try:
            if isinstance(ids, list) or (isinstance(ids, array) and ids.typecode in "ilq"):
                return native.chain(ids, block_size, parent)
            return native.chain(array("q", ids), block_size, parent)
        except (OverflowError, TypeError):  # not 64-bit ints: Python's hash takes any
            return array("q", py_chain(ids, block_size, parent))
    return py_chain(ids, block_size, parent)


def held(slots: memoryview, has: Callable[[int], bool], hashes: Sequence[int]) -> int:
    """How many of ``hashes``, from the first, the table over ``slots`` (whose lookup is
    ``has``) holds; in C for an ``array`` of hashes."""
    if native is not None and isinstance(hashes, array):
        return native.held(slots, hashes)
    return held_run(has, hashes) if hashes and has(hashes[0]) else 0


def held_run(has: Callable[[int], bool], hashes: Sequence[int]) -> int:
    """The length of the leading run of ``hashes`` that ``has``, ``hashes[0]`` known held, by
    bisection (see :meth:`KvIndex.match`)."""
    lo, hi = 1, len(hashes)  # hashes[lo - 1] is held; the run ends at hi at most
    if has(hashes[hi - 1]):
        return hi
    hi -= 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if has(hashes[mid - 1]):
            lo = mid
        else:
            hi = mid - 1
    return lo


def hold(
    ours: OrderedDict[K, int],
    refs: dict[int, int],
    changes: dict[int, bool],
    engine_hashes: list[K],
    hashes: Sequence[int],
    bound: int,
) -> tuple[int, int]:
    """A stored chain into one endpoint's blocks (:class:`~.index.KvIndex`): ``ours`` maps each
    engine hash to ours, oldest stored first, at most ``bound`` of them; ``refs`` counts the
    engine hashes standing for each of ours; ``changes`` gets each of ours the endpoint now holds
    (True) or no longer holds (False). Returns (the change in hashes held, engine hashes
    forgotten for the bound)."""
    if native is not None and isinstance(hashes, array) and type(engine_hashes) is list:
        return native.hold(ours, refs, changes, engine_hashes, hashes, bound)
    size = evicted = 0
    for engine_hash, h in zip(engine_hashes, hashes, strict=True):
        before = ours.get(engine_hash)
        if before is not None:
            ours.move_to_end(engine_hash)
            if before == h:
                continue
            ours[engine_hash] = h
            size += _release(refs, changes, before)
        else:
            ours[engine_hash] = h
            if len(ours) > bound:
                size += _release(refs, changes, ours.popitem(last=False)[1])
                evicted += 1
        count = refs.get(h, 0)
        refs[h] = count + 1
        if count == 0:
            size += 1
            changes[h] = True
    return size, evicted


def release(
    ours: OrderedDict[K, int], refs: dict[int, int], changes: dict[int, bool], engine_hashes: list[K]
) -> int:
    """An engine's removed blocks out of one endpoint's (see :func:`hold`); those it does not
    know are skipped. Returns the change in hashes held."""
    if native is not None and type(engine_hashes) is list:
        return native.release(ours, refs, changes, engine_hashes)
    size = 0
    for engine_hash in engine_hashes:
        h = ours.pop(engine_hash, None)
        if h is not None:
            size += _release(refs, changes, h)
    return size


def _release(refs: dict[int, int], changes: dict[int, bool], h: int) -> int:
    count = refs[h]
    if count > 1:
        refs[h] = count - 1
        return 0
    del refs[h]
    changes[h] = False
    return -1
