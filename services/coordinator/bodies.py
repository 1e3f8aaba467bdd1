"""Request and response bodies on the hot path, touched as little as possible.

The client's JSON is parsed once (to read ``model``, ``stream`` and the size estimate). Legs
that only *add* fields (the vLLM decode leg, both SGLang legs) get the client's bytes with the
new fields spliced in before the closing brace instead of a second ``json.dumps`` of the whole
request; only the vLLM prefill leg, which must change and drop fields, is serialised again.
Responses pass through as bytes unless they carry ``kv_transfer_params``.
"""

from __future__ import annotations

import json
from typing import Any

import orjson

KV = "kv_transfer_params"
_KV_B = KV.encode()
DEFAULT_MAX_TOKENS = 128  # only for the load estimate of requests that set no limit

# What the prefill leg asks of a vLLM prefill engine: compute the KV, keep it for a remote decode.
PREFILL_KV: dict[str, Any] = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


# Fields only the Coordinator may set: they tell an engine where to pull KV from (or which room
# to wait in), so a client's own values would let it point an engine at any host.
# Looked up in the parsed object, never searched for in the bytes: JSON may spell a key with
# \u escapes ("kv\u005ftransfer_params"), which every engine's parser reads as the same key.
HANDOFF_FIELDS = (KV, "bootstrap_host", "bootstrap_port", "bootstrap_room")


class BadBody(ValueError):
    """The body is not a JSON object within the limits; the message says why."""


def parse_request(raw: bytes, max_depth: int) -> tuple[dict[str, Any], bytes]:
    """The client's JSON object and the bytes to send on, without the hand-off fields.

    Nesting deeper than ``max_depth`` is refused. The count of opening brackets is an upper
    bound on the depth, so the exact walk only runs for bodies with many arrays or objects."""
    try:
        req = loads(raw)
    except RecursionError:
        raise BadBody(f"JSON nested deeper than max_json_depth ({max_depth})") from None
    except ValueError as exc:
        raise BadBody(f"invalid JSON body: {exc}") from None
    if not isinstance(req, dict):
        raise BadBody("request body must be a JSON object")
    if _brackets_exceed(raw, max_depth) and _depth(req, max_depth) > max_depth:
        raise BadBody(f"JSON nested deeper than max_json_depth ({max_depth})")
    present = [f for f in HANDOFF_FIELDS if f in req]  # four dict lookups
    if present:
        for f in present:
            del req[f]
        raw = _dumps(req)  # every copy of the key goes, duplicates included
    return req, raw


def _brackets_exceed(raw: bytes, limit: int) -> bool:
    """Whether ``raw`` has more than ``limit`` opening brackets. Found by ``find`` (memchr, which
    skips the bytes between brackets many at a time) and no further than the limit: bytes.count
    compares every byte, and for a 20 KB chat body cost twice what parsing it did."""
    n = 0
    for bracket in (b"{", b"["):
        at = raw.find(bracket)
        while at >= 0:
            n += 1
            if n > limit:
                return True
            at = raw.find(bracket, at + 1)
    return False


def _depth(obj: Any, limit: int) -> int:
    """Nesting depth of ``obj`` (a scalar is 0), giving up as soon as it passes ``limit``."""
    deepest = 0
    stack: list[tuple[Any, int]] = [(obj, 1)]
    while stack:
        node, d = stack.pop()
        if d > deepest:
            deepest = d
            if deepest > limit:
                return deepest
        for child in node.values() if isinstance(node, dict) else node:
            if isinstance(child, (dict, list)):
                stack.append((child, d + 1))
    return deepest


def loads(raw: bytes) -> Any:
    """orjson, or the standard library for what orjson refuses and Python's json takes (NaN,
    lone surrogates, numbers past a double): the engine judges those, not the router."""
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        if "recursion" in str(exc) or "depth limit" in str(exc):  # orjson stops at 1024 levels
            raise RecursionError(str(exc)) from None
        return json.loads(raw)


def _dumps(obj: Any) -> bytes:
    try:
        return orjson.dumps(obj)
    except TypeError:  # an integer past 64 bits, a lone surrogate ("\ud800") json.loads let in
        # ASCII: a lone surrogate goes on as the escape the client sent, not as bytes that are
        # not UTF-8 (encoding it would raise).
        return json.dumps(obj, separators=(",", ":")).encode()


def estimate_tokens(req: dict[str, Any]) -> tuple[int, int]:
    """(prompt tokens, prompt + max output tokens), at about four characters per token."""
    chars = 0
    prompt = req.get("prompt")
    messages = req.get("messages")
    if isinstance(messages, list):
        for m in messages:
            content = m.get("content") if isinstance(m, dict) else None
            if isinstance(content, str):
                chars += len(content)
            elif isinstance(content, list):
                for part in content:
                    if isinstance(part, dict) and isinstance(part.get("text"), str):
                        chars += len(part["text"])
    elif isinstance(prompt, str):
        chars = len(prompt)
    elif isinstance(prompt, list):
        for p in prompt:
            chars += len(p) if isinstance(p, str) else 4 * len(p) if isinstance(p, list) else 4
    limit = req.get("max_completion_tokens") or req.get("max_tokens")
    if not isinstance(limit, int) or isinstance(limit, bool) or limit < 0:
        limit = DEFAULT_MAX_TOKENS
    prompt_tokens = chars // 4 + 1
    return prompt_tokens, prompt_tokens + limit


def with_fields(raw: bytes, req: dict[str, Any], extra: dict[str, Any]) -> bytes:
    """The client's request plus ``extra``, splicing bytes when that is safe."""
    body = raw.strip()
    if req and body[:1] == b"{" and body[-1:] == b"}" and not any(k in req for k in extra):
        tail = _dumps(extra)  # '{"a":1,...}'
        return body[:-1] + b"," + tail[1:]
    merged = dict(req)
    merged.update(extra)
    return _dumps(merged)


def prefill_body(req: dict[str, Any]) -> bytes:
    """The vLLM prefill leg: no streaming, one token, KV kept for the remote decode."""
    leg = dict(req)
    leg["stream"] = False
    leg["max_tokens"] = 1
    if "max_completion_tokens" in leg:
        leg["max_completion_tokens"] = 1
    leg.pop("stream_options", None)
    carried = req.get(KV)  # a continuation's prompt ids (migration/carry.py) go with it
    leg[KV] = {**PREFILL_KV, **carried} if isinstance(carried, dict) else PREFILL_KV
    return _dumps(leg)


def _drop_kv(obj: Any) -> bool:
    """Remove kv_transfer_params from a response object (top level and per choice)."""
    changed = False
    if isinstance(obj, dict):
        if KV in obj:
            del obj[KV]
            changed = True
        choices = obj.get("choices")
        if isinstance(choices, list):
            for c in choices:
                if isinstance(c, dict) and KV in c:
                    del c[KV]
                    changed = True
    return changed


def strip_kv(body: bytes) -> bytes:
    """A non-streamed response without kv_transfer_params (unchanged bytes when absent)."""
    if _KV_B not in body:
        return body
    try:
        obj = loads(body)
    except (ValueError, RecursionError):
        return body
    return _dumps(obj) if _drop_kv(obj) else body


def kv_params_of(body: bytes) -> dict[str, Any] | None:
    """The kv_transfer_params a vLLM prefill engine answered, if any."""
    try:
        obj = loads(body)
    except (ValueError, RecursionError):
        return None
    kv = obj.get(KV) if isinstance(obj, dict) else None
    return kv if isinstance(kv, dict) else None


class SseFilter:
    """Passes an SSE byte stream through, removing kv_transfer_params from ``data:`` events.

    Complete lines are released at once; only a trailing partial line is held back until its
    newline arrives (so a marker split across two reads is still seen). Events end with a blank
    line, so no complete event is ever delayed.
    """

    __slots__ = ("_pending",)

    def __init__(self) -> None:
        self._pending = b""

    def feed(self, chunk: bytes) -> bytes:
        if self._pending:
            chunk = self._pending + chunk
        cut = chunk.rfind(b"\n") + 1
        self._pending = chunk[cut:]
        if cut < len(chunk):
            chunk = chunk[:cut]
        if _KV_B not in chunk:
            return chunk
        return b"".join(self._line(line) for line in chunk.splitlines(keepends=True))

    def flush(self) -> bytes:
        rest, self._pending = self._pending, b""
        return self._line(rest) if rest else b""

    @staticmethod
    def _line(line: bytes) -> bytes:
        if not line.startswith(b"data:") or _KV_B not in line:
            return line
        payload = line[5:].strip()
        try:
            obj = loads(payload)
        except (ValueError, RecursionError):
            return line
        if not _drop_kv(obj):
            return line
        end = line[len(line.rstrip(b"\r\n")) :]
        return b"data: " + _dumps(obj) + end
