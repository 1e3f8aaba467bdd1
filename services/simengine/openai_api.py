"""OpenAI request validation and response bodies (chat and legacy completions)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from motor_mesh.common.tokenizer import is_token_ids, message_text, sim_chat_text, token_prompt_text
from motor_mesh.simengine.generation import (
    Generated,
    chat_logprob_entries,
    chat_logprobs,
    completion_logprobs,
    count_tokens,
)

DEFAULT_MAX_TOKENS = 16
MAX_MODEL_LEN = 131072
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
    prompts: list[str]
    prompt_tokens: list[int]
    question: str
    max_tokens: int
    n: int
    stream: bool
    include_usage: bool
    top_k: int | None
    kv_params: dict[str, Any] | None
    bootstrap: list[Bootstrap]


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


def _prompts(body: dict[str, Any]) -> list[str]:
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return [prompt]
    if isinstance(prompt, list) and prompt:
        if all(isinstance(p, str) for p in prompt):
            return list(prompt)
        if is_token_ids(prompt):
            return [token_prompt_text(prompt)]
        if all(isinstance(p, list) and is_token_ids(p) for p in prompt):
            return [token_prompt_text(p) for p in prompt]
    raise RequestError("prompt must be a string, a list of strings, or token ids", "prompt")


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


def parse_request(body: Any, chat: bool) -> ParsedRequest:
    if not isinstance(body, dict):
        raise RequestError("request body must be a JSON object")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise RequestError("model must be a string", "model")
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise RequestError("messages is required and must be a non-empty list", "messages")
        pairs = [_message_text(m, i) for i, m in enumerate(messages)]
        prompts = [sim_chat_text(pairs)]
        user = [text for role, text in pairs if role == "user"]
        question = user[-1] if user else pairs[-1][1]
        max_tokens = _int_field(body, "max_completion_tokens", 1, MAX_MODEL_LEN)
        if max_tokens is None:
            max_tokens = _int_field(body, "max_tokens", 1, MAX_MODEL_LEN)
        logprobs = body.get("logprobs")
        if logprobs is not None and not isinstance(logprobs, bool):
            raise RequestError("logprobs must be a boolean", "logprobs")
        top = _int_field(body, "top_logprobs", 0, MAX_TOP_LOGPROBS)
        if top and not logprobs:
            raise RequestError("top_logprobs requires logprobs to be true", "top_logprobs")
        top_k = (top or 0) if logprobs else None
    else:
        prompts = _prompts(body)
        question = prompts[-1]
        max_tokens = _int_field(body, "max_tokens", 1, MAX_MODEL_LEN)
        top_k = _int_field(body, "logprobs", 0, MAX_TOP_LOGPROBS)
    stream = body.get("stream", False)
    if not isinstance(stream, bool | None):
        raise RequestError("stream must be a boolean", "stream")
    opts = body.get("stream_options")
    if opts is not None and not isinstance(opts, dict):
        raise RequestError("stream_options must be an object", "stream_options")
    kv = body.get("kv_transfer_params")
    if kv is not None and not isinstance(kv, dict):
        raise RequestError("kv_transfer_params must be an object", "kv_transfer_params")
    if kv and kv.get("do_remote_decode") is True and kv.get("do_remote_prefill") is True:
        raise RequestError("do_remote_decode and do_remote_prefill are exclusive", "kv_transfer_params")
    return ParsedRequest(
        chat=chat,
        model=model,
        prompts=prompts,
        prompt_tokens=[count_tokens(p) for p in prompts],
        question=question,
        max_tokens=DEFAULT_MAX_TOKENS if max_tokens is None else max_tokens,
        n=_int_field(body, "n", 1, MAX_N) or 1,
        stream=bool(stream),
        include_usage=bool(stream and opts and opts.get("include_usage")),
        top_k=top_k,
        kv_params=kv,
        bootstrap=_bootstrap(body),
    )


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def full_response(
    req: ParsedRequest,
    rid: str,
    created: int,
    model: str,
    gens: list[Generated],
    finish: str,
    extra: dict[str, Any] | None = None,
) -> bytes:
    choices: list[dict[str, Any]] = []
    top_k = req.top_k or 0
    for i, gen in enumerate(gens):
        if req.chat:
            choices.append(
                {
                    "index": i,
                    "message": {"role": "assistant", "content": gen.text},
                    "logprobs": chat_logprobs(gen, top_k),
                    "finish_reason": finish,
                }
            )
        else:
            lp = completion_logprobs(gen.tokens, gen.logprobs, top_k) if gen.logprobs is not None else None
            choices.append({"index": i, "text": gen.text, "logprobs": lp, "finish_reason": finish})
    body: dict[str, Any] = {
        "id": rid,
        "object": "chat.completion" if req.chat else "text_completion",
        "created": created,
        "model": model,
        "choices": choices,
        "usage": usage(sum(req.prompt_tokens), sum(len(g.tokens) for g in gens)),
    }
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
) -> tuple[bytes, list[bytes], bytes]:
    """(prelude, one SSE blob per token step, tail): the caller paces the steps."""
    obj = "chat.completion.chunk" if req.chat else "text_completion"
    top_k = req.top_k or 0

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
                "delta": {"role": "assistant", "content": ""},
                "logprobs": None,
                "finish_reason": None,
            }
            for i in range(len(gens))
        ]
        prelude = event(role)
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
            if req.chat:
                choices.append(
                    {"index": i, "delta": {"content": tok}, "logprobs": lp, "finish_reason": reason}
                )
            else:
                choices.append({"index": i, "text": tok, "logprobs": lp, "finish_reason": reason})
        steps.append(event(choices, extra if last else None))
    tail = b""
    if req.include_usage:
        tail += event([], {"usage": usage(sum(req.prompt_tokens), sum(len(g.tokens) for g in gens))})
    tail += b"data: [DONE]\n\n"
    return prelude, steps, tail
