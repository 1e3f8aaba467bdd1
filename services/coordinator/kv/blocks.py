"""The index's per-block work: how far a prompt's chain runs in an endpoint's blocks, and an
engine's stored and removed blocks into them (:class:`~.index.KvIndex`)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from typing import TypeVar

K = TypeVar("K", bound=Hashable)  # an engine's block hash


def held(has: Callable[[int], bool], hashes: Sequence[int]) -> int:
    """How many of ``hashes``, from the first, ``has``."""
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
    fresh = dict.fromkeys(hashes, True)
    if (
        len(fresh) == len(hashes) == len(set(engine_hashes))
        and ours.keys().isdisjoint(engine_hashes)
        and refs.keys().isdisjoint(hashes)
    ):
        # The usual batch: distinct blocks this endpoint did not hold, in bulk (a new prompt's
        # chain is hundreds of them, and a loop in Python costs about a microsecond each).
        ours.update(zip(engine_hashes, hashes, strict=True))
        refs.update(dict.fromkeys(fresh, 1))
        changes.update(fresh)
        size, evicted = len(fresh), 0
        while len(ours) > bound:
            size += _release(refs, changes, ours.popitem(last=False)[1])
            evicted += 1
        return size, evicted
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
    size = 0
    pop = ours.pop
    for engine_hash in engine_hashes:  # _release written out: a batch removes hundreds
        h = pop(engine_hash, None)
        if h is None:
            continue
        count = refs[h]
        if count > 1:
            refs[h] = count - 1
        else:
            del refs[h]
            changes[h] = False
            size -= 1
    return size


def _release(refs: dict[int, int], changes: dict[int, bool], h: int) -> int:
    count = refs[h]
    if count > 1:
        refs[h] = count - 1
        return 0
    del refs[h]
    changes[h] = False
    return -1
