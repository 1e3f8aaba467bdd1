"""The shared-prefix workload of bench/bench_kv_routing.py, and its client.

Several long system prompts; conversations, each under one of them, of several turns (each turn
sends the whole history again: the system prompt, every earlier question and answer, the new
question). Turns of different conversations are interleaved at random, each conversation's in
order, so an engine's cache sees the mix a chat service sees.

The client streams every request (``stream: true``) and times the first content chunk: the time
to first token a user waits.

Two kinds of text: :func:`build`'s made-up words (``policy0clause17``: one token each for the
simulated engine's built-in tokenizer, several for a real one), and :func:`prose`, English-like
sentences from a fixed word list, sized in a real tokenizer's tokens (:func:`build_prose`,
:func:`singles`), for the benches that tokenize as a Llama 3 engine does.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import aiohttp

MODEL = "motor-sim"


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
    session: aiohttp.ClientSession, url: str, messages: list[dict[str, str]], model: str = MODEL
) -> tuple[float, float, str]:
    """One streamed chat completion: (time to first token, total time, the answer's text)."""
    body = {"model": model, "messages": messages, "max_tokens": 16, "stream": True}
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
    model: str = MODEL,
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
            ttft, total, answer = await ask(session, url, conv.messages(turns[c]), model)
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


# -- English-like text, sized in a real tokenizer's tokens ---------------------------------------

# Common English words (one or two Llama 3 tokens each): text a real tokenizer splits as it
# splits prose, where made-up words would each cost it several tokens.
WORDS = tuple(
    """the of and to in is was for on that with as it by at from this be are or an have not but
    which one all were their they has more been there when will would who can said its about
    into than other some time only new may these two first any after also could over such most
    where years should between each made through people system many because both under before
    those while during state world water city work house school number part place case point
    government company group problem fact hand week night way day life year report policy order
    question answer service customer account payment request record data model engine network
    server cache memory token block prefix queue route load limit error value result process
    simple clear small large long short early late high low open close full empty public private
    local global common special general final recent strong quick slow safe ready able likely
    make take give find keep hold send read write check start stop change follow move serve
    build learn show tell ask need help call use try run turn bring carry leave meet pay""".split()
)
TokenCount = Callable[[str], int]  # a text's tokens as the engine counts them


def prose(rng: random.Random, words: int) -> str:
    """About ``words`` words of sentences (6 to 18 words, a comma now and then), paragraphs of
    about five sentences."""
    sentences: list[str] = []
    left = words
    while left > 0:
        n = min(left, rng.randint(6, 18))
        ws = [rng.choice(WORDS) for _ in range(n)]
        if n > 8 and rng.random() < 0.4:
            ws[rng.randrange(3, n - 2)] += ","
        sentences.append(" ".join(ws).capitalize() + ".")
        left -= n
    paragraphs = [" ".join(sentences[i : i + 5]) for i in range(0, len(sentences), 5)]
    return "\n\n".join(paragraphs)


def sized(rng: random.Random, tokens: int, count: TokenCount) -> str:
    """:func:`prose` of about ``tokens`` tokens by ``count``: a guess at the words, then
    paragraphs added or the last words dropped until it is within 1% (or 4 tokens) of it."""
    text = prose(rng, max(1, int(tokens / 1.1)))
    while count(text) < tokens:
        text += "\n\n" + prose(rng, max(1, int((tokens - count(text)) / 1.1) + 1))
    words = text.split(" ")
    while count(" ".join(words)) > tokens + max(4, tokens // 100) and len(words) > 1:
        over = count(" ".join(words)) - tokens
        words = words[: -max(1, int(over / 1.5))]
    return " ".join(words)


@dataclass(frozen=True)
class ProseShape:
    """Conversations under shared system prompts, sized in tokens (of :data:`TokenCount`)."""

    systems: int = 4
    system_tokens: int = 4000
    conversations: int = 8
    turns: int = 10
    question_tokens: int = 40
    seed: int = 16


def build_prose(shape: ProseShape, count: TokenCount) -> tuple[list[Conversation], list[int]]:
    """:func:`build`'s conversations in English-like text: conversation c under system prompt
    c mod ``systems``; turns interleaved at random, each conversation's in order."""
    rng = random.Random(shape.seed)
    systems = [sized(rng, shape.system_tokens, count) for _ in range(shape.systems)]
    convs = [
        Conversation(
            systems[c % shape.systems],
            [sized(rng, shape.question_tokens, count) + "?" for _ in range(shape.turns)],
        )
        for c in range(shape.conversations)
    ]
    order = [c for c in range(shape.conversations) for _ in range(shape.turns)]
    rng.shuffle(order)
    return convs, order


def spaced(conversations: int, turns: int, gap: int, seed: int) -> list[int]:
    """An order of every turn of every conversation (conversation index per request) with at
    least ``gap`` other requests between two turns of one conversation where it can be: each
    next one drawn at random among the conversations with turns left that none of the last
    ``gap`` requests belongs to, weighed by the turns they have left (so none is left alone with
    its last turns at the end); any with turns left when there is none such."""
    rng = random.Random(seed)
    left = dict.fromkeys(range(conversations), turns)
    out: list[int] = []
    while left:
        recent = set(out[-gap:]) if gap else set()
        ready = [c for c in left if c not in recent] or list(left)
        c = rng.choices(ready, weights=[left[c] for c in ready])[0]
        out.append(c)
        left[c] -= 1
        if not left[c]:
            del left[c]
    return out


def singles(n: int, tokens: int, count: TokenCount, seed: int = 17) -> list[list[dict[str, str]]]:
    """``n`` chats of one user message of about ``tokens`` tokens, each a text of its own."""
    rng = random.Random(seed)
    return [[{"role": "user", "content": sized(rng, tokens, count)}] for _ in range(n)]
