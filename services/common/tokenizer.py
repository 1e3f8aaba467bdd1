"""Prompt to token ids, the same way on both sides of KV-aware routing.

The simulated engine and the Coordinator must turn one prompt into the same token ids: the
engine publishes the ids of every KV block it caches, and the Coordinator finds which engine
holds a request's prefix by the request's own ids. Two tokenizers:

- :class:`Builtin`: one token per whitespace-separated word, its id a CRC-32 of the word. The
  simulated engine's default; its token counts are the sim's ``usage`` numbers.
- :class:`HfTokenizer`: a Hugging Face ``tokenizer.json`` (the ``tokenizers`` library) and, for
  chat, the model's Jinja chat template from ``tokenizer_config.json``, rendered as vLLM renders
  it (``add_generation_prompt``, then encoded without special tokens).

A chat becomes text by the model's template when its tokenizer has one, in the engines and the
Coordinator alike; the simulated engine without a template joins ``"<role>: <text>"`` lines
(:func:`sim_chat_text`).
"""

from __future__ import annotations

import functools
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

    def encode_all(self, texts: list[str], *, special: bool) -> list[list[int]]:
        """:meth:`encode` of each text, without holding the GIL while encoding (the library's
        batch call releases it, its single one does not): call it in a thread for long texts."""
        return [e.ids for e in self._tok.encode_batch(texts, add_special_tokens=special)]

    @functools.cached_property
    def splitters(self) -> dict[str, int]:
        """The added tokens (text → id) the tokenizer splits a text at before anything else
        (no stripping of neighbouring spaces, whole-text match): the text on either side of one
        encodes on its own, so a text cut right after one encodes as its two parts do."""
        out = {}
        for i, added in self._tok.get_added_tokens_decoder().items():
            if not (added.lstrip or added.rstrip or added.single_word or added.normalized):
                out[added.content] = i
        return out

    @property
    def has_chat_template(self) -> bool:
        return isinstance(self._config.get("chat_template"), str)

    def chat_text(
        self,
        messages: Sequence[dict[str, Any]],
        tools: Any = None,
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
    ) -> str | None:
        """The chat template rendered as vLLM renders it, or None without a template. A
        message's list of text parts is one string, the parts joined by newlines (vLLM's "string"
        content format, what most templates expect).

        ``continue_final_message``: the final message left open, as transformers leaves it for
        vLLM: its content is rendered with a marker after it (the generation prompt is not
        asked for, whatever ``add_generation_prompt`` says: vLLM refuses the pair before it
        renders), and the text is cut where the marker begins, trailing whitespace dropped when
        the template trimmed the content. ValueError when the final message has no text to
        continue or its text does not appear in the rendered chat (transformers' refusals)."""
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
        flat = [_flat(m) for m in messages]
        final = None
        if continue_final_message:
            add_generation_prompt = False
            final = _continued(flat, self._config["chat_template"])
        text = str(
            self._template.render(
                messages=flat,
                tools=tools,  # None is passed too, as transformers does for a request without tools
                documents=None,
                add_generation_prompt=add_generation_prompt,
                bos_token=_token_text(self._config.get("bos_token")),
                eos_token=_token_text(self._config.get("eos_token")),
            )
        )
        return text if final is None else _cut_at_tag(text, final)


# transformers' marker (chat_template_utils.render_jinja_template): appended to the final
# message's content, the rendered text is cut where it begins.
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


def _continued(flat: list[Any], template: str) -> str:
    """transformers' preparation of ``continue_final_message``: the final message's text, and
    that message (a copy, in ``flat``) with the marker after its content."""
    last = flat[-1] if flat and isinstance(flat[-1], dict) else {}
    final = last.get("content")
    if final is None:
        raise ValueError('continue_final_message is set but the final message has no "content" to continue!')
    if "content" not in template:
        raise ValueError(
            'continue_final_message is set to "content" but this is not an accepted field in the '
            "chat_template"
        )
    if not isinstance(final, str):
        raise ValueError(
            "continue_final_message is set but we could not find any text to continue in the final message!"
        )
    flat[-1] = {**last, "content": final + _CONTINUE_TAG}
    return final


def _cut_at_tag(rendered: str, final: str) -> str:
    tag = _CONTINUE_TAG.strip()
    if final.strip() not in rendered or tag not in rendered:
        raise ValueError(
            "continue_final_message is set but the final message does not appear in the chat after "
            "applying the chat template"
        )
    at = rendered.rindex(tag)
    if rendered[at : at + len(_CONTINUE_TAG)] == _CONTINUE_TAG:
        return rendered[:at]  # the template keeps the content as it is
    return rendered[:at].rstrip()  # it trimmed the content: its trailing spaces went with it


def _flat(message: Any) -> Any:
    if not isinstance(message, dict):
        return message
    content = message.get("content")
    if content is None and "content" in message:
        return {**message, "content": ""}  # vLLM renders a null content (a tool call's) as ""
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
