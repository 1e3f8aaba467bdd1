"""Deterministic token generation and log-probabilities.

The same prompt always yields the same text on every engine process, so a PD pair produces
exactly what a union engine would and tests can compare outputs across topologies. Simple
questions with a known answer (arithmetic, a few facts) are answered correctly, which is what
makes a precision probe meaningful: a healthy engine passes it, a `precision` fault fails it.
"""

from __future__ import annotations

import re
import zlib
from dataclasses import dataclass
from functools import lru_cache

VOCAB: tuple[str, ...] = tuple(
    """the of and to in is that for it as was with be by on not he this are or his from at which
    but have an they you were her she there been one all we their has would when if so no will
    more can out up who said what some time into them could only new other than then its about
    two these may first any like over such our very just where most through made after also
    many before must well back years much your way down should because each people state good
    world still own see men work long here between both life being under never day same another
    know while last might great old year off come since against go came right used take three
    system model token engine cache router prefill decode stream batch layer tensor vector""".split()
)
_V = len(VOCAB)
_MASK = (1 << 64) - 1
# Healthy top-1 log-probabilities stay in (-0.6, 0); a precision fault collapses them to this.
COLLAPSED_LOGPROB = -9.0
GARBLED = ("\ufffd", " \ufffd\ufffd", " the", " the", " the")

_ARITH = re.compile(r"(-?\d{1,12})\s*([-+*x\u00d7/])\s*(-?\d{1,12})")
_FACTS = (
    ("capital of france", "Paris"),
    ("capital of japan", "Tokyo"),
    ("capital of germany", "Berlin"),
    ("capital of italy", "Rome"),
    ("largest planet", "Jupiter"),
)


def count_tokens(text: str) -> int:
    return max(1, len(text.split()))


def seed_of(text: str, engine_seed: int = 0) -> int:
    return zlib.crc32(text.encode("utf-8", "surrogatepass")) ^ (engine_seed & 0xFFFFFFFF)


@lru_cache(maxsize=4096)
def known_answer(question: str) -> str | None:
    """The answer a healthy model gives to a simple probe question, if it is one."""
    m = _ARITH.search(question)
    if m:
        a, op, b = int(m.group(1)), m.group(2), int(m.group(3))
        if op == "+":
            return str(a + b)
        if op == "-":
            return str(a - b)
        if op in "*x\u00d7":
            return str(a * b)
        if b != 0 and a % b == 0:
            return str(a // b)
        return None
    low = question.lower()
    for key, answer in _FACTS:
        if key in low:
            return answer
    return None


@dataclass(slots=True)
class Generated:
    tokens: list[str]
    # per token: (chosen logprob, [(alternative token, logprob), ...]) only when asked for
    logprobs: list[tuple[float, list[tuple[str, float]]]] | None

    @property
    def text(self) -> str:
        return "".join(self.tokens)


def _generate(
    seed: int,
    n_tokens: int,
    answer: str | None = None,
    top_k: int | None = None,
    garbled: bool = False,
) -> Generated:
    tokens: list[str] = []
    x = (seed * 0x9E3779B97F4A7C15 + 1) & _MASK
    if garbled:
        tokens = [GARBLED[i % len(GARBLED)] for i in range(n_tokens)]
    else:
        if answer is not None and n_tokens > 0:
            tokens.append(answer)
        for i in range(len(tokens), n_tokens):
            x = (x * 6364136223846793005 + 1442695040888963407) & _MASK
            word = VOCAB[(x >> 33) % _V]
            tokens.append(word if i == 0 else " " + word)
    if top_k is None:
        return Generated(tokens, None)
    lps: list[tuple[float, list[tuple[str, float]]]] = []
    for i, tok in enumerate(tokens):
        x = (x * 6364136223846793005 + 1442695040888963407) & _MASK
        if garbled:
            top1 = COLLAPSED_LOGPROB
            step = 0.01
        else:
            top1 = -round(0.001 + ((x >> 40) % 500) / 1000, 4)
            step = 1.5
        alts: list[tuple[str, float]] = []
        j = 0
        while len(alts) < top_k - 1:
            cand = VOCAB[(i + 7 * j + (x >> 20)) % _V]
            j += 1
            cand = cand if i == 0 else " " + cand
            if cand != tok and all(cand != a for a, _ in alts):
                alts.append((cand, round(top1 - step * (len(alts) + 1), 4)))
        lps.append((top1, alts))
    return Generated(tokens, lps)


# Deterministic, so identical prompts (benchmarks, probes, PD legs) skip the work.
_generate_cached = lru_cache(maxsize=2048)(_generate)
_CACHE_MAX_TOKENS = 512


def generate(
    seed: int,
    n_tokens: int,
    answer: str | None = None,
    top_k: int | None = None,
    garbled: bool = False,
) -> Generated:
    """`n_tokens` tokens from `seed`; `top_k` (0-20) asks for log-probabilities and that many
    most likely tokens per position (the chosen one first); `garbled` simulates an engine whose
    numerics went wrong. Callers must not mutate the result: short outputs are cached."""
    if n_tokens <= _CACHE_MAX_TOKENS:
        return _generate_cached(seed, n_tokens, answer, top_k, garbled)
    return _generate(seed, n_tokens, answer, top_k, garbled)


def chat_logprobs(gen: Generated, top_k: int) -> dict[str, object] | None:
    """OpenAI chat shape: {"content": [{token, logprob, bytes, top_logprobs: [...]}, ...]}."""
    if gen.logprobs is None:
        return None
    return {"content": chat_logprob_entries(gen.tokens, gen.logprobs, top_k)}


def chat_logprob_entries(
    tokens: list[str], lps: list[tuple[float, list[tuple[str, float]]]], top_k: int
) -> list[dict[str, object]]:
    out: list[dict[str, object]] = []
    for tok, (lp, alts) in zip(tokens, lps, strict=True):
        top = [{"token": tok, "logprob": lp, "bytes": list(tok.encode())}] if top_k else []
        top += [
            {"token": a, "logprob": alp, "bytes": list(a.encode())} for a, alp in alts[: max(0, top_k - 1)]
        ]
        out.append({"token": tok, "logprob": lp, "bytes": list(tok.encode()), "top_logprobs": top})
    return out


def completion_logprobs(
    tokens: list[str], lps: list[tuple[float, list[tuple[str, float]]]], top_k: int, offset: int = 0
) -> dict[str, object]:
    """Legacy completions shape: tokens, token_logprobs, top_logprobs (dicts), text_offset."""
    tops: list[dict[str, float]] = []
    offsets: list[int] = []
    pos = offset
    for tok, (lp, alts) in zip(tokens, lps, strict=True):
        top = {tok: lp} if top_k else {}
        for a, alp in alts[: max(0, top_k - 1)]:
            top[a] = alp
        tops.append(top)
        offsets.append(pos)
        pos += len(tok)
    return {
        "tokens": list(tokens),
        "token_logprobs": [lp for lp, _ in lps],
        "top_logprobs": tops,
        "text_offset": offsets,
    }
