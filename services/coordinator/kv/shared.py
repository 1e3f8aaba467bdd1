"""The KV index of a Coordinator with inference workers, in memory they all map.

With ``workers > 1`` the management process alone follows the engines' events and keeps the
index (:mod:`.index`); it mirrors which of Motor's block hashes each endpoint holds into files
of its private directory that every worker maps read-only. A worker's routing decision then
reads that memory directly: no round trip, and no event work in the workers, whose CPU belongs
to the requests. (A copy per worker, fed by its own subscriptions, was measured first: every
worker decoded and applied every batch, and that work landed on the requests' critical path.)

The files (``<dir>/kv/``):

- ``endpoints``: which file holds which endpoint, as JSON behind a generation count the writer
  makes odd while it rewrites the JSON (a reader seeing it odd, or changed under it, tries again
  on its next refresh);
- one file per endpoint: a header page (capacity, block size, blocks held) then ``capacity``
  64-bit slots, an open-addressing set of the endpoint's block hashes (0 marks an empty slot),
  linear probing, deletion by shifting later entries back (no tombstones). Its space is
  allocated when it is created: a full file system fails that, and the endpoint is routed by
  load, instead of a later write into a file with no room killing the process (SIGBUS).

A table starts small (``MIN_CAPACITY`` slots) and is replaced by one at least four times what
it holds once it is more than half full (:mod:`.feed` makes the new file off the event loop, fills it from
the index and swaps it in), up to twice the index's bound per endpoint, which the index never
exceeds. A table sized to what its engine holds is what the management process writes on every
event and a worker probes on every request: a churning engine's batch of 130 changes took 17 µs
of writes into the 4 MiB table the default bound once allocated up front, 4 µs into one sized to
its engine, whose slots stay in the CPU caches. Until the swap, the old table takes adds up to
7/8 of its slots and then skips them (the new one gets them from the index), so it is never
full and every probe ends.

They live in the Coordinator's private directory (:mod:`motor_mesh.common.scratch`), and go with it.

A reader can race the writer: it may miss a hash that is being shifted, or read a block count a
moment old. Either costs one routing hint, never a wrong answer, as with any staleness of the
events themselves.
"""

from __future__ import annotations

import contextlib
import functools
import json
import mmap
import os
import shutil
from collections.abc import Collection, Hashable, Iterable, Sequence

from motor_mesh.coordinator.kv.blocks import held
from motor_mesh.coordinator.kv.prompt import Placer, PromptView, place
from motor_mesh.coordinator.routes import Upstream

DIRECTORY = "endpoints"
DIRECTORY_BYTES = 1 << 20
HEADER = mmap.PAGESIZE // 8  # int64s: capacity, block size, blocks held; the slots start a page in
_CAPACITY, _BLOCK_SIZE, _BLOCKS = 0, 1, 2
MIN_CAPACITY = 1024


def capacity_for(max_blocks: int) -> int:
    """Slots for an endpoint holding at most ``max_blocks``: a power of two, at most half full."""
    n = MIN_CAPACITY
    while n < 2 * max_blocks:
        n *= 2
    return n


def room(capacity: int) -> int:
    """The most hashes a table of ``capacity`` slots takes: never full, so every probe ends."""
    return capacity - capacity // 8


# Every page mapped up front (both calls are made off the event loop): a lookup probes slots
# at random, and a page a worker touched first on a request's path cost that request a page
# fault (the benchmark's workers took about two per request before this).
_POPULATE = getattr(mmap, "MAP_POPULATE", 0)


def _map(path: str, size: int | None = None) -> mmap.mmap:
    """Map ``path`` read-only; with ``size``, create it that large first, its space allocated
    (OSError if there is no room), and map it to write."""
    if size is None:
        fd = os.open(path, os.O_RDONLY)
        try:
            return mmap.mmap(fd, 0, flags=mmap.MAP_SHARED | _POPULATE, prot=mmap.PROT_READ)
        finally:
            os.close(fd)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        try:
            os.posix_fallocate(fd, 0, size)
        except OSError:
            os.unlink(path)
            raise
        return mmap.mmap(fd, 0, flags=mmap.MAP_SHARED | _POPULATE)
    finally:
        os.close(fd)


class Table:
    """One endpoint's set of block hashes, over a mapped file."""

    __slots__ = ("_mm", "file", "head", "mask", "path", "slots")

    def __init__(self, path: str, mm: mmap.mmap) -> None:
        self.path = path
        self._mm = mm
        self.file = memoryview(mm).cast("q")  # the header's int64s, then the slots
        self.head = self.file[:3]
        self.slots = self.file[HEADER:]
        self.mask = len(self.slots) - 1

    @classmethod
    def create(cls, path: str, capacity: int) -> Table:
        t = cls(path, _map(path, (HEADER + capacity) * 8))
        t.head[_CAPACITY] = capacity
        return t

    @classmethod
    def attach(cls, path: str) -> Table:
        return cls(path, _map(path))

    def close(self) -> None:
        for view in (self.slots, self.head, self.file):
            view.release()
        self._mm.close()

    # -- reading ----------------------------------------------------------------------------

    def has(self, h: int) -> bool:
        # The probe loop of _slot, inline: this is the workers' request path.
        slots, mask = self.slots, self.mask
        key = h or 1
        i = key & mask
        while True:
            s = slots[i]
            if s == key:
                return True
            if not s:
                return False
            i = (i + 1) & mask

    @property
    def block_size(self) -> int:
        return self.head[_BLOCK_SIZE]

    @property
    def blocks(self) -> int:
        return self.head[_BLOCKS]

    @property
    def capacity(self) -> int:
        return self.mask + 1

    @property
    def crowded(self) -> bool:
        """More than half full: probes lengthen, and past :func:`room` adds are skipped."""
        return 2 * self.head[_BLOCKS] > self.mask + 1

    # -- writing (the management process only) ------------------------------------------------

    def _slot(self, key: int) -> int:
        """Where ``key`` is, or the empty slot that ends its probe run."""
        slots, mask = self.slots, self.mask
        i = key & mask
        while slots[i] and slots[i] != key:
            i = (i + 1) & mask
        return i

    def update(self, changes: dict[int, bool]) -> None:
        """Hold each hash ``changes`` maps to True and none it maps to False. (An engine's
        batch changes hundreds: the adds' probe loop is written out here, without a call each.)"""
        slots, mask, head = self.slots, self.mask, self.head
        limit = room(mask + 1)
        for h, hold in changes.items():
            if not hold:
                self._remove(h)
                continue
            key = h or 1
            i = key & mask
            while True:
                s = slots[i]
                if s == key:
                    break
                if not s:
                    if head[_BLOCKS] < limit:
                        slots[i] = key
                        head[_BLOCKS] += 1
                    break
                i = (i + 1) & mask

    def _remove(self, h: int) -> None:
        slots, mask = self.slots, self.mask
        i = self._slot(h or 1)
        if not slots[i]:
            return
        # Shift back each later entry of the run that may live at i (its home slot is not
        # cyclically within (i, j]), so that no lookup meets the hole before its entry.
        j = i
        while True:
            j = (j + 1) & mask
            s = slots[j]
            if not s:
                break
            home = s & mask
            if (home <= i < j) or (i < j < home) or (j < home <= i):
                slots[i] = s
                i = j
        slots[i] = 0
        self.head[_BLOCKS] -= 1

    def clear(self) -> None:
        # Zeros written (about a millisecond for the default bound's 4 MiB), not the pages
        # freed: a freed page would need room again when next written.
        zeros = bytes(1 << 20)
        mm = self._mm
        for at in range(HEADER * 8, len(mm), len(zeros)):
            mm[at : at + len(zeros)] = zeros[: len(mm) - at]
        self.head[_BLOCKS] = 0

    def set_block_size(self, size: int) -> None:
        if self.head[_BLOCK_SIZE] != size:
            self.head[_BLOCK_SIZE] = size


class SharedWriter:
    """The management process's side: a :class:`Table` per endpoint and the directory. Tables
    are created and unlinked off the event loop (:meth:`create`, :meth:`unlink`); the index's
    changes (:meth:`update`, :meth:`clear`) only write memory."""

    def __init__(self, directory: str, max_blocks_per_endpoint: int) -> None:
        self.dir = os.path.join(directory, "kv")
        self.max_capacity = capacity_for(max_blocks_per_endpoint)
        self._tables: dict[Hashable, Table] = {}
        # Endpoints whose table is crowded and may grow: the feed replaces their tables.
        self.crowded: set[Hashable] = set()
        self._dir: mmap.mmap | None = None
        self._n = 0

    def open(self) -> None:
        """Create the directory and its file (blocking: call it off the event loop)."""
        os.mkdir(self.dir, 0o700)
        self._dir = _map(os.path.join(self.dir, DIRECTORY), DIRECTORY_BYTES)
        self._publish()

    def create(self, ep: Hashable, capacity: int = MIN_CAPACITY) -> Table:
        """A new, empty table file for ``ep`` (blocking); :meth:`install` makes it ``ep``'s."""
        self._n += 1
        return Table.create(os.path.join(self.dir, f"ep-{self._n}"), min(capacity, self.max_capacity))

    def table(self, ep: Hashable) -> Table | None:
        return self._tables.get(ep)

    def grown(self, blocks: int) -> int:
        """The capacity of the table that replaces a crowded one holding ``blocks``."""
        return min(capacity_for(2 * blocks), self.max_capacity)

    def install(self, ep: Hashable, table: Table) -> Table | None:
        """Make ``table`` ``ep``'s and tell the readers; the table it replaces is returned,
        emptied, for :meth:`unlink`."""
        old = self.uninstall(ep)
        self._tables[ep] = table
        self._publish()
        return old

    def replace(self, ep: Hashable, table: Table, hashes: Iterable[int]) -> Table | None:
        """Make ``table``, filled with ``hashes`` (what the index says ``ep`` holds), ``ep``'s
        in place of a crowded one, which is returned for :meth:`unlink` as it is: a worker
        reads it until it sees the new directory, a moment of stale hints rather than none."""
        table.update(dict.fromkeys(hashes, True))
        old = self._tables.get(ep)
        if old is not None:
            table.set_block_size(old.block_size)
        self._tables[ep] = table
        self.crowded.discard(ep)
        self._note_crowded(ep, table)
        self._publish()
        return old

    def uninstall(self, ep: Hashable) -> Table | None:
        """Forget ``ep``'s table (emptied first: a reader that still maps it sees no blocks)."""
        table = self._tables.pop(ep, None)
        self.crowded.discard(ep)
        if table is not None:
            table.clear()
            self._publish()
        return table

    @staticmethod
    def unlink(table: Table) -> None:
        """Close and delete a table's file (blocking)."""
        table.close()
        with contextlib.suppress(FileNotFoundError):  # deleted already: what was asked
            os.unlink(table.path)

    def close(self) -> None:
        """Everything off (blocking): at stop."""
        for ep in list(self._tables):
            table = self.uninstall(ep)
            if table is not None:
                self.unlink(table)
        if self._dir is not None:
            self._dir.close()
            self._dir = None
        shutil.rmtree(self.dir, ignore_errors=True)

    def _publish(self) -> None:
        if self._dir is None:
            return
        names = {str(ep): os.path.basename(t.path) for ep, t in self._tables.items()}
        data = json.dumps(names).encode()
        if len(data) > DIRECTORY_BYTES - 16:
            raise ValueError(f"{len(names)} endpoints do not fit the KV directory")
        head = memoryview(self._dir).cast("q")
        try:
            gen = head[0]
            head[0] = gen + 1  # odd: being rewritten
            head[1] = len(data)
            self._dir[16 : 16 + len(data)] = data
            head[0] = gen + 2
        finally:
            head.release()

    # -- the index's mirror --------------------------------------------------------------------

    def update(self, ep: Hashable, changes: dict[int, bool]) -> None:
        table = self._tables.get(ep)
        if table is not None:
            table.update(changes)
            self._note_crowded(ep, table)

    def _note_crowded(self, ep: Hashable, table: Table) -> None:
        if table.crowded and table.capacity < self.max_capacity:
            self.crowded.add(ep)

    def clear(self, ep: Hashable) -> None:
        table = self._tables.get(ep)
        if table is not None:
            table.clear()

    def block_size(self, ep: Hashable, size: int) -> None:
        table = self._tables.get(ep)
        if table is not None:
            table.set_block_size(size)


class SharedReader:
    """A worker's side: the index as the management process last wrote it, with the query
    methods of :class:`~motor_mesh.coordinator.kv.index.KvIndex` that ``kv_aware`` uses."""

    def __init__(self, directory: str) -> None:
        self.dir = os.path.join(directory, "kv")
        self._dir: mmap.mmap | None = None
        self._gen = 0
        self._tables: dict[Hashable, Table] = {}
        self.place: Placer = functools.partial(place, self.holder)

    # -- following the directory ----------------------------------------------------------------

    @property
    def mapped(self) -> bool:
        """Whether the directory is mapped: reading it is then a few memory reads."""
        return self._dir is not None

    def read_directory(self) -> tuple[int, dict[str, str]] | None:
        """The directory's generation and endpoints' file names, if it changed since the last
        :meth:`install` (blocking the first time: it maps the file); None if unchanged or
        mid-rewrite."""
        if self._dir is None:
            try:
                self._dir = _map(os.path.join(self.dir, DIRECTORY))
            except FileNotFoundError:
                return None
        head = memoryview(self._dir).cast("q")
        try:
            gen = head[0]
            if gen == self._gen or gen % 2:
                return None
            data = bytes(self._dir[16 : 16 + head[1]])
            if head[0] != gen:
                return None
        finally:
            head.release()
        names: dict[str, str] = json.loads(data)
        return gen, names

    def attach(self, names: dict[str, str]) -> dict[str, Table]:
        """Map the tables of ``names`` not mapped yet (blocking)."""
        current = {t.path for t in self._tables.values()}
        out = {}
        for ep, name in names.items():
            path = os.path.join(self.dir, name)
            if path in current:
                continue
            try:
                out[ep] = Table.attach(path)
            except FileNotFoundError:
                continue  # dropped since: the next directory says so, and no worker routes by it
        return out

    def install(self, gen: int, names: dict[str, str], opened: dict[str, Table]) -> None:
        """Swap in the directory just read (on the event loop: no request is mid-lookup)."""
        tables: dict[Hashable, Table] = {}
        for ep, name in names.items():
            path = os.path.join(self.dir, name)
            table = opened.get(ep)
            if table is None:
                table = next((t for t in self._tables.values() if t.path == path), None)
            if table is not None:
                tables[ep] = table
        for table in self._tables.values():
            if table not in tables.values():
                table.close()
        for ep, table in opened.items():
            if tables.get(ep) is not table:
                table.close()
        self._tables = tables
        self._gen = gen

    def close(self) -> None:
        for table in self._tables.values():
            table.close()
        self._tables = {}
        if self._dir is not None:
            # A refresh still reading it in its thread keeps it open: the process is stopping,
            # and the mapping goes with it.
            with contextlib.suppress(BufferError):
                self._dir.close()
            self._dir = None

    # -- queries ------------------------------------------------------------------------------

    def match(self, hashes: Sequence[int], eps: Collection[Hashable] | None = None) -> dict[Hashable, int]:
        """As :meth:`KvIndex.match`: the run of ``hashes`` each endpoint holds, by bisection."""
        if not hashes:
            return {}
        found: dict[Hashable, int] = {}
        tables = self._tables
        for ep in tables if eps is None else eps:
            table = tables.get(ep)
            if table is not None:
                run = held(table.has, hashes)
                if run:
                    found[ep] = run
        return found

    def holder(self, prompt: PromptView, endpoints: Sequence[Upstream]) -> tuple[int, Upstream | None]:
        """As :meth:`KvIndex.holder`."""
        cached, where = 0, None
        for ep in endpoints:
            table = self._tables.get(ep.base)
            size = table.block_size if table is not None else 0
            if table is None or not size or ep.down:
                continue
            tokens = held(table.has, prompt.hashes(size)) * size
            if tokens > cached:
                cached, where = tokens, ep
        return min(cached, prompt.n), where

    def endpoints(self) -> list[Hashable]:
        return list(self._tables)

    def endpoint_blocks(self, ep: Hashable) -> int:
        table = self._tables.get(ep)
        return table.blocks if table is not None else 0

    def block_size(self, ep: Hashable) -> int | None:
        table = self._tables.get(ep)
        size = table.block_size if table is not None else 0
        return size or None
