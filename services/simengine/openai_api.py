"""OpenAI request validation and response bodies (chat and legacy completions).

The fields beyond OpenAI's are vLLM 0.32's, named and placed as it places them: `return_token_ids`
(the prompt's ids and each choice's, or each delta's, output ids), a chat's
`kv_transfer_params.prompt_token_ids` (the prompt as ids, messages not rendered),
`continue_final_message` / `add_generation_prompt` and `echo`.

A chat's messages become one text (tokens.py encodes it without special tokens): with a Hugging
Face tokenizer whose `tokenizer_config.json` has a chat template, that template rendered as vLLM
renders it (`add_generation_prompt`, `continue_final_message`, `tools`; HfTokenizer.chat_text);
else the sim's own `<role>: <text>` lines (sim_chat_text).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from motor_mesh.common.tokenizer import (
    HfTokenizer,
    Tokenizer,
    is_token_ids,
    message_text,
    sim_chat_text,
    token_prompt_text,
)
from motor_mesh.simengine.generation import (
    Generated,
    chat_logprob_entries,
    chat_logprobs,
    completion_logprobs,
    count_tokens,
)

DEFAULT_MAX_TOKENS = 16
# Any count parses; what the context leaves is checked once the prompt is counted (completion.py).
MAX_TOKENS = (1 << 63) - 1
MAX_N = 128
MAX_TOP_LOGPROBS = 20


class RequestError(ValueError):
    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


# One encoder for the process: json.dumps with non-default options builds a new one per call.
_ENCODE = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False).encode


def dumps(obj: Any) -> bytes:
    """Compact JSON, as every answer body is spelled."""
    return _ENCODE(obj).encode()


@dataclass(slots=True)
class Bootstrap:
    host: str | None
    port: int | None
    room: int


@dataclass(slots=True)
class ParsedRequest:
    chat: bool
    model: str | None
    # Each prompt as text: a chat's messages rendered (the model's chat template, or the sim's
    # lines), even when ids are given.
    prompts: list[str]
    prompt_tokens: list[int]
    question: str | None  # what a known answer answers (chat); None: nothing to answer afresh
    max_tokens: int
    max_tokens_given: bool  # false: max_tokens is the default (cut to what the context leaves)
    n: int
    stream: bool
    include_usage: bool
    top_k: int | None
    kv_params: dict[str, Any] | None
    bootstrap: list[Bootstrap]
    # The prompts as token ids when the request gave ids (used as they are), else None.
    token_prompts: list[list[int]] | None = None
    ids_param: str | None = None  # where those ids came from, for an error naming them
    return_token_ids: bool = False
    role: str = "assistant"  # the answer's role: vLLM's is the last message's without a generation prompt
    echo: str | None = None  # a chat's `echo`: the last message's text, put before the answer


def _int_field(body: dict[str, Any], name: str, lo: int, hi: int) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise RequestError(f"{name} must be an integer in [{lo}, {hi}], got {value!r}", name)
    return value


def _message_text(msg: Any, i: int) -> tuple[str, str]:
    if not isinstance(msg, dict) or not isinstance(msg.get("role"), str):
        raise RequestError(f"messages[{i}] must be an object with a string 'role'", f"messages[{i}]")
    text = message_text(msg.get("content"))
    if text is None:
        raise RequestError(
            f"messages[{i}].content must be a string or a list of parts", f"messages[{i}].content"
        )
    return msg["role"], text


def _prompts(body: dict[str, Any]) -> tuple[list[str], list[list[int]] | None]:
    """The prompts as text, and as ids when given as ids (vLLM uses those as they are)."""
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return [prompt], None
    if isinstance(prompt, list) and prompt:
        if all(isinstance(p, str) for p in prompt):
            return list(prompt), None
        if is_token_ids(prompt):
            return [token_prompt_text(prompt)], [list(prompt)]
        if all(isinstance(p, list) and is_token_ids(p) for p in prompt):
            return [token_prompt_text(p) for p in prompt], [list(p) for p in prompt]
    raise RequestError("prompt must be a string, a list of strings, or token ids", "prompt")


def _bool_field(body: dict[str, Any], name: str) -> bool | None:
    value = body.get(name)
    if value is not None and not isinstance(value, bool):
        raise RequestError(f"{name} must be a boolean", name)
    return value


# vLLM's content part types that carry no media (renderers/chat_utils.py), and the keys that mark
# a part as media whatever its type.
_TEXT_PART_TYPES = frozenset({"text", "input_text", "output_text", "refusal", "thinking", "tool_reference"})
_MEDIA_PART_KEYS = frozenset(
    {
        "input_image",
        "image_url",
        "image_embeds",
        "audio_embeds",
        "video_embeds",
        "prompt_embeds",
        "image_pil",
        "audio_url",
        "input_audio",
        "video_url",
    }
)


def _has_non_text_content(messages: list[Any]) -> bool:
    """vLLM's has_non_text_content: a content part with media, or of a type that is not text."""
    for msg in messages:
        content = msg.get("content") if isinstance(msg, dict) else None
        if not isinstance(content, list):
            continue
        for part in content:
            if isinstance(part, dict):
                kind = part.get("type", "text")
                if (
                    not _MEDIA_PART_KEYS.isdisjoint(part)
                    or not isinstance(kind, str)
                    or kind not in _TEXT_PART_TYPES
                ):
                    return True
    return False


IDS_PARAM = "kv_transfer_params.prompt_token_ids"


def _reused_prompt_token_ids(kv: Any, echo: bool | None, messages: list[Any]) -> list[int] | None:
    """vLLM's ``_reused_prompt_token_ids`` (renderers/online_renderer.py): the prompt ids a router
    forwards in ``kv_transfer_params``, popped from them (they are no KV parameter); ignored when
    ``echo`` is set or a message has media (both need the messages rendered); malformed: a 400.
    Their range is checked against the tokenizer later (completion.py)."""
    if not isinstance(kv, dict):
        return None
    ids = kv.pop("prompt_token_ids", None)
    if ids is None or echo or _has_non_text_content(messages):
        return None
    # bool is an int subclass, hence the exact type check (as vLLM's).
    if not isinstance(ids, list) or not ids or any(type(x) is not int or x < 0 for x in ids):
        raise RequestError(
            "`kv_transfer_params['prompt_token_ids']` must be a non-empty list of non-negative integers.",
            IDS_PARAM,
        )
    return ids


def _check_final(msg: Any) -> None:
    """transformers' refusals of a final message that ``continue_final_message`` cannot continue."""
    content = msg.get("content")
    if content is None:
        raise RequestError(
            'continue_final_message is set but the final message has no "content" to continue!'
        )
    if isinstance(content, list):
        texts = [p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str)]
        if not texts:
            raise RequestError(
                "continue_final_message is set but we could not find any text to continue in the "
                "final message!"
            )


def _echo_text(content: Any) -> str:
    """A message's content as vLLM's `echo` repeats it: text parts joined by newlines."""
    if isinstance(content, list):
        return "\n".join(str(p.get("text", "")) for p in content if isinstance(p, dict) and "text" in p)
    return content if isinstance(content, str) else ""


def _template_text(
    tok: HfTokenizer, body: dict[str, Any], messages: list[Any], add_gen: bool | None, cont: bool | None
) -> str:
    """The model's chat template rendered as vLLM renders it (its refusals are 400s, as vLLM's
    renderer answers a template error)."""
    try:
        text = tok.chat_text(
            messages,
            body.get("tools"),
            add_generation_prompt=add_gen is not False,
            continue_final_message=bool(cont),
        )
    except Exception as exc:  # jinja2's TemplateError, transformers' ValueErrors, a template's TypeError
        raise RequestError(str(exc) or type(exc).__name__) from None
    assert text is not None  # has_chat_template was checked
    return text


def _chat_prompt(
    body: dict[str, Any],
    messages: list[Any],
    pairs: list[tuple[str, str]],
    kv: Any,
    tokenizer: Tokenizer | None = None,
) -> tuple[str, str | None, list[int] | None, str, str | None]:
    """(prompt text, question, prompt ids if given, the answer's role, echo text) of a chat.
    ``tokenizer``: the engine's; an HfTokenizer with a chat template renders the messages."""
    add_gen = _bool_field(body, "add_generation_prompt")
    cont = _bool_field(body, "continue_final_message")
    echo = _bool_field(body, "echo")
    if cont and add_gen:
        # vLLM's request validator (chat_completion/protocol.py).
        raise RequestError("Cannot set both `continue_final_message` and `add_generation_prompt` to True.")
    reused = _reused_prompt_token_ids(kv, echo, messages)
    user = [text for role, text in pairs if role == "user"]
    question: str | None = user[-1] if user else pairs[-1][1]
    if cont and reused is None:
        # add_generation_prompt defaults to true: transformers refuses the pair when rendering
        # (vLLM answers 400); with ids nothing is rendered, so nothing refuses.
        if add_gen is None:
            raise RequestError(
                "continue_final_message and add_generation_prompt are not compatible. Use "
                "continue_final_message when you want the model to continue the final message, and "
                "add_generation_prompt when you want to add a header that will prompt it to start a new "
                "assistant message instead."
            )
        _check_final(messages[-1])
    if cont and pairs[-1][0] == "assistant" and pairs[-1][1].strip():
        question = None  # the answer already begun: no fresh answer, the context goes on
    if isinstance(tokenizer, HfTokenizer) and tokenizer.has_chat_template:
        try:
            text = _template_text(tokenizer, body, messages, add_gen, cont)
        except RequestError:
            if reused is None:
                raise
            # Given ids are not rendered (vLLM renders nothing): a text that is not their
            # prompt, only read for a known answer, which it then does not match.
            text = sim_chat_text(pairs)
    elif cont and pairs[-1][0] == "assistant":
        # Open-ended: the sim's template has an empty generation prompt (an answer begins right
        # after the last message's line), so the answer being continued is its bare text, where
        # it began; the tokens after it are then exactly the ones the uninterrupted answer had.
        final = pairs[-1][1]
        text = sim_chat_text(pairs[:-1]) + "\n" + final if len(pairs) > 1 else final
    else:
        text = sim_chat_text(pairs)
    role = pairs[-1][0] if add_gen is False else "assistant"  # vLLM's get_chat_request_role
    echoed = None
    if echo and pairs[-1][0] == role:
        echoed = _echo_text(messages[-1].get("content"))
    return text, question, reused, role, echoed


def _bootstrap(body: dict[str, Any]) -> list[Bootstrap]:
    rooms = body.get("bootstrap_room")
    if rooms is None:
        return []
    hosts, ports = body.get("bootstrap_host"), body.get("bootstrap_port")
    batch = isinstance(rooms, list)
    rooms_l = rooms if batch else [rooms]
    out = []
    for i, room in enumerate(rooms_l):
        host = hosts[i] if isinstance(hosts, list) and i < len(hosts) else hosts
        port = ports[i] if isinstance(ports, list) and i < len(ports) else ports
        if isinstance(room, bool) or not isinstance(room, int):
            raise RequestError("bootstrap_room must be an integer (or a list of integers)", "bootstrap_room")
        if host is not None and not isinstance(host, str):
            raise RequestError("bootstrap_host must be a string", "bootstrap_host")
        if port is not None and (isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536):
            raise RequestError("bootstrap_port must be a port number", "bootstrap_port")
        out.append(Bootstrap(host, port, room))
    return out


def parse_request(body: Any, chat: bool, tokenizer: Tokenizer | None = None) -> ParsedRequest:
    """A request body, validated as vLLM validates it. ``tokenizer``: the engine's, which a
    chat's messages are rendered for (an HfTokenizer with a chat template: the template; else,
    and without one, the sim's ``<role>: <text>`` lines)."""
    if not isinstance(body, dict):
        raise RequestError("request body must be a JSON object")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise RequestError("model must be a string", "model")
    kv = body.get("kv_transfer_params")
    if kv is not None and not isinstance(kv, dict):
        raise RequestError("kv_transfer_params must be an object", "kv_transfer_params")
    token_prompts: list[list[int]] | None = None
    ids_param: str | None = None
    role, echo = "assistant", None
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise RequestError("messages is required and must be a non-empty list", "messages")
        pairs = [_message_text(m, i) for i, m in enumerate(messages)]
        text, question, reused, role, echo = _chat_prompt(body, messages, pairs, kv, tokenizer)
        prompts = [text]
        if reused is not None:
            token_prompts, ids_param = [reused], IDS_PARAM
        max_tokens = _int_field(body, "max_completion_tokens", 1, MAX_TOKENS)
        if max_tokens is None:
            max_tokens = _int_field(body, "max_tokens", 1, MAX_TOKENS)
        logprobs = body.get("logprobs")
        if logprobs is not None and not isinstance(logprobs, bool):
            raise RequestError("logprobs must be a boolean", "logprobs")
        top = _int_field(body, "top_logprobs", 0, MAX_TOP_LOGPROBS)
        if top and not logprobs:
            raise RequestError("top_logprobs requires logprobs to be true", "top_logprobs")
        top_k = (top or 0) if logprobs else None
    else:
        prompts, token_prompts = _prompts(body)
        ids_param = "prompt" if token_prompts is not None else None
        question = None  # each text prompt is its own question (completion.py)
        max_tokens = _int_field(body, "max_tokens", 1, MAX_TOKENS)
        top_k = _int_field(body, "logprobs", 0, MAX_TOP_LOGPROBS)
    stream = body.get("stream", False)
    if not isinstance(stream, bool | None):
        raise RequestError("stream must be a boolean", "stream")
    opts = body.get("stream_options")
    if opts is not None and not isinstance(opts, dict):
        raise RequestError("stream_options must be an object", "stream_options")
    if kv and kv.get("do_remote_decode") is True and kv.get("do_remote_prefill") is True:
        raise RequestError("do_remote_decode and do_remote_prefill are exclusive", "kv_transfer_params")
    return_ids = _bool_field(body, "return_token_ids")
    counts = [count_tokens(p) for p in prompts] if token_prompts is None else [len(p) for p in token_prompts]
    return ParsedRequest(
        chat=chat,
        model=model,
        prompts=prompts,
        prompt_tokens=counts,
        question=question,
        max_tokens=DEFAULT_MAX_TOKENS if max_tokens is None else max_tokens,
        max_tokens_given=max_tokens is not None,
        n=_int_field(body, "n", 1, MAX_N) or 1,
        stream=bool(stream),
        include_usage=bool(stream and opts and opts.get("include_usage")),
        top_k=top_k,
        kv_params=kv,
        bootstrap=_bootstrap(body),
        token_prompts=token_prompts,
        ids_param=ids_param,
        return_token_ids=bool(return_ids),
        role=role,
        echo=echo,
    )


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def _prompt_of(req: ParsedRequest, choice: int, prompt_ids: list[list[int]] | None) -> list[int]:
    """The prompt ids of one choice (choices run prompt by prompt, ``n`` each)."""
    return prompt_ids[choice // req.n] if prompt_ids else []


def full_response(
    req: ParsedRequest,
    rid: str,
    created: int,
    model: str,
    gens: list[Generated],
    finish: str,
    extra: dict[str, Any] | None = None,
    prompt_ids: list[list[int]] | None = None,
) -> bytes:
    """The whole answer. ``prompt_ids``: each prompt's, for `return_token_ids` (vLLM's fields: a
    chat's top-level ``prompt_token_ids`` and each choice's ``token_ids``; a completion choice's
    ``token_ids`` and ``prompt_token_ids``)."""
    choices: list[dict[str, Any]] = []
    top_k = req.top_k or 0
    ids = req.return_token_ids
    for i, gen in enumerate(gens):
        choice: dict[str, Any]
        if req.chat:
            content = gen.text if req.echo is None else req.echo + gen.text
            choice = {
                "index": i,
                "message": {"role": req.role, "content": content},
                "logprobs": chat_logprobs(gen, top_k),
                "finish_reason": finish,
            }
            if ids:
                choice["token_ids"] = gen.ids
        else:
            lp = completion_logprobs(gen.tokens, gen.logprobs, top_k) if gen.logprobs is not None else None
            choice = {"index": i, "text": gen.text, "logprobs": lp, "finish_reason": finish}
            if ids:
                choice["token_ids"] = gen.ids
                choice["prompt_token_ids"] = _prompt_of(req, i, prompt_ids)
        choices.append(choice)
    body: dict[str, Any] = {
        "id": rid,
        "object": "chat.completion" if req.chat else "text_completion",
        "created": created,
        "model": model,
        "choices": choices,
        "usage": usage(sum(req.prompt_tokens), sum(len(g.ids) for g in gens)),
    }
    if ids and req.chat:
        body["prompt_token_ids"] = _prompt_of(req, 0, prompt_ids)
    if extra:
        body.update(extra)
    return dumps(body)


def stream_chunks(
    req: ParsedRequest,
    rid: str,
    created: int,
    model: str,
    gens: list[Generated],
    finish: str,
    extra: dict[str, Any] | None = None,
    prompt_ids: list[list[int]] | None = None,
) -> tuple[bytes, list[bytes], bytes]:
    """(prelude, one SSE blob per token step, tail): the caller paces the steps. With
    `return_token_ids`, as vLLM: a chat's role chunk carries the top-level ``prompt_token_ids``,
    a completion choice's first chunk its ``prompt_token_ids``, every token chunk's choice the
    ``token_ids`` of its delta."""
    obj = "chat.completion.chunk" if req.chat else "text_completion"
    top_k = req.top_k or 0
    ids = req.return_token_ids

    def event(choices: list[dict[str, Any]], more: dict[str, Any] | None = None) -> bytes:
        chunk: dict[str, Any] = {
            "id": rid,
            "object": obj,
            "created": created,
            "model": model,
            "choices": choices,
        }
        if more:
            chunk.update(more)
        return b"data: " + dumps(chunk) + b"\n\n"

    prelude = b""
    if req.chat:
        role = [
            {
                "index": i,
                "delta": {"role": req.role, "content": ""},
                "logprobs": None,
                "finish_reason": None,
            }
            for i in range(len(gens))
        ]
        prelude = event(role, {"prompt_token_ids": _prompt_of(req, 0, prompt_ids)} if ids else None)
        if req.echo:
            echoed = [
                {"index": i, "delta": {"content": req.echo}, "logprobs": None, "finish_reason": None}
                for i in range(len(gens))
            ]
            prelude += event(echoed)
    steps: list[bytes] = []
    n_steps = max(len(g.tokens) for g in gens)
    offsets = [0] * len(gens)
    for t in range(n_steps):
        last = t == n_steps - 1
        choices: list[dict[str, Any]] = []
        for i, gen in enumerate(gens):
            if t >= len(gen.tokens):
                continue
            tok = gen.tokens[t]
            lp: Any = None
            if gen.logprobs is not None:
                one = gen.logprobs[t : t + 1]
                if req.chat:
                    lp = {"content": chat_logprob_entries([tok], one, top_k)}
                else:
                    lp = completion_logprobs([tok], one, top_k, offsets[i])
            offsets[i] += len(tok)
            reason = finish if t == len(gen.tokens) - 1 else None
            choice: dict[str, Any]
            if req.chat:
                choice = {"index": i, "delta": {"content": tok}, "logprobs": lp, "finish_reason": reason}
            else:
                choice = {"index": i, "text": tok, "logprobs": lp, "finish_reason": reason}
                if ids and t == 0:
                    choice["prompt_token_ids"] = _prompt_of(req, i, prompt_ids)
            if ids:
                choice["token_ids"] = gen.ids[t : t + 1]
            choices.append(choice)
        steps.append(event(choices, extra if last else None))
    tail = b""
    if req.include_usage:
        tail += event([], {"usage": usage(sum(req.prompt_tokens), sum(len(g.ids) for g in gens))})
    tail += b"data: [DONE]\n\n"
    return prelude, steps, tail
