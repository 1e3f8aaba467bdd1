"""The management side of the workers' ZeroMQ layer: one table, many inference workers.

The rule: every worker holds a full copy of the table. A worker asks for a snapshot when it
starts and whenever it sees it missed a revision; a management write returns only once every
live worker acknowledged the new revision, so after a successful RPC no worker routes by the
old table. A worker that does not acknowledge in time turns the write into UNAVAILABLE
(:class:`WorkersUnavailable`) rather than a silent divergence.

Three ipc sockets in a private directory (:func:`codec.addresses`):

- ROUTER: a worker's hello (index, pid, its link's token) is answered with the current snapshot.
  The first hello from a link makes the worker *live*; a hello from a new link with the same
  index (a restarted worker) replaces it; :meth:`WorkerHub.forget` ends it.
- PUB: every new state in full (tables are small, and a full state per revision makes a lost
  message harmless), a beat every ``beat_s`` with the current revision (level-triggered: a worker
  that missed anything sees a newer revision and asks for a snapshot) and every live worker's
  loads every ``loads_s``.
- PULL: acks, each worker's loads (with its admission: requests running and queued, which the
  congestion alarm sums), "serving" (it listens on the inference port), precision samples.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import stat
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

import zmq
import zmq.asyncio

from motor_mesh.common import log, tasks
from motor_mesh.coordinator.precision.groups import Completed
from motor_mesh.coordinator.table import TableState
from motor_mesh.coordinator.workers import codec
from motor_mesh.coordinator.workers.shares import DemandShares, decode_demand
from motor_mesh.coordinator.workers.shares import encode as encode_parts

BEAT_S = 0.5
LOADS_S = 0.1
PARTS_S = 0.5
# Pids of workers that were forgotten, kept so a hello still queued from a dead process cannot
# make it live again. Bounded: only the most recent restarts can still have messages in flight.
_DEAD_KEPT = 256

K = TypeVar("K")
SampleSink = Callable[[int, int, Completed], None]


class WorkersUnavailable(Exception):
    """Live workers did not acknowledge ``revision`` in time. The hub keeps the new state (a
    worker that comes back gets it in its snapshot) until it publishes another; the write is
    reported as UNAVAILABLE."""

    def __init__(self, revision: int, missing: list[int]) -> None:
        super().__init__(
            f"inference worker(s) {', '.join(map(str, missing))} did not acknowledge "
            f"table revision {revision}"
        )
        self.revision = revision
        self.missing = missing


@dataclass
class _Worker:
    index: int
    pid: int
    token: int
    acked: int = -1  # the newest revision it acknowledged
    loads: dict[int, int] = field(default_factory=dict)
    legs: dict[int, int] = field(default_factory=dict)  # in flight per instance id
    reported: int = -1  # the table revision it routed by when it sent its last report
    running: int = 0  # its admission as last reported: requests holding a slot,
    queued: int = 0  # and requests waiting for one
    serving: bool = False  # it said it listens on the inference port


def _check_private(sock_dir: str) -> None:
    """Anyone who can connect to the sockets could acknowledge revisions or feed samples, so
    the directory must be this user's alone (the caller creates it with mode 0700)."""
    st = os.stat(sock_dir)
    if not stat.S_ISDIR(st.st_mode):
        raise NotADirectoryError(sock_dir)
    if st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise PermissionError(
            f"worker socket directory {sock_dir} must be owned by uid {os.getuid()} with mode 0700 "
            f"(is uid {st.st_uid}, mode {stat.S_IMODE(st.st_mode):o})"
        )


def _remember(kept: dict[K, None], key: K) -> None:
    """Add ``key`` to an insertion-ordered set bounded to the newest _DEAD_KEPT keys."""
    kept[key] = None
    while len(kept) > _DEAD_KEPT:
        del kept[next(iter(kept))]


class WorkerHub:
    def __init__(
        self,
        sock_dir: str,
        ack_timeout_s: float = 5.0,
        *,
        on_sample: SampleSink | None = None,
        beat_s: float = BEAT_S,
        loads_s: float = LOADS_S,
    ) -> None:
        self.sock_dir = sock_dir
        self.addresses = codec.addresses(sock_dir)
        self.ack_timeout_s = ack_timeout_s
        self.on_sample = on_sample
        self.beat_s = beat_s
        self.loads_s = loads_s
        # Tells this hub from one that replaced it on the same sockets: a worker that sees a
        # different incarnation has a table from a dead process and must not keep serving it.
        self.incarnation = os.urandom(8)
        self._state = TableState()
        self.settings_generation = 0  # of the workers' settings file (pool.reconfigure)
        self.shares = DemandShares()  # each worker's part of every rate-limit bucket
        self._encoded = codec.encode_state(self._state)
        self._workers: dict[int, _Worker] = {}
        self._dead: dict[tuple[int, int], None] = {}  # (index, pid), oldest first
        self._dead_tokens: dict[int, None] = {}
        self._changed = asyncio.Event()
        self._ctx: zmq.asyncio.Context | None = None
        self._router: zmq.asyncio.Socket | None = None
        self._pub: zmq.asyncio.Socket | None = None
        self._pull: zmq.asyncio.Socket | None = None
        self._tasks: list[asyncio.Task[None]] = []

    # ---- life cycle ----------------------------------------------------------------------------

    async def start(self) -> None:
        _check_private(self.sock_dir)
        ctx = zmq.asyncio.Context()
        self._ctx = ctx
        try:
            self._router = self._bind(ctx, zmq.ROUTER, self.addresses.snapshot)
            self._pub = self._bind(ctx, zmq.PUB, self.addresses.publish)
            self._pull = self._bind(ctx, zmq.PULL, self.addresses.report)
        except BaseException:
            await self.close()
            raise
        self._tasks = [
            tasks.spawn("worker_hub_hellos", self._serve_hellos),
            tasks.spawn("worker_hub_reports", self._serve_reports),
            tasks.spawn("worker_hub_beat", self._beat),
            tasks.spawn("worker_hub_loads", self._share_loads),
            tasks.spawn("worker_hub_parts", self._share_parts),
        ]
        log.event("worker_hub_started", sock_dir=self.sock_dir, revision=self._state.revision)

    @staticmethod
    def _bind(ctx: zmq.asyncio.Context, kind: int, address: str) -> zmq.asyncio.Socket:
        sock = ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        try:
            sock.bind(address)
        except BaseException:
            sock.close(linger=0)  # an open socket would keep the context's term() waiting
            raise
        return sock

    async def close(self) -> None:
        for task in self._tasks:
            await tasks.cancel_quietly(task)
        self._tasks = []
        for sock in (self._router, self._pub, self._pull):
            if sock is not None:
                sock.close(linger=0)
        self._router = self._pub = self._pull = None
        if self._ctx is not None:
            self._ctx.term()  # every socket is closed with linger 0: returns at once
            self._ctx = None
        for address in self.addresses:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(codec.ipc_path(address))
        self._workers.clear()
        self._notify()

    # ---- the table ------------------------------------------------------------------------------

    @property
    def state(self) -> TableState:
        return self._state

    def set_state(self, state: TableState) -> None:
        """Make ``state`` the snapshot workers get, without publishing it (before workers exist,
        or to let the beat carry it: a worker sees the newer revision and asks)."""
        if state.revision < self._state.revision:
            raise ValueError(f"revision {state.revision} is older than the hub's {self._state.revision}")
        self._encoded = codec.encode_state(state)
        self._state = state

    async def publish(self, state: TableState) -> None:
        """Publish ``state`` and return once every live worker acknowledged its revision (or a
        newer one); raise :class:`WorkersUnavailable` naming the others after ``ack_timeout_s``.

        A worker that joins meanwhile gets the new state in its snapshot and must acknowledge it
        too; one that is forgotten (its process exited) is no longer waited for."""
        await self.announce(state)
        await self._acked_by_all(state.revision)

    async def announce(self, state: TableState) -> None:
        """Publish ``state`` (unless the hub has a newer one) without waiting for the acks."""
        if state.revision >= self._state.revision:
            self.set_state(state)
            if self._pub is not None:
                await self._pub.send_multipart([codec.STATE, self.incarnation, self._encoded])

    async def _acked_by_all(self, revision: int) -> None:
        deadline = asyncio.get_running_loop().time() + self.ack_timeout_s
        while True:
            changed = self._changed
            missing = sorted(i for i, w in self._workers.items() if w.acked < revision)
            if not missing:
                return
            left = deadline - asyncio.get_running_loop().time()
            if left <= 0:
                pids = [self._workers[i].pid for i in missing]
                log.warn("workers_unavailable", revision=revision, missing=missing, pids=pids)
                raise WorkersUnavailable(revision, missing)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(changed.wait(), left)

    # ---- workers --------------------------------------------------------------------------------

    def live(self) -> dict[int, int]:
        """index -> pid of every live worker."""
        return {i: w.pid for i, w in sorted(self._workers.items())}

    def acked(self) -> dict[int, int]:
        """index -> the newest revision each live worker acknowledged (-1: none yet)."""
        return {i: w.acked for i, w in sorted(self._workers.items())}

    def legs(self, since: int = 0) -> tuple[dict[int, int], int]:
        """Legs in flight per instance id, every live worker's summed as last reported, and how
        many workers last reported before they routed by revision ``since`` (their counts may
        miss a request they were still sending to an instance that has since left routing)."""
        total: dict[int, int] = {}
        behind = 0
        for w in self._workers.values():
            behind += w.reported < since
            for iid, n in w.legs.items():
                total[iid] = total.get(iid, 0) + n
        return total, behind

    def admission(self) -> tuple[int, int]:
        """Requests running and queued in every live worker together, as last reported (a
        forgotten worker's numbers leave the sums with it)."""
        running = queued = 0
        for w in self._workers.values():
            running += w.running
            queued += w.queued
        return running, queued

    def serving(self) -> dict[int, int]:
        """index -> pid of every live worker that said it listens (:meth:`WorkerLink.serving`)."""
        return {i: w.pid for i, w in sorted(self._workers.items()) if w.serving}

    async def wait_live(self, n: int, timeout: float) -> None:  # noqa: ASYNC109  (a start-up bound)
        """Wait until at least ``n`` workers are live; TimeoutError naming how many are."""
        await self._wait_count(self.live, n, timeout, "live")

    async def wait_serving(self, n: int, timeout: float) -> None:  # noqa: ASYNC109  (a start-up bound)
        """Wait until at least ``n`` live workers are serving; TimeoutError naming how many are."""
        await self._wait_count(self.serving, n, timeout, "serving")

    async def _wait_count(
        self,
        which: Callable[[], dict[int, int]],
        n: int,
        timeout: float,  # noqa: ASYNC109
        what: str,
    ) -> None:
        deadline = asyncio.get_running_loop().time() + timeout
        while len(which()) < n:
            changed = self._changed
            left = deadline - asyncio.get_running_loop().time()
            if left <= 0:
                raise TimeoutError(f"{len(which())} of {n} inference workers {what} after {timeout}s")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(changed.wait(), left)

    def forget(self, index: int, pid: int | None = None) -> None:
        """Worker ``index`` is gone (its process exited): stop waiting for its acks and drop its
        loads. With ``pid``, only that process is forgotten (a newer worker with the same index
        stays live), and a hello it may still have queued is ignored."""
        if pid is not None:
            _remember(self._dead, (index, pid))
        worker = self._workers.get(index)
        if worker is None or (pid is not None and worker.pid != pid):
            return
        del self._workers[index]
        _remember(self._dead_tokens, worker.token)
        log.event("worker_forgotten", index=index, pid=worker.pid, acked=worker.acked)
        self._notify()

    def _notify(self) -> None:
        """Wake everything waiting on the set of workers or their acks."""
        self._changed.set()
        self._changed = asyncio.Event()

    def _hello(self, index: int, token: int, pid: int) -> bool:
        """Whether the hello is answered (a dead process's hello is not)."""
        if token in self._dead_tokens or (index, pid) in self._dead:
            log.warn("worker_hello_ignored", index=index, pid=pid, why="worker was forgotten")
            return False
        current = self._workers.get(index)
        if current is not None and current.token == token:
            return True  # a worker that missed a revision asks again
        if current is not None:
            _remember(self._dead_tokens, current.token)
            log.event("worker_replaced", index=index, pid=pid, old_pid=current.pid)
        self._workers[index] = _Worker(index, pid, token)
        log.event("worker_joined", index=index, pid=pid, revision=self._state.revision)
        self._notify()
        return True

    def _peer(self, data: bytes) -> _Worker | None:
        index, token = codec.unpack_peer(data)
        worker = self._workers.get(index)
        return worker if worker is not None and worker.token == token else None

    # ---- loops ----------------------------------------------------------------------------------

    async def _serve_hellos(self) -> None:
        assert self._router is not None
        while True:
            frames = await self._router.recv_multipart()
            try:
                if len(frames) != 4 or frames[1] != codec.HELLO:
                    raise codec.CodecError(f"{len(frames)} frames, kind {frames[1][:16]!r}")
                index, token = codec.unpack_peer(frames[2])
                pid = codec.unpack_u64(frames[3])
            except (codec.CodecError, IndexError) as exc:
                log.warn("worker_message_bad", socket="snapshot", error=str(exc))
                continue
            if self._hello(index, token, pid):
                await self._router.send_multipart([frames[0], codec.STATE, self.incarnation, self._encoded])

    async def _serve_reports(self) -> None:
        assert self._pull is not None
        while True:
            frames = await self._pull.recv_multipart()
            try:
                if len(frames) != 3:
                    raise codec.CodecError(f"{len(frames)} frames")
                self._report(*frames)
            except codec.CodecError as exc:
                log.warn("worker_message_bad", socket="report", kind=frames[0][:16], error=str(exc))

    def _report(self, kind: bytes, peer: bytes, body: bytes) -> None:
        if kind == codec.SAMPLE:
            # A sample is a fact about an engine pair whoever reported it, even a worker that
            # has exited since: it is delivered regardless of liveness.
            p, d, completed = codec.decode_sample(body)
            if self.on_sample is not None:
                try:
                    self.on_sample(p, d, completed)
                except Exception:
                    log.exception("worker_sample_failed", p=p, d=d)
            return
        worker = self._peer(peer)  # anything else from a forgotten worker is stale
        if kind == codec.ACK:
            revision = codec.unpack_u64(body)
            if worker is not None and revision > worker.acked:
                worker.acked = revision
                self._notify()
        elif kind == codec.LOADS:
            report = codec.decode_report(body)
            if worker is not None:
                worker.loads, worker.legs, worker.reported = report.loads, report.legs, report.revision
                worker.running, worker.queued = report.running, report.queued
        elif kind == codec.DEMAND:
            if worker is not None:
                try:
                    self.shares.add(worker.index, decode_demand(body))
                except ValueError as exc:
                    raise codec.CodecError(f"demand: {exc}") from None
        elif kind == codec.SERVING:
            if worker is not None and not worker.serving:
                worker.serving = True
                self._notify()
        else:
            raise codec.CodecError(f"unknown kind {kind[:16]!r}")

    async def _beat(self) -> None:
        while True:
            await self.beat_now()
            await asyncio.sleep(self.beat_s)

    async def beat_now(self) -> None:
        """The table revision and settings generation every worker must hold."""
        assert self._pub is not None
        revision, generation = codec.pack_u64(self._state.revision), codec.pack_u64(self.settings_generation)
        await self._pub.send_multipart([codec.BEAT, self.incarnation, revision, generation])

    async def _share_parts(self) -> None:
        """Every PARTS_S, the parts of the rate-limit buckets that moved (shares.py)."""
        assert self._pub is not None
        while True:
            await asyncio.sleep(PARTS_S)
            changed = self.shares.round(self._workers)
            if changed:
                await self._pub.send_multipart([codec.PARTS, self.incarnation, encode_parts(changed)])

    async def _share_loads(self) -> None:
        """Every live worker's loads (even none: a worker that left must leave the sums)."""
        assert self._pub is not None
        while True:
            await asyncio.sleep(self.loads_s)
            if self._workers:
                body = codec.encode_worker_loads({i: w.loads for i, w in self._workers.items()})
                await self._pub.send_multipart([codec.LOADS, self.incarnation, body])
