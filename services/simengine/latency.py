"""Latency model and the `--max-num-seqs` admission queue.

With every latency at zero nothing here sleeps, so the engine costs only its HTTP handling: it
is the physical-limit baseline that router benchmarks are compared against.

Two opt-in knobs make the latency depend on load, as a real engine's does (docs/sim-engine.md):
`--prefill-compute serial` (prefills are compute-bound: they share one compute, a `Slots(1)`
taken in arrival order) and `--tpot-ms-per-seq X` (decode is memory-bound: each output token's
interval grows by X ms per other running sequence).
"""

from __future__ import annotations

import asyncio
from collections import deque

from motor_mesh.simengine.config import EngineConfig


class LatencyModel:
    def __init__(self, cfg: EngineConfig) -> None:
        self.ttft_s = cfg.ttft_ms / 1000
        self.prefill_s_per_token = cfg.prefill_ms_per_token / 1000
        self.tpot_s = cfg.tpot_ms / 1000
        self.tpot_s_per_seq = cfg.tpot_ms_per_seq / 1000
        self.serial_prefill = cfg.prefill_compute == "serial"
        self.kv_transfer_s = cfg.kv_transfer_ms / 1000

    def first_token_s(self, prompt_tokens: int, kv_transfer: bool) -> float:
        """Time to the first token: the prefill of ``prompt_tokens`` (those not already in the
        prefix cache), or for a decode leg the KV transfer instead."""
        if kv_transfer:
            return self.kv_transfer_s
        return self.ttft_s + self.prefill_s_per_token * prompt_tokens

    def decode_s(self, tokens: int) -> float:
        """Time for every token after the first."""
        return self.tpot_s * max(0, tokens - 1)

    def token_interval_s(self, running: int) -> float:
        """One output token's interval with ``running`` sequences in the batch (this one
        included): `tpot + per_seq x (running - 1)`."""
        return self.tpot_s + self.tpot_s_per_seq * max(0, running - 1)


class Slots:
    """At most `limit` running sequences (0 = unlimited); the rest wait in FIFO order."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.running = 0
        self._waiters: deque[asyncio.Future[None]] = deque()

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    def try_acquire(self) -> bool:
        """Take a slot if one is free right now (no coroutine, no future: the common case)."""
        if self.limit <= 0 or (self.running < self.limit and not self._waiters):
            self.running += 1
            return True
        return False

    async def acquire(self) -> None:
        if self.try_acquire():
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(fut)
        try:
            await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():
                # The slot was handed to us just as we were cancelled: pass it on.
                self.release()
            else:
                self._waiters.remove(fut)
            raise

    def release(self) -> None:
        # A finishing sequence hands its slot straight to the oldest waiter.
        while self._waiters:
            fut = self._waiters.popleft()
            if not fut.done():
                fut.set_result(None)
                return
        self.running -= 1
