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


def _dumps(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode()


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
    leg[KV] = PREFILL_KV
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
        obj = json.loads(body)
    except ValueError:
        return body
    return _dumps(obj) if _drop_kv(obj) else body


def kv_params_of(body: bytes) -> dict[str, Any] | None:
    """The kv_transfer_params a vLLM prefill engine answered, if any."""
    try:
        obj = json.loads(body)
    except ValueError:
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
            obj = json.loads(payload)
        except ValueError:
            return line
        if not _drop_kv(obj):
            return line
        end = line[len(line.rstrip(b"\r\n")) :]
        return b"data: " + _dumps(obj) + end
