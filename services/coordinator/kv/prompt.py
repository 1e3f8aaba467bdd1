"""A request's prompt as the engine will see it: its token ids, and their block keys.

``kv_aware`` matches a request against the blocks engines say they hold, so the request must be
tokenized exactly as the engine tokenizes it (:mod:`motor_mesh.common.tokenizer`): a chat is the
model's chat template rendered as vLLM renders it and encoded with its ``tokenizer.json`` (vLLM,
SGLang, and the simulated engine given a model directory); the simulated engine without a
template joins ``<role>: <text>`` lines, and without a ``tokenizer.json`` uses its built-in
tokenizer. Only the first prompt of a batched completion request is matched.

Chats repeat themselves: each turn of a conversation sends every earlier turn again, usually
behind a long system prompt, and encoding them whole costs about a microsecond a token (5 to 10
ms a request on a 10-turn chat with a 4k-token system prompt). So a rendered chat is encoded in
segments cut right after an added token such as Llama 3's ``<|eot_id|>``: the tokenizer splits a
text at those before anything else, so the segments' ids put together are the whole text's. The
ids of a rendered chat up to its last such cut are remembered (:class:`ChatMemo`) under the
messages it rendered, and so are those of its first message (usually a system prompt that other
conversations share). The next turn renders the template (tens of microseconds), checks that its
text starts with the remembered text (a template that does not render a conversation as a
growing text, or writes today's date into it, fails that check and is encoded whole), and
encodes only what follows. When a model's tokenizer is loaded, sample conversations are encoded
both ways (:func:`segments_agree`); a tokenizer for which the two differ is always encoded whole.

A text longer than :data:`LONG_TEXT` characters is encoded in a thread, by the tokenizer's batch
call, which does not hold the GIL while it encodes: the event loop goes on serving meanwhile.
And a long prompt is encoded a chunk at a time (:data:`CHUNK` characters, then twice that, and
so on), cut between two words (a space between letters or digits: no pre-tokenizer joins
across it, which :func:`chunks_agree` checks of the tokenizer when it is loaded): after each
chunk the index is asked whether some engine holds every block so far. Where none does, the
rest cannot change the choice (routing reads how far an engine holds the prompt's leading
blocks), so it is not encoded, and the prompt's length is estimated from the characters left.
A new 8k-token document then costs its first chunk (about 128 tokens), not its whole encoding;
one some engine holds is encoded whole, chunk after chunk.

The tokenizer of each model is loaded once per inference process (:class:`Tokenizers`), for
kv_aware and the context budget (``coordinator.clamp_max_tokens``) alike.
"""

from __future__ import annotations

import asyncio
import itertools
from array import array
from collections import OrderedDict
from collections.abc import Callable, Mapping, MutableSequence, Sequence
from typing import Any, Protocol

from motor_mesh.common import enums, log, tasks
from motor_mesh.common.tokenizer import (
    Builtin,
    HfTokenizer,
    Tokenizer,
    is_token_ids,
    load,
    message_text,
    sim_chat_text,
    tokenizer_file,
)
from motor_mesh.coordinator.kv.hashing import chain
from motor_mesh.coordinator.routes import Upstream

# Characters of text encoded inline at most: about half a millisecond of encoding at worst (short
# random words are about 2 characters a token, English prose 4; the tokenizer takes 1 to 2 µs a
# token on a busy machine), leaving room under the 1 ms the loop may be held for the rest.
LONG_TEXT = 1024
# Characters of a long prompt's first chunk (each next one twice the last): about 128 tokens,
# encoded inline in about 0.1 ms, are enough to see that no engine holds a new document.
CHUNK = 512
CUT_WITHIN = 512  # characters past a chunk's end searched for a place to cut it
MEMO_CHATS = 4096  # rendered chat prefixes remembered, at most
MEMO_TOKENS = 4 << 20  # and their token ids (8 bytes each): 32 MiB


class PromptView(Protocol):
    """A request's prompt as routing reads it: ``n`` tokens, their block keys per block size,
    and what ``kv_aware`` decided (``cached``: the tokens it expects the chosen engine to have
    cached; ``endpoint``: which of the instance's endpoints holds them)."""

    n: int
    cached: int
    endpoint: Upstream | None

    @property
    def tokens(self) -> list[int]: ...

    def hashes(self, block_size: int) -> Sequence[int]: ...


# A request's lookup: (prompt, the instance's endpoints) -> (tokens held, the endpoint holding them).
Holder = Callable[[PromptView, Sequence[Upstream]], tuple[int, Upstream | None]]
# The same, its answer written into the prompt and added to a tally of [prompt tokens, cached].
Placer = Callable[[PromptView, Sequence[Upstream], MutableSequence[int]], None]


def place(
    holder: Holder, prompt: PromptView, endpoints: Sequence[Upstream], tally: MutableSequence[int]
) -> None:
    """A :data:`Placer` from a :data:`Holder`."""
    prompt.cached, prompt.endpoint = holder(prompt, endpoints)
    tally[0] += prompt.n
    tally[1] += prompt.cached


class Said:
    """A rendered chat's text up to a cut, its ids, and their block keys per block size."""

    __slots__ = ("hashes", "ids", "text")

    def __init__(self, text: str, ids: array[int]) -> None:
        self.text = text
        self.ids = ids
        self.hashes: dict[int, array[int]] = {}


class Prompt:
    """A prompt known by its token ids; ``base``: a remembered prefix of them, whose block keys
    are not computed again; ``keep``: remembered prefixes that get this prompt's keys."""

    __slots__ = ("_base", "_hashes", "_keep", "cached", "endpoint", "ids", "n")

    def __init__(
        self, ids: Sequence[int], base: Said | None = None, keep: Sequence[Said] = (), n: int | None = None
    ) -> None:
        self.ids = ids  # all of them, or (n given: a chunked prompt cut short) the leading ones
        self.n = len(ids) if n is None else n
        self._base = base
        self._keep = keep
        self._hashes: dict[int, Sequence[int]] = {}
        self.cached = 0
        self.endpoint: Upstream | None = None

    @property
    def tokens(self) -> list[int]:
        return list(self.ids)

    def hashes(self, block_size: int) -> Sequence[int]:
        """The keys of the prompt's full blocks of ``block_size`` tokens (:mod:`.hashing`);
        none when an id has no key."""
        h = self._hashes.get(block_size)
        if h is None:
            h = self._hashes[block_size] = self._chain(block_size)
            for said in self._keep:
                if block_size not in said.hashes and isinstance(h, array):
                    said.hashes[block_size] = h[: len(said.ids) // block_size]
        return h

    def _chain(self, block_size: int) -> Sequence[int]:
        base = self._base
        known = base.hashes.get(block_size) if base is not None else None
        try:
            if known:
                done = len(known) * block_size
                return known + chain(self.ids[done:], block_size, known[-1])
            return chain(self.ids, block_size)
        except OverflowError:  # an id outside 64 bits (given by the client): no keys
            return array("q")


class ChatMemo:
    """Rendered chat prefixes (:class:`Said`) by the messages rendered, the least recently used
    forgotten first past ``max_chats`` of them or ``max_tokens`` ids in all."""

    def __init__(self, max_chats: int = MEMO_CHATS, max_tokens: int = MEMO_TOKENS) -> None:
        self.max_chats = max_chats
        self.max_tokens = max_tokens
        self._said: OrderedDict[int, Said] = OrderedDict()
        self.tokens = 0

    def __len__(self) -> int:
        return len(self._said)

    def find(self, keys: Sequence[int], text: str) -> Said | None:
        """The longest remembered prefix of ``text`` among those of the messages ``keys`` name."""
        said_by = self._said
        for key in reversed(keys):
            said = said_by.get(key)
            if said is not None and text.startswith(said.text):
                said_by.move_to_end(key)
                return said
        return None

    def keep(self, key: int, said: Said) -> None:
        old = self._said.pop(key, None)
        if old is not None:
            self.tokens -= len(old.ids)
        self._said[key] = said
        self.tokens += len(said.ids)
        while self._said and (len(self._said) > self.max_chats or self.tokens > self.max_tokens):
            self.tokens -= len(self._said.popitem(last=False)[1].ids)


def message_keys(messages: Sequence[Any]) -> list[int]:
    """A key per leading run of ``messages``: the i-th names messages[: i + 1]. (Keys only pick
    a remembered text to try: the text itself is compared before it is used.)"""
    keys: list[int] = []
    key = 0
    for m in messages:
        content = m.get("content")
        if len(m) == 2 and isinstance(content, str):
            key = hash((key, m.get("role"), content))
        else:
            key = hash((key, repr(m)))
        keys.append(key)
    return keys


class _Job:
    """A prompt's text to encode, in segments, and what to remember once it is encoded."""

    __slots__ = ("base", "cuts", "segments", "special", "text")

    def __init__(
        self,
        text: str,
        special: bool,
        base: Said | None = None,
        cuts: Sequence[tuple[int, int]] = (),
    ) -> None:
        self.text = text
        self.special = special
        self.base = base
        # (character, message key): remember the text up to each cut, under that key
        self.cuts = cuts
        start = len(base.text) if base is not None else 0
        bounds = [start, *(c for c, _ in cuts), len(text)]
        self.segments = [text[a:b] for a, b in itertools.pairwise(bounds)]

    @property
    def chars(self) -> int:
        return sum(map(len, self.segments))

    def finish(self, encoded: Sequence[Sequence[int]], memo: ChatMemo | None) -> Prompt:
        """The prompt of the segments' ids (one list each), its prefixes remembered."""
        if not self.cuts and self.base is None:
            return Prompt(encoded[0])
        ids = self.base_ids()
        keep: list[Said] = []
        for segment, (cut, key) in zip(encoded, self.cuts, strict=False):
            ids.extend(segment)
            self.remember(cut, key, ids, keep, memo)
        ids.extend(encoded[-1])
        return Prompt(ids, self.base, keep)

    def base_ids(self) -> array[int]:
        """A copy of the remembered prefix's ids, to extend."""
        return array("q", self.base.ids) if self.base is not None else array("q")

    def remember(self, cut: int, key: int, ids: array[int], keep: list[Said], memo: ChatMemo | None) -> None:
        """The text up to ``cut``, whose ids are ``ids``, remembered under message key ``key``."""
        said = Said(self.text[:cut], ids[:])
        keep.append(said)
        if memo is not None:
            memo.keep(key, said)


class Tokens:
    """Token ids of request bodies for one (model, engine type)."""

    def __init__(self, tokenizer: Tokenizer, sim: bool) -> None:
        self.tokenizer = tokenizer
        self.sim = sim
        hf = tokenizer if isinstance(tokenizer, HfTokenizer) else None
        self._hf = hf
        self.templated = hf is not None and hf.has_chat_template
        # The added tokens the template writes, which a rendered chat is cut after; and the
        # memo, once segments_agree says the tokenizer encodes cut texts as whole ones.
        self.cutters: tuple[str, ...] = ()
        self.memo: ChatMemo | None = None
        # Whether a long prompt may be encoded a chunk at a time (chunks_agree).
        self.chunked = hf is not None and chunks_agree(hf)
        if hf is not None and self.templated:
            self.cutters = template_cutters(self)
            if self.cutters:
                self.memo = ChatMemo()  # what segments_agree reads the samples through
                self.memo = ChatMemo() if segments_agree(self) else None  # without the samples

    # -- reading a request ---------------------------------------------------------------------

    def of(self, req: dict[str, Any], chat: bool) -> list[int] | None:
        """The ids of the request's (first) prompt; None when the body has none we can read."""
        prompt = self.read(req, chat)
        return None if prompt is None else prompt.tokens

    def read(self, req: dict[str, Any], chat: bool) -> Prompt | None:
        """The request's (first) prompt, encoded here; None when the body has none we can read
        (a template or tokenizer error only costs the routing hint)."""
        try:
            job = self._job(req, chat)
            if job is None or isinstance(job, Prompt):
                return job
            return job.finish(self._encode(job), self.memo)
        except Exception:
            return None

    async def prompt(
        self, req: dict[str, Any], chat: bool, held: Callable[[Prompt], bool] | None = None
    ) -> Prompt | None:
        """:meth:`read`, a long text encoded in a thread (the request path's). ``held``: whether
        some engine holds every block of a prompt's leading chunks: with it a long prompt is
        encoded only as far as that is so."""
        try:
            job = self._job(req, chat)
            if job is None or isinstance(job, Prompt):
                return job
            hf = self._hf
            if hf is not None and held is not None and self.chunked and job.chars > CHUNK + CUT_WITHIN:
                return await self._chunked(hf, job, held)
            if hf is not None and job.chars > LONG_TEXT:
                encoded = await asyncio.to_thread(hf.encode_all, job.segments, special=job.special)
            else:
                encoded = self._encode(job)
            return job.finish(encoded, self.memo)
        except Exception:
            return None

    async def _chunked(self, hf: HfTokenizer, job: _Job, held: Callable[[Prompt], bool]) -> Prompt:
        """``job`` encoded a chunk at a time, as long as ``held`` says some engine holds every
        block so far (see the module's doc); the chat prefixes it passes are remembered."""
        text, base = job.text, job.base
        ids = job.base_ids()
        keys = dict(job.cuts)
        bounds = sorted({*keys, len(text)})
        keep: list[Said] = []
        pos = len(base.text) if base is not None else 0
        size = CHUNK
        while True:
            end = next(b for b in bounds if b > pos)
            if end - pos > size + CUT_WITHIN:
                end = _word_cut(text, pos + size, pos + size + CUT_WITHIN) or end
            special = job.special and pos == 0
            piece = text[pos:end]
            if len(piece) > LONG_TEXT:
                (part,) = await asyncio.to_thread(hf.encode_all, [piece], special=special)
            else:
                part = hf.encode(piece, special=special)
            ids.extend(part)
            key = keys.get(end)
            if key is not None:
                job.remember(end, key, ids, keep, self.memo)
            if end == len(text):
                return Prompt(ids, base, keep)
            if end - pos >= size:  # a whole chunk: ask before the next one
                if not held(Prompt(ids, base, keep)):
                    seen = end - (len(base.text) if base is not None else 0)
                    left = len(text) - end
                    estimate = len(ids) + round(left * (len(ids) - (len(base.ids) if base else 0)) / seen)
                    return Prompt(ids, base, keep, n=estimate)
                size *= 2
            pos = end

    def _encode(self, job: _Job) -> list[list[int]]:
        encode = self.tokenizer.encode
        if len(job.segments) == 1:  # (an empty completion prompt is its BOS)
            return [encode(job.segments[0], special=job.special)]
        return [encode(s, special=job.special) if s else [] for s in job.segments]

    def _job(self, req: dict[str, Any], chat: bool) -> _Job | Prompt | None:
        if not chat:
            return self._completion(req.get("prompt"))
        messages = req.get("messages")
        if not isinstance(messages, list) or not messages:
            return None
        text = self.chat_text(req, messages)
        if text is None:
            return None
        memo = self.memo
        if memo is None or not all(isinstance(m, dict) for m in messages):
            return _Job(text, False)
        keys = message_keys(messages)
        base = memo.find(keys, text)
        start = len(base.text) if base is not None else 0
        cuts: list[tuple[int, int]] = []
        if base is None and len(keys) > 1:
            # A conversation's first request: remember its first message too (a system prompt
            # other conversations share), cut at its last added token.
            # (Rendered alone, it may end otherwise: Llama 3's template always adds the
            # assistant's header. What it shares with the whole chat is what counts.)
            first = self._first_message_text(messages[0])
            if first is not None:
                cut = self._last_cut(text, 0, _common_prefix(first, text))
                if cut > 0:
                    cuts.append((cut, keys[0]))
        last = self._last_cut(text, max(start, cuts[-1][0] if cuts else 0), len(text))
        if last > 0:
            cuts.append((last, keys[-1]))
        return _Job(text, False, base, cuts)

    def chat_text(self, req: dict[str, Any], messages: list[Any]) -> str | None:
        """The chat as the engine renders it; None when it cannot be read."""
        tok = self._hf
        if tok is not None and self.templated:
            return tok.chat_text(
                messages,
                req.get("tools"),
                add_generation_prompt=req.get("add_generation_prompt") is not False,
                continue_final_message=req.get("continue_final_message") is True,
            )
        if not self.sim:
            return None  # a real engine's template is unknown: its ids cannot be guessed
        pairs = []
        for m in messages:
            text = message_text(m.get("content")) if isinstance(m, dict) else None
            role = m.get("role") if isinstance(m, dict) else None
            if text is None or not isinstance(role, str):
                return None
            pairs.append((role, text))
        return sim_chat_text(pairs)

    def _first_message_text(self, message: Any) -> str | None:
        hf = self._hf
        if hf is None:
            return None
        try:
            return hf.chat_text([message], add_generation_prompt=False)
        except Exception:
            return None

    def _last_cut(self, text: str, lo: int, hi: int) -> int:
        """The end of the last added token of the template in ``text[lo:hi]``; 0 if none."""
        best = 0
        for token in self.cutters:
            at = text.rfind(token, lo, hi)
            if at >= 0:
                best = max(best, at + len(token))
        return best

    def _completion(self, prompt: Any) -> _Job | Prompt | None:
        if isinstance(prompt, list):
            if not prompt:
                return None  # no prompt (the engine rejects it), not an empty one
            prompt = prompt[0] if isinstance(prompt[0], (str, list)) else prompt
        if isinstance(prompt, str):
            return _Job(prompt, True)
        if isinstance(prompt, list) and is_token_ids(prompt):
            return Prompt(list(prompt))  # token ids: every engine takes them as they are
        return None


class Tokenizers:
    """The :class:`Tokens` of each (model, engine type), loaded off the loop once something
    wants them: ``paths`` (``coordinator.tokenizers``) names a model's tokenizer, else the model
    name is tried as a local path. One per inference process, shared by what reads prompts
    (kv_aware routing, the context budget), so a tokenizer is loaded once. ``who`` names the
    log events (``<who>_tokenizer``, ``<who>_no_tokenizer``, ``<who>_tokenizer_failed``)."""

    def __init__(self, paths: Mapping[str, str], who: str = "kv") -> None:
        self._paths = paths
        self._who = who
        self._tokens: dict[tuple[str, int], Tokens | None] = {}  # None: loading, or none to load

    def get(self, model: str, engine_type: int) -> Tokens | None:
        """The loaded Tokens; None while loading, or when there is no tokenizer to load."""
        return self._tokens.get((model, engine_type))

    def want(self, model: str, engine_type: int) -> None:
        """Start loading the tokenizer of (model, engine type), unless that was done before."""
        key = (model, engine_type)
        if key in self._tokens:
            return
        self._tokens[key] = None
        tasks.start(f"{self._who}_tokenizer {model}", self._load(model, engine_type))

    async def _load(self, model: str, engine_type: int) -> None:
        sim = engine_type == enums.ENGINE_SIM
        path = self._paths.get(model) or model
        who = self._who
        try:
            tokenizer = await asyncio.to_thread(_tokenizer_for, path, sim)
        except Exception as exc:  # any failure: this model's prompts are not read
            log.warn(f"{who}_tokenizer_failed", model=model, path=path, error=str(exc) or type(exc).__name__)
            return
        if tokenizer is None:
            # A real engine's ids cannot be guessed: its prompts are not read.
            log.warn(f"{who}_no_tokenizer", model=model, hint="set coordinator.tokenizers")
            return
        # Loading checks how the tokenizer encodes sample chats (segments_agree): off the loop.
        tokens = await asyncio.to_thread(Tokens, tokenizer, sim)
        self._tokens[(model, engine_type)] = tokens
        incremental = tokens.memo is not None
        log.event(f"{who}_tokenizer", model=model, tokenizer=tokenizer.name, sim=sim, incremental=incremental)


def _tokenizer_for(path: str, sim: bool) -> Tokenizer | None:
    """The simulated engine falls back to its built-in tokenizer, as the engine itself does."""
    if tokenizer_file(path) is None:
        return Builtin() if sim else None
    return load(path)


def _word_cut(text: str, lo: int, hi: int) -> int | None:
    """A place in ``text[lo:hi]`` to cut it between two words: a space with a letter or digit on
    either side (the cut goes before the space, which starts the next word's token)."""
    at = text.find(" ", lo, hi)
    while at > 0:
        if at + 1 < len(text) and text[at - 1].isalnum() and text[at + 1].isalnum():
            return at
        at = text.find(" ", at + 1, hi)
    return None


_CHUNK_SAMPLES = (
    "The quick brown fox jumps over the lazy dog. " * 40,
    "def route(self, call):\n    return self.policy(call)  # why: 12345 67890\n" * 30,
    "Ünïcödé wörds, 漢字 テキスト and emoji 🙂 between spaces; numbers 3141592653 too. " * 30,
    "it's they're we've I'm you'll he'd: contractions after spaces " * 40,
)


def chunks_agree(tok: HfTokenizer) -> bool:
    """Whether sample texts cut between words (:func:`_word_cut`) encode, chunk after chunk, as
    they do whole: with the special tokens on the first chunk only."""
    try:
        for text in _CHUNK_SAMPLES:
            for at in (97, 331, 800, 1500):
                cut = _word_cut(text, at, at + CUT_WITHIN)
                if cut is None:
                    continue
                whole = tok.encode(text, special=True)
                parts = tok.encode(text[:cut], special=True) + tok.encode(text[cut:], special=False)
                if parts != whole:
                    return False
    except Exception:
        return False
    return True


def _common_prefix(a: str, b: str) -> int:
    """The length of the longest common prefix of ``a`` and ``b``, by bisection (each step a
    memory compare)."""
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if b.startswith(a[:mid]):
            lo = mid
        else:
            hi = mid - 1
    return lo


# Conversations encoded both ways when a tokenizer is loaded: spaces and newlines at the edges
# of messages (what a cut could change the encoding of), non-ASCII text, an empty message.
_SAMPLES = (
    "You are a helpful assistant.\n\nAnswer briefly.  ",
    " Hello there,\nhow are you?",
    "\n\nI am fine. Ünïcödé, 漢字 and emoji 🙂 too.\n",
    "",
    "   spaces before and after   ",
    "Numbers 12345 and symbols <tag> {json: [1, 2]}\n\n\n",
)


def template_cutters(tokens: Tokens) -> tuple[str, ...]:
    """The added tokens a tokenizer splits at that its chat template writes (found by rendering
    a sample conversation)."""
    hf = tokens._hf
    if hf is None:
        return ()
    messages = [{"role": "system", "content": _SAMPLES[0]}, {"role": "user", "content": _SAMPLES[1]}]
    try:
        text = hf.chat_text(messages)
    except Exception:
        return ()
    if text is None:
        return ()
    return tuple(t for t in hf.splitters if t in text)


def segments_agree(tokens: Tokens) -> bool:
    """Whether sample conversations, turn after turn, encode through the memo as they do whole."""
    hf = tokens._hf
    if hf is None:
        return False
    messages: list[dict[str, Any]] = [{"role": "system", "content": _SAMPLES[0]}]
    try:
        for i, content in enumerate(_SAMPLES[1:]):
            messages.append({"role": "user", "content": content})
            body = {"messages": list(messages)}
            text = tokens.chat_text(body, body["messages"])
            if text is None or tokens.of(body, True) != hf.encode(text, special=False):
                return False
            messages.append({"role": "assistant", "content": _SAMPLES[-1 - i]})
    except Exception:
        return False
    return True
