"""A request's prompt as the engine will see it: its token ids, and their block hashes.

``kv_aware`` matches a request against the blocks engines say they hold, so the request must be
tokenized exactly as the engine tokenizes it (:mod:`services.common.tokenizer`): for the
simulated engine its ``<role>: <text>`` chat lines and its tokenizer, for vLLM and SGLang the
model's chat template and ``tokenizer.json``. Only the first prompt of a batched completion
request is matched (the others usually share its prefix).

Chat requests repeat themselves: a long system prompt in request after request, and each turn of
a conversation sends every earlier turn again. So with the built-in tokenizer (one token per
whitespace word: the ids of lines joined by newlines are the lines' ids one after the other) each
chat message's ids are remembered, and so is each *sequence* of messages seen (a :class:`Turn`:
the sequence before it and one more message), with its block hashes. A request then tokenizes
and hashes only the messages it adds to one already seen, usually its last question.

That matters more than the arithmetic suggests: between two requests the other processes of the
machine evict this one's CPU caches, so every per-token object a request touches (an int in a
list of ids, a hash) costs a trip to memory. A request that re-read its 1,000-token system prompt
took four times as long on the request path as in a tight loop; one that reads only its new
tokens, and keeps its hashes in one flat array, does not.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
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

LINE_CACHE_MAX = 4096  # distinct chat messages remembered (system prompts, earlier turns)
TURN_CACHE_MAX = 4096  # distinct message sequences remembered (conversations so far)
TURN_CACHE_BLOCKS = 1 << 20  # block hashes the remembered sequences may hold (8 MiB)


class Prompt:
    """One request's prompt: ``n`` tokens and their block hashes per block size. ``cached`` and
    ``endpoint`` are what ``kv_aware`` decided (the tokens it expects the chosen engine to have
    cached, and which of the instance's endpoints holds them)."""

    __slots__ = ("_hashes", "_tokens", "_turn", "cached", "endpoint", "n")

    def __init__(self, tokens: Sequence[int] = (), turn: Turn | None = None) -> None:
        self._tokens = tokens
        self._turn = turn  # a remembered chat: its ids and hashes are the turn's
        self.n = turn.n if turn is not None else len(tokens)
        self._hashes: dict[int, Sequence[int]] = {}
        self.cached = 0
        self.endpoint: Upstream | None = None

    @property
    def tokens(self) -> list[int]:
        return self._turn.ids() if self._turn is not None else list(self._tokens)

    def hashes(self, block_size: int) -> Sequence[int]:
        """The chained hashes of the prompt's full blocks of ``block_size`` tokens."""
        if self._turn is not None:
            return self._turn.state(block_size)[0]
        h = self._hashes.get(block_size)
        if h is None:
            h = self._hashes[block_size] = chain(self._tokens, block_size)
        return h


class Line:
    """One remembered chat message's ids. An object of its own, so that a :class:`Turn` is found
    by the message's identity, not by hashing all its ids again."""

    __slots__ = ("ids",)

    def __init__(self, ids: list[int]) -> None:
        self.ids = tuple(ids)


class Turn:
    """A remembered sequence of chat messages: ``parent``'s and one more ``line``. Per block size
    its state is the block hashes of its tokens' full blocks (one flat array) and the tokens of
    its last, partial block, from which a longer sequence's hashes go on."""

    __slots__ = ("_memo", "_state", "line", "n", "parent")

    def __init__(self, parent: Turn | None, line: Line, memo: Turns) -> None:
        self.parent = parent
        self.line = line
        self._memo: Turns | None = memo
        self.n: int = len(line.ids) + (parent.n if parent is not None else 0)
        self._state: dict[int, tuple[array[int], tuple[int, ...]]] = {}

    def ids(self) -> list[int]:
        lines = []
        turn: Turn | None = self
        while turn is not None:
            lines.append(turn.line.ids)
            turn = turn.parent
        return [i for ids in reversed(lines) for i in ids]

    def state(self, block_size: int) -> tuple[array[int], tuple[int, ...]]:
        state = self._state.get(block_size)
        if state is not None:
            return state
        # From the nearest turn with this block size's state on (iteratively: a long
        # conversation is deeper than Python's recursion limit).
        todo = []
        turn: Turn | None = self
        while turn is not None and block_size not in turn._state:
            todo.append(turn)
            turn = turn.parent
        hashes, tail = turn._state[block_size] if turn is not None else (array("q"), ())
        for turn in reversed(todo):
            tokens = tail + turn.line.ids
            full = len(tokens) - len(tokens) % block_size
            hashes = hashes + array("q", chain(tokens[:full], block_size, hashes[-1] if hashes else ROOT))
            tail = tokens[full:]
            if turn._memo is not None:  # a forgotten turn keeps no hashes
                turn._state[block_size] = (hashes, tail)
                turn._memo.blocks += len(hashes)
        return hashes, tail

    def forget(self) -> None:
        """Drop the hashes (a forgotten turn's children keep their own)."""
        if self._memo is not None:
            self._memo.blocks -= sum(len(h) for h, _ in self._state.values())
            self._memo = None
        self._state.clear()


class Turns:
    """The remembered message sequences, least recently used forgotten first, bounded in number
    and in the block hashes they hold."""

    def __init__(self) -> None:
        self._turns: dict[tuple[Turn | None, Line], Turn] = {}
        self.blocks = 0

    def __len__(self) -> int:
        return len(self._turns)

    def get(self, parent: Turn | None, line: Line) -> Turn:
        turns = self._turns
        key = (parent, line)
        turn = turns.pop(key, None)  # and back in at the end
        if turn is None:
            turn = Turn(parent, line, self)
            while turns and (len(turns) >= TURN_CACHE_MAX or self.blocks > TURN_CACHE_BLOCKS):
                turns.pop(next(iter(turns))).forget()
        turns[key] = turn
        return turn


class Tokens:
    """Token ids of request bodies for one (model, engine type)."""

    def __init__(self, tokenizer: Tokenizer, sim: bool) -> None:
        self.tokenizer = tokenizer
        self.sim = sim
        self._lines: dict[tuple[str, str], Line] = {}
        self._turns = Turns()
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
        turn = None
        for pair in pairs:
            turn = self._turns.get(turn, self._line(pair))
        return Prompt(turn=turn)

    def _line(self, pair: tuple[str, str]) -> Line:
        lines = self._lines
        line = lines.pop(pair, None)  # and back in at the end: least recently used goes first
        if line is None:
            line = Line(self.tokenizer.encode(sim_chat_text([pair]), special=False))
            if len(lines) >= LINE_CACHE_MAX:
                lines.pop(next(iter(lines)))
        lines[pair] = line
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
