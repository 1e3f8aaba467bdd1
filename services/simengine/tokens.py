"""Prompt token ids, exactly as a KV-aware router computes them for this engine.

A router that places requests by the blocks an engine reports must turn a prompt into the same
ids the engine cached it under, so both use motor_mesh.common.tokenizer the same way: a completion
prompt's text (token ids read as words) is encoded with the model's special tokens, a chat's
text (:func:`sim_chat_text`) without them, as vLLM encodes a rendered chat template.
"""

from __future__ import annotations

from motor_mesh.common import log
from motor_mesh.common.tokenizer import Builtin, Tokenizer, load, tokenizer_file
from motor_mesh.simengine.config import EngineConfig
from motor_mesh.simengine.openai_api import ParsedRequest


def load_tokenizer(cfg: EngineConfig) -> Tokenizer:
    """`--tokenizer`, else the model's directory, else the built-in tokenizer. Reads files:
    call it before serving (or off the event loop)."""
    if cfg.tokenizer and tokenizer_file(cfg.tokenizer) is None:
        # vLLM would fetch a hub name; the sim has no network to fetch from, so it carries on.
        log.warn("tokenizer_not_found", path=cfg.tokenizer, using="builtin")
        return Builtin()
    return load(cfg.tokenizer or cfg.model)


def prompt_ids(tok: Tokenizer, req: ParsedRequest) -> list[list[int]]:
    """The token ids of each of the request's prompts."""
    special = not req.chat
    return [tok.encode(text, special=special) for text in req.prompts]
