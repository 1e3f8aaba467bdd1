"""Short prompts straight to a decode instance (``coordinator.pd_min_prompt_tokens``), measured.

``motor up --prefill 1 --decode 1``, simulated engines with their default latencies and Llama
3's tokenizer. The same prompts, at the same fixed request rate (open loop: request i is sent at
i / rate seconds, whether or not the earlier ones have ended), once with ``pd_min_prompt_tokens``
above their length (each goes to the decode instance alone, which computes its prefill itself)
and once with 0 (each through the prefill leg, then the decode leg with the hand-off). The
Coordinator's ``motor_coordinator_routed_total`` says which way each went.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

from bench.loadgen import kv_workload
from bench.loadgen.kv_real import SETTLE_S, Cluster, Times, metrics, warm

ROUTED = "motor_coordinator_routed_total"


@dataclass
class Short:
    """One prompt length under one threshold, over its rounds."""

    ttft: Times = field(default_factory=Times)
    seconds: float = 0.0  # first send to last answer, summed over rounds
    decode_only: int = 0
    vllm_pd: int = 0

    @property
    def throughput(self) -> float:
        return self.ttft.n / self.seconds if self.seconds else 0.0


async def _at_rate(
    session: aiohttp.ClientSession, url: str, model: str, prompts: list[list[dict[str, str]]], rate: float
) -> tuple[list[float], float]:
    """Every prompt, request i sent i / rate seconds after the first: (TTFTs, seconds from the
    first send to the last answer)."""
    t0 = time.perf_counter()

    async def one(i: int, messages: list[dict[str, str]]) -> float:
        await asyncio.sleep(max(0.0, t0 + i / rate - time.perf_counter()))
        return (await kv_workload.ask(session, url, messages, model))[0]

    ttfts = await asyncio.gather(*(one(i, m) for i, m in enumerate(prompts)))
    return list(ttfts), time.perf_counter() - t0


async def short_round(
    workdir: Path,
    threshold: int,
    lengths: dict[int, list[list[dict[str, str]]]],
    rate: float,
    out: dict[int, Short],
) -> None:
    """Every length's prompts on one fresh cluster with ``pd_min_prompt_tokens`` = ``threshold``,
    added to ``out`` (by length)."""
    cluster = Cluster(
        workdir, prefill=1, decode=1, engine_type="sim",
        coordinator={"pd_min_prompt_tokens": threshold}, engine_args={},
    )  # fmt: skip
    cluster.start()
    try:
        connector = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=120)) as s:
            await warm(s, cluster.url, cluster.model)
            for length, prompts in lengths.items():
                before = await _routed(s, cluster.url)
                ttfts, seconds = await _at_rate(s, cluster.url, cluster.model, prompts, rate)
                after = await _routed(s, cluster.url)
                row = out.setdefault(length, Short())
                row.ttft.add(ttfts)
                row.seconds += seconds
                row.decode_only += int(after[0] - before[0])
                row.vllm_pd += int(after[1] - before[1])
    finally:
        cluster.stop()


async def _routed(session: aiohttp.ClientSession, url: str) -> tuple[float, float]:
    """(decode_only, vllm_pd) requests so far, every worker's."""
    await asyncio.sleep(SETTLE_S)
    # One name, two label sets: two scrapes (metrics() sums one label set per name).
    a = await metrics(session, url, {ROUTED: {"mode": "decode_only"}})
    b = await metrics(session, url, {ROUTED: {"mode": "vllm_pd"}})
    return a[ROUTED], b[ROUTED]
