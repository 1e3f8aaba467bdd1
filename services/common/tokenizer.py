"""Prompt to token ids, the same way on both sides of KV-aware routing.

The simulated engine and the Coordinator must turn one prompt into the same token ids: the
engine publishes the ids of every KV block it caches, and the Coordinator finds which engine
holds a request's prefix by the request's own ids. Two tokenizers:

- :class:`Builtin`: one token per whitespace-separated word, its id a CRC-32 of the word. The
  simulated engine's default; its token counts are the sim's ``usage`` numbers.
- :class:`HfTokenizer`: a Hugging Face ``tokenizer.json`` (the ``tokenizers`` library) and, for
  chat, the model's Jinja chat template from ``tokenizer_config.json``, rendered as vLLM renders
  it (``add_generation_prompt``, then encoded without special tokens).

How chat messages become text differs: the simulated engine joins ``"<role>: <text>"`` lines
(:func:`sim_chat_text`), a real engine renders the model's template.
"""

from __future__ import annotations

import json
import os
import zlib
from collections.abc import Sequence
from datetime import datetime
from typing import Any, Protocol

BUILTIN_VOCAB = 32000
TOKENIZER_FILE = "tokenizer.json"
CONFIG_FILE = "tokenizer_config.json"


class Tokenizer(Protocol):
    name: str

    def encode(self, text: str, *, special: bool) -> list[int]:
        """Token ids of ``text``; ``special``: with the model's special tokens (a plain
        completion prompt), without (an already rendered chat template)."""
        ...


class Builtin:
    """One token per whitespace-separated word: deterministic in every process, no files."""

    name = "builtin"

    def encode(self, text: str, *, special: bool = True) -> list[int]:
        crc = zlib.crc32
        return [crc(w.encode("utf-8", "surrogatepass")) % BUILTIN_VOCAB for w in text.split()]


class HfTokenizer:
    """A ``tokenizer.json`` and, when its directory has one, the chat template beside it."""

    def __init__(self, path: str) -> None:
        from tokenizers import Tokenizer as _Tok  # heavy: only when a model has a tokenizer

        self.name = path
        self._tok = _Tok.from_file(path)
        self._config = _read_config(os.path.dirname(path))
        self._template: Any = None

    def encode(self, text: str, *, special: bool) -> list[int]:
        ids: list[int] = self._tok.encode(text, add_special_tokens=special).ids
        return ids

    @property
    def has_chat_template(self) -> bool:
        return isinstance(self._config.get("chat_template"), str)

    def chat_text(self, messages: Sequence[dict[str, Any]], tools: Any = None) -> str | None:
        """The chat template rendered as vLLM renders it, or None without a template. A
        message's list of text parts is one string, the parts joined by newlines (vLLM's "string"
        content format, what most templates expect)."""
        if not self.has_chat_template:
            return None
        if self._template is None:
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            # transformers' environment: templates use {% break %}, its tojson, and today's date
            # (Llama 3's system header: a fixed fallback date would differ in the first block).
            env = ImmutableSandboxedEnvironment(
                trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
            )
            env.filters["tojson"] = _tojson
            env.globals["strftime_now"] = _strftime_now
            self._template = env.from_string(self._config["chat_template"])
        return str(
            self._template.render(
                messages=[_flat(m) for m in messages],
                tools=tools,  # None is passed too, as transformers does for a request without tools
                documents=None,
                add_generation_prompt=True,
                bos_token=_token_text(self._config.get("bos_token")),
                eos_token=_token_text(self._config.get("eos_token")),
            )
        )


def _flat(message: Any) -> Any:
    content = message.get("content") if isinstance(message, dict) else None
    if not isinstance(content, list):
        return message
    parts = [p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text"]
    return {**message, "content": "\n".join(str(p) for p in parts)}


def _tojson(value: Any, indent: int | None = None, separators: Any = None, sort_keys: bool = False) -> str:
    """transformers' filter: plain JSON, where Jinja's own escapes HTML characters and sorts keys."""
    return json.dumps(value, ensure_ascii=False, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _token_text(token: Any) -> str:
    if isinstance(token, dict):  # {"content": "<s>", ...} in older tokenizer configs
        return str(token.get("content", ""))
    return token if isinstance(token, str) else ""


def _read_config(directory: str) -> dict[str, Any]:
    try:
        with open(os.path.join(directory, CONFIG_FILE), encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError):
        return {}
    return config if isinstance(config, dict) else {}


def tokenizer_file(path: str) -> str | None:
    """The ``tokenizer.json`` that ``path`` names: the file itself, or the one in the directory;
    None when there is none."""
    if not path:
        return None
    if os.path.isdir(path):
        candidate = os.path.join(path, TOKENIZER_FILE)
        return candidate if os.path.isfile(candidate) else None
    return path if os.path.isfile(path) and path.endswith(".json") else None


def load(path: str | None) -> Tokenizer:
    """The tokenizer at ``path`` (a directory with ``tokenizer.json`` or the file), else the
    built-in one. Blocking file reads: call it once, off the event loop."""
    found = tokenizer_file(path or "")
    return HfTokenizer(found) if found else Builtin()


def sim_chat_text(pairs: Sequence[tuple[str, str]]) -> str:
    """The simulated engine's chat template: one ``<role>: <text>`` line per message."""
    return "\n".join(f"{role}: {text}" for role, text in pairs)


def message_text(content: Any) -> str | None:
    """A message's text as the simulated engine reads it (string or text parts); None when it is
    neither."""
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list):
        parts = [p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text"]
        return " ".join(str(p) for p in parts)
    return None


def is_token_ids(values: Sequence[Any]) -> bool:
    """Whether a prompt is given as token ids (integers; a JSON true is not one)."""
    return all(isinstance(v, int) and not isinstance(v, bool) for v in values)


def token_prompt_text(ids: Sequence[int]) -> str:
    """A prompt given as token ids, as the simulated engine reads it (its ids joined as words)."""
    return " ".join(map(str, ids))
