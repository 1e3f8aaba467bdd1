"""A request's prompt as the engine will see it: its token ids, and their block hashes.

``kv_aware`` matches a request against the blocks engines say they hold, so the request must be
tokenized exactly as the engine tokenizes it (:mod:`motor_mesh.common.tokenizer`): for the
simulated engine its ``<role>: <text>`` chat lines and its tokenizer, for vLLM and SGLang the
model's chat template and ``tokenizer.json``. Only the first prompt of a batched completion
request is matched (the others usually share its prefix).

Chat requests repeat themselves: a long system prompt in request after request, and each turn of
a conversation sends every earlier turn again. With the built-in tokenizer (one token per
whitespace word: the ids of lines joined by newlines are the lines' ids one after the other)
each chat message's ids are remembered, so a request tokenizes only the messages it adds,
usually its last question. In C (:mod:`.speedups`, where it was built) what is remembered is
each *sequence* of messages seen, by a hash of its texts, with its block hashes: a request then
tokenizes and hashes only what follows the longest sequence seen, and reads no ids at all of
the rest.
"""

from __future__ import annotations

from collections.abc import Callable, MutableSequence, Sequence
from typing import Any, Protocol

from motor_mesh.common.tokenizer import (
    BUILTIN_VOCAB,
    Builtin,
    HfTokenizer,
    Tokenizer,
    is_token_ids,
    message_text,
    sim_chat_text,
)
from motor_mesh.coordinator.kv import speedups
from motor_mesh.coordinator.kv.hashing import ROOT
from motor_mesh.coordinator.routes import Upstream

LINE_CACHE_MAX = 4096  # chat messages whose ids are remembered (the Python path)
TURN_CACHE_MAX = 4096  # message sequences whose hashes are remembered (the C path)
TURN_CACHE_BYTES = 64 << 20  # their hashes, at most
DEFAULT_BLOCK_SIZE = 16  # what a chat is hashed at before the index knows the engines'


class PromptView(Protocol):
    """A request's prompt as routing reads it: ``n`` tokens, their block hashes per block size,
    and what ``kv_aware`` decided (``cached``: the tokens it expects the chosen engine to have
    cached; ``endpoint``: which of the instance's endpoints holds them). A :class:`Prompt`, or
    the C path's ``ChatPrompt``."""

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
    """A :data:`Placer` from a :data:`Holder`: what the C ``place`` does, in Python."""
    prompt.cached, prompt.endpoint = holder(prompt, endpoints)
    tally[0] += prompt.n
    tally[1] += prompt.cached


class Prompt:
    """A prompt known by its token ids."""

    __slots__ = ("_hashes", "cached", "endpoint", "ids", "n")

    def __init__(self, ids: Sequence[int]) -> None:
        self.ids = ids
        self.n = len(ids)
        self._hashes: dict[int, Sequence[int]] = {}
        self.cached = 0
        self.endpoint: Upstream | None = None

    @property
    def tokens(self) -> list[int]:
        return list(self.ids)

    def hashes(self, block_size: int) -> Sequence[int]:
        """The chained hashes of the prompt's full blocks of ``block_size`` tokens."""
        h = self._hashes.get(block_size)
        if h is None:
            h = self._hashes[block_size] = speedups.chain(self.ids, block_size)
        return h


class Tokens:
    """Token ids of request bodies for one (model, engine type)."""

    def __init__(self, tokenizer: Tokenizer, sim: bool) -> None:
        self.tokenizer = tokenizer
        self.sim = sim
        by_line = sim and isinstance(tokenizer, Builtin)
        # With the built-in tokenizer: in C, each sequence of chat messages' hashes remembered;
        # here (text parts, or no C), each message's ids.
        native = speedups.native
        self.chats = (
            native.Chats(BUILTIN_VOCAB, TURN_CACHE_MAX, TURN_CACHE_BYTES, ROOT)
            if by_line and native is not None
            else None
        )
        self._lines: dict[tuple[str, str], tuple[int, ...]] | None = {} if by_line else None
        self.block_size = DEFAULT_BLOCK_SIZE

    @property
    def block_size(self) -> int:
        """The engines' block size, which a chat is hashed at in C (kept by routing.KvRouting,
        and by :attr:`chats` for the C request path)."""
        return self._block_size

    @block_size.setter
    def block_size(self, size: int) -> None:
        if self.chats is not None:
            self.chats.block_size = size  # checks it
        self._block_size = size

    def of(self, req: dict[str, Any], chat: bool) -> list[int] | None:
        """The ids of the request's (first) prompt; None when the body has none we can read."""
        prompt = self.prompt(req, chat)
        return None if prompt is None else prompt.tokens

    def prompt(self, req: dict[str, Any], chat: bool) -> PromptView | None:
        """The request's (first) prompt; None when the body has none we can read."""
        chats = self.chats
        if chat and chats is not None:
            try:
                read = chats.prompt(req.get("messages"), self.block_size)
            except Exception:
                return None
            if read is not None:
                return read
        return self.read(req, chat)

    def read(self, req: dict[str, Any], chat: bool) -> Prompt | None:
        """:meth:`prompt` in Python: what :attr:`chats` (the C path, where it was built) does not
        read. Called directly by a request path that tried ``chats`` itself."""
        try:
            ids = (
                self._chat(req.get("messages"), req.get("tools"))
                if chat
                else self._completion(req.get("prompt"))
            )
        except Exception:  # a template or tokenizer error only costs the hint
            return None
        return None if ids is None else Prompt(ids)

    def _chat(self, messages: Any, tools: Any) -> Sequence[int] | None:
        if not isinstance(messages, list) or not messages:
            return None
        if not self.sim:
            tok = self.tokenizer
            text = tok.chat_text(messages, tools) if isinstance(tok, HfTokenizer) else None
            return None if text is None else tok.encode(text, special=False)
        pairs = []
        for m in messages:
            text = message_text(m.get("content")) if isinstance(m, dict) else None
            role = m.get("role") if isinstance(m, dict) else None
            if text is None or not isinstance(role, str):
                return None
            pairs.append((role, text))
        if self._lines is None:
            return self.tokenizer.encode(sim_chat_text(pairs), special=False)
        return [i for pair in pairs for i in self._line(self._lines, pair)]

    def _line(self, lines: dict[tuple[str, str], tuple[int, ...]], pair: tuple[str, str]) -> tuple[int, ...]:
        ids = lines.pop(pair, None)  # and back in at the end: least recently used goes first
        if ids is None:
            ids = tuple(self.tokenizer.encode(sim_chat_text([pair]), special=False))
            if len(lines) >= LINE_CACHE_MAX:
                lines.pop(next(iter(lines)))
        lines[pair] = ids
        return ids

    def _completion(self, prompt: Any) -> list[int] | None:
        if isinstance(prompt, list):
            if not prompt:
                return None  # no prompt (the engine rejects it), not an empty one
            prompt = prompt[0] if isinstance(prompt[0], (str, list)) else prompt
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt, special=True)
        if isinstance(prompt, list) and is_token_ids(prompt):
            return list(prompt)  # token ids: every engine, the simulated one too, takes them as they are
        return None
