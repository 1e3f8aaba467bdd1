"""The shared-prefix workload of bench/bench_kv_routing.py, and its client.

Several long system prompts; conversations, each under one of them, of several turns (each turn
sends the whole history again: the system prompt, every earlier question and answer, the new
question). Turns of different conversations are interleaved at random, each conversation's in
order, so an engine's cache sees the mix a chat service sees.

The client streams every request (``stream: true``) and times the first content chunk: the time
to first token a user waits.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass, field

import aiohttp


@dataclass
class Conversation:
    system: str
    questions: list[str]
    answers: list[str] = field(default_factory=list)

    def messages(self, turn: int) -> list[dict[str, str]]:
        msgs = [{"role": "system", "content": self.system}]
        for q, a in zip(self.questions[:turn], self.answers[:turn], strict=True):
            msgs += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
        return [*msgs, {"role": "user", "content": self.questions[turn]}]


@dataclass(frozen=True)
class Shape:
    systems: int = 8
    system_words: int = 1000
    conversations: int = 32
    turns: int = 4
    question_words: int = 40
    seed: int = 16


def build(shape: Shape) -> tuple[list[Conversation], list[int]]:
    """The conversations and the order of their turns (conversation index per request)."""
    rng = random.Random(shape.seed)
    systems = [
        " ".join(f"policy{i}clause{j}" for j in range(shape.system_words)) for i in range(shape.systems)
    ]
    convs = []
    for c in range(shape.conversations):
        questions = [
            " ".join(f"c{c}t{t}q{w}" for w in range(shape.question_words)) for t in range(shape.turns)
        ]
        convs.append(Conversation(systems[c % shape.systems], questions))
    order = [c for c in range(shape.conversations) for _ in range(shape.turns)]
    rng.shuffle(order)
    return convs, order


async def ask(
    session: aiohttp.ClientSession, url: str, messages: list[dict[str, str]]
) -> tuple[float, float, str]:
    """One streamed chat completion: (time to first token, total time, the answer's text)."""
    body = {"model": "motor-sim", "messages": messages, "max_tokens": 16, "stream": True}
    started = time.perf_counter()
    first = 0.0
    text: list[str] = []
    async with session.post(f"{url}/v1/chat/completions", json=body) as resp:
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {(await resp.text())[:200]}")
        async for line in resp.content:
            if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                continue
            chunk = json.loads(line[6:])
            for choice in chunk.get("choices", []):
                piece = choice.get("delta", {}).get("content")
                if piece:
                    if not first:
                        first = time.perf_counter() - started
                    text.append(piece)
    return first, time.perf_counter() - started, "".join(text)


async def run(
    url: str,
    convs: list[Conversation],
    order: list[int],
    clients: int = 1,
    session: aiohttp.ClientSession | None = None,
) -> list[tuple[float, float]]:
    """Every turn of ``order``; with ``clients`` > 1 they share the order, each conversation
    still one turn at a time. Returns (ttft, total) per request. Over ``session`` if given (its
    connections, so the Coordinator's workers they reach), else a session of its own."""
    for c in convs:
        c.answers.clear()
    turns = {i: 0 for i in range(len(convs))}
    busy: set[int] = set()
    results: list[tuple[float, float]] = []
    queue = list(order)

    async def worker(session: aiohttp.ClientSession) -> None:
        while queue:
            # The next turn whose conversation is not waiting on its previous answer.
            pick = next((k for k, c in enumerate(queue) if c not in busy), None)
            if pick is None:
                await asyncio.sleep(0.001)
                continue
            c = queue.pop(pick)
            busy.add(c)
            conv = convs[c]
            ttft, total, answer = await ask(session, url, conv.messages(turns[c]))
            conv.answers.append(answer)
            turns[c] += 1
            busy.discard(c)
            results.append((ttft, total))

    if session is not None:
        await asyncio.gather(*(worker(session) for _ in range(clients)))
        return results
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as own:
        await asyncio.gather(*(worker(own) for _ in range(clients)))
    return results
