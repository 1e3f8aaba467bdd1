"""The worker side of the workers' ZeroMQ layer (see :mod:`.hub` for the rule and the sockets).

A worker serves only with a table: :meth:`WorkerLink.start` returns once the first snapshot is
applied. After that it applies every newer state the hub publishes, acknowledges each revision
once its ``on_state`` returned, and asks for a snapshot whenever a beat shows a revision it has
not seen (it missed a publication). A worker must never serve a stale table for long: when the
beats stop (the management process died) or come from another hub, ``on_lost`` is called and
the worker is expected to exit.

Everything it sends goes through one PUSH socket without ever blocking: an ack or a "serving"
that cannot be queued is sent again on the next beat, loads on the next tick; a precision sample
is dropped.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import time
from collections.abc import Callable

import zmq
import zmq.asyncio

from motor_mesh.common import log, tasks
from motor_mesh.coordinator.precision.groups import Completed
from motor_mesh.coordinator.table import TableState
from motor_mesh.coordinator.workers import codec
from motor_mesh.coordinator.workers.hub import BEAT_S, LOADS_S
from motor_mesh.coordinator.workers.shares import decode as decode_parts
from motor_mesh.coordinator.workers.shares import encode_demand

LOST_AFTER_S = 3.0  # no beat for this long: the hub (the management process) is gone
LOADS_REFRESH_S = 1.0  # unchanged loads are still sent this often (the hub may have restarted)
ASK_AGAIN_S = 1.0  # a snapshot request not answered within this is sent again
_DROP_LOG_EVERY = 1000

LoadsGetter = Callable[[], dict[int, int]]
AdmissionGetter = Callable[[], tuple[int, int]]  # requests running, requests queued


class WorkerLink:
    def __init__(
        self,
        sock_dir: str,
        index: int,
        on_state: Callable[[TableState], None],
        on_loads: Callable[[dict[int, int]], None],
        *,
        on_lost: Callable[[str], None] | None = None,
        on_settings: Callable[[int], None] | None = None,
        settings_generation: int = 0,
        on_parts: Callable[[dict[str, dict[int, float]]], None] | None = None,
        lost_after_s: float = LOST_AFTER_S,
        loads_s: float = LOADS_S,
    ) -> None:
        self.addresses = codec.addresses(sock_dir)
        self.index = index
        self.on_state = on_state
        self.on_loads = on_loads
        self.on_lost = on_lost
        # Told the generation of newer settings a beat announces (the pool rewrote its file).
        self.on_settings = on_settings
        self.settings_generation = settings_generation
        # Told this worker's new parts of the rate-limit buckets (shares.py).
        self.on_parts = on_parts
        self.lost_after_s = lost_after_s
        self.loads_s = loads_s
        self.pid = os.getpid()
        # Tells this link from a previous one with the same index (a restarted worker), even in
        # one process (tests), so the hub never credits one with the other's acks.
        self.token = secrets.randbits(64)
        self.revision = -1  # the applied table's revision; -1: none yet
        self.incarnation: bytes | None = None  # the hub's, from the first snapshot
        self.lost = False
        self.dropped_samples = 0
        self._peer = codec.pack_peer(index, self.token)
        self._ack_pending = False
        self._serving_pending = False
        self._asked_at = float("-inf")
        self._last_beat = time.monotonic()
        self._others: dict[int, int] | None = None
        self._ctx: zmq.asyncio.Context | None = None
        self._sub: zmq.asyncio.Socket | None = None
        self._dealer: zmq.asyncio.Socket | None = None
        self._push: zmq.Socket[bytes] | None = None
        self._tasks: list[asyncio.Task[None]] = []

    # ---- life cycle ----------------------------------------------------------------------------

    async def start(self, timeout_s: float = 10.0) -> None:
        """Connect and apply the first snapshot; TimeoutError if none came within ``timeout_s``
        (the link is closed then)."""
        try:
            await self._start(timeout_s)
        except BaseException:
            await self.close()
            raise

    async def _start(self, timeout_s: float) -> None:
        ctx = zmq.asyncio.Context()
        self._ctx = ctx
        # SUB first: whatever is published once the snapshot is taken reaches this link (or the
        # beat tells it what it missed while the subscription was still on its way).
        self._sub = ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.LINGER, 0)
        self._sub.setsockopt(zmq.SUBSCRIBE, b"")
        self._sub.connect(self.addresses.publish)
        self._dealer = ctx.socket(zmq.DEALER)
        self._dealer.setsockopt(zmq.LINGER, 0)
        self._dealer.connect(self.addresses.snapshot)
        # A plain socket: sends with NOBLOCK return or fail at once, so the request path can
        # send samples synchronously.
        self._push = zmq.Socket(ctx, zmq.PUSH)
        self._push.setsockopt(zmq.LINGER, 0)
        self._push.connect(self.addresses.report)

        deadline = time.monotonic() + timeout_s
        while self.revision < 0:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"no table snapshot from the management process within {timeout_s}s")
            await self._ask()  # again each ASK_AGAIN_S, also after a snapshot on_state refused
            try:
                frames = await asyncio.wait_for(self._dealer.recv_multipart(), min(left, ASK_AGAIN_S))
            except TimeoutError:
                continue
            self._on_state(frames, "snapshot")
        self._last_beat = time.monotonic()
        self._asked_at = float("-inf")
        log.event("worker_link_started", index=self.index, pid=self.pid, revision=self.revision)
        self._tasks = [
            tasks.spawn(f"worker_link_{self.index}_publications", self._serve_publications),
            tasks.spawn(f"worker_link_{self.index}_snapshots", self._serve_snapshots),
            tasks.spawn(f"worker_link_{self.index}_watchdog", self._watchdog),
        ]

    async def close(self) -> None:
        for task in self._tasks:
            await tasks.cancel_quietly(task)
        self._tasks = []
        for sock in (self._sub, self._dealer, self._push):
            if sock is not None:
                sock.close(linger=0)
        self._sub = self._dealer = self._push = None
        if self._ctx is not None:
            self._ctx.term()  # every socket is closed with linger 0: returns at once
            self._ctx = None

    # ---- what the worker calls -----------------------------------------------------------------

    def report_loads(
        self,
        get_loads: LoadsGetter,
        get_legs: LoadsGetter = dict,
        get_admission: AdmissionGetter | None = None,
    ) -> None:
        """Every ``loads_s``, send this worker's in-flight load and legs per instance id, and its
        admission (requests running, queued) (when they changed, and at least every
        LOADS_REFRESH_S). Call after :meth:`start`."""
        if self._push is None:
            raise RuntimeError("WorkerLink.report_loads before start")
        admission = get_admission or (lambda: (0, 0))
        self._tasks.append(
            tasks.spawn(
                f"worker_link_{self.index}_loads", lambda: self._report(get_loads, get_legs, admission)
            )
        )

    def serving(self) -> None:
        """Tell the hub this worker listens on the inference port (the management process
        reports the port ready once every worker did)."""
        self._serving_pending = not self._send([codec.SERVING, self._peer, b""])

    def send_sample(self, p: int, d: int, completed: Completed) -> None:
        """Hand a precision sample to the hub. Never blocks and never raises: a sample that
        cannot be encoded or queued is dropped (and counted)."""
        try:
            body = codec.encode_sample(p, d, completed)
        except codec.CodecError as exc:
            self._dropped("unencodable", exc)
            return
        if not self._send([codec.SAMPLE, self._peer, body]):
            self._dropped("queue_full", None)

    # ---- incoming ------------------------------------------------------------------------------

    def _on_state(self, frames: list[bytes], source: str) -> None:
        if len(frames) != 3 or frames[0] != codec.STATE:
            log.warn("worker_message_bad", index=self.index, socket=source, frames=len(frames))
            return
        if not self._same_hub(frames[1]):
            return
        try:
            state = codec.decode_state(frames[2])
        except codec.CodecError as exc:
            log.warn("worker_message_bad", index=self.index, socket=source, error=str(exc))
            return
        if state.revision > self.revision:
            try:
                self.on_state(state)
            except Exception:
                # Not acknowledged: the hub reports the write UNAVAILABLE, and the next beat
                # (a revision newer than ours) makes this link ask again.
                log.exception("worker_state_failed", index=self.index, revision=state.revision)
                return
            self.revision = state.revision
        self._ack()

    def _same_hub(self, incarnation: bytes) -> bool:
        if self.incarnation is None:
            self.incarnation = incarnation
        elif incarnation != self.incarnation:
            self._lose("the management process was replaced")
        return not self.lost

    def _on_beat(self, frames: list[bytes]) -> bool:
        """Whether the beat shows a revision this link has not applied (it missed one)."""
        if not self._same_hub(frames[1]):
            return False
        self._last_beat = time.monotonic()
        generation = codec.unpack_u64(frames[3])
        if generation > self.settings_generation:
            self.settings_generation = generation
            if self.on_settings is not None:
                self.on_settings(generation)
        if self._serving_pending:
            self.serving()
        if codec.unpack_u64(frames[2]) > self.revision:
            return True
        if self._ack_pending:
            self._ack()
        return False

    def _on_parts(self, frames: list[bytes]) -> None:
        if not self._same_hub(frames[1]) or self.on_parts is None:
            return
        try:
            parts = decode_parts(frames[2])
        except (ValueError, AttributeError, TypeError) as exc:
            raise codec.CodecError(f"parts: {exc}") from None
        self.on_parts(parts)

    def send_demand(self, asked: dict[str, float]) -> None:
        """What each rate-limit bucket was asked for lately (never blocks; dropped when the
        queue to the hub is full: the next report carries on)."""
        if asked:
            self._send([codec.DEMAND, self._peer, encode_demand(asked)])

    def _on_loads(self, frames: list[bytes]) -> None:
        if not self._same_hub(frames[1]):
            return
        others: dict[int, int] = {}
        for index, loads in codec.decode_worker_loads(frames[2]).items():
            if index == self.index:
                continue
            for iid, load in loads.items():
                others[iid] = others.get(iid, 0) + load
        if others != self._others:
            self._others = others
            self.on_loads(dict(others))

    # ---- outgoing ------------------------------------------------------------------------------

    def _send(self, frames: list[bytes]) -> bool:
        if self._push is None:
            return False
        try:
            self._push.send_multipart(frames, flags=zmq.NOBLOCK)
        except zmq.ZMQError:  # zmq.Again (queue full) or a socket being closed
            return False
        return True

    def _ack(self) -> None:
        self._ack_pending = not self._send([codec.ACK, self._peer, codec.pack_u64(self.revision)])

    async def _ask(self) -> None:
        """Ask for a snapshot, at most once per ASK_AGAIN_S while unanswered."""
        now = time.monotonic()
        if self._dealer is None or now - self._asked_at < ASK_AGAIN_S:
            return
        self._asked_at = now
        try:
            hello = [codec.HELLO, self._peer, codec.pack_u64(self.pid)]
            await self._dealer.send_multipart(hello, zmq.NOBLOCK)
        except zmq.Again:
            pass  # not connected yet; asked again on the next beat

    def _dropped(self, why: str, exc: Exception | None) -> None:
        self.dropped_samples += 1
        if self.dropped_samples % _DROP_LOG_EVERY == 1:
            log.warn(
                "worker_sample_dropped",
                index=self.index,
                why=why,
                dropped=self.dropped_samples,
                error=str(exc) if exc else "",
            )

    def _lose(self, why: str) -> None:
        if self.lost:
            return
        self.lost = True
        log.warn("worker_hub_lost", index=self.index, pid=self.pid, revision=self.revision, why=why)
        if self.on_lost is not None:
            try:
                self.on_lost(why)
            except Exception:
                log.exception("worker_on_lost_failed", index=self.index)

    # ---- loops ----------------------------------------------------------------------------------

    async def _serve_publications(self) -> None:
        assert self._sub is not None
        while True:
            frames = await self._sub.recv_multipart()
            if self.lost:
                continue
            kind = frames[0]
            try:
                if kind == codec.STATE:
                    self._on_state(frames, "publish")
                elif len(frames) != (4 if kind == codec.BEAT else 3):
                    raise codec.CodecError(f"{len(frames)} frames")
                elif kind == codec.BEAT:
                    if self._on_beat(frames):
                        await self._ask()
                elif kind == codec.LOADS:
                    self._on_loads(frames)
                elif kind == codec.PARTS:
                    self._on_parts(frames)
                else:
                    raise codec.CodecError(f"unknown kind {kind[:16]!r}")
            except codec.CodecError as exc:
                log.warn("worker_message_bad", index=self.index, socket="publish", error=str(exc))

    async def _serve_snapshots(self) -> None:
        assert self._dealer is not None
        while True:
            frames = await self._dealer.recv_multipart()
            self._asked_at = float("-inf")  # answered: the next gap may ask at once
            if not self.lost:
                self._on_state(frames, "snapshot")

    async def _watchdog(self) -> None:
        every = min(BEAT_S, self.lost_after_s / 4)
        last_tick = time.monotonic()
        while not self.lost:
            await asyncio.sleep(every)
            now = time.monotonic()
            late = now - last_tick - every
            last_tick = now
            if late > self.lost_after_s / 2:
                # This process was stopped or starved: beats may be waiting unread in the SUB
                # queue. Let the reader catch up before judging the hub.
                continue
            if now - self._last_beat > self.lost_after_s:
                self._lose(f"no beat for {self.lost_after_s}s")

    async def _report(
        self, get_loads: LoadsGetter, get_legs: LoadsGetter, get_admission: AdmissionGetter
    ) -> None:
        last: tuple[dict[int, int], dict[int, int], int, int, int] | None = None
        sent_at = float("-inf")
        while True:
            report = dict(get_loads()), dict(get_legs()), self.revision, *get_admission()
            now = time.monotonic()
            if (report != last or now - sent_at >= LOADS_REFRESH_S) and self._send(
                [codec.LOADS, self._peer, codec.encode_report(*report)]
            ):
                last, sent_at = report, now
            await asyncio.sleep(self.loads_s)
