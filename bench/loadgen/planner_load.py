"""bench/bench_planner.py's trace, client and scoring.

- ``trace``: a seeded, deterministic list of requests: phases of one kind each (``A``: long
  prompts, short answers; ``B``: short prompts, long answers), open-loop Poisson arrivals at the
  phase's rate. Every prompt starts with a word of its own (``q<index>``), so no prompt is a
  prefix-cache hit of another: every prefill costs its whole prompt.
- ``replay``: sends the trace to one cluster at its times, whatever the answers (streamed
  completions through aiohttp), and keeps what each client saw: time to the first content token,
  every gap between two content tokens (with the time it ended), the tokens received, the error.
- ``score``: 30 s windows of the scored part of the trace; a window meets the SLA when the p90
  time to first token of the requests sent in it and the p90 of the inter-token gaps that ended
  in it are both within their targets.
"""

from __future__ import annotations

import asyncio
import math
import random
from dataclasses import dataclass, field

import aiohttp
import orjson

from bench.loadgen.harness import percentile

MODEL = "motor-sim"
# Words of the prompts (the built-in tokenizer: one token per whitespace-separated word).
VOCAB = tuple(
    "the a of to and in is on for with as by at from that this it be are was an or not which "
    "cache token prompt engine decode prefill batch latency request answer model router queue "
    "planner instance role switch drain capacity demand target window phase trace load stream "
    "north south east west river mountain valley harbour lighthouse keeper winter summer storm".split()
)


@dataclass(frozen=True)
class Phase:
    kind: str  # "A" (long prompts, short answers) or "B" (short prompts, long answers)
    seconds: float
    rate: float  # requests per second (Poisson)
    prompt_words: tuple[int, int]  # uniform, inclusive
    answer_tokens: tuple[int, int]  # max_tokens, uniform, inclusive (the sim answers exactly that)
    scored: bool = True


@dataclass(frozen=True)
class Request:
    index: int
    at: float  # seconds from the trace's start
    phase: int
    kind: str
    prompt: str
    max_tokens: int

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt.split())


def trace(phases: list[Phase], seed: int) -> list[Request]:
    rng = random.Random(seed)
    out: list[Request] = []
    start = 0.0
    for p_index, phase in enumerate(phases):
        at = start
        while True:
            at += rng.expovariate(phase.rate)
            if at >= start + phase.seconds:
                break
            i = len(out)
            words = rng.randint(*phase.prompt_words)
            prompt = " ".join([f"q{i}", *(rng.choice(VOCAB) for _ in range(words - 1))])
            out.append(Request(i, at, p_index, phase.kind, prompt, rng.randint(*phase.answer_tokens)))
        start += phase.seconds
    return out


@dataclass
class Answer:
    request: Request
    ttft: float = math.inf  # seconds, send to the first content token; inf: none came
    tokens: int = 0  # content tokens received
    error: str = ""  # "" = whole answer
    end_times: list[float] = field(default_factory=list)  # trace time each gap ended
    gaps: list[float] = field(default_factory=list)  # seconds between two content tokens


async def _one(
    session: aiohttp.ClientSession, url: str, req: Request, t0: float, first_s: float, total_s: float
) -> Answer:
    """One streamed completion; given up (error ``timeout``) when no token came within
    ``first_s`` or the answer is not whole within ``total_s``."""
    ans = Answer(req)
    body = {"model": MODEL, "prompt": req.prompt, "max_tokens": req.max_tokens, "stream": True}
    loop = asyncio.get_running_loop()
    sent = last = loop.time()
    done = False
    try:
        async with asyncio.timeout(first_s) as limit, session.post(f"{url}/v1/completions", json=body) as r:
            if r.status != 200:
                ans.error = f"HTTP {r.status}"
                await r.read()
                return ans
            async for line in r.content:
                if not line.startswith(b"data:"):
                    continue
                payload = line[5:].strip()
                if payload == b"[DONE]":
                    done = True
                    continue
                event = orjson.loads(payload)
                if event.get("error") and not event.get("choices"):
                    ans.error = "error event"
                    continue
                if not any(c.get("text") for c in event.get("choices") or ()):
                    continue
                now = loop.time()
                if ans.tokens == 0:
                    ans.ttft = now - sent
                    limit.reschedule(sent + total_s)
                else:
                    ans.gaps.append(now - last)
                    ans.end_times.append(now - t0)
                last = now
                ans.tokens += 1
        if not ans.error and not done:
            ans.error = "truncated"
        elif not ans.error and ans.tokens != req.max_tokens:
            ans.error = f"short ({ans.tokens} of {req.max_tokens} tokens)"
    except TimeoutError:
        ans.error = "timeout"
    except (aiohttp.ClientError, ValueError) as exc:
        ans.error = type(exc).__name__
    return ans


async def replay(url: str, requests: list[Request], first_s: float, total_s: float) -> list[Answer]:
    """Every request at its time (open loop); returns once every answer is in or given up (no
    first token within ``first_s``, not whole within ``total_s``)."""
    loop = asyncio.get_running_loop()
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        t0 = loop.time()
        tasks = []
        for req in requests:
            delay = t0 + req.at - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(_one(session, url, req, t0, first_s, total_s)))
        return list(await asyncio.gather(*tasks))


@dataclass(frozen=True)
class Window:
    start: float  # trace time
    kind: str  # the phase kind it lies in
    requests: int
    ttft_p90: float  # seconds (inf: a request without a first token among the slowest 10 %)
    itl_p90: float | None  # seconds; None: no gap ended in it
    met: bool


def score(
    answers: list[Answer], phases: list[Phase], window_s: float, ttft_target_s: float, itl_target_s: float
) -> list[Window]:
    """The scored part of the trace (its phases with ``scored``, which follow the others) cut
    into ``window_s`` windows."""
    start = sum(p.seconds for p in phases if not p.scored)
    end = sum(p.seconds for p in phases)
    bounds, t = [], 0.0
    for p in phases:
        bounds.append((t, t + p.seconds, p.kind))
        t += p.seconds
    gaps = sorted((e, g) for a in answers for e, g in zip(a.end_times, a.gaps, strict=True))
    out = []
    w = start
    while w + window_s <= end + 1e-9:
        kind = next(k for a, b, k in bounds if a <= w < b)
        ttfts = sorted(a.ttft for a in answers if w <= a.request.at < w + window_s)
        itls = sorted(g for e, g in gaps if w <= e < w + window_s)
        ttft = percentile(ttfts, 90) if ttfts else 0.0
        itl = percentile(itls, 90) if itls else None
        met = ttft <= ttft_target_s and (itl is None or itl <= itl_target_s)
        out.append(Window(w, kind, len(ttfts), ttft, itl, met))
        w += window_s
    return out
