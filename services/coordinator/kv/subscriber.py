"""Following one engine's KV cache events: vLLM's ZeroMQ publisher, batch by batch, in order.

The engine publishes numbered batches (``[topic, seq, payload]``, seq 8-byte big-endian from 0)
on a PUB socket and keeps its last batches for replay behind a ROUTER: a DEALER sends
``[b"", start_seq]`` and gets ``[b"", seq, payload]`` for each buffered batch from ``start_seq``
on, then ``[b"", SEQ_END, b""]``.

A :class:`Subscription` hands every batch to ``apply`` exactly once and in order:

- on start it asks for a replay from 0, so a Coordinator started after the engine still learns
  what the engine cached before (as far back as the engine's buffer goes);
- a SUB message numbered ``last + 1`` is applied; one already applied (it came in a replay) is
  skipped; after a gap it asks for a replay from ``last + 1``;
- a SUB message numbered at or below the previous SUB message is a new publisher (PUB/SUB keeps
  one publisher's order, and a restarted engine numbers from 0 again): ``reset(key, "restart")``
  and the new engine's batches are followed from its first;
- a gap no replay can fill (the replay starts later, it times out, there is no replay port, or a
  payload cannot be decoded: the replay would hold the same bytes): ``reset(key, "gap")`` and the
  index is rebuilt from the batches that follow. It then claims less than the engine holds
  (blocks cached before the gap are unknown until cached again), never more.

``reset`` is called only once something was applied: nothing has to be forgotten before that.

Whoever runs the subscription can also ask whether the engine still answers (:meth:`probe`,
the feed's staleness check): a replay from ``last + 1`` on, which an idle engine answers at once
with nothing, a missed stretch with the batches (applied), and a wedged or unreachable one not
at all. ``heard_at`` says when the engine last sent anything, published or replayed.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Hashable
from typing import Generic, Protocol, TypeVar

import zmq
import zmq.asyncio

from motor_mesh.common import log
from motor_mesh.coordinator.kv import wire
from motor_mesh.coordinator.kv.wire import Batch, WireError

# Batches handled in a row before yielding to the event loop: a socket with messages waiting
# hands them over without suspending, so a burst (a catch-up of thousands) would otherwise hold
# the loop for all of its length.
YIELD_EVERY = 64
# The SUB socket's queue, in messages (zmq's default is 1000): room for what the engine publishes
# while a long replay is being applied.
SUB_HWM = 100_000
# After a batch is applied, the next ones are taken COALESCE_S later, all those queued at once (a
# batch after a quiet spell is applied as it comes). An engine publishes a batch per prefill, and
# each wake-up of the process following them costs it far more than a batch's own work: between
# two wake-ups the machine's other processes have evicted its CPU caches. In the churning rows of
# bench/bench_kv_routing.py (an engine evicting and storing on every request) taking them every
# 50 ms rather than every 10 ms halved that process's CPU per request (460 to 232 µs), and the
# TTFT rows' cache hits stayed the same.
COALESCE_S = 0.05

K = TypeVar("K", bound=Hashable)


class Stats(Protocol):
    def batch(self, lag_s: float, events: int) -> None: ...

    def replay(self, outcome: str) -> None:
        """``outcome``: "ok", "truncated" (it started past what was missing or ended short),
        "timeout", or "none" (no replay port)."""

    def reset(self, reason: str) -> None: ...


class NullStats:
    def batch(self, lag_s: float, events: int) -> None:
        return None

    def replay(self, outcome: str) -> None:
        return None

    def reset(self, reason: str) -> None:
        return None


def address(host: str, port: int) -> str:
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


def _seq(frame: bytes) -> int | None:
    return int.from_bytes(frame, "big") if len(frame) == 8 else None


class Subscription(Generic[K]):
    def __init__(
        self,
        ctx: zmq.asyncio.Context,
        key: K,
        host: str,
        port: int,
        replay_port: int,
        apply: Callable[[K, Batch], None],
        reset: Callable[[K, str], None],
        stats: Stats,
        *,
        replay_timeout_s: float = 1.0,
    ) -> None:
        self.key = key
        self.engine = f"{host}:{port}"  # how logs name it
        self._ctx = ctx
        self._ipv6 = ":" in host
        self._publish_address = address(host, port)
        self._replay_address = address(host, replay_port) if replay_port else None
        self._apply = apply
        self._reset = reset
        self._stats = stats
        self._replay_timeout_s = replay_timeout_s
        # The last batch applied, or lost to a reset; -1: none since the start, a restart or
        # forget().
        self.last_seq = -1
        self.gaps = 0  # batches found missing
        self.replays = 0  # replay requests sent
        self.resets = 0  # reset() calls
        self.undecodable = 0  # messages or payloads that could not be read
        self._sub_seq: int | None = None  # the previous SUB message's number
        self._dealer: zmq.asyncio.Socket | None = None
        self._handled = 0
        # Monotonic time of the engine's last message, published or replayed (at first: when
        # this subscription was made): how long it has been silent.
        self.heard_at = time.monotonic()
        self.probes = 0  # probes sent
        self.unanswered = 0  # of them, not answered in time
        # One replay at a time on the DEALER: the stream's catch-ups and the probes.
        self._replaying = asyncio.Lock()

    async def run(self) -> None:
        """Follow the engine until cancelled. Safe to call again after it failed: it carries on
        from ``last_seq``."""
        sub = self._socket(zmq.SUB)
        try:
            sub.setsockopt(zmq.RCVHWM, SUB_HWM)
            sub.setsockopt(zmq.SUBSCRIBE, b"")
            sub.connect(self._publish_address)
            # Subscribed first, then the catch-up: a batch published meanwhile is either in the
            # replay or reaches the SUB socket (or both: the copy is skipped).
            await self._replay(self.last_seq + 1, need=None)
            # What is queued is taken without a future per message (the asyncio wrapper cost more
            # than applying a small batch), then nothing until COALESCE_S has passed.
            queued: zmq.Socket[bytes] = zmq.Socket.shadow(sub.underlying)
            while True:
                frames: list[bytes] | None = await sub.recv_multipart()
                while frames is not None:
                    await self._on_published(frames)
                    await self._breathe()
                    try:
                        frames = queued.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        frames = None
                await asyncio.sleep(COALESCE_S)
        finally:
            sub.close(linger=0)
            self._close_dealer()

    # ---- the stream ----------------------------------------------------------------------------

    async def _on_published(self, frames: list[bytes]) -> None:
        self.heard_at = time.monotonic()
        seq = _seq(frames[1]) if len(frames) == 3 else None
        if seq is None:
            # Its number is unknown, so is what it held: the next message shows any gap.
            self._unreadable(f"a message of {len(frames)} frames")
            return
        if self._sub_seq is not None and seq <= self._sub_seq:
            self._lose("restart")
            self.last_seq = -1
        self._sub_seq = seq
        if seq <= self.last_seq:
            return
        if seq > self.last_seq + 1:
            self.gaps += 1
            await self._replay(self.last_seq + 1, need=seq - 1)
            if seq <= self.last_seq:
                return
            if seq > self.last_seq + 1:
                self._lose("gap")
        self._deliver(seq, frames[2])

    def _deliver(self, seq: int, payload: bytes) -> None:
        """Apply batch ``seq``, which follows the last one (or starts the stream anew)."""
        try:
            batch = wire.decode(payload)
        except WireError as exc:
            # A replay would return the very same bytes: this batch is lost for good.
            self._unreadable(f"batch {seq}: {exc}")
            self.gaps += 1
            self._lose("gap")
            self.last_seq = seq
            return
        self._apply(self.key, batch)
        self.last_seq = seq
        self._stats.batch(time.time() - batch.ts, len(batch.events))

    def _lose(self, reason: str) -> None:
        """What was applied can no longer be trusted to match the engine."""
        if self.last_seq < 0:
            return
        self.resets += 1
        log.event("kv_events_reset", engine=self.engine, reason=reason, after_seq=self.last_seq)
        self._reset(self.key, reason)
        self._stats.reset(reason)

    def _unreadable(self, what: str) -> None:
        self.undecodable += 1
        if self.undecodable == 1:  # a broken engine would repeat it for every batch
            log.warn("kv_events_undecodable", engine=self.engine, what=what)

    async def _breathe(self) -> None:
        self._handled += 1
        if self._handled % YIELD_EVERY == 0:
            await asyncio.sleep(0)

    # ---- replay --------------------------------------------------------------------------------

    async def _replay(self, start: int, need: int | None) -> str:
        """Apply the engine's buffered batches from ``start`` on; ``need``: the last one the
        caller is missing (None: whatever the buffer has)."""
        replay_address = self._replay_address
        if replay_address is None:
            outcome = "none"
        else:
            self.replays += 1
            async with self._replaying:
                try:
                    outcome = await self._fetch(replay_address, start, need, self._replay_timeout_s)
                except TimeoutError:
                    # The answer may still come: on a new socket it cannot pass for the next one's.
                    self._close_dealer()
                    outcome = "timeout"
        self._stats.replay(outcome)
        return outcome

    async def probe(self, timeout_s: float) -> bool | None:
        """Ask the engine for the batches after the last one applied (from the start of its
        buffer after :meth:`forget`), each applied as a replay's: True when it answered (even
        with nothing), False when it did not within ``timeout_s`` or has no replay port, None
        when a replay is already under way (ask again later). Not counted as a replay in the
        stats: nothing was found missing."""
        replay_address = self._replay_address
        if replay_address is None:
            return False
        if self._replaying.locked():
            return None
        async with self._replaying:
            self.probes += 1
            try:
                await self._fetch(replay_address, self.last_seq + 1, None, timeout_s)
            except TimeoutError:
                self._close_dealer()  # as after a replay's timeout
                self.unanswered += 1
                return False
            except asyncio.CancelledError:
                self._close_dealer()  # the rest of the answer must not pass for the next one's
                raise
        return True

    def forget(self) -> None:
        """What was applied has been dropped by the caller: the next catch-up (after a gap, or
        a probe) asks for the engine's whole buffer, as a new subscription's does."""
        self.last_seq = -1

    async def _fetch(self, replay_address: str, start: int, need: int | None, wait_s: float) -> str:
        dealer = self._dealer
        if dealer is None:
            dealer = self._dealer = self._socket(zmq.DEALER)
            dealer.connect(replay_address)
        await asyncio.wait_for(dealer.send_multipart([b"", start.to_bytes(8, "big")]), wait_s)
        truncated = False
        while True:
            frames = await asyncio.wait_for(dealer.recv_multipart(), wait_s)
            self.heard_at = time.monotonic()
            parts = _replayed(frames)
            seq = _seq(parts[0]) if parts is not None else None
            if parts is None or seq is None:
                self._unreadable(f"a replay message of {len(frames)} frames")
                self._close_dealer()  # the rest of this answer would be read as the next one
                truncated = True
                break
            if parts[0] == wire.SEQ_END:
                break
            if seq <= self.last_seq:
                continue
            if seq > self.last_seq + 1:
                truncated = True  # the engine's buffer no longer reaches back to it
                self._lose("gap")
            self._deliver(seq, parts[1])
            await self._breathe()
        if need is not None and self.last_seq < need:
            truncated = True
        return "truncated" if truncated else "ok"

    def _socket(self, kind: int) -> zmq.asyncio.Socket:
        sock = self._ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        if self._ipv6:
            sock.setsockopt(zmq.IPV6, 1)
        return sock

    def _close_dealer(self) -> None:
        if self._dealer is not None:
            self._dealer.close(linger=0)
            self._dealer = None


def _replayed(frames: list[bytes]) -> tuple[bytes, bytes] | None:
    """(sequence number, payload) of one replay answer, as a DEALER receives it: vLLM releases
    differ in whether the topic is repeated before the number (``["", topic, seq, payload]``,
    vLLM 0.32's CPU build among them, or ``["", seq, payload]``); None for anything else."""
    if len(frames) == 4 and not frames[0]:
        return frames[2], frames[3]
    if len(frames) == 3 and not frames[0]:
        return frames[1], frames[2]
    return None
