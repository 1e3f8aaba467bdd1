"""Which engine holds which prefix blocks, from the engines' KV cache events.

Each endpoint's blocks are kept under Motor's chained hashes (:mod:`.hashing`), computed from
the tokens its ``BlockStored`` events carry, so a prompt's hashes can be looked up directly:
:meth:`KvIndex.match` says how many of a prompt's leading blocks each endpoint holds.

The engine's own hashes are kept too (mapped to ours): ``BlockRemoved`` names blocks by them,
and a stored chain names its parent by one. One of our hashes can stand for several engine
hashes (the same tokens cached twice, e.g. under two cache salts or LoRA adapters, which feed
the engine's hash but not ours), so each is counted per endpoint and a block is forgotten only
when the last engine hash for it is removed. (Such a block may not be reusable by a request with
another salt or adapter: the index can then overstate a hit, which costs only a routing choice.)

Memory is bounded per endpoint: past ``max_blocks_per_endpoint`` engine hashes the oldest stored
are forgotten first. Forgetting only makes the index claim less than an engine holds, which
costs a cache hit, never a wrong answer about what is cached.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Hashable, Iterable, MutableSequence, Sequence
from typing import Protocol

from motor_mesh.coordinator.kv.blocks import held_run, hold, release
from motor_mesh.coordinator.kv.hashing import ROOT, chain
from motor_mesh.coordinator.kv.prompt import PromptView, place
from motor_mesh.coordinator.kv.wire import BlockHash, Cleared, Event, Removed, Stored
from motor_mesh.coordinator.routes import Upstream

DEFAULT_MAX_BLOCKS = 262144


class Mirror(Protocol):
    """What else must know which of our hashes each endpoint holds (:mod:`.shared`)."""

    def update(self, ep: Hashable, changes: dict[int, bool]) -> None:
        """``ep`` now holds each hash ``changes`` maps to True, and none it maps to False."""

    def clear(self, ep: Hashable) -> None: ...

    def block_size(self, ep: Hashable, size: int) -> None: ...


class _Held:
    """One endpoint's blocks."""

    __slots__ = ("block_size", "ours", "refs")

    def __init__(self) -> None:
        # engine hash -> our hash, oldest stored first (what the bound forgets first)
        self.ours: OrderedDict[BlockHash, int] = OrderedDict()
        self.refs: dict[int, int] = {}  # our hash -> how many engine hashes stand for it
        self.block_size: int | None = None


class KvIndex:
    def __init__(
        self, max_blocks_per_endpoint: int = DEFAULT_MAX_BLOCKS, mirror: Mirror | None = None
    ) -> None:
        if max_blocks_per_endpoint < 1:
            raise ValueError("max_blocks_per_endpoint must be at least 1")
        self.max_blocks_per_endpoint = max_blocks_per_endpoint
        self.mirror = mirror
        self._held: dict[Hashable, _Held] = {}
        self.size = 0  # (block, endpoint) entries, our hashes
        self.orphans = 0  # stored chains skipped: their parent was not known
        self.mismatched = 0  # stored events skipped: their tokens did not fill their blocks
        self.evicted_by_bound = 0  # engine hashes forgotten for the memory bound
        # What the mirror must change, gathered over one event and handed over at once: each
        # hash's last change wins (a block released and held again within an event stays).
        self._changes: dict[int, bool] = {}

    # ---- events --------------------------------------------------------------------------------

    def apply(self, ep: Hashable, event: Event) -> None:
        try:
            if isinstance(event, Stored):
                self._store(ep, event)
            elif isinstance(event, Removed):
                held = self._held.get(ep)
                if held is not None:
                    self.size += release(held.ours, held.refs, self._changes, event.block_hashes)
            elif isinstance(event, Cleared):
                held = self._held.get(ep)
                if held is not None:
                    self.size -= len(held.refs)
                    held.ours.clear()
                    held.refs.clear()
                    if self.mirror is not None:
                        self.mirror.clear(ep)
        finally:
            if self._changes:
                if self.mirror is None:  # nobody to tell (one process): the dict is reused
                    self._changes.clear()
                else:
                    changes, self._changes = self._changes, {}
                    self.mirror.update(ep, changes)

    def apply_all(self, ep: Hashable, events: Iterable[Event]) -> None:
        for event in events:
            self.apply(ep, event)

    def drop(self, ep: Hashable) -> None:
        """Forget ``ep`` entirely (an engine gone for good)."""
        held = self._held.pop(ep, None)
        if held is not None:
            self.size -= len(held.refs)
            if self.mirror is not None:
                self.mirror.clear(ep)

    def _store(self, ep: Hashable, event: Stored) -> None:
        held = self._held.get(ep)
        if held is None:
            held = self._held[ep] = _Held()
        if held.block_size != event.block_size:
            held.block_size = event.block_size
            if self.mirror is not None:
                self.mirror.block_size(ep, event.block_size)
        if event.parent is None:
            parent = ROOT
        else:
            known = held.ours.get(event.parent)
            if known is None:
                # Stored before this index started (or forgotten since): the chain's tokens
                # alone cannot say which prefix it continues.
                self.orphans += 1
                return
            parent = known
        if len(event.token_ids) != event.block_size * len(event.block_hashes):
            self.mismatched += 1
            return
        try:
            hashes = chain(event.token_ids, event.block_size, parent)
        except OverflowError:  # an id no tokenizer gives (outside 32 bits): no key for it
            self.mismatched += 1
            return
        size, evicted = hold(
            held.ours, held.refs, self._changes, event.block_hashes, hashes, self.max_blocks_per_endpoint
        )
        self.size += size
        self.evicted_by_bound += evicted

    # ---- queries -------------------------------------------------------------------------------

    def match(self, hashes: Sequence[int], eps: Collection[Hashable] | None = None) -> dict[Hashable, int]:
        """How many leading blocks of ``hashes`` each endpoint (of ``eps``, if given) holds;
        endpoints holding none are left out.

        An engine's cached blocks of one chain are a leading run: vLLM frees a request's blocks
        last first and a prefix hit takes every block before it, so a block is never evicted
        before its child (SGLang evicts radix-tree leaves first, the simulated engine the deepest
        blocks first). So the run's end is found by bisection, in about log2(len(hashes)) probes
        rather than one per block: each probe is a trip to memory on a request path whose CPU
        caches other processes have just evicted."""
        if not hashes:
            return {}
        first = hashes[0]
        found: dict[Hashable, int] = {}
        candidates = (
            self._held.items()
            if eps is None
            else [(ep, held) for ep in eps if (held := self._held.get(ep)) is not None]
        )
        for ep, held in candidates:
            refs = held.refs
            if first in refs:
                found[ep] = held_run(refs.__contains__, hashes)
        return found

    def holder(self, prompt: PromptView, endpoints: Sequence[Upstream]) -> tuple[int, Upstream | None]:
        """The longest prefix of ``prompt`` (in tokens, at most all of it) that one of
        ``endpoints`` that is up holds, each hashed at its own block size, and that endpoint."""
        cached, where = 0, None
        for ep in endpoints:
            held = self._held.get(ep.base)
            if held is None or not held.block_size or ep.down:
                continue
            hashes = prompt.hashes(held.block_size)
            if hashes and hashes[0] in held.refs:
                tokens = held_run(held.refs.__contains__, hashes) * held.block_size
                if tokens > cached:
                    cached, where = tokens, ep
        return min(cached, prompt.n), where

    def place(self, prompt: PromptView, endpoints: Sequence[Upstream], tally: MutableSequence[int]) -> None:
        """:meth:`holder`, its answer written into ``prompt`` (``cached``, ``endpoint``) and
        added to ``tally`` (prompt tokens, cached tokens)."""
        place(self.holder, prompt, endpoints, tally)

    def endpoints(self) -> list[Hashable]:
        return list(self._held)

    def blocks(self, ep: Hashable) -> frozenset[int]:
        held = self._held.get(ep)
        return frozenset(held.refs) if held is not None else frozenset()

    def endpoint_blocks(self, ep: Hashable) -> int:
        held = self._held.get(ep)
        return len(held.refs) if held is not None else 0

    def block_size(self, ep: Hashable) -> int | None:
        """The block size ``ep``'s events last gave (what a prompt is hashed with for it)."""
        held = self._held.get(ep)
        return held.block_size if held is not None else None
