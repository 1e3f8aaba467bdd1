"""The simulated engine's prefix cache: vLLM's automatic prefix caching, minus the GPU.

A prompt's full blocks of `--block-size` tokens form a chain: each block's hash covers its
parent's hash and its own token ids, so a hash names a whole prefix. A request's cached prefix
is its leading blocks found in the cache; only the tokens after it are prefilled. Once prefilled,
the request's blocks are stored (the missing ones) or touched (the hits), and while the cache
holds more than `--num-gpu-blocks-override` blocks the least recently used one is evicted.

A chain is touched from its last block to its first, so the first is the most recent: deeper
blocks go before the prefixes they extend (vLLM frees a request's blocks in the same reverse
order), and a block never outlives its parent. Every change is published as KV events (one
batch per request) when `--kv-events-config` asks for them.

The hashes are computed once per distinct request (kept in its plan); a request then costs a
walk over them, and a repeat of the request stored last costs nothing.
"""

from __future__ import annotations

import hashlib
import sys
from array import array
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from motor_mesh.simengine import kv_events


@dataclass(frozen=True, slots=True, eq=False)
class Chain:
    """One prompt's full blocks: their hashes and their token ids (block_size per hash)."""

    hashes: tuple[int, ...]
    token_ids: list[int]


def seed_key(seed: int) -> bytes:
    """The hash key: engines started with different seeds name the same blocks differently, as
    vLLM engines with different hash seeds do."""
    return (seed & 0xFFFFFFFFFFFFFFFF).to_bytes(8, "little")


def make_chain(ids: list[int], block_size: int, key: bytes, max_blocks: int) -> Chain:
    """The chain of ``ids``' full blocks, at most ``max_blocks`` of them (a prompt longer than
    the whole cache caches its start). A block's hash: the unsigned 64-bit little-endian
    blake2b (8-byte digest, keyed) of its parent's hash (8 bytes, little-endian; nothing for the
    first block) and its token ids (32-bit, little-endian)."""
    n = min(len(ids) // block_size, max_blocks)
    keyed = hashlib.blake2b(digest_size=8, key=key)
    tokens = array("I", ids[: n * block_size])  # 32-bit wherever CPython runs
    if sys.byteorder == "big":
        tokens.byteswap()
    data = tokens.tobytes()
    step = 4 * block_size
    hashes: list[int] = []
    parent = b""
    for i in range(0, n * step, step):
        h = keyed.copy()  # the key is set up once
        h.update(parent)
        h.update(data[i : i + step])
        parent = h.digest()
        hashes.append(int.from_bytes(parent, "little"))
    return Chain(tuple(hashes), ids[: n * block_size])


class PrefixCache:
    """An LRU of block hashes (``key``: the hash key, :func:`seed_key`). ``emit``: receives
    each request's events as one batch."""

    def __init__(
        self,
        capacity: int,
        block_size: int,
        key: bytes = b"",
        emit: Callable[[list[Any]], None] | None = None,
    ) -> None:
        self.capacity = capacity
        self.block_size = block_size
        self.key = key
        self.emit = emit
        # Oldest first. An OrderedDict: eviction keeps deleting the oldest entry, which in a
        # plain dict makes finding the next one a walk over the deleted ones' tombstones.
        self._blocks: OrderedDict[int, None] = OrderedDict()
        # The chains stored last, while nothing else has changed: all theirs are cached and
        # already the most recent, so a repeat (a benchmark's one body) is answered at once.
        self._hot: tuple[Chain, ...] | None = None
        self._hot_tokens = 0

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, block: int) -> bool:
        return block in self._blocks

    def order(self) -> list[int]:
        """The cached blocks, next to be evicted first."""
        return list(self._blocks)

    def chain(self, ids: list[int]) -> Chain:
        return make_chain(ids, self.block_size, self.key, self.capacity)

    def hit_tokens(self, chains: tuple[Chain, ...]) -> int:
        """Tokens of the chains' cached prefixes."""
        if chains is self._hot:
            return self._hot_tokens
        blocks = self._blocks
        hit = 0
        for chain in chains:
            for h in chain.hashes:
                if h not in blocks:
                    break
                hit += 1
        return hit * self.block_size

    def store(self, chains: tuple[Chain, ...]) -> None:
        """Cache the chains' blocks after their prefill: store what is missing, touch the rest,
        evict what no longer fits; publish the changes as one batch."""
        if chains is self._hot:
            return
        events: list[Any] | None = [] if self.emit is not None else None
        total = 0
        for chain in chains:
            self._store(chain, events)
            total += len(chain.hashes)
        # Together they may not fit (each one alone does): then some may have been evicted.
        fits = total <= self.capacity
        self._hot, self._hot_tokens = (chains, total * self.block_size) if fits else (None, 0)
        if events and self.emit is not None:
            self.emit(events)

    def _store(self, chain: Chain, events: list[Any] | None) -> None:
        blocks = self._blocks
        hashes = chain.hashes
        new: list[tuple[int, int]] = []  # [start, end) runs of blocks not cached yet
        start = -1
        for i, h in enumerate(hashes):
            if h in blocks:
                if start >= 0:
                    new.append((start, i))
                    start = -1
            elif start < 0:
                start = i
        if start >= 0:
            new.append((start, len(hashes)))
        for h in reversed(hashes):
            blocks[h] = None
            blocks.move_to_end(h)
        evicted = []
        while len(blocks) > self.capacity:
            evicted.append(blocks.popitem(last=False)[0])
        if events is None:
            return
        if evicted:
            events.append(kv_events.removed(evicted))
        bs = self.block_size
        for s, e in new:
            parent = hashes[s - 1] if s else None
            events.append(kv_events.stored(list(hashes[s:e]), parent, chain.token_ids[s * bs : e * bs], bs))

    def clear(self) -> None:
        """Drop every block (`/reset_prefix_cache`); publishes AllBlocksCleared."""
        self._blocks.clear()
        self._hot, self._hot_tokens = None, 0
        if self.emit is not None:
            self.emit([kv_events.AllBlocksCleared()])
