"""Deterministic token generation and log-probabilities.

The same prompt always yields the same text on every engine process, so a PD pair produces
exactly what a union engine would and tests can compare outputs across topologies. Simple
questions with a known answer (arithmetic, a few facts) are answered correctly, which is what
makes a precision probe meaningful: a healthy engine passes it, a `precision` fault fails it.

Each output token is a function of the whole token context before it, as a language model's is
under greedy sampling: the context (prompt ids, then the ids generated so far) is folded into a
CRC-32 state, each id as one little-endian 32-bit word, and the next token is picked from that
state and the context's length. So a request whose prompt is a fault-free run's prompt plus its
first k output ids, asking for k fewer tokens, yields exactly that run's tokens k.. (same ids,
same text): what lets a router continue a stream on another engine after the first one died
(docs/sim-engine.md). CRC-32, not a wider hash: zlib folds a whole prompt in C, and the
length mixed into each pick keeps the sequence from ever cycling. The sim reads no sampling
parameter: every request decodes greedily, whatever its temperature.

The output vocabulary (:class:`OutputVocab`) is a fixed list of English words, each spelled with
a leading space and carried by the id the engine's tokenizer gives it, so the ids of an answer
are what its text tokenizes to. A known answer is emitted first for a fresh question (its text
in the prompt, as text, and not already followed by the answer); the tokens after it fold it
into the context like any other.
"""

from __future__ import annotations

import array
import re
import sys
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

from motor_mesh.common.tokenizer import Builtin

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
_MASK32 = 0xFFFFFFFF
_GOLDEN = 0x9E3779B97F4A7C15
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

# (piece, id): one output token, its text and its id.
Token = tuple[str, int]


def count_tokens(text: str) -> int:
    return max(1, len(text.split()))


def seed_of(text: str, engine_seed: int = 0) -> int:
    return zlib.crc32(text.encode("utf-8", "surrogatepass")) ^ (engine_seed & 0xFFFFFFFF)


@lru_cache(maxsize=4096)
def _find(question: str) -> tuple[str, int] | None:
    """The answer to a simple probe question in the text, and where that question ends."""
    m = _ARITH.search(question)
    if m:
        a, op, b = int(m.group(1)), m.group(2), int(m.group(3))
        if op == "+":
            return str(a + b), m.end()
        if op == "-":
            return str(a - b), m.end()
        if op in "*x\u00d7":
            return str(a * b), m.end()
        if b != 0 and a % b == 0:
            return str(a // b), m.end()
        return None
    low = question.lower()
    for key, answer in _FACTS:
        at = low.find(key)
        if at >= 0:
            return answer, at + len(key)
    return None


def known_answer(question: str) -> str | None:
    """The answer a healthy model gives to a simple probe question, if it is one."""
    hit = _find(question)
    return hit[0] if hit is not None else None


def unanswered(text: str) -> str | None:
    """The known answer a prompt asks for, unless the prompt already has it after its question:
    then it is an answer being continued (a prompt resent with the text delivered so far), whose
    next tokens come from the context."""
    hit = _find(text)
    if hit is None:
        return None
    answer, end = hit
    return None if answer in text[end:].split() else answer


class OutputVocab:
    """What the engine generates from: :data:`VOCAB`'s words as pieces (" word") with the ids the
    engine's tokenizer gives them (tokens.output_vocab builds it), and the garbled pieces of a
    precision fault with theirs. Compared by identity (it keys the generation cache)."""

    __slots__ = ("garbled", "ids", "packed", "pieces")

    def __init__(self, tokens: Sequence[Token], garbled: Sequence[Token]) -> None:
        self.pieces = tuple(p for p, _ in tokens)
        self.ids = tuple(i for _, i in tokens)
        self.packed = tuple(pack_ids([i]) for i in self.ids)  # what the fold hashes per token
        self.garbled = tuple(garbled)


def pack_ids(ids: Sequence[int]) -> bytes:
    """Token ids as the context hash reads them: little-endian 32-bit words (the same bytes on
    every machine). Ids are vocabulary indices, checked non-negative and in range before."""
    try:
        arr = array.array("I", ids)
    except OverflowError:  # not a real id: only for a caller that did not check (fold mod 2^32)
        arr = array.array("I", [i & _MASK32 for i in ids])
    if sys.byteorder != "little":
        arr.byteswap()
    return arr.tobytes()


def context_state(ids: Sequence[int]) -> int:
    """The fold of a whole context: CRC-32 over its ids. Appending ids continues it:
    ``crc32(pack_ids(more), context_state(ids)) == context_state(ids + more)``."""
    return zlib.crc32(pack_ids(ids))


def choice_salt(engine_seed: int, index: int) -> int:
    """What makes choice ``index`` of an n > 1 request differ from choice 0 (and one `--seed`
    from another); choice 0 with seed 0 is the plain function of the context."""
    return (engine_seed ^ (index * 0x9E3779B1)) & _MASK32


@dataclass(slots=True)
class Generated:
    tokens: list[str]
    ids: list[int]
    # per token: (chosen logprob, [(alternative token, logprob), ...]) only when asked for
    logprobs: list[tuple[float, list[tuple[str, float]]]] | None

    @property
    def text(self) -> str:
        return "".join(self.tokens)


def _pick(state: int, length: int, salt: int) -> int:
    """Well-mixed bits from a context's state and length (the length: no sequence ever cycles):
    the high bits of a multiplicative hash, where every bit of the input has reached."""
    return (((state ^ salt) | (length << 32)) * _GOLDEN) >> 32


def _continue(
    vocab: OutputVocab,
    state: int,
    length: int,
    n_tokens: int,
    salt: int = 0,
    forced: tuple[Token, ...] = (),
    top_k: int | None = None,
    garbled: bool = False,
) -> Generated:
    if garbled:
        return _garbled(vocab, state, n_tokens, top_k)
    pieces, ids, packed, v = vocab.pieces, vocab.ids, vocab.packed, len(vocab.pieces)
    out_t: list[str] = []
    out_i: list[int] = []
    picks: list[int] | None = [] if top_k is not None else None
    crc = zlib.crc32
    for piece, tid in forced[:n_tokens]:
        out_t.append(piece)
        out_i.append(tid)
        if picks is not None:
            picks.append(_pick(state, length, salt))
        state = crc(pack_ids([tid]), state)
        length += 1
    # _pick inlined, the length kept shifted: this loop is the generation's whole cost.
    high, one = length << 32, 1 << 32
    add_t, add_i = out_t.append, out_i.append
    for _ in range(n_tokens - len(out_t)):
        z = (((state ^ salt) | high) * _GOLDEN) >> 32
        k = z % v
        add_t(pieces[k])
        add_i(ids[k])
        if picks is not None:
            picks.append(z)
        state = crc(packed[k], state)
        high += one
    if picks is None or top_k is None:
        return Generated(out_t, out_i, None)
    lps: list[tuple[float, list[tuple[str, float]]]] = []
    for tok, z in zip(out_t, picks, strict=True):
        # From the pick's own bits: a position's log-probabilities depend on its context only.
        top1 = -round(0.001 + ((z >> 8) % 500) / 1000, 4)
        alts: list[tuple[str, float]] = []
        j = 0
        while len(alts) < top_k - 1:
            cand = pieces[((z >> 20) + 7 * j) % v]
            j += 1
            if cand != tok and all(cand != a for a, _ in alts):
                alts.append((cand, round(top1 - 1.5 * (len(alts) + 1), 4)))
        lps.append((top1, alts))
    return Generated(out_t, out_i, lps)


def _garbled(vocab: OutputVocab, seed: int, n_tokens: int, top_k: int | None) -> Generated:
    """What an engine with broken numerics emits: replacement characters and one token over and
    over, every log-probability collapsed (not a function of the context: a fault)."""
    marks = vocab.garbled
    toks = [marks[i % len(marks)] for i in range(n_tokens)]
    gen = Generated([p for p, _ in toks], [i for _, i in toks], None)
    if top_k is None:
        return gen
    x = (seed * _GOLDEN + 1) & _MASK
    lps: list[tuple[float, list[tuple[str, float]]]] = []
    for i, tok in enumerate(gen.tokens):
        x = (x * 6364136223846793005 + 1442695040888963407) & _MASK
        alts: list[tuple[str, float]] = []
        j = 0
        while len(alts) < top_k - 1:
            cand = vocab.pieces[(i + 7 * j + (x >> 20)) % len(vocab.pieces)]
            j += 1
            if cand != tok and all(cand != a for a, _ in alts):
                alts.append((cand, round(COLLAPSED_LOGPROB - 0.01 * (len(alts) + 1), 4)))
        lps.append((COLLAPSED_LOGPROB, alts))
    gen.logprobs = lps
    return gen


# Deterministic, so identical prompts (benchmarks, probes, PD legs) skip the work.
_continue_cached = lru_cache(maxsize=2048)(_continue)
_CACHE_MAX_TOKENS = 512


def continue_context(
    vocab: OutputVocab,
    state: int,
    length: int,
    n_tokens: int,
    salt: int = 0,
    forced: tuple[Token, ...] = (),
    top_k: int | None = None,
    garbled: bool = False,
) -> Generated:
    """`n_tokens` tokens after a context of `length` ids folded into `state`
    (:func:`context_state`): first the `forced` ones (a known answer), then each picked from the
    context so far. `salt` (:func:`choice_salt`) sets one choice of an n > 1 request apart;
    `top_k` (0-20) asks for log-probabilities and that many most likely tokens per position (the
    chosen one first); `garbled` simulates an engine whose numerics went wrong. Callers must not
    mutate the result: short outputs are cached."""
    if n_tokens <= _CACHE_MAX_TOKENS:
        return _continue_cached(vocab, state, length, n_tokens, salt, forced, top_k, garbled)
    return _continue(vocab, state, length, n_tokens, salt, forced, top_k, garbled)


def _builtin_vocab() -> OutputVocab:
    enc = Builtin().encode
    words = [(" " + w, enc(w)[0]) for w in VOCAB]
    return OutputVocab(words, [(p, (enc(p) or [0])[0]) for p in GARBLED])


# The built-in tokenizer's: one id per word (tokens.output_vocab hands it out for that tokenizer).
BUILTIN_OUTPUT = _builtin_vocab()


def generate(
    seed: int,
    n_tokens: int,
    answer: str | None = None,
    top_k: int | None = None,
    garbled: bool = False,
) -> Generated:
    """`n_tokens` tokens after an empty context whose state is `seed`, in the built-in
    tokenizer's vocabulary, `answer` first: the generator without a prompt (what a test wants
    from the sim's text without running it). Callers must not mutate the result."""
    forced: tuple[Token, ...] = ()
    if answer is not None:
        forced = ((" " + answer, (Builtin().encode(answer) or [0])[0]),)
    return continue_context(BUILTIN_OUTPUT, seed & _MASK32, 0, n_tokens, 0, forced, top_k, garbled)


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
