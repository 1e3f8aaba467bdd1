"""A request's prompt as the engine will see it: its token ids, and their block hashes.

``kv_aware`` matches a request against the blocks engines say they hold, so the request must be
tokenized exactly as the engine tokenizes it (:mod:`services.common.tokenizer`): for the
simulated engine its ``<role>: <text>`` chat lines and its tokenizer, for vLLM and SGLang the
model's chat template and ``tokenizer.json``. Only the first prompt of a batched completion
request is matched (the others usually share its prefix).

A long system prompt repeats in request after request, so with the built-in tokenizer each chat
message's ids are remembered (a bounded cache): splitting on whitespace, the ids of lines joined
by newlines are the lines' ids one after the other. The first message's own block hashes are
remembered with it, so a request hashes only the blocks after its system prompt: this runs on
every request, and a 1,000-token prompt costs tens of microseconds to tokenize and hash afresh.
"""

from __future__ import annotations

from typing import Any

from services.common.tokenizer import (
    Builtin,
    HfTokenizer,
    Tokenizer,
    is_token_ids,
    message_text,
    sim_chat_text,
    token_prompt_text,
)
from services.coordinator.kv.hashing import ROOT, chain
from services.coordinator.routes import Upstream

LINE_CACHE_MAX = 4096  # distinct chat lines remembered (system prompts, earlier turns)


class Prompt:
    """One request's token ids, hashed per block size on first use; ``cached`` and ``endpoint``
    are what ``kv_aware`` decided (the tokens it expects the chosen engine to have cached, and
    which of the instance's endpoints holds them)."""

    __slots__ = ("_hashes", "_head", "cached", "endpoint", "tokens")

    def __init__(self, tokens: list[int], head: Line | None = None) -> None:
        self.tokens = tokens
        self._head = head  # the remembered message the tokens start with, if any
        self._hashes: dict[int, list[int]] = {}
        self.cached = 0
        self.endpoint: Upstream | None = None

    def hashes(self, block_size: int) -> list[int]:
        h = self._hashes.get(block_size)
        if h is None:
            head = self._head
            if head is None:
                h = chain(self.tokens, block_size)
            else:
                # The head's full blocks are the prompt's first ones: hashed once, then the
                # chain goes on from the last of them.
                known = head.hashes(block_size)
                rest = self.tokens[len(known) * block_size :]
                h = known + chain(rest, block_size, known[-1] if known else ROOT)
            self._hashes[block_size] = h
        return h


class Line:
    """One remembered chat message: its ids, and the hashes of their full blocks when it starts
    a prompt."""

    __slots__ = ("_hashes", "ids")

    def __init__(self, ids: list[int]) -> None:
        self.ids = ids
        self._hashes: dict[int, list[int]] = {}

    def hashes(self, block_size: int) -> list[int]:
        h = self._hashes.get(block_size)
        if h is None:
            h = self._hashes[block_size] = chain(self.ids, block_size)
        return h


class Tokens:
    """Token ids of request bodies for one (model, engine type)."""

    def __init__(self, tokenizer: Tokenizer, sim: bool) -> None:
        self.tokenizer = tokenizer
        self.sim = sim
        self._lines: dict[tuple[str, str], Line] = {}
        self._by_line = sim and isinstance(tokenizer, Builtin)

    def of(self, req: dict[str, Any], chat: bool) -> list[int] | None:
        """The ids of the request's (first) prompt; None when the body has none we can read."""
        prompt = self.prompt(req, chat)
        return None if prompt is None else prompt.tokens

    def prompt(self, req: dict[str, Any], chat: bool) -> Prompt | None:
        """The request's (first) prompt; None when the body has none we can read."""
        try:
            if chat:
                return self._chat(req.get("messages"), req.get("tools"))
            ids = self._completion(req.get("prompt"))
        except Exception:  # a template or tokenizer error only costs the hint
            return None
        return None if ids is None else Prompt(ids)

    def _chat(self, messages: Any, tools: Any) -> Prompt | None:
        if not isinstance(messages, list) or not messages:
            return None
        if not self.sim:
            tok = self.tokenizer
            text = tok.chat_text(messages, tools) if isinstance(tok, HfTokenizer) else None
            return None if text is None else Prompt(tok.encode(text, special=False))
        pairs = []
        for m in messages:
            text = message_text(m.get("content")) if isinstance(m, dict) else None
            role = m.get("role") if isinstance(m, dict) else None
            if text is None or not isinstance(role, str):
                return None
            pairs.append((role, text))
        if not self._by_line:
            return Prompt(self.tokenizer.encode(sim_chat_text(pairs), special=False))
        first = self._line(pairs[0])
        ids = list(first.ids)
        for pair in pairs[1:]:
            ids += self._line(pair).ids
        return Prompt(ids, first)

    def _line(self, pair: tuple[str, str]) -> Line:
        line = self._lines.get(pair)
        if line is None:
            line = Line(self.tokenizer.encode(sim_chat_text([pair]), special=False))
            if len(self._lines) >= LINE_CACHE_MAX:
                self._lines.pop(next(iter(self._lines)))  # oldest first
            self._lines[pair] = line
        return line

    def _completion(self, prompt: Any) -> list[int] | None:
        if isinstance(prompt, list):
            if not prompt:
                return None  # no prompt (the engine rejects it), not an empty one
            prompt = prompt[0] if isinstance(prompt[0], (str, list)) else prompt
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt, special=True)
        if isinstance(prompt, list) and is_token_ids(prompt):
            # Token ids: a real engine takes them as they are; the simulated one reads them as words.
            return (
                self.tokenizer.encode(token_prompt_text(prompt), special=True) if self.sim else list(prompt)
            )
        return None
