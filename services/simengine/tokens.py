"""Prompt token ids, exactly as a KV-aware router computes them for this engine.

A router that places requests by the blocks an engine reports must turn a prompt into the same
ids the engine cached it under, so both use motor_mesh.common.tokenizer the same way: a completion
prompt's text is encoded with the model's special tokens, a chat's text without them, as vLLM
encodes a rendered chat template. That text (openai_api.py) is the model's chat template rendered
as vLLM renders it when the tokenizer is a Hugging Face one with a template in its
`tokenizer_config.json` (Llama 3's puts `<|begin_of_text|>` itself), else the sim's
`<role>: <text>` lines (:func:`sim_chat_text`). A prompt given as token ids (a completion prompt
of ids, a chat's `kv_transfer_params.prompt_token_ids`) is those ids as they are, as in vLLM.

The tokenizer also spells what the engine generates (:func:`output_vocab`, :func:`answer_tokens`):
an answer's ids are what its text encodes to.
"""

from __future__ import annotations

from collections import Counter

from motor_mesh.common import log
from motor_mesh.common.tokenizer import BUILTIN_VOCAB, Builtin, Tokenizer, load, tokenizer_file
from motor_mesh.simengine import generation
from motor_mesh.simengine.config import EngineConfig
from motor_mesh.simengine.generation import GARBLED, VOCAB, OutputVocab, Token
from motor_mesh.simengine.openai_api import ParsedRequest

# An HF tokenizer that spells fewer of the vocabulary's words as one token each than this gives
# text that is not its ids (see output_vocab).
MIN_OUTPUT_WORDS = 16


def load_tokenizer(cfg: EngineConfig) -> Tokenizer:
    """`--tokenizer`, else the model's directory, else the built-in tokenizer. Reads files:
    call it before serving (or off the event loop)."""
    if cfg.tokenizer and tokenizer_file(cfg.tokenizer) is None:
        # vLLM would fetch a hub name; the sim has no network to fetch from, so it carries on.
        log.warn("tokenizer_not_found", path=cfg.tokenizer, using="builtin")
        return Builtin()
    return load(cfg.tokenizer or cfg.model)


def prompt_ids(tok: Tokenizer, req: ParsedRequest) -> list[list[int]]:
    """The token ids of each of the request's prompts: given ones as they are, text encoded."""
    if req.token_prompts is not None:
        return req.token_prompts
    special = not req.chat
    return [tok.encode(text, special=special) for text in req.prompts]


def text_prompt_ids(tok: Tokenizer, req: ParsedRequest) -> list[int]:
    """The ids of the request's first prompt as text, even when the request gave ids instead
    (a chat's messages, rendered): what its known answer is checked against."""
    return tok.encode(req.prompts[0], special=not req.chat)


def vocab_size(tok: Tokenizer) -> int | None:
    """Ids at or above this are out of vocabulary; None: unknown (no upper bound checked)."""
    if isinstance(tok, Builtin):
        return BUILTIN_VOCAB
    # motor_mesh.common.tokenizer.HfTokenizer keeps the tokenizers library's object as _tok.
    inner = getattr(tok, "_tok", None)
    size = getattr(inner, "get_vocab_size", None)
    return int(size(with_added_tokens=True)) if callable(size) else None


def _one_id(tok: Tokenizer, piece: str) -> int | None:
    ids = tok.encode(piece, special=False)
    return ids[0] if len(ids) == 1 else None


def output_vocab(tok: Tokenizer) -> OutputVocab:
    """The words the engine generates, each with the id ``tok`` spells it as. With an HF
    tokenizer only the words it spells as one token of their own are kept (so an answer's text
    encodes back to its ids); should too few be, every word is kept with its first id, and the
    text no longer tokenizes to exactly the ids (logged)."""
    if isinstance(tok, Builtin):
        return generation.BUILTIN_OUTPUT
    pieces = [" " + w for w in VOCAB]
    ones = [(p, i) for p in pieces if (i := _one_id(tok, p)) is not None]
    # An id several words share is no spelling of any of them (a WordLevel's [UNK]): out.
    shared = Counter(i for _, i in ones)
    words = [(p, i) for p, i in ones if shared[i] == 1]
    if len(words) < MIN_OUTPUT_WORDS:
        log.warn("output_vocab_degraded", tokenizer=tok.name, single_token_words=len(words))
        words = [(p, (tok.encode(p, special=False) or [0])[0]) for p in pieces]
    garbled = [(p, (tok.encode(p, special=False) or [0])[0]) for p in GARBLED]
    return OutputVocab(words, garbled)


def answer_tokens(tok: Tokenizer, answer: str) -> tuple[Token, ...]:
    """A known answer as output tokens: the piece " <answer>", split where ``tok`` spells it as
    several tokens (e.g. Llama 3's " 42": " " and "42") into pieces of one id each."""
    piece = " " + answer
    ids = tok.encode(piece, special=False)
    if len(ids) == 1:
        return ((piece, ids[0]),)
    out: list[Token] = []
    rest = piece
    while rest:  # the longest prefix that is one token, then the rest (answers are short)
        for end in range(len(rest), 0, -1):
            one = _one_id(tok, rest[:end])
            if one is not None:
                out.append((rest[:end], one))
                rest = rest[end:]
                break
        else:
            break
    if rest or [i for _, i in out] != ids:
        # No split that encodes back: one piece with the first id (the text then says more).
        return ((piece, ids[0] if ids else 0),)
    return tuple(out)
