"""Open-loop tenants against a ``motor up`` with a tenants file: each tenant sends streamed
completions at a fixed Poisson rate, whatever the answers, and every answer's time to first
token, status and completion tokens are kept (bench/bench_admission.py)."""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass, field

import aiohttp


@dataclass
class Answer:
    sent: float  # seconds since the run began
    status: int
    ttft_s: float  # send to the first token (streamed answers of 200)
    tokens: int  # completion tokens written (usage, else events)
    ended: float


@dataclass
class Tenant:
    name: str
    key: str
    rate: float  # requests per second
    stream: bool = True  # False: whole answers (no time to first token, less work for the client)
    start_s: float = 0.0  # when it starts sending, from the run's start
    answers: list[Answer] = field(default_factory=list)


async def _one(
    s: aiohttp.ClientSession, url: str, model: str, tenant: Tenant, prompt: str, max_tokens: int, t0: float
) -> None:
    sent = time.perf_counter()
    body: dict[str, object] = {"model": model, "prompt": prompt, "max_tokens": max_tokens}
    if tenant.stream:
        body.update(stream=True, stream_options={"include_usage": True})
    headers = {"Authorization": f"Bearer {tenant.key}"}
    first = 0.0
    tokens = 0
    try:
        async with s.post(f"{url}/v1/completions", json=body, headers=headers) as r:
            status = r.status
            if status == 200 and not tenant.stream:
                tokens = (await r.json())["usage"]["completion_tokens"]
            elif status == 200:
                async for line in r.content:
                    if not line.startswith(b"data: {"):
                        continue
                    event = json.loads(line[6:])
                    if event.get("usage"):
                        tokens = event["usage"]["completion_tokens"]
                    elif event.get("choices") and event["choices"][0].get("text") and not first:
                        first = time.perf_counter()
            else:
                await r.read()
    except aiohttp.ClientError:
        status = 0
    end = time.perf_counter()
    tenant.answers.append(Answer(sent - t0, status, (first - sent) if first else 0.0, tokens, end - t0))


async def run(
    url: str, model: str, tenants: list[Tenant], seconds: float, prompt: str, max_tokens: int, seed: int = 1
) -> None:
    """Every tenant at its rate for ``seconds``; returns once every answer is in. Each tenant is
    a client of its own, with its own connections, as two applications would be: one pool shared
    by both would hand a connection a flood's refusal just freed to the other tenant's next
    request, moving that tenant from one inference worker to another as no real client does."""
    rng = random.Random(seed)
    timeout = aiohttp.ClientTimeout(total=120)
    sessions = [
        aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout) for _ in tenants
    ]
    try:
        t0 = time.perf_counter()
        pending: set[asyncio.Task[None]] = set()

        async def feed(tenant: Tenant, s: aiohttp.ClientSession) -> None:
            at = tenant.start_s
            while True:
                at += rng.expovariate(tenant.rate)
                if at >= seconds:
                    return
                delay = t0 + at - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                task = asyncio.create_task(_one(s, url, model, tenant, prompt, max_tokens, t0))
                pending.add(task)
                task.add_done_callback(pending.discard)

        await asyncio.gather(*(feed(t, s) for t, s in zip(tenants, sessions, strict=True)))
        while pending:
            await asyncio.gather(*list(pending))
    finally:
        for s in sessions:
            await s.close()
